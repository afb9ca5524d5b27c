"""Alias of gpt2core.evaluate, so that `python -m gpt2core.eval hellaswag --checkpoint ...` works too."""
import sys

from .evaluate import evaluate_loss, hellaswag_batches, hellaswag_losses, main, score_hellaswag  # noqa: F401

__all__ = ["evaluate_loss", "score_hellaswag", "hellaswag_losses", "hellaswag_batches", "main"]

if __name__ == "__main__":
    sys.exit(main())
