#!/usr/bin/env bash
# CI (issues 13, 28): the CUDA backend builds for both CUDA majors from NVIDIA's PyPI wheels on a machine with no
# CUDA toolkit, and each build loads and checks its own NVIDIA libraries.
#   CUDA 13: nvidia-cuda-nvcc & co. install a toolkit tree in site-packages/nvidia/cu13; CMake is configured with
#            every /usr/local/cuda-* hidden and compiles the CUDA backend (one arch) and NCCL communicator from it.
#   CUDA 12: NVIDIA's CUDA 12 nvcc wheel ships ptxas only (no nvcc): clang compiles the CUDA code against the CUDA 12
#            wheels' headers, ptxas and libdevice (GPT2CORE_CUDA_MAJOR=12, cmake/gpt2core_cuda12_clang.cmake); the
#            whole package is pip-installed into a venv with the cuda12 extra's exact pins, imports, and the doctor
#            reports the libraries it verified. The assembled CUDA 12 tree is left in $WORK/build12/cuda12-toolkit for
#            the cuBLASLt descriptor and cuDNN graph tests against the CUDA 12 libraries (.ci/run).
# The NVIDIA wheel versions are the extras' exact pins in pyproject.toml (tests/python/test_libs.py checks this file
# uses exactly those). Root only: a private mount namespace (unshare -m) with an empty directory over each toolkit.
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
  nvidia-cuda-nvcc==13.0.88 nvidia-cuda-cccl==13.0.85 nvidia-cuda-crt==13.0.88 nvidia-nvvm==13.0.88 \
  nvidia-cuda-runtime==13.0.96 nvidia-cublas==13.0.2.14 nvidia-cuda-nvrtc==13.0.88 nvidia-cudnn-cu13==9.19.0.56 \
  nvidia-nccl-cu13==2.28.9
echo "== CUDA 13 from PyPI: configure (system toolkit hidden) and build the CUDA module for sm_75"
PY="$WORK/venv13/bin/python"
rm -rf "$WORK/build13"
GPT2CORE_CUDA_ARCHS=75 cmake -S "$ROOT" -B "$WORK/build13" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGPT2CORE_CUDA=ON \
  -DGPT2CORE_GLOO=OFF -DPython_EXECUTABLE="$PY" -Dpybind11_DIR="$("$PY" -m pybind11 --cmakedir)" > "$WORK/configure13.log" \
  || { tail -n 60 "$WORK/configure13.log"; exit 1; }
grep "gpt2core:" "$WORK/configure13.log"
grep -q "CUDA toolchain from NVIDIA's PyPI wheels" "$WORK/configure13.log"
grep -q "CUDA backend ON, archs = 75, cuDNN = ON, NCCL = ON" "$WORK/configure13.log"
cmake --build "$WORK/build13" --target _C_cuda > "$WORK/build13.log" 2>&1 || { tail -n 60 "$WORK/build13.log"; exit 1; }
grep -q 'CUDA_VERSION = "13.0"' "$WORK/build13/_build_config.py"
grep -q 'CUDNN_VERSION = "9.19.0"' "$WORK/build13/_build_config.py"
readelf -d "$WORK"/build13/_C_cuda*.so | grep -E "NEEDED.*(cublasLt|nccl)"

echo "== CUDA 12 by clang from PyPI's CUDA 12 wheels: venv with the cuda12 extra's pins"
python3 -m venv "$WORK/venv12"
V12="$WORK/venv12/bin"
"$V12/pip" install -q scikit-build-core pybind11 scipy-openblas32 numpy tiktoken tqdm nvidia-cudnn-frontend==1.28.0 \
  nvidia-cuda-nvcc-cu12==12.9.86 nvidia-cuda-cccl-cu12==12.9.27 nvidia-curand-cu12==10.3.10.19 nvidia-cuda-nvcc==13.0.88 \
  nvidia-cuda-runtime-cu12==12.9.79 nvidia-cublas-cu12==12.9.1.4 nvidia-cuda-nvrtc-cu12==12.9.86 \
  nvidia-cudnn-cu12==9.19.0.56 nvidia-nccl-cu12==2.28.9
t0=$SECONDS
rm -rf "$WORK/build12"
GPT2CORE_CUDA_MAJOR=12 GPT2CORE_CUDA=ON GPT2CORE_CUDA_ARCHS=75 "$V12/pip" install --no-build-isolation -v \
  -C build-dir="$WORK/build12" "$ROOT" > "$WORK/build12.log" 2>&1 || { tail -n 80 "$WORK/build12.log"; exit 1; }
grep "gpt2core:" "$WORK/build12.log"
grep -q "gpt2core: CUDA 12.9 compiled by .*clang" "$WORK/build12.log"
echo "CUDA 12 build (clang): $((SECONDS - t0)) s"
cd "$WORK"
"$V12/python" - <<'PY'
import json, gpt2core
from gpt2core import _build_config
i = gpt2core.build_info()
print(json.dumps({k: i.get(k) for k in ("cuda_version", "cudnn_version", "nccl_version", "cuda_library_versions",
                                        "cuda_error", "cuda_driver")}))
assert _build_config.CUDA_VERSION == "12.9" and i["cuda"] and "cuda_error" not in i, i
assert all(p.startswith("nvidia-") for p in _build_config.NVIDIA_PINS) and len(_build_config.NVIDIA_PINS) == 5
PY
"$V12/gpt2core-doctor" --seconds 0 | tee "$WORK/doctor12.txt"
grep -qE "^  cudnn +9\.19\.0 for CUDA 12\.[0-9]+ +nvidia-cudnn-cu12==9\.19\.0\.56 " "$WORK/doctor12.txt"
grep -qE "^  cublasLt +12\.9\.[0-9]+ for CUDA 12\.[0-9]+ +nvidia-cublas-cu12==12\.9\.1\.4 " "$WORK/doctor12.txt"
grep -qE "^  nccl +2\.28\.9 for CUDA 12\.[0-9]+ +nvidia-nccl-cu12==2\.28\.9 " "$WORK/doctor12.txt"
readelf -d "$WORK"/venv12/lib/python3*/site-packages/gpt2core/_C_cuda*.so | grep -E "NEEDED.*(cublasLt.so.12|nccl)"
echo "CUDA from PyPI: OK"
