#include "cpu/blas.h"

namespace gpt2::cpu {
// OpenBLAS (scipy-openblas32 or a system OpenBLAS) keeps its own thread pool, separate from OpenMP.
void blas_set_num_threads(int n) { GPT2CORE_BLAS(openblas_set_num_threads)(n); }
}  // namespace gpt2::cpu
