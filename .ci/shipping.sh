#!/usr/bin/env bash
# CI's shipping checks (issues 13, 28): .ci/wheel.sh, then (a CUDA build) .ci/cuda_pypi.sh. .ci/run starts this
# beside the tests, at the lowest CPU priority, and waits for it after them. Root only (both hide the system
# toolkit in a private mount namespace). Isolated from the tests: each script has its own work folder in /tmp (venvs,
# build folders, wheels), never the checkout's build/ tree, and the toolkit is hidden in its own mount namespace only.
set -euo pipefail
cd "$(dirname "$0")/.."
t0=$SECONDS; bash .ci/wheel.sh; echo "== wheel step: $((SECONDS - t0)) s"
if python3 -c "import gpt2core, sys; sys.exit(0 if gpt2core.build_info()['cuda'] else 1)"; then
  t0=$SECONDS; bash .ci/cuda_pypi.sh; echo "== CUDA-from-PyPI step: $((SECONDS - t0)) s"
fi
