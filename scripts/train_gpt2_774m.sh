#!/usr/bin/env bash
# GPT-2 774M (d36) with llm.c's hyperparameters: see scripts/train_gpt2_large.sh (knobs, sources, plans).
exec "$(dirname "$0")/train_gpt2_large.sh" d36 "$@"
