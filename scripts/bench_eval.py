"""`scripts/bench.py --eval`: scoring speed of CORE and of lm-eval's harness, ours beside lm-eval's Hugging Face model.

    python scripts/bench.py --eval --preset d12 --threads 2 [--eval-items 64] [--eval-data hellaswag_val.jsonl]

The task: the first --eval-items HellaSwag items (default: tests/data/hellaswag_val_120.jsonl) as a 4-way multiple
choice, context = ctx, choices = " " + each ending, zero-shot (CORE's hellaswag_zeroshot). Random weights (seed 0):
speed does not depend on them. Measured in one run, on the same weights and threads:
- CORE: gpt2core.core_eval.score_items (items/s): the prompts tokenized, batched through the KV-cache prefill.
- lm-eval with `--model gpt2core` (gpt2core.lm_eval) on the same items as a local YAML task (requests/s and items/s);
  with torch and transformers installed, lm-eval's `--model hf` on the project's HF export (GPT2.save_pretrained,
  float32, torch threads = --threads, batch size --eval-hf-batch), and the ratio ours / theirs (above 1: ours is
  faster). The two score the same requests; lm-eval's own time (task building, metrics) is in both.
The machine is shared: figures from a busy machine move from run to run; the ratio, measured in one run in
alternation-free sequence, is the figure to quote, with that caveat.
"""
from __future__ import annotations

import tempfile
import time
from pathlib import Path

DEFAULT_DATA = Path(__file__).resolve().parents[1] / "tests" / "data" / "hellaswag_val_120.jsonl"


def load_task(path, n: int):
    from gpt2core.core_eval import Task
    from gpt2core.data import hellaswag as hs
    items = hs.load_items(path, limit=n)
    core = Task("hellaswag_zeroshot", "multiple_choice", 0, " ", str(path), 0.25,
                [{"query": it["ctx"], "choices": it["endings"], "gold": it["label"]} for it in items])
    return items, core


def time_core(model, task, batch_tokens: int) -> float:
    """Seconds to score every item of `task`, after an untimed pass over the same items: the first forward of a
    batch shape allocates the KV cache and the logits of every position (2x the time of a later pass here), and
    the lm-eval run that follows reuses them, so both engines are timed warm."""
    from gpt2core.core_eval import score_items
    score_items(model, task, range(len(task.items)), batch_tokens)
    t0 = time.perf_counter()
    score_items(model, task, range(len(task.items)), batch_tokens)
    return time.perf_counter() - t0


def write_lm_eval_task(items, folder: Path) -> str:
    """The same items as a local lm-eval task (gpt2core.lm_eval.write_multiple_choice_task)."""
    from gpt2core.lm_eval import write_multiple_choice_task
    return write_multiple_choice_task(folder, "gpt2core_bench_hellaswag",
                                      [{"text": it["ctx"], "choices": it["endings"], "label": it["label"]}
                                       for it in items])


def time_lm_eval(lm, task_name: str, folder: Path) -> float:
    import lm_eval
    from lm_eval.tasks import TaskManager
    tm = TaskManager(include_path=str(folder), include_defaults=False)
    t0 = time.perf_counter()
    lm_eval.simple_evaluate(model=lm, tasks=[task_name], task_manager=tm)
    return time.perf_counter() - t0


def hf_lm(model, folder: Path, threads: int, batch: int):
    """lm-eval's Hugging Face model on the project's HF export of `model` (with GPT-2's tokenizer files)."""
    import sys
    import torch
    from lm_eval.models.huggingface import HFLM
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_llamacpp import export_hf
    torch.set_num_threads(threads)
    out = export_hf(model, folder / "hf")
    return HFLM(pretrained=str(out), device="cpu", dtype="float32", batch_size=batch)


def eval_bench(args) -> dict:
    from gpt2core import GPT2, _C, load_model
    from gpt2core.config import get_preset
    if args.threads:
        _C.set_num_threads(args.threads)
    threads = _C.get_num_threads()
    model = (load_model(args.load, device=args.device) if args.load else
             GPT2(get_preset(args.preset), seed=0, device=args.device, training=False))
    items, task = load_task(args.eval_data or DEFAULT_DATA, args.eval_items)
    n = len(items)
    what = f"model {args.load}" if args.load else f"preset {args.preset} (random weights, seed 0)"
    print(f"eval: {what}, {model.num_parameters:,} parameters, device {args.device}, {threads} threads; "
          f"{n} HellaSwag items as a 4-way multiple choice, zero-shot")
    core_s = time_core(model, task, args.eval_batch_tokens)
    result = {"items": n, "core_items_per_s": n / core_s}
    print(f"{'engine':<34} {'seconds':>9} {'items/s':>9}")
    print(f"{'CORE (gpt2core.core_eval)':<34} {core_s:>9.2f} {n / core_s:>9.1f}")
    if args.eval_harness == "none":
        return result
    try:
        import lm_eval  # noqa: F401
        from gpt2core.lm_eval import GPT2CoreLM
    except ImportError as e:
        print(f"lm-eval not measured ({e})")
        return result
    with tempfile.TemporaryDirectory(prefix="gpt2core-bench-eval-") as d:
        folder = Path(d)
        name = write_lm_eval_task(items, folder)
        ours = time_lm_eval(GPT2CoreLM(model=model, batch_tokens=args.eval_batch_tokens), name, folder)
        result["lm_eval_gpt2core_items_per_s"] = n / ours
        print(f"{'lm-eval --model gpt2core':<34} {ours:>9.2f} {n / ours:>9.1f}")
        try:
            theirs = time_lm_eval(hf_lm(model, folder, threads, args.eval_hf_batch), name, folder)
        except Exception as e:  # noqa: BLE001 - torch / transformers missing or not loadable: ours alone
            print(f"lm-eval --model hf not measured ({type(e).__name__}: {e})")
            return result
        result["lm_eval_hf_items_per_s"] = n / theirs
        result["ratio"] = theirs / ours
        print(f"{'lm-eval --model hf (transformers)':<34} {theirs:>9.2f} {n / theirs:>9.1f}")
        print(f"ours / theirs: {theirs / ours:.2f}x (items/s; above 1: ours is faster; a shared machine moves "
              "both figures)")
    return result
