"""A CORE eval bundle (gpt2core.evaluation.core_eval's format: core.yaml, eval_meta_data.csv, eval_data/*.jsonl)
built from what is reachable here, for the lease's eval step (`python -m gpt2core.calibrate --core-bundle DIR`):
CORE's code path, few-shot prompts and scoring on the GPU at the size of a real bundle, not DCLM's 22 tasks.

Tasks (the random baselines are the tasks' own: 4 endings, or a word to produce exactly):
  hellaswag_zeroshot   multiple_choice, 0-shot: HellaSwag's validation items (--hellaswag: the shared data's
                       hellaswag_val_full.txt or a .jsonl); query = ctx, choices = the 4 endings, gold = label; 25%
  hellaswag            the same items, 10-shot (as in DCLM's core.yaml); 25%
  shakespeare_lambada  language_modeling, 0-shot: LAMBADA's construction on the bundled tiny Shakespeare: each
                       speech of at least --min-words words (a block between blank lines, the speaker's line
                       dropped), context = all but its last word, continuation = " " + the last word; 0%
One record of the last task (the first speech of 20 words or more, the First Citizen's): {"context": "We are
accounted poor citizens, the patricians good. [...] in hunger for bread, not in thirst for", "continuation":
" revenge"}.

    python scripts/lease_core_bundle.py --hellaswag /work/shared/data/hellaswag/hellaswag_val_full.txt --out core

writes DIR/core.yaml, DIR/eval_meta_data.csv and DIR/eval_data/*.jsonl; with the full HellaSwag set: 10,042 items in
each HellaSwag task, 2,575 speeches in the third.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def fail(msg: str) -> None:
    raise SystemExit(f"lease_core_bundle: {msg}")


def speeches(text: str, min_words: int) -> list[dict]:
    """LAMBADA-style items of tiny Shakespeare: per speech (blank-line separated; the speaker's line dropped) of
    at least min_words words, the context without the last word and the last word as the continuation."""
    out = []
    for block in text.split("\n\n"):
        lines = block.strip().split("\n")
        if len(lines) < 2 or not lines[0].endswith(":"):
            continue
        words = " ".join(lines[1:]).split()
        if len(words) < min_words:
            continue
        last = words[-1].strip(".,;:!?'\"-")
        if not last.isalpha():
            continue
        ctx = " ".join(words[:-1])
        out.append({"context": ctx, "continuation": " " + last})
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="lease_core_bundle.py", description=__doc__.split("\n")[0])
    ap.add_argument("--hellaswag", required=True, help="HellaSwag's validation set (6-line .txt or .jsonl)")
    ap.add_argument("--out", required=True, help="the bundle's folder (created)")
    ap.add_argument("--limit", type=int, default=None, help="the first N HellaSwag items only")
    ap.add_argument("--min-words", type=int, default=20, help="shortest speech for the Shakespeare task (20)")
    args = ap.parse_args(argv)
    from gpt2core.data import hellaswag
    from gpt2core.errors import Error
    try:
        items = hellaswag.load_items(args.hellaswag, args.limit, flag="--hellaswag")
    except (Error, OSError) as e:
        fail(f"--hellaswag {args.hellaswag}: {e}")
    asset = Path(hellaswag.__file__).resolve().parents[1] / "assets" / "tinyshakespeare.txt"
    lm = speeches(asset.read_text(), args.min_words)
    if len(items) <= 10 or len(lm) < 2:
        fail(f"too few items ({len(items)} HellaSwag, {len(lm)} speeches): 10-shot needs more than 10")
    out = Path(args.out)
    (out / "eval_data").mkdir(parents=True, exist_ok=True)
    mc = [{"query": it["ctx"], "choices": it["endings"], "gold": it["label"]} for it in items]
    for name, rows in (("hellaswag.jsonl", mc), ("shakespeare_lambada.jsonl", lm)):
        (out / "eval_data" / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    (out / "core.yaml").write_text(
        "icl_tasks:\n"
        "- {label: hellaswag_zeroshot, dataset_uri: hellaswag.jsonl, num_fewshot: [0], "
        "icl_task_type: multiple_choice}\n"
        "- {label: hellaswag, dataset_uri: hellaswag.jsonl, num_fewshot: [10], icl_task_type: multiple_choice}\n"
        "- {label: shakespeare_lambada, dataset_uri: shakespeare_lambada.jsonl, num_fewshot: [0], "
        "icl_task_type: language_modeling}\n")
    (out / "eval_meta_data.csv").write_text("Eval Task,Random baseline\nhellaswag_zeroshot,25\nhellaswag,25\n"
                                            "shakespeare_lambada,0\n")
    print(f"{out}: hellaswag_zeroshot and hellaswag {len(mc):,} items each, shakespeare_lambada {len(lm):,} items")
    return 0


if __name__ == "__main__":
    sys.exit(main())
