#include "cpu/backend_cpu.h"

namespace gpt2::cpu {
template class CpuBackend<float>;
template class CpuBackend<double>;
}  // namespace gpt2::cpu
