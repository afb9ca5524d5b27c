"""Training curves from metrics.jsonl: loss, HellaSwag, learning rate and grad norm against tokens seen.

    gpt2core-plot runs/gpt2_124m                               # -> runs/gpt2_124m/metrics.png
    gpt2core-plot runs/lr3e-4 runs/lr6e-4 -o lr.png --log-x    # several runs overlaid, one colour each

In Python (a notebook shows the returned Figure inline):

    from gpt2core.plot import plot_runs
    fig = plot_runs(["runs/gpt2_124m"], path="curves.png")

A run is a directory holding metrics.jsonl (what gpt2core-train writes), or such a file itself, or
llm.c's main.log (lines ``s:250 tel:3.41``). gpt2core-train opens each run (and each resume) with a
record ``{"run": {"preset", "params", "tokens_per_step", "start_step", "steps"}}``; the others are
per step ``{"step", "loss", "lr", "grad_norm", ...}`` ("step" = optimizer steps done) and per
evaluation ``{"step", "val_loss"}`` / ``{"step", "hellaswag_acc", "hellaswag_acc_norm"}``.
Tokens seen = step x tokens_per_step; without that record (llm.c logs, older files) the x axis is
steps unless --tokens-per-step is given.

Reference lines are drawn for 124M runs, i.e. runs whose record says the model has 124M parameters
(124,475,904 with the vocab padded, 124,439,808 without; --references on/off overrides): GPT-2 124M
(OpenAI) at val loss 3.2924 on FineWeb-Edu (llm.c's measurement) and HellaSwag acc_norm 0.2955, and
GPT-3 124M (Brown et al. 2020, table H.1) at HellaSwag 0.337.

matplotlib is an optional dependency: ``pip install gpt2core[plot]``.
"""
from __future__ import annotations

import json
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .. import cli
from ..errors import FileFormatError, utf8_text

# (value, label, line style) of each panel's reference lines
REF_VAL_LOSS = [(3.2924, "GPT-2 124M (val, llm.c)", "--")]
REF_HELLASWAG = [(0.2955, "GPT-2 124M", "--"), (0.337, "GPT-3 124M", ":")]

TRAIN_KEYS = ("loss", "lr", "grad_norm")                          # per optimizer step
EVAL_KEYS = ("val_loss", "val_bpb", "hellaswag_acc", "hellaswag_acc_norm", "core")   # per evaluation
# llm.c's main.log: "s:<step> trl:<loss> lr:<lr> norm:<norm>" (step 0-based, before it ran),
# "s:<step> tel:<val loss>", "s:<step> eval:<HellaSwag acc_norm>"
_LLMC_KEYS = {"trl": "loss", "lr": "lr", "norm": "grad_norm", "tel": "val_loss", "eval": "hellaswag_acc_norm"}


@dataclass
class Run:
    """One run's curves: series[key] = (steps, values), ascending in step, one value per step."""
    name: str
    path: Path
    info: dict = field(default_factory=dict)   # the last "run" record: preset, params, tokens_per_step, ...
    series: dict = field(default_factory=dict)

    @property
    def tokens_per_step(self) -> int | None:
        return self.info.get("tokens_per_step")

    @property
    def is_124m(self) -> bool:
        """A GPT-2 124M-shaped model: 124.4-124.5M parameters (vocab padded or not)."""
        return round(self.info.get("params", 0) / 1e6) == 124

    def curve(self, key: str, tokens: bool = True):
        """(x, y) arrays of a series (empty when the run has none); x in tokens seen, or in steps (also when
        the run does not know its tokens per step)."""
        steps, y = self.series.get(key, ((), ()))
        x = np.asarray(steps, dtype=np.float64)
        return (x * self.tokens_per_step if tokens and self.tokens_per_step else x), np.asarray(y, dtype=np.float64)


def _parse_llmc(line: str) -> dict | None:
    """A metrics record from one line of llm.c's main.log; None for lines it does not recognise."""
    m = re.match(r"s:(\d+)\s+(.*)", line)
    if not m:
        return None
    rec = {_LLMC_KEYS[k]: float(v) for k, v in re.findall(r"(\w+):(\S+)", m.group(2)) if k in _LLMC_KEYS}
    # a train line reports step s before it ran: s + 1 steps done once its loss exists
    rec["step"] = int(m.group(1)) + (1 if "loss" in rec else 0)
    return rec


def read_run(path, name: str | None = None, tokens_per_step: int | None = None) -> Run:
    """Read a run directory (its metrics.jsonl), a metrics.jsonl file or an llm.c main.log.

    Records of steps a later run record supersedes are dropped: resuming from step s (or starting
    again at 0 in the same directory) keeps training records up to step s and evaluations before
    it. A later record for the same step replaces an earlier one. A half-written last line (a run
    being written right now) is skipped."""
    p = Path(path)
    file = p / "metrics.jsonl" if p.is_dir() else p
    if not file.is_file():
        raise FileNotFoundError(f"{file}: no metrics file (give a run directory holding metrics.jsonl, "
                                "a metrics.jsonl file or an llm.c main.log)")
    raw = file.read_bytes()
    try:
        text = utf8_text(raw, str(file))
    except FileFormatError as e:
        raise FileFormatError(f"{e}: give a metrics.jsonl or an llm.c main.log") from None
    lines = text.split("\n")
    info: dict = {}
    points: dict[str, dict[int, float]] = {k: {} for k in TRAIN_KEYS + EVAL_KEYS}
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        if line.lstrip().startswith("{"):
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                if lineno == len(lines):  # no newline yet: being written
                    continue
                raise ValueError(f"{file}: line {lineno}: not valid JSON ({e.msg})") from None
        else:
            rec = _parse_llmc(line)
            if rec is None:
                raise ValueError(f"{file}: line {lineno}: neither a JSON record nor an llm.c log line: "
                                 f"{line[:60]!r}")
        if isinstance(rec.get("run"), dict):
            info = rec["run"]
            s = int(info.get("start_step", 0))
            for k, pts in points.items():
                points[k] = {t: v for t, v in pts.items() if (t <= s if k in TRAIN_KEYS else t < s)}
            continue
        if "step" not in rec:
            continue
        for k in points:
            if isinstance(rec.get(k), (int, float)):
                points[k][int(rec["step"])] = float(rec[k])
    if tokens_per_step is not None:
        info = {**info, "tokens_per_step": int(tokens_per_step)}
    series = {k: (np.array(sorted(pts)), np.array([pts[t] for t in sorted(pts)])) for k, pts in points.items() if pts}
    if not series:
        raise ValueError(f"{file}: no loss, val_loss or HellaSwag records")
    if name is None:
        name = (p if p.is_dir() else p.parent).resolve().name if file.name in ("metrics.jsonl", "main.log") \
            else file.stem
    return Run(name, file, info, series)


def _tokens(x, _pos=None) -> str:
    """Tick label: 0, 500K, 1.5M, 10B."""
    for div, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if abs(x) >= div:
            return f"{x / div:.3g}{unit}"
    return f"{x:.3g}"


def _figure_class():
    """matplotlib's Figure (no pyplot: no global figure list, no GUI backend), or a clear ImportError.
    Under IPython / Jupyter, Figure objects are set to display as PNG (what `%matplotlib inline` sets up),
    so a figure returned by a notebook cell shows inline."""
    try:
        from matplotlib.figure import Figure
    except ImportError as e:
        raise ImportError("gpt2core.plot needs matplotlib: pip install 'gpt2core[plot]'") from e
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None else None
    if shell is not None:
        from IPython.core.pylabtools import select_figure_formats
        select_figure_formats(shell, {"png"})
    return Figure


def plot_runs(runs, path=None, log_x: bool = False, references: str | bool = "auto", tokens_per_step=None,
              title: str | None = None):
    """A 2x2 figure (train/val loss, HellaSwag acc_norm, learning rate, grad norm) of one or several runs
    (Run objects or paths for read_run), one colour per run. references: "auto" (when a run is 124M),
    True or False; tokens_per_step: for paths whose file does not record it. Writes a PNG to `path` when
    given; returns the matplotlib Figure."""
    Figure = _figure_class()
    from matplotlib.ticker import FuncFormatter
    runs = [r if isinstance(r, Run) else read_run(r, tokens_per_step=tokens_per_step) for r in runs]
    if not runs:
        raise ValueError("plot_runs: no runs given")
    by_tokens = all(r.tokens_per_step for r in runs)  # one x axis for all: tokens if every run knows them
    if references == "auto":
        references = any(r.is_124m for r in runs)
    fig = Figure(figsize=(12, 8), layout="constrained")
    ax_loss, ax_hs, ax_lr, ax_norm = fig.subplots(2, 2, sharex=True).flat
    for i, run in enumerate(runs):
        c = f"C{i % 10}"
        ax_loss.plot(*run.curve("loss", by_tokens), color=c, lw=0.8, alpha=0.6, label=f"{run.name} train")
        ax_loss.plot(*run.curve("val_loss", by_tokens), color=c, marker="o", ms=3, label=f"{run.name} val")
        ax_hs.plot(*run.curve("hellaswag_acc_norm", by_tokens), color=c, marker="o", ms=3, label=run.name)
        if "core" in run.series:
            ax_hs.plot(*run.curve("core", by_tokens), color=c, ls="--", marker="^", ms=3, label=f"{run.name} CORE")
        ax_lr.plot(*run.curve("lr", by_tokens), color=c, label=run.name)
        ax_norm.plot(*run.curve("grad_norm", by_tokens), color=c, lw=0.8, label=run.name)
    if any("val_bpb" in r.series for r in runs):  # tokenizer-independent: its own axis beside the nats
        ax_bpb = ax_loss.twinx()
        for i, run in enumerate(runs):
            ax_bpb.plot(*run.curve("val_bpb", by_tokens), color=f"C{i % 10}", ls=":", marker="s", ms=3,
                        label=f"{run.name} val bpb")
        ax_bpb.set_ylabel("val bits per byte (dotted)")
    if references:
        for ax, refs in ((ax_loss, REF_VAL_LOSS), (ax_hs, REF_HELLASWAG)):
            for y, label, ls in refs:
                ax.axhline(y, color="k", ls=ls, lw=1, label=label)
    losses = np.concatenate([r.curve(k, by_tokens)[1] for r in runs for k in ("loss", "val_loss")])
    if not log_x and losses.size > 50:
        # the first steps (from ln(50257) = 10.8) would squash the part worth reading: keep 98% of the
        # points (and the reference) in view; --log-x shows the start instead
        lo = min(losses.min(), *(y for y, _, _ in REF_VAL_LOSS)) if references else losses.min()
        hi = np.percentile(losses, 98)
        ax_loss.set_ylim(lo - 0.05 * (hi - lo), hi + 0.05 * (hi - lo))
    ax_loss.set(title="loss", ylabel="cross-entropy (nats/token)")
    ax_hs.set(title="HellaSwag" + (" and CORE (dashed)" if any("core" in r.series for r in runs) else ""),
              ylabel="acc_norm / CORE")
    ax_lr.set(title="learning rate", ylabel="lr")
    ax_norm.set(title="gradient norm (before clipping)", ylabel="global L2 norm", yscale="log")
    if not any("hellaswag_acc_norm" in r.series or "core" in r.series for r in runs):
        ax_hs.text(0.5, 0.5, "no HellaSwag evaluations\n(gpt2core-train --hellaswag-every N)",
                   transform=ax_hs.transAxes, ha="center", va="center", color="gray")
    for ax in (ax_loss, ax_hs):
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize="small")
    for ax in (ax_lr, ax_norm):
        ax.set_xlabel("tokens seen" if by_tokens else "step")
        if log_x:
            ax.set_xscale("log", nonpositive="mask")  # step 0 (the evaluation before training) is left out
        if by_tokens:
            ax.xaxis.set_major_formatter(FuncFormatter(_tokens))
    for ax in (ax_loss, ax_hs, ax_lr, ax_norm):
        ax.grid(alpha=0.3)
    if title is None:
        title = " vs ".join(r.name for r in runs)
    fig.suptitle(title)
    if path is not None:
        fig.savefig(path, dpi=100)
    return fig


def plot_ladder(rows, path=None, title: str | None = None):
    """The speed ladder (scripts/bench.py --ladder) as two bar charts: ms/step and speed-up in tokens/s
    over the first rung, one bar per measured rung. rows: dicts with "rung", "ms_per_step", "tok_per_s"."""
    Figure = _figure_class()
    if not rows:
        raise ValueError("plot_ladder: no measured rungs")
    names = [r["rung"] for r in rows]
    ms = np.array([r["ms_per_step"] for r in rows])
    speedup = np.array([r["tok_per_s"] for r in rows]) / rows[0]["tok_per_s"]
    fig = Figure(figsize=(11, 1.2 + 0.45 * len(rows)), layout="constrained")
    ax_ms, ax_up = fig.subplots(1, 2, sharey=True)
    y = np.arange(len(rows))
    for ax, v, fmt, xlabel in ((ax_ms, ms, "{:.1f} ms", "ms / step (lower is better)"),
                               (ax_up, speedup, "{:.2f}x", f"speed-up over {names[0]} (tokens/s)")):
        bars = ax.barh(y, v, color=[f"C{i % 10}" for i in range(len(rows))])
        ax.bar_label(bars, [fmt.format(x) for x in v], padding=3, fontsize="small")
        ax.set_xlabel(xlabel)
        ax.set_xlim(0, v.max() * 1.25)
        ax.grid(axis="x", alpha=0.3)
    ax_up.axvline(1.0, color="k", lw=0.8)
    ax_ms.set_yticks(y, names)
    ax_ms.invert_yaxis()  # first rung on top, as in the printed table
    fig.suptitle(title or "speed ladder: each rung adds one optimisation")
    if path is not None:
        fig.savefig(path, dpi=100)
    return fig


def main(argv=None) -> int:
    ap = cli.ArgumentParser(prog="gpt2core-plot", description=__doc__.split("\n\n")[0],
                                 epilog="Reference lines: GPT-2 124M val 3.2924, HellaSwag 0.2955; GPT-3 124M "
                                        "HellaSwag 0.337 (shown for 124M runs unless --references says otherwise)")
    ap.add_argument("runs", nargs="+", metavar="RUN", help="run directory (metrics.jsonl inside), metrics file "
                                                           "or llm.c main.log")
    ap.add_argument("-o", "--output", type=cli.output_file, help="PNG to write (default: RUN/metrics.png for one run directory, "
                                           "else metrics.png here)")
    ap.add_argument("--log-x", action="store_true", help="logarithmic tokens axis")
    ap.add_argument("--labels", nargs="+", help="legend names, one per RUN (default: the directory names)")
    ap.add_argument("--tokens-per-step", type=cli.positive_int, help="for files that do not record it (llm.c logs: 524288)")
    ap.add_argument("--references", choices=["auto", "on", "off"], default="auto",
                    help="GPT-2/GPT-3 124M reference lines: auto draws them when a run is a 124M model")
    ap.add_argument("--title")
    args = ap.parse_args(argv)
    if args.labels and len(args.labels) != len(args.runs):
        ap.error(f"--labels: {len(args.labels)} names for {len(args.runs)} runs")
    try:
        runs = [read_run(p, name, args.tokens_per_step)
                for p, name in zip(args.runs, args.labels or [None] * len(args.runs))]
    except (OSError, ValueError) as e:
        print(f"gpt2core-plot: {e}", file=sys.stderr)
        return 1
    out = args.output or (Path(args.runs[0]) / "metrics.png" if len(runs) == 1 and Path(args.runs[0]).is_dir()
                          else Path("metrics.png"))
    for p, r in zip(args.runs, runs):
        if not r.tokens_per_step:  # written before the run record existed, or by another tool
            print(f"gpt2core-plot: {p} records no tokens per step (no {{\"run\": ...}} line): plotting against "
                  "optimizer steps (--tokens-per-step N gives a tokens axis)", file=sys.stderr)
    refs = {"auto": "auto", "on": True, "off": False}[args.references]
    plot_runs(runs, out, log_x=args.log_x, references=refs, title=args.title)
    for r in runs:
        print(summary(r))
    print(f"wrote {out}")
    return 0


def summary(run: Run) -> str:
    """One line: steps, tokens, last train loss, last val loss and bpb, last HellaSwag acc_norm, last CORE."""
    parts = [run.name]
    steps, loss = run.series.get("loss", ((), ()))
    if len(steps):
        tok = f" ({_tokens(steps[-1] * run.tokens_per_step)} tokens)" if run.tokens_per_step else ""
        parts.append(f"step {int(steps[-1])}{tok} | train loss {loss[-1]:.4f}")
    for key, label in (("val_loss", "val loss"), ("val_bpb", "val bpb"), ("hellaswag_acc_norm", "HellaSwag acc_norm"),
                       ("core", "CORE")):
        s, v = run.series.get(key, ((), ()))
        if len(s):
            parts.append(f"{label} {v[-1]:.4f} (step {int(s[-1])})")
    return " | ".join(parts)


console = cli.entry("gpt2core-plot", main)

if __name__ == "__main__":
    sys.exit(console())
