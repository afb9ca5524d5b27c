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
  # the vendor seams against CUDA 12's real libraries: cuBLASLt descriptors and the cuDNN SDPA graph, compiled
  # against the CUDA 12 wheels' headers (the tree cuda_pypi.sh assembled) and run on their libraries (a process of
  # their own: cuDNN has one soname). Here, beside the tests, not after them: their builds go to build/<lib>-<hash of
  # the include folder>, apart from the CUDA 13 ones the tests make; no pytest cache is written
  t0=$SECONDS
  GPT2CORE_SEAM_CUDA_HOME=/tmp/gpt2core-cuda-pypi/build12/cuda12-toolkit python3 -m pytest -q -rs -p no:cacheprovider \
    tests/csrc/cuda/test_cublaslt_descriptors.py tests/csrc/cuda/test_cudnn_graph.py | tee /tmp/gpt2core-cu12-seams.txt
  if grep -q "skipped" /tmp/gpt2core-cu12-seams.txt; then echo "CUDA 12 seam tests skipped"; exit 1; fi
  echo "== CUDA 12 seam tests: $((SECONDS - t0)) s"
fi
