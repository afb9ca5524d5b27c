"""Recipe benchmark (a benchmark, never a timed test): training recipes side by side on the same data and model
size, over several seeds and at two scales; validation loss against tokens, the tokens each row needs to reach the
GPT-2 recipe's final validation loss (and the ratio: how many times fewer), loss spikes; and the sweep that chose
the modern recipe's learning rates and warm-up.

Data (real English text, larger than tiny Shakespeare, so that no run repeats its data), both from Debian's
documentation packages (origin, version, archive URL, sha256, licence and preparation: docs/DATA_SOURCES.md):
  - linux-doc-6.12, the Linux kernel's documentation (GPL-2; 11.3M GPT-2 tokens): the sweep's data;
  - python3.11-doc, the Python documentation (PSF License; 3.6M tokens; --html-sources): the held-out text the
    benchmark is measured on, never swept on.

    apt-get download linux-doc-6.12 && dpkg-deb -x linux-doc-6.12_*.deb linux-doc
    apt-get download python3.11-doc && dpkg-deb -x python3.11-doc_*.deb pydoc
    # the sweep: --recipe modern with one flag at a time changed (-> <out>/recipe_sweep.md)
    nice python scripts/recipe_bench.py --docs linux-doc --out runs/sweep --preset s4 -B 2 -T 128 --steps 32 \
        --val-every 8 --val-steps 8 --sweep embedding-lr=0.02,0.06 head-lr=0.002,0.02 muon-lr=0.01,0.04 warmup=5
    # the benchmark: every row over --seeds at each of --scales (-> <out>/recipe_bench.md)
    nice python scripts/recipe_bench.py --docs pydoc --html-sources --data-name pydoc --shard-tokens 250000 \
        --out runs/recipe_bench --only gpt2 modern --seeds 1337 1338 1339 --scales 1 4

prepares the shards once (GPT-2 BPE, llm.c's shard format; the first shard is validation), trains each run with
gpt2core-train (per seed the same data order and initialisation for every row), and writes <out>/recipe_bench.md
and <out>/recipe_bench.json after every run (a partial benchmark is not lost; a rerun reuses the runs that
finished), then <out>/recipe_bench.png (gpt2core-plot, the first seed and scale).

Scale k trains k times the batch (tokens per step) for k times the steps, evaluating every k * --val-every steps
(the same tokens apart). --steps and --val-every count micro-batches of B x T: a row that accumulates gradients
(its --total-batch-tokens, or its recipe's own tokens per step) takes proportionally fewer optimizer steps, so every
row trains the same tokens. --gpt2-lrs sweeps the baseline's LR at the first seed of each scale and makes the best
one the gpt2 row of every seed (a baseline tuned on the very text it is measured on); --modern-tokens runs the
modern row at each tokens-per-step value given. Seconds are training seconds: the steps' own wall times (dt_ms in
metrics.jsonl; validation not counted) summed up to where the val curve reaches the target. For each scale and row: the final val loss, the tokens to the GPT-2 row's final val loss
of the same seed (linear between evaluations) and the ratio, each as mean ± standard deviation over the seeds; how
many seeds reached it; spikes: steps whose training loss is above the median training loss of the --spike-window
steps before them by more than --spike-margin (2 nats; spikes() says why not against the val loss). The rows
(each adds its flags to the row above; --only picks some: gpt2, control, modern, or labels):

    gpt2                                  --recipe gpt2 (AdamW lr 1e-3, cosine, GPT-2's architecture)
    AdamW at lr 6e-3 (control)            --lr 6e-3 --beta1 0.8 --weight-decay 0 (the modern recipe's AdamW)
    + rotary                              --position rope
    + RMSNorm, QK-norm, no biases         --norm rmsnorm --qk-norm --no-bias
    + ReLU²                               --activation relu2
    + untied head, zero-init proj, soft-cap 15   --untied --zero-init-proj --logit-softcap 15
    + Muon                                --optimizer muon (Muon's settings from --recipe modern)
    + AdamW group LRs                     --embedding-lr, --head-lr (the recipe's)
    + WSD, warm-up, tokens per step (= --recipe modern)   --recipe modern itself (its --newton-schulz-share: the
                                          micro-batches accumulated per step, so the rows train the same tokens)

On a GPU the same script runs at d12 on FineWeb (--data-dir of FineWeb shards, --preset d12 --extra --device cuda).
"""
from __future__ import annotations

import argparse
import gzip
import json
import math
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

from gpt2core.config import MODERN_ARCH, RECIPES


def iter_docs(root: Path, html_sources: bool = False):
    """The documentation's text files (rst and txt, gzipped as Debian ships them), in a fixed shuffled order.
    html_sources: read only Sphinx's reStructuredText copies under html/_sources/ (for a package that ships only its
    HTML build, such as python3.11-doc); else skip every html/ folder (linux-doc-6.12 ships both)."""
    def wanted(p: Path) -> bool:
        if not p.name.endswith((".rst.gz", ".txt.gz", ".rst", ".txt")):
            return False
        return "/_sources/" in str(p) if html_sources else "/html/" not in str(p)

    files = sorted(p for p in root.rglob("*") if p.is_file() and wanted(p))
    if not files:
        raise SystemExit(f"recipe_bench: no .rst/.txt files under {root}" + (" (html/_sources/)" if html_sources else
                                                                             " (unpack linux-doc-6.12 there)"))
    random.Random(0).shuffle(files)
    for p in files:
        raw = gzip.decompress(p.read_bytes()) if p.suffix == ".gz" else p.read_bytes()
        text = raw.decode("utf-8", errors="replace").strip()
        if text:
            yield text


def prepare(docs: Path, data_dir: Path, shard_tokens: int, name: str = "linuxdoc", html_sources: bool = False,
            source: str = "debian linux-doc-6.12") -> None:
    from gpt2core.data.fineweb import write_shards
    write_shards(iter_docs(docs, html_sources), data_dir, name=name, shard_size=shard_tokens, progress=False,
                 settings={"source": source})


GROUP_LRS = ("embedding_lr", "head_lr", "scalar_lr")


def rows(warmup: int = 10) -> list[tuple[str, list[str]]]:
    """(label, gpt2core-train flags) of each ablation row: the GPT-2 recipe, a fair AdamW control, then one
    ingredient at a time on top of it (the architecture's GPT2Config fields, each a train flag; Muon; AdamW's group
    LRs; the WSD schedule with the recipe's warm-up). The last row is `--recipe modern` itself (test_recipe_bench
    checks that the rows add up to it). warmup: the LR warm-up of every row but the last (the recipe's own)."""
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
            "--muon-weight-decay", str(modern["muon_weight_decay"]),
            *(["--muon-ns-dtype", modern["muon_ns_dtype"]] if "muon_ns_dtype" in modern else [])]
    groups = [*muon, *[f for k in GROUP_LRS if modern.get(k) is not None
                       for f in (f"--{k.replace('_', '-')}", str(modern[k]))]]
    group_label = ", ".join(f"{k.split('_')[0]} {modern[k]:g}" for k in GROUP_LRS if modern.get(k) is not None)
    return [("gpt2", ["--recipe", "gpt2", *w]),
            (f"AdamW at lr {modern['lr']:g} (control)", adamw),
            ("+ rotary", rope),
            ("+ RMSNorm, QK-norm, no biases", norm),
            ("+ ReLU²", relu2),
            ("+ untied head, zero-init proj, soft-cap 15", head),
            ("+ Muon", muon),
            (f"+ AdamW group LRs ({group_label})", groups),
            (f"+ WSD, warm-up {modern['warmup']}, Newton-Schulz share {modern.get('newton_schulz_share')} of a step "
             "(= --recipe modern)", ["--recipe", "modern"])]


def row_label(label: str) -> str:
    """A row's short name for --only: gpt2, control, modern, or the label itself."""
    return "control" if "(control)" in label else "modern" if "--recipe modern" in label else label


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


def seconds_curve(run: Path) -> list[tuple[int, float]]:
    """(tokens, training seconds so far) after each step of a run: the steps' own wall times (metrics.jsonl's dt_ms:
    forward, backward and the optimizer; validation and checkpoints not counted) summed."""
    per_step, total, out = None, 0.0, [(0, 0.0)]
    for line in (run / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line)
        if "run" in r:
            per_step = r["run"]["tokens_per_step"]
        elif "dt_ms" in r:
            total += r["dt_ms"] / 1e3
            out.append((r["step"] * per_step, total))
    return out


def seconds_at(curve: list[tuple[int, float]], tokens: float | None) -> float | None:
    """The training seconds at which a run had trained `tokens` (linear between steps; None for None or past the
    run's end)."""
    if tokens is None:
        return None
    for (t0, s0), (t1, s1) in zip(curve, curve[1:]):
        if t0 <= tokens <= t1:
            return s0 + (s1 - s0) * (tokens - t0) / (t1 - t0) if t1 > t0 else s1
    return None


def train_tok_per_s(run: Path) -> float:
    """The median training throughput of a run's steps (metrics.jsonl's tok_per_s; validation not counted)."""
    v = sorted(json.loads(line)["tok_per_s"] for line in (run / "metrics.jsonl").read_text().splitlines()
               if '"tok_per_s"' in line)
    return v[len(v) // 2] if v else float("nan")


def spikes(run: Path, margin: float, window: int) -> list[dict]:
    """The steps whose training loss is above the median training loss of the `window` steps before them (the
    first `window` steps: against the initial val loss) by more than margin, from a run's
    metrics.jsonl: [{"step", "loss", "ref", "excess"}]. Not against the val loss itself: the few validation batches
    sit 1-2 nats below the typical training batch on this text, which would make every step a spike."""
    losses, out, first_val = [], [], None
    for line in (run / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line)
        if "val_loss" in r and first_val is None:
            first_val = r["val_loss"]
        elif "loss" in r and "val_loss" not in r:
            prev = losses[-window:]
            ref = statistics.median(prev) if len(prev) == window else first_val
            if ref is not None and r["loss"] > ref + margin:
                out.append({"step": r["step"], "loss": r["loss"], "ref": ref, "excess": r["loss"] - ref})
            losses.append(r["loss"])
    return out


def max_grad_norm(run: Path) -> tuple[float, int]:
    """The largest pre-clip gradient norm of a run's steps, and its step."""
    recs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if '"grad_norm"' in line]
    r = max((r for r in recs if r.get("grad_norm") is not None), key=lambda r: r["grad_norm"])
    return r["grad_norm"], r["step"]


def mean_sd(xs) -> tuple[float, float]:
    xs = [x for x in xs if x is not None]
    if not xs:
        return float("nan"), float("nan")
    return statistics.fmean(xs), (statistics.stdev(xs) if len(xs) > 1 else 0.0)


def summarize(results: list[dict]) -> list[dict]:
    """Per scale and row, over the seeds: final val loss, the tokens and training seconds to reach the GPT-2 row's
    final val loss of the same seed (and scale) and the ratios (the GPT-2 run's tokens / these, its training seconds
    / these), mean and standard deviation; the spikes. A seed whose run never reaches the target counts in `reached`
    only."""
    base = {(r["scale"], r["seed"]): r for r in results if r["label"] == "gpt2"}
    out = []
    for key in dict.fromkeys((r["scale"], r["label"]) for r in results):
        runs = [r for r in results if (r["scale"], r["label"]) == key]
        toks, ratios, secs, sec_ratios = [], [], [], []
        for r in runs:
            b = base.get((r["scale"], r["seed"]))
            t = tokens_to_reach(r["curve"], b["final_val"]) if b else None
            r["tokens_to_target"] = t
            r["ratio"] = b["tokens"] / t if t else None
            sec = seconds_at(r.get("seconds_curve") or [], t)
            b_sec = (b.get("seconds_curve") or [(0, None)])[-1][1] if b else None
            r["seconds_to_target"] = sec
            r["seconds_ratio"] = b_sec / sec if sec and b_sec else None
            toks.append(t)
            ratios.append(r["ratio"])
            secs.append(sec)
            sec_ratios.append(r["seconds_ratio"])
        fm, fs = mean_sd(r["final_val"] for r in runs)
        tm, ts = mean_sd(toks)
        rm, rs = mean_sd(ratios)
        sm, ss = mean_sd(secs)
        qm, qs = mean_sd(sec_ratios)
        sp = [s for r in runs for s in r["spikes"]]
        out.append({"scale": key[0], "label": key[1], "seeds": [r["seed"] for r in runs], "tokens": runs[0]["tokens"],
                    "final_val": (fm, fs), "tokens_to_target": (tm, ts), "ratio": (rm, rs),
                    "seconds_to_target": (sm, ss), "seconds_ratio": (qm, qs),
                    "tokens_per_step": runs[0].get("tokens_per_step"), "flags": runs[0].get("flags"),
                    "ratio_min": min((x for x in ratios if x), default=None),
                    "ratio_max": max((x for x in ratios if x), default=None),
                    "reached": sum(t is not None for t in toks), "spikes": len(sp),
                    "worst_spike": max(sp, key=lambda s: s["excess"]) if sp else None,
                    "tok_per_s": mean_sd(r.get("tok_per_s") for r in runs)[0]})
    return out


def write_report(a, results: list[dict]) -> list[dict]:
    """<out>/recipe_bench.md (one table per scale) and <out>/recipe_bench.json (the summary and every run) of the
    runs so far; returns the summary."""
    summary = summarize(results)
    lines = [f"Data {a.data_name}, {a.preset}, T={a.seq_len}; scale k: B={a.batch_size}k, {a.steps}k steps, "
             f"validation every {a.val_every}k steps ({a.val_steps}/k batches); seeds {', '.join(map(str, a.seeds))}. "
             f"Target: the GPT-2 row's final val loss of the same seed. Spike: a step's training loss above the "
             f"median training loss of the {a.spike_window}k steps before it by more than {a.spike_margin:g}.", ""]
    for scale in dict.fromkeys(s["scale"] for s in summary):
        rows_ = [s for s in summary if s["scale"] == scale]
        lines += [f"### scale {scale}x: B={a.batch_size * scale}, {a.steps * scale} steps, "
                  f"{rows_[0]['tokens']:,} tokens per run", "",
                  "| row | tokens per step | final val loss (mean ± sd) | tokens to GPT-2's final val loss (mean ± sd) "
                  "| fewer tokens (mean ± sd; min–max) | training seconds to it (mean ± sd) | fewer seconds (mean ± sd) "
                  "| reached | spikes (worst) | train tok/s |", "|---|---|---|---|---|---|---|---|---|---|"]
        for s in rows_:
            (fm, fs), (tm, ts), (rm, rs) = s["final_val"], s["tokens_to_target"], s["ratio"]
            (sm, ss), (qm, qs) = s.get("seconds_to_target", (math.nan,) * 2), s.get("seconds_ratio", (math.nan,) * 2)
            w = s["worst_spike"]
            lines.append(
                f"| {s['label']} | {s.get('tokens_per_step') or '-'} | {fm:.4f} ± {fs:.4f} | "
                + ("not reached" if math.isnan(tm) else f"{tm:,.0f} ± {ts:,.0f}") + " | "
                + ("-" if math.isnan(rm) else f"{rm:.2f}x ± {rs:.2f} ({s['ratio_min']:.2f}–{s['ratio_max']:.2f})")
                + " | " + ("-" if math.isnan(sm) else f"{sm:,.1f} ± {ss:,.1f}")
                + " | " + ("-" if math.isnan(qm) else f"{qm:.2f}x ± {qs:.2f}")
                + f" | {s['reached']}/{len(s['seeds'])} | {s['spikes']}"
                + (f" (step {w['step']}: {w['loss']:.2f} vs {w['ref']:.2f})" if w else "")
                + f" | {s['tok_per_s']:.0f} |")
        lines.append("")
    (a.out / "recipe_bench.md").write_text("\n".join(lines))
    (a.out / "recipe_bench.json").write_text(json.dumps({"summary": summary, "runs": results}, indent=1))
    print("\n".join(lines), flush=True)
    return summary


def val_steps(a, scale: int) -> int:
    """Validation batches at scale k: --val-steps / k (at least 1), so that every scale scores about the same
    validation tokens (the batch is k times larger)."""
    return max(1, -(-a.val_steps // scale))


def accumulation(preset: str, flags: list[str], B: int, T: int) -> int:
    """Micro-steps per optimizer step of a row, as gpt2core-train settles them (TrainConfig.tokens_per_step): its
    --total-batch-tokens, else its recipe's own rule (the modern recipe's --newton-schulz-share), else 1; refused
    unless a multiple of the micro-batch's B*T tokens."""
    from gpt2core.training import train
    cfg = train.parse_args(["--preset", preset, "-B", str(B), "-T", str(T), *flags])
    total = cfg.tokens_per_step(cfg.model_config(), B * T)
    if total % (B * T):
        raise SystemExit(f"recipe_bench: {total} tokens per step is not a multiple of B*T = {B * T}")
    return total // (B * T)


def run_row(a, data: Path, run: Path, flags: list[str], scale: int, seed: int, fraction: float = 1.0) -> dict:
    """One row at one scale and seed with gpt2core-train; a run that finished already (metrics.jsonl up to its
    last step) is read back instead. Every row trains the same tokens: --steps micro-batches of B x T (times the
    scale), so a row with k micro-steps per optimizer step (accumulation()) takes 1/k as many optimizer steps
    (rounded up: up to k - 1 micro-batches more) and evaluates every 1/k as many (rounded: about the same tokens
    apart; the comparisons interpolate on tokens). fraction < 1: the run trains that share of the tokens, a shorter
    run with its schedule over its own length (--modern-fraction)."""
    B = a.batch_size * scale
    accum = accumulation(a.preset, [*flags, *a.extra], B, a.seq_len)
    micro = math.ceil(a.steps * scale * fraction)
    steps = -(-micro // accum)  # rounded up: at most accum - 1 micro-batches more than the other rows
    cmd = [sys.executable, "-m", "gpt2core.train", "--preset", a.preset, "--steps", str(steps), "-B", str(B),
           "-T", str(a.seq_len), "--val-every", str(max(1, round(a.val_every * scale / accum))),
           "--val-steps", str(val_steps(a, scale)),
           "--data-dir", str(data), "--output-dir", str(run), "--sample-tokens", "0", "--seed", str(seed),
           *(["--threads", str(a.threads)] if a.threads else []), *flags, *a.extra]
    row = {"flags": flags, "command": " ".join(cmd[2:]), "run": str(run), "scale": scale, "seed": seed}
    done = (run / "metrics.jsonl").exists() and val_curve(run)
    if done and done[-1][0] == steps * accum * B * a.seq_len:  # this run finished already: reuse it
        prev = json.loads((run / "row.json").read_text()) if (run / "row.json").exists() else {}
        row.update(seconds=prev.get("seconds"), tok_per_s=prev.get("tok_per_s"))
    else:
        t0 = time.perf_counter()
        print(f"[{scale}x seed {seed}] " + " ".join(cmd[2:]), flush=True)
        run.mkdir(parents=True, exist_ok=True)
        r = subprocess.run([*cmd, "--overwrite"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        (run / "train.log").write_text(r.stdout)
        if r.returncode:
            print(r.stdout[-3000:])
            raise SystemExit(f"recipe_bench: {run} failed (exit {r.returncode}), log in {run}/train.log")
        row.update(seconds=time.perf_counter() - t0, tok_per_s=train_tok_per_s(run))
        (run / "row.json").write_text(json.dumps({"seconds": row["seconds"], "tok_per_s": row["tok_per_s"]}))
    curve = val_curve(run)
    per_step = next(json.loads(x)["run"]["tokens_per_step"] for x in (run / "metrics.jsonl").read_text().splitlines()
                    if '"run"' in x)
    row.update(curve=curve, final_val=curve[-1][1], tokens=curve[-1][0], seconds_curve=seconds_curve(run),
               tokens_per_step=per_step,
               spikes=spikes(run, a.spike_margin, a.spike_window * scale))
    return row


def sweep(a, data: Path, specs: list[str]) -> list[dict]:
    """--recipe modern at scale 1 and the first seed, one flag at a time set to each of its values (the others at
    the recipe's and --extra's): <out>/recipe_sweep.md and .json, the final and best val loss and spikes per point."""
    points = [] if a.no_base else [("recipe", "-", [])]
    for spec in specs:
        flag, _, values = spec.partition("=")
        if not values:
            raise SystemExit(f"recipe_bench: --sweep {spec!r}: give FLAG=V1,V2,... (e.g. embedding-lr=0.006,0.02)")
        points += [(flag.lstrip("-"), v, [f"--{flag.lstrip('-')}", v]) for v in values.split(",")]
    res = []
    lines = [f"--recipe modern on {a.data_name}, {a.preset}, B={a.batch_size}, T={a.seq_len}, {a.steps} steps, seed "
             f"{a.seeds[0]}, validation every {a.val_every} steps ({a.val_steps} batches); one flag changed per "
             f"row{', with ' + ' '.join(a.extra) if a.extra else ''}.", "",
             "| flag | value | final val loss | best val loss | spikes (worst) | largest grad norm (step) |",
             "|---|---|---|---|---|---|"]
    for flag, value, flags in points:
        slug = "".join(c if c.isalnum() else "_" for c in f"{flag}_{value}")
        r = run_row(a, data, a.out / "sweep" / slug, ["--recipe", "modern", *flags], 1, a.seeds[0])
        r.update(flag=flag, value=value)
        res.append(r)
        w = max(r["spikes"], key=lambda s: s["excess"]) if r["spikes"] else None
        lines.append(f"| {flag} | {value} | {r['final_val']:.4f} | {min(v for _, v in r['curve']):.4f} | "
                     f"{len(r['spikes'])}" + (f" (step {w['step']}: {w['loss']:.2f} vs {w['ref']:.2f})" if w
                                              else "") + " | %.1f (%d) |" % max_grad_norm(Path(r["run"])))
        (a.out / "recipe_sweep.md").write_text("\n".join(lines) + "\n")
        (a.out / "recipe_sweep.json").write_text(json.dumps(res, indent=1))
        print(lines[-1], flush=True)
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--docs", type=Path, help="unpacked linux-doc-6.12 (or any folder of .rst/.txt[.gz] text)")
    ap.add_argument("--html-sources", action="store_true", help="read the .txt copies under html/_sources/ of --docs "
                    "(a package that ships only its HTML build, e.g. python3.11-doc) instead of skipping html/")
    ap.add_argument("--data-name", default="linuxdoc", help="shard name of the prepared data (and the report's)")
    ap.add_argument("--source", default="debian linux-doc-6.12", help="where --docs comes from (the manifest's)")
    ap.add_argument("--data-dir", type=Path, help="token shards (default: <out>/data, prepared from --docs)")
    ap.add_argument("--out", type=Path, default=Path("runs/recipe_bench"))
    ap.add_argument("--preset", default="s4")
    ap.add_argument("--steps", type=int, default=48, help="steps at scale 1 (scale k: k times as many)")
    ap.add_argument("-B", "--batch-size", type=int, default=2, help="B at scale 1 (scale k: k times as many)")
    ap.add_argument("-T", "--seq-len", type=int, default=256)
    ap.add_argument("--val-every", type=int, default=4, help="steps between evaluations at scale 1 (scale k: k "
                    "times as many, the same tokens apart)")
    ap.add_argument("--val-steps", type=int, default=4, help="validation batches at scale 1 (scale k: 1/k as many "
                    "of k times the size: the same validation tokens)")
    ap.add_argument("--warmup", type=int, default=5, help="LR warm-up steps of every row but --recipe modern "
                    "(which has its own)")
    ap.add_argument("--seeds", type=int, nargs="+", default=[1337, 1338, 1339])
    ap.add_argument("--scales", type=int, nargs="+", default=[1, 4], help="k: B*k and steps*k (4: four times the "
                    "tokens per step and four times the steps)")
    ap.add_argument("--spike-margin", type=float, default=2.0, help="a step's training loss above the median "
                    "training loss of the --spike-window steps before it by more than this (nats) is a spike")
    ap.add_argument("--spike-window", type=int, default=8, help="steps at scale 1 (scale k: k times as many) whose "
                    "median training loss a step is compared with")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--shard-tokens", type=int, default=10**6, help="tokens per shard (shard 0: validation)")
    ap.add_argument("--only", nargs="*", help="run only these rows: labels, or gpt2 / control / modern "
                    "(default: all)")
    ap.add_argument("--sweep", nargs="+", metavar="FLAG=V1,V2", help="instead of the rows: --recipe modern at scale "
                    "1 and the first seed with one flag at a time set to each value (e.g. embedding-lr=0.006,0.02 "
                    "warmup=0,10); the table goes to <out>/recipe_sweep.md")
    ap.add_argument("--no-base", action="store_true", help="--sweep: leave out the recipe's own point (run by "
                    "another sweep)")
    ap.add_argument("--gpt2-lrs", type=float, nargs="+", default=None, help="sweep the GPT-2 recipe's --lr over these "
                    "at the first seed of each scale; the best final val loss is the baseline (row gpt2) at every "
                    "seed: a fair baseline, tuned on the text it is measured on")
    ap.add_argument("--modern-tokens", type=int, nargs="+", default=None, help="run the modern row once per "
                    "tokens per optimizer step given (--total-batch-tokens; gradient accumulation over B x T)")
    ap.add_argument("--modern-fraction", type=float, default=1.0, help="the modern rows train this share of the "
                    "tokens (0.5: half), a shorter run with its schedule over its own length: does the modern recipe "
                    "at half the tokens reach the GPT-2 recipe's final val loss? (issue 51's check)")
    ap.add_argument("--extra", nargs=argparse.REMAINDER, default=[], help="more gpt2core-train flags for every row")
    a = ap.parse_args(argv)
    if not 0 < a.modern_fraction <= 1:
        ap.error(f"--modern-fraction: a share of the tokens in (0, 1], got {a.modern_fraction:g}")
    a.out.mkdir(parents=True, exist_ok=True)
    data = a.data_dir or a.out / "data"
    if not any(data.glob("*_val_*.bin")):
        if not a.docs:
            raise SystemExit("recipe_bench: give --docs (unpacked linux-doc-6.12) or --data-dir (prepared shards)")
        prepare(a.docs, data, a.shard_tokens, a.data_name, a.html_sources, a.source)
    if a.sweep:
        sweep(a, data, a.sweep)
        return 0
    chosen = [(label, flags) for label, flags in rows(a.warmup)
              if not a.only or label in a.only or row_label(label) in a.only]
    if a.modern_tokens:  # the modern row once per tokens-per-step value
        chosen = [x for label, flags in chosen for x in (
            [(f"{label}, {n} tokens/step", [*flags, "--total-batch-tokens", str(n)]) for n in a.modern_tokens]
            if row_label(label) == "modern" else [(label, flags)])]
    results = []

    if a.modern_fraction < 1:
        chosen = [(f"{label}, {a.modern_fraction:g} of the tokens", flags) if row_label(label) == "modern"
                  else (label, flags) for label, flags in chosen]

    def run(label, flags, scale, seed, slug=None):
        # the modern row's variants (--modern-tokens, --modern-fraction) each get a folder of their own
        variant = label.partition("(= --recipe modern)")[2] if row_label(label) == "modern" else ""
        slug = slug or "".join(c if c.isalnum() else "_" for c in (row_label(label) + variant).replace("+ ", "plus_"))
        fraction = a.modern_fraction if row_label(label) == "modern" else 1.0
        r = run_row(a, data, a.out / f"x{scale}" / f"seed{seed}" / slug, flags, scale, seed, fraction)
        results.append({"label": label, **r})
        print(f"[{label}, {scale}x, seed {seed}] final val loss {r['final_val']:.4f} after {r['tokens']:,} "
              f"tokens, {len(r['spikes'])} spikes", flush=True)
        write_report(a, results)  # after every run: a partial benchmark is not lost
        return r

    for scale in a.scales:
        gpt2_flags = next((f for label, f in chosen if label == "gpt2"), None)
        if gpt2_flags and a.gpt2_lrs:  # the baseline's LR swept at the first seed; the best one is "gpt2"
            swept = {lr: run(f"gpt2, lr {lr:g} (sweep, seed {a.seeds[0]})", [*gpt2_flags, "--lr", f"{lr:g}"], scale,
                             a.seeds[0], slug=f"gpt2_lr_{lr:g}".replace(".", "_").replace("-", "_"))
                     for lr in a.gpt2_lrs}
            best = min(swept, key=lambda lr: swept[lr]["final_val"])
            gpt2_flags = [*gpt2_flags, "--lr", f"{best:g}"]
            print(f"[{scale}x] the GPT-2 recipe's best LR at seed {a.seeds[0]}: {best:g}", flush=True)
        for seed in a.seeds:
            for label, flags in chosen:
                if label == "gpt2" and a.gpt2_lrs:
                    run("gpt2", gpt2_flags, scale, seed, slug=f"gpt2_lr_{best:g}".replace(".", "_").replace("-", "_"))
                else:
                    run(label, flags, scale, seed)
    if not results:
        return 0
    try:
        first = [r for r in results if r["seed"] == a.seeds[0] and r["scale"] == a.scales[0]]
        subprocess.run([sys.executable, "-m", "gpt2core.plot", *[r["run"] for r in first], "-o",
                        str(a.out / "recipe_bench.png"), "--labels", *[r["label"] for r in first],
                        "--title", f"recipes on {a.data_name} ({a.preset}, seed {a.seeds[0]})"], check=True)
    except (subprocess.CalledProcessError, FileNotFoundError) as e:
        print(f"recipe_bench: no plot ({e})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
