# BLAS for the CPU backend, shared by the package build (CMakeLists.txt) and the test-only emulated
# CUDA module (tests/csrc/cuda/cuda_emu). Needs Python_EXECUTABLE. Sets _blas_target (link it), _blas_defs
# (GPT2CORE_BLAS_PREFIX for csrc/cpu/blas.h) and _blas_name (for build_info()).
# Preferred: scipy-openblas32 from PyPI (what numpy and scipy build against; prefixed symbols).
# Fallback: a system CBLAS found by CMake's FindBLAS (set GPT2CORE_BLAS=system to force it).
set(GPT2CORE_BLAS "AUTO" CACHE STRING "AUTO, scipy-openblas or system")
set(_blas_name "")
if(NOT GPT2CORE_BLAS STREQUAL "system")
  execute_process(
    COMMAND "${Python_EXECUTABLE}" -c "import scipy_openblas32 as s; print(s.get_lib_dir(), end='')"
    OUTPUT_VARIABLE _sob_libdir RESULT_VARIABLE _sob_rc ERROR_QUIET)
  if(_sob_rc EQUAL 0 AND EXISTS "${_sob_libdir}/cmake/openblas/OpenBLASConfig.cmake")
    include("${_sob_libdir}/cmake/openblas/OpenBLASConfig.cmake")
    set(_blas_target OpenBLAS::OpenBLAS)
    set(_blas_defs GPT2CORE_BLAS_PREFIX=scipy_)
    set(_blas_name "scipy-openblas32 ${OpenBLAS_VERSION}")
  elseif(GPT2CORE_BLAS STREQUAL "scipy-openblas")
    message(FATAL_ERROR "GPT2CORE_BLAS=scipy-openblas but the scipy_openblas32 package is not importable")
  endif()
endif()
if(_blas_name STREQUAL "")
  set(BLA_VENDOR OpenBLAS)
  find_package(BLAS)
  if(NOT BLAS_FOUND)
    unset(BLA_VENDOR)
    find_package(BLAS REQUIRED)
  endif()
  set(_blas_target BLAS::BLAS)
  set(_blas_defs GPT2CORE_BLAS_PREFIX=)
  set(_blas_name "system BLAS (${BLAS_LIBRARIES})")
endif()
message(STATUS "gpt2core: BLAS = ${_blas_name}")
