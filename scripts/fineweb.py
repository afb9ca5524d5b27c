"""FineWeb-Edu -> GPT-2 token shards. Same as `python -m gpt2core.data fineweb`; see
gpt2core/data/fineweb.py for the source, a sample record and what it produces.

    python scripts/fineweb.py --num-procs 16            # HF sample-10BT into data/edu_fineweb10B
    python scripts/fineweb.py --input ../shared/data/fineweb/fineweb_10BT_sample300.jsonl \\
        --out-dir /tmp/fw300 --shard-size 100000
"""
import sys

from gpt2core.data.fineweb import main

if __name__ == "__main__":
    sys.exit(main())
