#!/usr/bin/env bash
# Nsight Compute on the attention kernels of one d12 bf16 micro-step (B=8, T=1024), on a GPU with gpt2core
# installed. Writes into OUT (default ./ncu_out): k_<attention>.csv, every kernel's duration for attention=cudnn
# and flash, and ncu_<kernel>.txt, the sections of one launch of each of our attention kernels (layer 2).
# Used in docs/GPU_H100_2026-11-28.md ("A second lease"). Usage: bash scripts/ncu_attention.sh [OUT]
set -u
OUT="${1:-${OUT:-ncu_out}}"; mkdir -p "$OUT"
NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
[ -n "$NCU" ] || { echo "ncu (Nsight Compute) not found"; exit 2; }
STEP=$(mktemp --suffix .py)
cat > "$STEP" <<'PY'
import sys, numpy as np
from gpt2core import GPT2
m = GPT2("d12", device="cuda", precision="bf16", attention=sys.argv[1], seed=0)
x = np.random.default_rng(0).integers(0, 50257, (8, 1024), dtype=np.int32)
m.zero_grad(); m.forward(x, x); m.backward(); m.take_loss()
PY
for A in cudnn flash; do
  timeout 120 "$NCU" --metrics gpu__time_duration.sum --csv python3 "$STEP" $A > "$OUT/k_$A.csv" 2>&1
  echo "kernel durations, attention=$A: rc $?"
done
for K in attention_tc_forward attention_tc_backward_dkdv attention_tc_backward_dq attention_backward_dot; do
  timeout 120 "$NCU" --kernel-name regex:$K --launch-skip 1 --launch-count 1 --section SpeedOfLight \
    --section Occupancy --section LaunchStats --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis \
    --section WarpStateStats --section SchedulerStats python3 "$STEP" flash > "$OUT/ncu_$K.txt" 2>&1
  echo "sections, $K: rc $?"
  grep -E "Duration|Registers Per|Theoretical Occupancy|Achieved Occupancy|Issued Warp|Compute \(SM\)" "$OUT/ncu_$K.txt"
done
rm -f "$STEP"
