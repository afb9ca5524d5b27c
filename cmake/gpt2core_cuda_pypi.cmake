# NVIDIA's PyPI toolchain, for machines without a system CUDA toolkit (Colab-like images, clusters, CI):
#   pip install "nvidia-cuda-nvcc>=13,<14" "nvidia-cuda-runtime>=13,<14" "nvidia-cublas>=13,<14" nvidia-cuda-cccl \
#               nvidia-cuda-crt nvidia-nvvm [nvidia-cudnn-cu13 nvidia-nccl-cu13]
# CUDA 13's wheels install a toolkit tree, <site-packages>/nvidia/cu13/{bin/nvcc,include,lib,nvvm}, that nvcc and
# FindCUDAToolkit use as they are, except that the libraries are in lib/ (nvcc.profile says lib64) and versioned only (libcublasLt.so.13, no
# libcublasLt.so): the link-time names are made here as symlinks in <build>/cuda-pypi-lib. cuDNN and NCCL wheels
# (nvidia/cudnn, nvidia/nccl) get the same treatment. CUDA 12's nvcc wheel (nvidia-cuda-nvcc-cu12) ships ptxas
# only, no nvcc: a CUDA 12 build needs a system toolkit.
#
# Used when no nvcc is found otherwise (CUDACXX, PATH, /usr/local/cuda); needs Python_EXECUTABLE. Sets
# CMAKE_CUDA_COMPILER, CUDAToolkit_ROOT and _cuda_from_pypi (ON when used).
set(_cuda_from_pypi OFF)
if(NOT CMAKE_CUDA_COMPILER)
  execute_process(
    COMMAND "${Python_EXECUTABLE}" -c [=[
import importlib.util, os
spec = importlib.util.find_spec("nvidia")
for base in (spec.submodule_search_locations or []) if spec else []:
    if os.path.exists(os.path.join(base, "cu13", "bin", "nvcc")):
        print(base, end="")
        break
]=]
    OUTPUT_VARIABLE _nvidia_dir RESULT_VARIABLE _rc ERROR_QUIET)
  if(_rc EQUAL 0 AND NOT _nvidia_dir STREQUAL "")
    set(_cuda_from_pypi ON)
    set(CMAKE_CUDA_COMPILER "${_nvidia_dir}/cu13/bin/nvcc" CACHE FILEPATH "CUDA compiler" FORCE)
    set(CUDAToolkit_ROOT "${_nvidia_dir}/cu13")
    # nvcc.profile links from <root>/lib64; the wheels have <root>/lib
    string(APPEND CMAKE_CUDA_FLAGS " -L${_nvidia_dir}/cu13/lib")
    set(_links "${CMAKE_BINARY_DIR}/cuda-pypi-lib")
    file(MAKE_DIRECTORY "${_links}")
    file(GLOB _sos "${_nvidia_dir}/*/lib/lib*.so.*")
    foreach(_so IN LISTS _sos)
      get_filename_component(_name "${_so}" NAME)
      string(REGEX REPLACE "\\.so\\..*$" ".so" _dev "${_name}")
      file(CREATE_LINK "${_so}" "${_links}/${_dev}" SYMBOLIC)
    endforeach()
    file(GLOB _includes LIST_DIRECTORIES true "${_nvidia_dir}/*/include")
    list(APPEND CMAKE_LIBRARY_PATH "${_links}")
    list(APPEND CMAKE_INCLUDE_PATH ${_includes})
    message(STATUS "gpt2core: CUDA toolchain from NVIDIA's PyPI wheels (${_nvidia_dir}/cu13)")
  endif()
endif()
