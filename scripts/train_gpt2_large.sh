#!/usr/bin/env bash
# GPT-2 350M (d24), 774M (d36) and 1558M (d48, GPT-2 XL) with llm.c's published hyperparameters:
#   scripts/train_gpt2_large.sh d24|d36|d48 [extra gpt2core-train flags]
# (scripts/train_gpt2_350m.sh, _774m.sh and _1558m.sh call it with their preset.)
#
# The hyperparameters are llm.c's run scripts (github.com/karpathy/llm.c, scripts/run_gpt2_350M.sh,
# run_gpt2_774M.sh, run_gpt2_1558M.sh), flag for flag:
#   d24  FineWeb 100B, 524,288 tokens/step (-d), 60,000 steps (-x) = 31.5B tokens, max LR 3e-4 (-l) decaying
#        to 0 (-q 0.0), 700 warmup steps (-u), weight decay 0.1 (-c), B=64 per GPU (-b), T=1024 (-t)
#   d36  FineWeb 100B, 524,288 tokens/step, 286,102 steps = 150B tokens, max LR 2.5e-4 -> 0, 700 warmup, wd 0.1,
#        B=32 per GPU
#   d48  FineWeb-Edu 100B, 1,048,576 tokens/step, 32,000 steps = 33.6B tokens, max LR 6e-4 -> 6e-5 cosine
#        (-k cosine, -q 0.1), 700 warmup, wd 0.1, B=16 per GPU
# and, for all three: ZeRO-1 over the 8 GPUs (-z 1), val loss and HellaSwag every 250 steps (-v 250, -h 1),
# AdamW betas (0.9, 0.95) and clip 1.0 (llm.c's defaults). llm.c ran them on one 8x A100 80GB node (d24 ~14 h,
# d36 ~5.6 days) and one 8x H100 80GB node (d48 ~24 h).
#
# Before training, the script prints the memory plan of the command (gpt2core-train --plan: bytes per GPU by
# part, the largest micro-batch that fits this GPU's free memory, which memory options fit) and stops with its
# one-line suggestion when the run does not fit. The plans for common cards are in docs/training/memory.md
# ("Memory and scale"). Environment knobs (defaults in brackets):
#   NGPU [8]  B [llm.c's]  T [1024]  RECOMPUTE [none]  ZERO [1 with NGPU > 1, else 0]  OFFLOAD [none]  DATA
#   HELLASWAG  OUT
#   LAUNCHER [auto: torchrun if installed, else python -m gpt2core.launch]  PYTHON [python]  DEVICE [cuda]
#   GPU_MEMORY [the GPU's free memory]: the plan's budget per GPU, e.g. 24GiB
# Examples:
#   scripts/train_gpt2_350m.sh                                   # 8 GPUs, llm.c's run
#   NGPU=1 B=8 RECOMPUTE=layer scripts/train_gpt2_350m.sh        # one RTX 3080 10 GB (docs/training/memory.md's plan)
#   NGPU=2 B=4 RECOMPUTE=layer scripts/train_gpt2_1558m.sh       # two RTX 4090 24 GB, ZeRO-1
#   NGPU=2 B=8 RECOMPUTE=layer ZERO=2 scripts/train_gpt2_1558m.sh   # the same with ZeRO-2 (gradients sharded)
#   NGPU=1 B=16 RECOMPUTE=layer OFFLOAD=optimizer scripts/train_gpt2_1558m.sh   # one RTX 4090: AdamW on the host
# Fewer GPUs or a smaller B keep the tokens per step through gradient accumulation. Rerunning resumes from the
# newest complete checkpoint (--resume auto). These are llm.c's figures, not measurements of gpt2core.
set -euo pipefail

PRESET=${1:?"usage: train_gpt2_large.sh d24|d36|d48 [gpt2core-train flags]"}
shift
case "$PRESET" in
  d24) b=64; tokens=524288;  steps=60000;  lr=3e-4;   min_frac=0.0; data=data/fineweb100B;     name=350m ;;
  d36) b=32; tokens=524288;  steps=286102; lr=2.5e-4; min_frac=0.0; data=data/fineweb100B;     name=774m ;;
  d48) b=16; tokens=1048576; steps=32000;  lr=6e-4;   min_frac=0.1; data=data/edu_fineweb100B; name=1558m ;;
  *) echo "train_gpt2_large.sh: the preset must be d24, d36 or d48, got $PRESET" >&2; exit 2 ;;
esac
NGPU=${NGPU:-8}
B=${B:-$b}
T=${T:-1024}
DATA=${DATA:-$data}
HELLASWAG=${HELLASWAG:-data/hellaswag/hellaswag_val.npz}
OUT=${OUT:-runs/gpt2_$name}
RECOMPUTE=${RECOMPUTE:-none}
OFFLOAD=${OFFLOAD:-none}
if (( NGPU > 1 )); then ZERO=${ZERO:-1}; else ZERO=${ZERO:-0}; fi
DEVICE=${DEVICE:-cuda}
LAUNCHER=${LAUNCHER:-auto}
PYTHON=${PYTHON:-python}

per_step=$((B * T * NGPU))
if (( tokens % per_step )); then
  echo "train_gpt2_large.sh: $tokens tokens per step is not a multiple of B*T*NGPU = $B*$T*$NGPU" >&2
  exit 2
fi
source "$(dirname "$0")/launch_cmd.sh" train_gpt2_large.sh

args=(--preset "$PRESET" --device "$DEVICE" --precision bf16 -B "$B" -T "$T" --total-batch-tokens "$tokens"
      --recompute "$RECOMPUTE" --zero "$ZERO" --offload "$OFFLOAD")
# the plan first, in this process (no GPU memory is allocated): exit 2 with its suggestion when it does not fit
"$PYTHON" -m gpt2core.train "${args[@]}" --plan --world-size "$NGPU" ${GPU_MEMORY:+--gpu-memory "$GPU_MEMORY"}

mkdir -p "$OUT"
set -x
exec "${launch[@]}" "${args[@]}" --data-dir "$DATA" \
  --steps "$steps" --lr "$lr" --min-lr-frac "$min_frac" --warmup 700 --schedule cosine \
  --weight-decay 0.1 --grad-clip 1.0 --beta1 0.9 --beta2 0.95 \
  --val-every 250 --val-steps 20 \
  --hellaswag-every 250 --hellaswag-path "$HELLASWAG" \
  --checkpoint-every 2000 --resume auto --sample-every 2000 \
  --output-dir "$OUT" "$@"
