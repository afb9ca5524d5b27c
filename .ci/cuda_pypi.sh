#!/usr/bin/env bash
# CI (issues 13, 28): the CUDA plugins gpt2core-cuda13 and gpt2core-cuda12 (plugins/cuda*/pyproject.toml: only the
# CUDA module, GPT2CORE_PLUGIN=ON) and the CPU package gpt2core are built as wheels from NVIDIA's PyPI wheels on a
# machine with no CUDA toolkit, installed side by side, and each plugin loads and checks its own NVIDIA libraries.
#   CUDA 13: nvidia-cuda-nvcc & co. install a toolkit tree in site-packages/nvidia/cu13; the plugin is compiled from
#            it with every /usr/local/cuda-* hidden (one arch; no cuDNN frontend in this venv, so its attention seam
#            is the stub: that compile is the CUDA 12 plugin's).
#   CUDA 12: NVIDIA's CUDA 12 nvcc wheel ships ptxas only (no nvcc): clang compiles the CUDA code against the CUDA 12
#            wheels' headers, ptxas and libdevice (GPT2CORE_CUDA_MAJOR=12, cmake/gpt2core_cuda12_clang.cmake). The
#            assembled CUDA 12 tree is left in $WORK/build12/cuda12-toolkit for the cuBLASLt descriptor and cuDNN
#            graph tests against the CUDA 12 libraries (.ci/run).
#   CPU:     gpt2core with GPT2CORE_CUDA=OFF (the core that the whole CUDA 12 package compiled before).
# Then: each venv with the CPU wheel and its plugin imports, build_info() and the doctor report the plugin and the
# libraries it verified; both plugins installed together are refused, naming the fix.
# The NVIDIA wheel versions are the plugins' exact pins (tests/python/test_libs.py checks this file uses exactly
# those). Root only: a private mount namespace (unshare -m) with an empty directory over each toolkit.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
WORK="${GPT2CORE_PYPI_WORK:-/tmp/gpt2core-cuda-pypi}"
if [ "${1:-}" != "--hidden" ]; then
  exec unshare -m "$0" --hidden
fi
mkdir -p "$WORK/empty"
for d in /usr/local/cuda-*; do [ -d "$d" ] && mount --bind "$WORK/empty" "$d"; done
if command -v nvcc >/dev/null && nvcc --version >/dev/null 2>&1; then echo "a system nvcc is still visible"; exit 1; fi

DIST="$WORK/dist"
rm -rf "$DIST"; mkdir -p "$DIST"
# The three builds are independent: the CUDA 13 venv and plugin (a background job) while the CUDA 12 venv
# installs, then the CUDA 12 plugin and the CPU package side by side (each compile is mostly one long file: two
# cores do both). Each job's output is kept and shown in this order once all three are done.
cu13() {
  set -e
  echo "== CUDA 13 from PyPI: venv"
  python3 -m venv "$WORK/venv13"
  PY="$WORK/venv13/bin/python"
  "$PY" -m pip install -q scikit-build-core pybind11 \
    nvidia-cuda-nvcc==13.0.88 nvidia-cuda-cccl==13.0.85 nvidia-cuda-crt==13.0.88 nvidia-nvvm==13.0.88 \
    nvidia-cuda-runtime==13.0.96 nvidia-cublas==13.0.2.14 nvidia-cuda-nvrtc==13.0.88 nvidia-cudnn-cu13==9.19.0.56 \
    nvidia-nccl-cu13==2.28.9
  echo "== the plugin gpt2core-cuda13 (system toolkit hidden), sm_75"
  rm -rf "$WORK/build13"
  GPT2CORE_CUDA_ARCHS=75 "$PY" -m pip wheel --no-build-isolation --no-deps -v -w "$DIST" -C build-dir="$WORK/build13" \
    "$ROOT/plugins/cuda13" > "$WORK/build13.log" 2>&1 || { tail -n 60 "$WORK/build13.log"; exit 1; }
  grep "gpt2core:" "$WORK/build13.log"
  grep -q "CUDA toolchain from NVIDIA's PyPI wheels" "$WORK/build13.log"
  grep -q "CUDA backend ON, archs = 75, cuDNN = ON, NCCL = ON" "$WORK/build13.log"
  grep -q 'CUDA_VERSION = "13.0"' "$WORK/build13/_build_config.py"
  grep -q 'DIST = "gpt2core-cuda13"' "$WORK/build13/_build_config.py"
  readelf -d "$WORK"/build13/_C_cuda*.so | grep -E "NEEDED.*(cublasLt|nccl)"
}
cu12() {
  set -e
  echo "== the plugin gpt2core-cuda12 (clang), sm_75"
  local t0=$SECONDS
  rm -rf "$WORK/build12"
  GPT2CORE_CUDA_ARCHS=75 "$V12/python" -m pip wheel --no-build-isolation --no-deps -v -w "$DIST" \
    -C build-dir="$WORK/build12" "$ROOT/plugins/cuda12" > "$WORK/build12.log" 2>&1 \
    || { tail -n 80 "$WORK/build12.log"; exit 1; }
  grep "gpt2core:" "$WORK/build12.log"
  grep -q "gpt2core: CUDA 12.9 compiled by .*clang" "$WORK/build12.log"
  echo "CUDA 12 plugin (clang): $((SECONDS - t0)) s"
}
cpu() {
  set -e
  echo "== the CPU package gpt2core (GPT2CORE_CUDA=OFF)"
  local t0=$SECONDS
  rm -rf "$WORK/buildcpu"
  GPT2CORE_CUDA=OFF "$V12/python" -m pip wheel --no-build-isolation --no-deps -v -w "$DIST" \
    -C build-dir="$WORK/buildcpu" "$ROOT" > "$WORK/buildcpu.log" 2>&1 || { tail -n 80 "$WORK/buildcpu.log"; exit 1; }
  grep -q 'CUDA_VERSION = ""' "$WORK/buildcpu/_build_config.py"
  echo "CPU package: $((SECONDS - t0)) s"
}
cu13 > "$WORK/job-cu13.out" 2>&1 &
pid13=$!

echo "== CUDA 12 by clang from PyPI's CUDA 12 wheels: venv with the plugin's pins"
python3 -m venv "$WORK/venv12"
V12="$WORK/venv12/bin"
"$V12/python" -m pip install -q scikit-build-core pybind11 scipy-openblas32 numpy tiktoken tqdm \
  nvidia-cudnn-frontend==1.28.0 \
  nvidia-cuda-nvcc-cu12==12.9.86 nvidia-cuda-cccl-cu12==12.9.27 nvidia-curand-cu12==10.3.10.19 nvidia-cuda-nvcc==13.0.88 \
  nvidia-cuda-runtime-cu12==12.9.79 nvidia-cublas-cu12==12.9.1.4 nvidia-cuda-nvrtc-cu12==12.9.86 \
  nvidia-cudnn-cu12==9.19.0.56 nvidia-nccl-cu12==2.28.9
cu12 > "$WORK/job-cu12.out" 2>&1 &
pid12=$!
cpu > "$WORK/job-cpu.out" 2>&1 &
pidcpu=$!
failed=""
for job in cu13:$pid13 cu12:$pid12 cpu:$pidcpu; do
  wait "${job#*:}" || failed="$failed ${job%%:*}"
  cat "$WORK/job-${job%%:*}.out"
done
if [ -n "$failed" ]; then echo "failed:$failed"; exit 1; fi
ls -l "$DIST"
CPU_WHL=$(ls "$DIST"/gpt2core-[0-9]*.whl)
cd "$WORK"
check() {  # venv major: the CPU package + the plugin of that major
  local venv="$1" major="$2"
  "$venv/bin/python" -m pip uninstall -q -y gpt2core gpt2core-cuda12 gpt2core-cuda13 2>/dev/null || true  # a reused venv
  "$venv/bin/python" -m pip install -q "$CPU_WHL" "$DIST"/gpt2core_cuda"$major"-*.whl
  "$venv/bin/python" - "$major" <<'PY'
import json, sys
import gpt2core
from gpt2core import _plugins
major = sys.argv[1]
i = gpt2core.build_info()
print(json.dumps({k: i.get(k) for k in ("cuda_plugin", "cuda_version", "cudnn_version", "nccl_version",
                                        "cuda_library_versions", "cuda_error", "cuda_driver")}))
b = _plugins.find()
assert b.dist == f"gpt2core-cuda{major}" and b.module == f"gpt2core_cuda{major}._C_cuda", b
assert i["cuda_plugin"].startswith(f"gpt2core-cuda{major} {gpt2core.__version__} (CUDA {major}."), i
assert i["cuda"] and "cuda" in i["backends"] and "cuda_error" not in i, i
assert len(b.config.NVIDIA_PINS) == 5 and all(p.startswith("nvidia-") for p in b.config.NVIDIA_PINS), b.config
PY
  "$venv/bin/gpt2core-doctor" --seconds 0 | tee "$WORK/doctor$major.txt"
  grep -qE "^  CUDA plugin gpt2core-cuda$major [0-9.]+ \(CUDA $major\." "$WORK/doctor$major.txt"
  readelf -d "$venv"/lib/python3*/site-packages/gpt2core_cuda"$major"/_C_cuda*.so \
    | grep -E "NEEDED.*(cublasLt.so.$major|nccl)"
}
echo "== venv12: gpt2core + gpt2core-cuda12"
check "$WORK/venv12" 12
grep -qE "^  cudnn +9\.19\.0 for CUDA 12\.[0-9]+ +nvidia-cudnn-cu12==9\.19\.0\.56 " "$WORK/doctor12.txt"
grep -qE "^  cublasLt +12\.9\.[0-9]+ for CUDA 12\.[0-9]+ +nvidia-cublas-cu12==12\.9\.1\.4 " "$WORK/doctor12.txt"
grep -qE "^  nccl +2\.28\.9 for CUDA 12\.[0-9]+ +nvidia-nccl-cu12==2\.28\.9 " "$WORK/doctor12.txt"
echo "== venv13: gpt2core + gpt2core-cuda13"
check "$WORK/venv13" 13
grep -qE "^  cublasLt +13\.0\.[0-9]+ for CUDA 13\.0 +nvidia-cublas==13\.0\.2\.14 " "$WORK/doctor13.txt"
grep -qE "^  nccl +2\.28\.9 for CUDA 13\.[0-9]+ +nvidia-nccl-cu13==2\.28\.9 " "$WORK/doctor13.txt"
echo "-- both plugins installed together: refused, with the fix (the doctor fails, device='cuda' says so)"
"$WORK/venv13/bin/python" -m pip install -q --no-deps "$DIST"/gpt2core_cuda12-*.whl
if "$WORK/venv13/bin/gpt2core-doctor" --seconds 0 > "$WORK/doctor-both.txt" 2>&1; then
  cat "$WORK/doctor-both.txt"; echo "the doctor passed with two CUDA majors' plugins"; exit 1
fi
grep -E "CUDA +not loaded: gpt2core's CUDA plugins for two CUDA majors are installed together" "$WORK/doctor-both.txt"
grep -q "pip uninstall -y gpt2core-cuda12 && pip install --force-reinstall \"gpt2core\[cuda13\]==" "$WORK/doctor-both.txt"
! grep -q Traceback "$WORK/doctor-both.txt"
"$WORK/venv13/bin/python" -c "import gpt2core; gpt2core.GPT2('tiny', device='cuda')" 2> "$WORK/both.txt" && exit 1
tail -n 1 "$WORK/both.txt" | grep "DeviceError: device='cuda': gpt2core's CUDA plugins for two CUDA majors"
"$WORK/venv13/bin/python" -m pip uninstall -q -y gpt2core-cuda12
"$WORK/venv13/bin/gpt2core-doctor" --seconds 0 | grep -E "^  CUDA plugin gpt2core-cuda13 "
echo "CUDA from PyPI: OK"
