// Run-time dispatch between the CPU backend's instruction-set variants (backend_cpu.h).
#include "cpu/backend_cpu.h"

#include <atomic>
#include <iterator>
#include <stdexcept>

namespace gpt2::cpu {

// Each variant's factory (backend_cpu_impl.h), compiled in its own file with its own target.
#define GPT2CORE_DECLARE_VARIANT(ns)                                      \
  namespace ns {                                                          \
  template <typename T>                                                   \
  std::unique_ptr<Backend<T>> make_backend();                             \
  extern template std::unique_ptr<Backend<float>> make_backend<float>();  \
  extern template std::unique_ptr<Backend<double>> make_backend<double>(); \
  }
GPT2CORE_DECLARE_VARIANT(baseline)
#if GPT2CORE_CPU_DISPATCH
GPT2CORE_DECLARE_VARIANT(x86_64_v3)
GPT2CORE_DECLARE_VARIANT(x86_64_v4)
#endif
#undef GPT2CORE_DECLARE_VARIANT

namespace {

struct Variant {
  const char* name;
  bool (*runs_here)();
  std::unique_ptr<Backend<float>> (*make_f32)();
  std::unique_ptr<Backend<double>> (*make_f64)();
};

// best first; the baseline runs everywhere
const Variant kVariants[] = {
#if GPT2CORE_CPU_DISPATCH
    {"x86-64-v4", [] { return __builtin_cpu_supports("x86-64-v4") > 0; }, x86_64_v4::make_backend<float>,
     x86_64_v4::make_backend<double>},
    {"x86-64-v3", [] { return __builtin_cpu_supports("x86-64-v3") > 0; }, x86_64_v3::make_backend<float>,
     x86_64_v3::make_backend<double>},
#endif
#ifdef GPT2CORE_CPU_NATIVE
    {"native", [] { return true; }, baseline::make_backend<float>, baseline::make_backend<double>},
#else
    {"baseline", [] { return true; }, baseline::make_backend<float>, baseline::make_backend<double>},
#endif
};

const Variant* best() {
  for (const Variant& v : kVariants)
    if (v.runs_here()) return &v;
  return &kVariants[std::size(kVariants) - 1];
}

std::atomic<const Variant*> g_chosen{nullptr};

const Variant& chosen() {
  const Variant* v = g_chosen.load();
  if (!v) {
    v = best();
    g_chosen.store(v);
  }
  return *v;
}

}  // namespace

std::vector<std::string> isas() {
  std::vector<std::string> names;
  for (const Variant& v : kVariants)
    if (v.runs_here()) names.emplace_back(v.name);
  return names;
}

std::string isa() { return chosen().name; }

void set_isa(const std::string& name) {
  for (const Variant& v : kVariants)
    if (v.runs_here() && name == v.name) {
      g_chosen.store(&v);
      return;
    }
  std::string choices;
  for (const std::string& n : isas()) choices += (choices.empty() ? "" : ", ") + n;
  throw std::invalid_argument("CPU instruction set '" + name + "' is not one this build and CPU run (choices: " +
                              choices + ")");
}

template <>
std::unique_ptr<Backend<float>> make_backend<float>() {
  return chosen().make_f32();
}
template <>
std::unique_ptr<Backend<double>> make_backend<double>() {
  return chosen().make_f64();
}

}  // namespace gpt2::cpu
