#!/usr/bin/env bash
# CI (issue 13): the CUDA code builds from NVIDIA's PyPI toolchain on a machine with no CUDA toolkit.
#   CUDA 13: nvidia-cuda-nvcc & co. install a toolkit tree in site-packages/nvidia/cu13; CMake is configured with
#            every /usr/local/cuda-* hidden and compiles the CUDA backend (one arch) and NCCL communicator from it.
#   CUDA 12: NVIDIA's CUDA 12 nvcc wheel ships ptxas only (no nvcc), so a CUDA 12 build needs a system toolkit;
#            here the host-side vendor seams are compiled against CUDA 12's headers from the PyPI wheels.
# Root only: a private mount namespace (unshare -m) with an empty directory bind-mounted over each toolkit.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
WORK="${GPT2CORE_PYPI_WORK:-/tmp/gpt2core-cuda-pypi}"
if [ "${1:-}" != "--hidden" ]; then
  exec unshare -m "$0" --hidden
fi
mkdir -p "$WORK/empty"
for d in /usr/local/cuda-*; do [ -d "$d" ] && mount --bind "$WORK/empty" "$d"; done
if command -v nvcc >/dev/null && nvcc --version >/dev/null 2>&1; then echo "a system nvcc is still visible"; exit 1; fi

echo "== CUDA 13 from PyPI: venv"
python3 -m venv "$WORK/venv13"
"$WORK/venv13/bin/pip" install -q pybind11 scipy-openblas32 \
  nvidia-cuda-nvcc==13.0.88 nvidia-cuda-runtime==13.0.96 nvidia-cuda-cccl==13.0.85 nvidia-cuda-crt==13.0.88 \
  nvidia-nvvm==13.0.88 nvidia-cublas==13.0.2.14 nvidia-nccl-cu13
echo "== CUDA 13 from PyPI: configure (system toolkit hidden) and build the CUDA module for sm_75"
PY="$WORK/venv13/bin/python"
rm -rf "$WORK/build13"
GPT2CORE_CUDA_ARCHS=75 cmake -S "$ROOT" -B "$WORK/build13" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGPT2CORE_CUDA=ON \
  -DGPT2CORE_GLOO=OFF -DPython_EXECUTABLE="$PY" -Dpybind11_DIR="$("$PY" -m pybind11 --cmakedir)" > "$WORK/configure13.log" \
  || { tail -n 60 "$WORK/configure13.log"; exit 1; }
grep "gpt2core:" "$WORK/configure13.log"
grep -q "CUDA toolchain from NVIDIA's PyPI wheels" "$WORK/configure13.log"
grep -q "CUDA backend ON, archs = 75, cuDNN = OFF, NCCL = ON" "$WORK/configure13.log"
cmake --build "$WORK/build13" --target _C_cuda > "$WORK/build13.log" 2>&1 || { tail -n 60 "$WORK/build13.log"; exit 1; }
grep -q 'CUDA_VERSION = "13.0"' "$WORK/build13/_build_config.py"
readelf -d "$WORK"/build13/_C_cuda*.so | grep -E "NEEDED.*(cublasLt|nccl)"

echo "== CUDA 12 headers from PyPI: the host-side seams against them"
python3 -m venv "$WORK/venv12"
"$WORK/venv12/bin/pip" install -q nvidia-cuda-runtime-cu12==12.9.79 nvidia-cuda-nvcc-cu12==12.9.86 \
  nvidia-cuda-cccl-cu12==12.9.27 nvidia-cublas-cu12==12.9.1.4 nvidia-nccl-cu12
N12="$("$WORK/venv12/bin/python" -c 'import nvidia, os; print(os.path.dirname(nvidia.__file__) if nvidia.__file__ else list(nvidia.__path__)[0])')"
for src in csrc/cuda/seams_cublaslt.cu csrc/comm/comm_nccl.cpp; do
  g++ -std=c++17 -fsyntax-only -x c++ -Wall -Wextra -Werror -I"$ROOT/csrc" -I"$N12/cuda_runtime/include" \
    -I"$N12/cuda_nvcc/include" -I"$N12/cuda_cccl/include" -I"$N12/cublas/include" -I"$N12/nccl/include" "$ROOT/$src"
  echo "$src: compiles against CUDA 12.9 headers"
done
echo "CUDA from PyPI: OK"
