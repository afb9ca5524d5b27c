"""Render the HellaSwag val set for evaluation. Same as `python -m gpt2core.data hellaswag`; see
gpt2core/data/hellaswag.py for the source, the formats and the reference scores.

    python scripts/hellaswag.py --input ../shared/data/hellaswag/hellaswag_val_full.txt \\
        --out data/hellaswag/hellaswag_val.npz
    python scripts/hellaswag.py                                  # downloads rowanz's hellaswag_val.jsonl
"""
import sys

from gpt2core.data.hellaswag import main

if __name__ == "__main__":
    sys.exit(main())
