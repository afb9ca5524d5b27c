"""Recipe benchmark (a benchmark, never a timed test): training recipes side by side on the same data and model
size, validation loss against tokens, the tokens the modern recipe needs to reach the GPT-2 recipe's final
validation loss (and the ratio), and an ablation: the GPT-2 recipe, then each ingredient added one at a time.

Data (real English text, larger than tiny Shakespeare, so that no run repeats its data): the Linux kernel's
documentation as Debian ships it, package `linux-doc-6.12` (GPL-2; ~40 MB .deb, 31 MB of reStructuredText/plain
text once unpacked, 11.3M GPT-2 tokens). Its origin (Debian version, archive URL, sha256), licence and how it is
prepared: docs/DATA_SOURCES.md.

    apt-get download linux-doc-6.12 && dpkg-deb -x linux-doc-6.12_*.deb linux-doc
    nice -n 5 python scripts/recipe_bench.py --docs linux-doc --out runs/recipe_bench \\
        --preset s4 --steps 48 -B 2 -T 256 --val-every 8 --val-steps 4 --warmup 5

prepares the shards once (GPT-2 BPE, llm.c's shard format; the first shard is validation), trains each row of the
ablation with gpt2core-train (the same data order, seed and tokens), and writes <out>/recipe_bench.md (the table)
and <out>/recipe_bench.json after every row (a partial run is not lost; a rerun reuses the rows that finished),
then <out>/recipe_bench.png (gpt2core-plot). The rows (each adds its flags to the row above):

    gpt2                                  --recipe gpt2 (AdamW lr 1e-3, cosine, GPT-2's architecture)
    AdamW at lr 6e-3 (control)            --lr 6e-3 --beta1 0.8 --weight-decay 0 (the modern recipe's AdamW)
    + rotary                              --position rope
    + RMSNorm, QK-norm, no biases         --norm rmsnorm --qk-norm --no-bias
    + ReLU²                               --activation relu2
    + untied head, zero-init proj, soft-cap 15   --untied --zero-init-proj --logit-softcap 15
    + Muon                                --optimizer muon (Muon's settings from --recipe modern)
    + WSD, no warm-up (= --recipe modern) --recipe modern itself

On a GPU the same script runs at d12 on FineWeb (--data-dir of FineWeb shards, --preset d12 --extra --device cuda).
"""
from __future__ import annotations

import argparse
import gzip
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

from gpt2core.config import MODERN_ARCH, RECIPES


def iter_docs(root: Path):
    """The documentation's text files (rst and txt, gzipped as Debian ships them), in a fixed shuffled order."""
    files = sorted(p for p in root.rglob("*") if p.name.endswith((".rst.gz", ".txt.gz", ".rst", ".txt"))
                   and "/html/" not in str(p))
    if not files:
        raise SystemExit(f"recipe_bench: no .rst/.txt files under {root} (unpack linux-doc-6.12 there)")
    random.Random(0).shuffle(files)
    for p in files:
        raw = gzip.decompress(p.read_bytes()) if p.suffix == ".gz" else p.read_bytes()
        text = raw.decode("utf-8", errors="replace").strip()
        if text:
            yield text


def prepare(docs: Path, data_dir: Path, shard_tokens: int) -> None:
    from gpt2core.data.fineweb import write_shards
    write_shards(iter_docs(docs), data_dir, name="linuxdoc", shard_size=shard_tokens, progress=False,
                 settings={"source": "debian linux-doc-6.12"})


def rows(warmup: int = 10) -> list[tuple[str, list[str]]]:
    """(label, gpt2core-train flags) of each ablation row: the GPT-2 recipe, a fair AdamW control, then one
    ingredient at a time on top of it (the architecture's GPT2Config fields, each a train flag; Muon; the WSD
    schedule). The last row is `--recipe modern` itself (test_recipe_bench checks that the rows add up to it).
    warmup: the LR warm-up of every row but the last (the modern recipe has none)."""
    modern = RECIPES["modern"]
    w = ["--warmup", str(warmup)]
    # the control: AdamW alone at the modern recipe's AdamW settings (its higher LR is not the optimizer's merit)
    adamw = ["--recipe", "gpt2", *w, "--lr", str(modern["lr"]), "--beta1", str(modern["beta1"]),
             "--weight-decay", str(modern["weight_decay"])]
    rope = [*adamw, "--position", "rope"]
    norm = [*rope, "--norm", "rmsnorm", "--qk-norm", "--no-bias"]
    relu2 = [*norm, "--activation", "relu2"]
    head = [*relu2, "--untied", "--zero-init-proj", "--logit-softcap", str(MODERN_ARCH["logit_softcap"])]
    muon = [*head, "--optimizer", "muon", "--muon-lr", str(modern["muon_lr"]), "--muon-momentum",
            str(modern["muon_momentum"]), "--muon-momentum-warmup", str(modern["muon_momentum_warmup"]),
            "--muon-weight-decay", str(modern["muon_weight_decay"])]
    return [("gpt2", ["--recipe", "gpt2", *w]),
            (f"AdamW at lr {modern['lr']:g} (control)", adamw),
            ("+ rotary", rope),
            ("+ RMSNorm, QK-norm, no biases", norm),
            ("+ ReLU²", relu2),
            ("+ untied head, zero-init proj, soft-cap 15", head),
            ("+ Muon", muon),
            ("+ WSD, no warm-up (= --recipe modern)", ["--recipe", "modern"])]


def val_curve(run: Path) -> list[tuple[int, float]]:
    """(tokens, val loss) of a run's metrics.jsonl."""
    per_step, curve = None, []
    for line in (run / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line)
        if "run" in r:
            per_step = r["run"]["tokens_per_step"]
        elif "val_loss" in r:
            curve.append((r["step"] * per_step, r["val_loss"]))
    return curve


def tokens_to_reach(curve, target: float) -> float | None:
    """Tokens at which the val curve first reaches target (linear between evaluations), None if it never does."""
    prev = None
    for tok, loss in curve:
        if loss <= target:
            if prev is None or prev[1] == loss:
                return float(tok)
            (t0, l0) = prev
            return t0 + (tok - t0) * (l0 - target) / (l0 - loss)
        prev = (tok, loss)
    return None


def train_tok_per_s(run: Path) -> float:
    """The median training throughput of a run's steps (metrics.jsonl's tok_per_s; validation not counted)."""
    v = sorted(json.loads(line)["tok_per_s"] for line in (run / "metrics.jsonl").read_text().splitlines()
               if '"tok_per_s"' in line)
    return v[len(v) // 2] if v else float("nan")


def write_report(a, results: list[dict]) -> None:
    """<out>/recipe_bench.md (the table) and <out>/recipe_bench.json of the rows run so far. Targets: the GPT-2
    recipe's final val loss and the AdamW control's (the first two rows), for each row the tokens it needs to reach
    them and the ratio (the target run's tokens / these)."""
    base = results[0]
    control = next((r for r in results if "(control)" in r["label"]), None)
    lines = [f"Same data (linux-doc-6.12), {a.preset}, B={a.batch_size}, T={a.seq_len}, {a.steps} steps = "
             f"{base['tokens']:,} tokens per run; targets: the GPT-2 recipe's final val loss {base['final_val']:.4f}"
             + (f", and the AdamW control's {control['final_val']:.4f}" if control else "") + ".", "",
             "| recipe | final val loss | tokens to GPT-2's final val loss (fewer) |"
             + (" tokens to the AdamW control's final val loss (fewer) |" if control else "") + " train tok/s | wall s |",
             "|---|---|---|" + ("---|" if control else "") + "---|---|"]

    def reach(r, ref):
        t = tokens_to_reach(r["curve"], ref["final_val"])
        return t, ("not reached" if t is None else "0 (at the start)" if t == 0 else
                   f"{t:,.0f} ({ref['tokens'] / t:.2f}x)")

    for r in results:
        r["tokens_to_target"], cell = reach(r, base)
        r["ratio"] = base["tokens"] / r["tokens_to_target"] if r["tokens_to_target"] else None  # None: never/at 0
        if control:
            r["tokens_to_control"], cell2 = reach(r, control)
            r["ratio_to_control"] = control["tokens"] / r["tokens_to_control"] if r["tokens_to_control"] else None
            cell += f" | {cell2}"
        tps, sec = r.get("tok_per_s"), r.get("seconds")
        lines.append(f"| {r['label']} | {r['final_val']:.4f} | {cell} | {'-' if tps is None else f'{tps:.0f}'} | "
                     f"{'-' if sec is None else f'{sec:.0f}'} |")
    (a.out / "recipe_bench.md").write_text("\n".join(lines) + "\n")
    (a.out / "recipe_bench.json").write_text(json.dumps(results, indent=1))
    print("\n".join(lines), flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--docs", type=Path, help="unpacked linux-doc-6.12 (or any folder of .rst/.txt[.gz] text)")
    ap.add_argument("--data-dir", type=Path, help="token shards (default: <out>/data, prepared from --docs)")
    ap.add_argument("--out", type=Path, default=Path("runs/recipe_bench"))
    ap.add_argument("--preset", default="s4")
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("-B", "--batch-size", type=int, default=2)
    ap.add_argument("-T", "--seq-len", type=int, default=256)
    ap.add_argument("--val-every", type=int, default=8)
    ap.add_argument("--val-steps", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=5, help="LR warm-up steps of every row but --recipe modern "
                    "(which has none)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--shard-tokens", type=int, default=10**6, help="tokens per shard (shard 0: validation)")
    ap.add_argument("--only", nargs="*", help="run only these row labels (default: all)")
    ap.add_argument("--extra", nargs=argparse.REMAINDER, default=[], help="more gpt2core-train flags for every row")
    a = ap.parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    data = a.data_dir or a.out / "data"
    if not any(data.glob("*_val_*.bin")):
        if not a.docs:
            raise SystemExit("recipe_bench: give --docs (unpacked linux-doc-6.12) or --data-dir (prepared shards)")
        prepare(a.docs, data, a.shard_tokens)
    results = []
    for label, flags in rows(a.warmup):
        if a.only and label not in a.only:
            continue
        run = a.out / "".join(c if c.isalnum() else "_" for c in label.replace("+ ", "plus_"))
        cmd = [sys.executable, "-m", "gpt2core.train", "--preset", a.preset, "--steps", str(a.steps),
               "-B", str(a.batch_size), "-T", str(a.seq_len), "--val-every", str(a.val_every), "--val-steps",
               str(a.val_steps), "--data-dir", str(data), "--output-dir", str(run), "--sample-tokens", "0",
               *(["--threads", str(a.threads)] if a.threads else []), *flags, *a.extra]
        done = (run / "train.log").exists() and (run / "metrics.jsonl").exists() and val_curve(run)
        if done and done[-1][0] == a.steps * a.batch_size * a.seq_len:  # this row ran already: reuse it
            prev = json.loads((run / "row.json").read_text()) if (run / "row.json").exists() else {}
            results.append({**prev, "label": label, "flags": flags, "run": str(run), "curve": done,
                            "final_val": done[-1][1], "tokens": done[-1][0]})
        else:
            t0 = time.perf_counter()
            print(f"[{label}] " + " ".join(cmd[2:]), flush=True)
            run.mkdir(parents=True, exist_ok=True)
            r = subprocess.run([*cmd, "--overwrite"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            (run / "train.log").write_text(r.stdout)
            if r.returncode:
                print(r.stdout[-3000:])
                raise SystemExit(f"recipe_bench: row {label!r} failed (exit {r.returncode}), log in {run}/train.log")
            curve = val_curve(run)
            results.append({"label": label, "flags": flags, "command": " ".join(cmd[2:]), "run": str(run),
                            "curve": curve, "final_val": curve[-1][1], "tokens": curve[-1][0],
                            "seconds": time.perf_counter() - t0, "tok_per_s": train_tok_per_s(run)})
            (run / "row.json").write_text(json.dumps(results[-1]))
            print(f"[{label}] final val loss {curve[-1][1]:.4f} after {curve[-1][0]:,} tokens "
                  f"({results[-1]['seconds']:.0f} s, {results[-1]['tok_per_s']:.0f} tok/s)", flush=True)
        write_report(a, results)  # after every row: a partial run is not lost
    if not results:
        return 0
    try:
        subprocess.run([sys.executable, "-m", "gpt2core.plot", *[r["run"] for r in results], "-o",
                        str(a.out / "recipe_bench.png"), "--labels", *[r["label"] for r in results],
                        "--title", f"recipes on linux-doc ({a.preset})"], check=True)
    except (subprocess.CalledProcessError, FileNotFoundError) as e:
        print(f"recipe_bench: no plot ({e})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
