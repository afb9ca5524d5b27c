"""Alias of gpt2core.evaluate, so that `python -m gpt2core.eval hellaswag --checkpoint ...` works too."""
import sys

from .evaluate import evaluate_loss, hellaswag_batches, main, score_hellaswag  # noqa: F401

__all__ = ["evaluate_loss", "score_hellaswag", "hellaswag_batches", "main"]

if __name__ == "__main__":
    sys.exit(main())
