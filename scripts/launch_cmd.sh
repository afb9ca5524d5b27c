# Sourced by the train_gpt2_*.sh scripts: sets the array `launch` to the command that starts gpt2core-train on
# $NGPU processes: LAUNCHER auto (torchrun when installed, else python -m gpt2core.launch), torchrun or gpt2core.
# $1: the calling script's name, for the error message.
if [[ "$LAUNCHER" == auto ]]; then
  if command -v torchrun >/dev/null 2>&1; then LAUNCHER=torchrun; else LAUNCHER=gpt2core; fi
fi
case "$LAUNCHER" in
  torchrun) launch=(torchrun --standalone --nproc_per_node="$NGPU" -m gpt2core.train) ;;
  gpt2core) launch=("$PYTHON" -m gpt2core.launch --nproc-per-node "$NGPU" --master-port auto -m gpt2core.train) ;;
  *) echo "$1: LAUNCHER must be auto, torchrun or gpt2core, got $LAUNCHER" >&2; exit 2 ;;
esac
