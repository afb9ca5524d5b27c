# A CUDA 12 build without a CUDA 12 toolkit: clang as the CUDA compiler, against NVIDIA's CUDA 12 PyPI wheels.
#
# NVIDIA's CUDA 12 compiler wheel (nvidia-cuda-nvcc-cu12) ships ptxas, libdevice and the crt headers but no nvcc,
# so on a machine with only CUDA 13 (this project's CI) or no toolkit at all the CUDA 12 module is compiled by clang
# (LLVM's CUDA front end; Debian's clang-19 reads CUDA 12 headers, warning that it knows them up to 12.5), which
# emits PTX, assembles it with the wheel's own CUDA 12 ptxas, and packs the images with `fatbinary`. That one tool
# exists in no CUDA 12 wheel: the CUDA 13 one is used (system toolkit or the nvidia-cuda-nvcc wheel) through a
# wrapper that translates clang's CUDA <= 12 option syntax and turns compression off (drivers before 12.8 cannot
# read compressed images). The container format is the same; every image in it is CUDA 12's.
#
# Used when GPT2CORE_CUDA_MAJOR=12 and no CUDA 12 nvcc is found. The toolkit tree clang and FindCUDAToolkit want
# is assembled from the wheels' files under <build>/cuda12-toolkit (symlinks): include/ (runtime, crt, CCCL, cuBLAS,
# NVRTC, cuDNN, NCCL, and cuRAND's headers, which clang's CUDA runtime wrapper includes), lib64/ (with the link-time names), nvvm/libdevice, bin/ptxas, bin/fatbinary (wrapper) and
# bin/nvcc, a stub that only answers `--version` for CMake (which asks nvcc for the toolkit version when the CUDA
# compiler is clang) and refuses anything else. Needs Python_EXECUTABLE. Sets CMAKE_CUDA_COMPILER,
# CMAKE_CUDA_FLAGS, CUDAToolkit_ROOT and _cuda12_clang (ON when used).
set(_cuda12_clang OFF)
if(GPT2CORE_CUDA_MAJOR STREQUAL "12" AND NOT (CMAKE_CUDA_COMPILER AND _nvcc_major STREQUAL "12"))
  execute_process(
    COMMAND "${Python_EXECUTABLE}" -c [=[
import importlib.util, os
spec = importlib.util.find_spec("nvidia")
for base in (spec.submodule_search_locations or []) if spec else []:
    if os.path.exists(os.path.join(base, "cuda_nvcc", "bin", "ptxas")) and \
       os.path.exists(os.path.join(base, "cuda_runtime", "include", "cuda_runtime.h")):
        print(base, end="")
        break
]=]
    OUTPUT_VARIABLE _n12 RESULT_VARIABLE _rc ERROR_QUIET)
  if(NOT _rc EQUAL 0 OR _n12 STREQUAL "")
    message(FATAL_ERROR "GPT2CORE_CUDA_MAJOR=12: no CUDA 12 nvcc and no CUDA 12 wheels to compile with clang; "
      "pip install nvidia-cuda-nvcc-cu12 nvidia-cuda-cccl-cu12 nvidia-curand-cu12 \"gpt2core[cuda12]\" first (README: Which CUDA major)")
  endif()
  find_program(_clang_cuda NAMES clang++-19 clang++-20 clang++-18 clang++)
  if(NOT _clang_cuda)
    message(FATAL_ERROR "GPT2CORE_CUDA_MAJOR=12 without a CUDA 12 nvcc needs clang (apt-get install clang-19)")
  endif()
  # the wheel's first (a system toolkit may be hidden or absent, leaving dangling links such as /usr/local/bin's)
  find_program(_fatbinary NAMES fatbinary PATHS "${_n12}/cu13/bin" NO_DEFAULT_PATH NO_CACHE)
  if(NOT _fatbinary)
    find_program(_fatbinary NAMES fatbinary PATHS /usr/local/cuda/bin ENV CUDA_HOME ENV CUDA_PATH PATH_SUFFIXES bin NO_CACHE)
  endif()
  if(NOT _fatbinary)
    message(FATAL_ERROR "GPT2CORE_CUDA_MAJOR=12 with clang needs NVIDIA's fatbinary (CUDA 13's: pip install "
      "nvidia-cuda-nvcc, or a system toolkit); no CUDA 12 wheel ships it")
  endif()
  set(_t "${CMAKE_BINARY_DIR}/cuda12-toolkit")
  file(REMOVE_RECURSE "${_t}")
  file(MAKE_DIRECTORY "${_t}/include" "${_t}/lib64" "${_t}/bin" "${_t}/nvvm")
  foreach(_pkg cuda_runtime cuda_nvcc cuda_cccl cublas cuda_nvrtc cudnn nccl curand)
    file(GLOB_RECURSE _hdrs RELATIVE "${_n12}/${_pkg}/include" "${_n12}/${_pkg}/include/*")
    foreach(_h IN LISTS _hdrs)
      get_filename_component(_d "${_t}/include/${_h}" DIRECTORY)
      file(MAKE_DIRECTORY "${_d}")
      file(CREATE_LINK "${_n12}/${_pkg}/include/${_h}" "${_t}/include/${_h}" SYMBOLIC)
    endforeach()
    file(GLOB _libs "${_n12}/${_pkg}/lib/lib*.so*" "${_n12}/${_pkg}/lib/lib*.a")
    foreach(_so IN LISTS _libs)
      get_filename_component(_name "${_so}" NAME)
      file(CREATE_LINK "${_so}" "${_t}/lib64/${_name}" SYMBOLIC)
      if(_name MATCHES "^(lib[^.]+)\\.so\\.[0-9]+$")  # link-time name: libcublasLt.so -> libcublasLt.so.12
        file(CREATE_LINK "${_so}" "${_t}/lib64/${CMAKE_MATCH_1}.so" SYMBOLIC)
      endif()
    endforeach()
  endforeach()
  file(CREATE_LINK "${_n12}/cuda_nvcc/bin/ptxas" "${_t}/bin/ptxas" SYMBOLIC)
  file(CREATE_LINK "${_n12}/cuda_nvcc/nvvm/libdevice" "${_t}/nvvm/libdevice" SYMBOLIC)
  # the CUDA 12 release, from cuda.h (CUDA_VERSION 12090 -> 12.9) and the ptxas wheel's version (12.9.86)
  file(STRINGS "${_t}/include/cuda.h" _cv REGEX "^#define CUDA_VERSION [0-9]+")
  string(REGEX REPLACE ".* ([0-9]+)$" "\\1" _cv "${_cv}")
  math(EXPR _cv_major "${_cv} / 1000")
  math(EXPR _cv_minor "(${_cv} % 1000) / 10")
  execute_process(COMMAND "${_n12}/cuda_nvcc/bin/ptxas" --version OUTPUT_VARIABLE _ptxas_v)
  string(REGEX MATCH "V([0-9]+\\.[0-9]+\\.[0-9]+)" _ptxas_v "${_ptxas_v}")
  file(WRITE "${_t}/bin/nvcc" "#!/bin/sh\n"
    "# not nvcc: CMake asks the toolkit's nvcc for its version when clang compiles CUDA (cmake/gpt2core_cuda12_clang.cmake)\n"
    "if [ \"$1\" = --version ]; then echo 'Cuda compilation tools, release ${_cv_major}.${_cv_minor}, ${_ptxas_v}'; exit 0; fi\n"
    "echo 'gpt2core cuda12-toolkit: no nvcc here (CUDA 12 is compiled by clang)' >&2; exit 1\n")
  file(WRITE "${_t}/bin/fatbinary" "#!/bin/sh\n"
    "# clang's CUDA <= 12 fatbinary call, passed to ${_fatbinary} (cmake/gpt2core_cuda12_clang.cmake)\n"
    "args=''\nfor a in \"$@\"; do\n  case \"$a\" in\n"
    "    --image=profile=sm_*) r=\${a#--image=profile=sm_}; a=\"--image3=kind=elf,sm=\${r%%,*},\${r#*,}\";;\n"
    "    --image=profile=compute_*) r=\${a#--image=profile=compute_}; a=\"--image3=kind=ptx,sm=\${r%%,*},\${r#*,}\";;\n"
    "  esac\n  args=\"$args '$a'\"\ndone\n"
    "eval exec '${_fatbinary}' $args --compress=false\n")
  file(CHMOD "${_t}/bin/nvcc" "${_t}/bin/fatbinary" PERMISSIONS OWNER_READ OWNER_WRITE OWNER_EXECUTE GROUP_READ
       GROUP_EXECUTE WORLD_READ WORLD_EXECUTE)
  set(_cuda12_clang ON)
  # check_language(CUDA) leaves a NOTFOUND compiler (and its failed identification) in the cache: start clean
  unset(CMAKE_CUDA_COMPILER CACHE)
  unset(CMAKE_CUDA_COMPILER_ID CACHE)
  unset(CMAKE_CUDA_HOST_COMPILER CACHE)
  set(CMAKE_CUDA_COMPILER "${_clang_cuda}" CACHE FILEPATH "CUDA compiler" FORCE)
  set(CUDAToolkit_ROOT "${_t}")
  # -Wno-unknown-cuda-version: clang-19 knows CUDA up to 12.5 and says so for 12.9; -Wno-cuda-compat: nvcc-isms
  string(APPEND CMAKE_CUDA_FLAGS " --cuda-path=${_t} -Wno-unknown-cuda-version -Wno-cuda-compat")
  list(APPEND CMAKE_LIBRARY_PATH "${_t}/lib64")
  list(APPEND CMAKE_INCLUDE_PATH "${_t}/include")
  message(STATUS "gpt2core: CUDA ${_cv_major}.${_cv_minor} compiled by ${_clang_cuda} with NVIDIA's CUDA 12 wheels "
                 "(${_n12}), ptxas ${_ptxas_v}, fatbinary ${_fatbinary}")
endif()
