# The cuDNN frontend (header-only C++ graph API over cuDNN) for the attention seam (csrc/cuda/seams_cudnn.cu).
# Needs Python_EXECUTABLE and, from CMakeLists.txt, _cuda_enabled, _cudnn_found and CUDAToolkit_INCLUDE_DIRS.
# Sets _cudnn_sdpa (ON when the seam can be built over cuDNN's fused SDPA), _cudnn_fe_include (the directory
# holding cudnn_frontend.h) and _cudnn_fe_version.
# Where the headers come from, first found wins:
#   1. the environment variable GPT2CORE_CUDNN_FRONTEND_INCLUDE, else the cache variable of that name;
#   2. the PyPI package nvidia-cudnn-frontend of the Python doing the build (its wheel installs the headers
#      as <site-packages>/include/cudnn_frontend*.h; found through the package's file list, without importing
#      it), so `pip install -r requirements-dev.txt` then `pip install --no-build-isolation .` gets them;
#   3. the usual include directories (a system or conda install).
# Versions older than the oldest one compiled here (1.28.0, the one requirements-dev.txt pins) are ignored.
set(_cudnn_sdpa OFF)
set(_cudnn_fe_include "")
set(_cudnn_fe_version "")
set(GPT2CORE_CUDNN_FRONTEND_INCLUDE "" CACHE PATH
    "Directory holding cudnn_frontend.h (empty: ask Python for the nvidia-cudnn-frontend package)")
if(_cuda_enabled AND _cudnn_found)
  if(DEFINED ENV{GPT2CORE_CUDNN_FRONTEND_INCLUDE} AND NOT "$ENV{GPT2CORE_CUDNN_FRONTEND_INCLUDE}" STREQUAL "")
    set(_cudnn_fe_include "$ENV{GPT2CORE_CUDNN_FRONTEND_INCLUDE}")
  elseif(NOT GPT2CORE_CUDNN_FRONTEND_INCLUDE STREQUAL "")
    set(_cudnn_fe_include "${GPT2CORE_CUDNN_FRONTEND_INCLUDE}")
  else()
    execute_process(
      COMMAND "${Python_EXECUTABLE}" -c [=[
import importlib.metadata as md, os
for f in md.files("nvidia-cudnn-frontend") or []:
    if str(f).replace(os.sep, "/").endswith("include/cudnn_frontend.h"):
        print(os.path.dirname(os.path.abspath(str(f.locate()))), end="")
        break
]=]
      OUTPUT_VARIABLE _cudnn_fe_include RESULT_VARIABLE _fe_rc ERROR_QUIET)
    if(NOT _fe_rc EQUAL 0)
      set(_cudnn_fe_include "")
    endif()
    if(_cudnn_fe_include STREQUAL "")
      find_path(_cudnn_fe_sys_include cudnn_frontend.h HINTS ${CUDAToolkit_INCLUDE_DIRS} ${CUDNN_INCLUDE_DIR})
      if(_cudnn_fe_sys_include)
        set(_cudnn_fe_include "${_cudnn_fe_sys_include}")
      endif()
    endif()
  endif()
  if(NOT _cudnn_fe_include STREQUAL "" AND EXISTS "${_cudnn_fe_include}/cudnn_frontend.h"
     AND EXISTS "${_cudnn_fe_include}/cudnn_frontend_version.h")
    file(STRINGS "${_cudnn_fe_include}/cudnn_frontend_version.h" _fe_lines
         REGEX "#define CUDNN_FRONTEND_(MAJOR|MINOR|PATCH)_VERSION [0-9]+")
    foreach(_part MAJOR MINOR PATCH)
      string(REGEX MATCH "CUDNN_FRONTEND_${_part}_VERSION ([0-9]+)" _m "${_fe_lines}")
      set(_fe_${_part} "${CMAKE_MATCH_1}")
    endforeach()
    set(_cudnn_fe_version "${_fe_MAJOR}.${_fe_MINOR}.${_fe_PATCH}")
    if(_cudnn_fe_version VERSION_LESS "1.28.0")
      message(STATUS "gpt2core: cuDNN frontend ${_cudnn_fe_version} in ${_cudnn_fe_include} is older than 1.28.0: "
                     "attention seam not built over cuDNN")
    else()
      set(_cudnn_sdpa ON)
    endif()
  endif()
  if(_cudnn_sdpa)
    message(STATUS "gpt2core: cuDNN frontend ${_cudnn_fe_version} (${_cudnn_fe_include}): cuDNN SDPA attention ON")
  else()
    message(STATUS "gpt2core: cuDNN frontend not found (pip install nvidia-cudnn-frontend, or set "
                   "GPT2CORE_CUDNN_FRONTEND_INCLUDE): cuDNN SDPA attention OFF")
  endif()
endif()
