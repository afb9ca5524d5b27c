"""The GPU lease driver (issue 48): turns any lease into the next rows of one report, in value order, continuing
where the last lease stopped.

    python -m gpt2core.calibrate --budget 540 --data lease_data --hellaswag hellaswag_val_full.txt --out lease_out
    python -m gpt2core.calibrate --list                 # the steps in order, with their bounds
    python -m gpt2core.calibrate --index                # docs/gpu/README.md from the pages there
    python -m gpt2core.calibrate --budget 900 --dry-run --device cpu --out /tmp/dry   # every step, tiny shapes
    python -m gpt2core.calibrate --budget 300 --only serve dp                         # these, measured or not

The steps (gpt2core.runtime.lease_steps.STEPS, in value order: doctor, gpu_tests, learn, d12_step, recipe_profile,
scale, serve, dp, fp16, fp8, eval, resume, then bitwise, bgradb, ladder, vs_cpu, gemm) each run in a subprocess of their own, bounded by
min(the step's bound, the budget left); a step past its bound is killed (its whole process group: servers and
ranks too) and is "cut", keeping the rows it wrote as it went. A step that cannot run on the device at hand is
"skipped" with the reason as its row; a step that fails is "failed" (its error as the last row) and the driver goes
on. A step already measured ("ok") for this commit on this GPU kind, in a report under --docs or in --out, is
skipped unless --only names it: the next lease continues the list. The commit is the last one that changed
anything outside docs/ (so committing a report does not make the next lease start over), "+dirty" when tracked
files outside docs/ differ from it.

Writes, after every step (a lease cut short keeps its report):
  OUT/report.json   exactly {"gpu", "commit", "steps": {NAME: {"status": "ok"|"cut"|"skipped"|"failed",
                    "seconds", "rows"}}}; steps/NAME/rows.jsonl and log.txt beside it
  DOCS/<date>_<gpu kind>_<commit>.md and .json   the page (and its JSON: a same-named page of an earlier lease is
                    merged), and DOCS/README.md, the index of every page (DOCS: --docs, default docs/gpu of the
                    source checkout for a GPU run; a dry run or a run without a GPU writes them under OUT)
Without a usable GPU (and without --dry-run) only the doctor runs: each GPU step is skipped, saying why.
Exit status: 0 unless a step failed.
"""
from __future__ import annotations

import datetime
import importlib
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from .. import cli
from ..errors import ArgError
from . import lease_steps

ROOT = lease_steps.ROOT
# How a step's process starts: this Python, then `-m STEPS_MODULE NAME ROWS BUDGET CTX`. A test puts the emulated
# CUDA module in front (the emulated dry run) or names a module of its own steps.
PYTHON = [sys.executable]
STEPS_MODULE = "gpt2core.runtime.lease_steps"
MIN_STEP_S = 10.0  # a step is not started with less of the budget left (a Python process and imports alone)
STATUSES = ("ok", "cut", "skipped", "failed")


def steps() -> list:
    return importlib.import_module(STEPS_MODULE).STEPS


def bound_of(step, dry: bool) -> float:
    return float(step.dry_bound if dry else step.bound)


# ------------------------------------------------------------------------------------------ the machine
def code_commit(root: Path) -> str:
    """The last commit that changed anything outside docs/ (short hash), +dirty when tracked files outside docs/
    differ from it; "unknown" outside a git checkout."""
    def git(*args):
        return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=30)
    try:
        r = git("log", "-1", "--format=%h", "--abbrev=12", "--", ".", ":(exclude)docs")
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    if r.returncode != 0 or not r.stdout.strip():
        return "unknown"
    dirty = git("status", "--porcelain", "--untracked-files=no", "--", ".", ":(exclude)docs").stdout.strip()
    return r.stdout.strip() + ("+dirty" if dirty else "")


def gpu_kind(name: str | None) -> str:
    """A report's GPU kind: H100, H200, A100, ... from the driver's name; cpu without one."""
    if not name:
        return "cpu"
    m = re.search(r"\b([A-Z]{1,2}\d{2,4}[A-Za-z]?)\b", name.replace("NVIDIA", ""))
    return m.group(1) if m else re.sub(r"[^A-Za-z0-9]+", "-", name).strip("-")


def find_device(requested: str) -> tuple[str, str, str]:
    """(device, GPU name, why no GPU) for --device auto|cpu|cuda."""
    if requested == "cpu":
        return "cpu", "", "--device cpu"
    from gpt2core import _C, _libs
    why = _libs.driver_problem() or _C.cuda_status()
    if why:
        if requested == "cuda":
            raise ArgError(f"--device cuda: no usable GPU ({why})")
        return "cpu", "", f"no usable GPU ({why})"
    return "cuda", _C.cuda_device_name(0), ""


# ------------------------------------------------------------------------------------------ running a step
def run_bounded(name: str, bound: float, ctx: lease_steps.Ctx, step_dir: Path) -> dict:
    """Runs step `name` in a process group of its own, killed (SIGKILL, the whole group) after `bound` seconds:
    {"status", "seconds", "rows"}, the rows as the step wrote them, whatever became of it."""
    step_dir.mkdir(parents=True, exist_ok=True)
    rows_path = step_dir / "rows.jsonl"
    rows_path.unlink(missing_ok=True)
    ctx.work = str(step_dir)
    cmd = [*PYTHON, "-m", STEPS_MODULE, name, str(rows_path), f"{bound:.1f}", lease_steps.ctx_to_json(ctx)]
    t0 = time.perf_counter()
    with open(step_dir / "log.txt", "w") as logf:
        proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, start_new_session=True, cwd=step_dir)
        try:
            code = proc.wait(timeout=bound)
        except subprocess.TimeoutExpired:
            code = None
        # the step's children (a server, ranks, a training run) go with it, also after a normal exit
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
    seconds = round(time.perf_counter() - t0, 1)
    rows = read_rows(rows_path)
    if code is None:
        status = "cut"
        rows.append({"cut": f"killed at its bound of {bound:.0f} s"})
    elif code == 0:
        status = "ok"
    elif code == lease_steps.SKIPPED_EXIT:
        status = "skipped"
    else:
        status = "failed"
        tail = (step_dir / "log.txt").read_text(errors="replace")[-3000:]
        rows.append({"error": f"exit status {code}", "log_tail": tail})
    return {"status": status, "seconds": seconds, "rows": rows}


def read_rows(path: Path) -> list:
    """The rows a step wrote (one JSON per line); a line cut mid-write by a kill is left out."""
    rows = []
    if path.exists():
        for line in path.read_text(errors="replace").splitlines():
            try:
                rows.append(json.loads(line))
            except ValueError:
                pass
    return rows


# ------------------------------------------------------------------------------------------ the reports
def page_name(gpu: str, commit: str, dry: bool, date: str | None = None) -> str:
    date = date or datetime.date.today().isoformat()
    return f"{date}_{gpu_kind(gpu)}_{commit}" + ("_dry-run" if dry else "")


def measured(folders: list, out: Path, kind: str, commit: str) -> dict:
    """{step: where} of the steps already "ok" for this commit on this GPU kind: the reports (page JSONs) in
    `folders` and out/report.json."""
    found = {}
    files = [f for d in folders if d.is_dir() for f in sorted(d.glob("*.json"))]
    for f in files + [out / "report.json"]:
        try:
            rep = json.loads(f.read_text())
        except (OSError, ValueError):
            continue
        if not isinstance(rep, dict) or rep.get("commit") != commit or gpu_kind(rep.get("gpu")) != kind:
            continue
        for name, st in (rep.get("steps") or {}).items():
            if st.get("status") == "ok":
                found.setdefault(name, str(f))
    return found


def write_json(path: Path, obj) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1) + "\n")
    os.replace(tmp, path)


def render_page(report: dict, title: str, command: str) -> str:
    lines = [f"# {title}", "", f"- **GPU**: {report['gpu'] or 'none (CPU)'}", f"- **commit**: `{report['commit']}`",
             f"- **command**: `{command}`", "", "| step | status | seconds | rows |", "|---|---|---|---|"]
    for name, st in report["steps"].items():
        lines.append(f"| [{name}](#{name}) | {st['status']} | {st['seconds']} | {len(st['rows'])} |")
    for name, st in report["steps"].items():
        lines += ["", f"## {name}", "", f"{st['status']}, {st['seconds']} s", "", "```"]
        for r in st["rows"]:
            text = json.dumps(r)
            lines.append(text if len(text) <= 2000 else text[:2000] + " ...")
        lines.append("```")
    return "\n".join(lines) + "\n"


def write_index(docs: Path) -> None:
    """docs/README.md: one line per report page, newest first."""
    rows = []
    for f in sorted(docs.glob("*.json"), reverse=True):
        try:
            rep = json.loads(f.read_text())
            counts = {s: sum(st["status"] == s for st in rep["steps"].values()) for s in STATUSES}
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            continue
        date = f.stem.split("_")[0]
        rows.append(f"| {date} | {rep['gpu'] or 'CPU'} | `{rep['commit']}` | "
                    + " / ".join(str(counts[s]) for s in STATUSES) + f" | [{f.stem}]({f.stem}.md) |")
    text = ["# GPU reports", "",
            "One page per lease (date, GPU kind, commit), written by `python -m gpt2core.calibrate` (issue 48: "
            "`python/gpt2core/runtime/calibrate.py`, the steps in `runtime/lease_steps/`); each step's rows are in "
            "the page, its JSON beside it. A step measured (ok) for a commit on a GPU kind is skipped by the next "
            "lease on that commit and kind unless named with `--only`, so each lease continues the list. The "
            "commit is the last one that changed anything outside docs/.", "",
            "## A lease, step by step", "",
            "Here, before the lease (no GPU needed):", "",
            "```bash",
            "scripts/lease_build.sh 90          # the sm_90 wheel (H100/H200), repaired; dependency wheels in deps/",
            "python scripts/lease_data.py --out lease_data --max-mib 24   # learn's tokens (docs/DATA_SOURCES.md)",
            "python -m gpt2core.calibrate --dry-run --device cpu --out /tmp/dry   # every step at tiny shapes",
            "```", "",
            "Carry `build/lease-wheels/90`, `lease_data` and HellaSwag's `hellaswag_val_full.txt` (what travels is "
            "64 MiB at most, the tree's ~7 MiB included: hence 24 of lease_data.py's default 60 MiB; learn repeats "
            "them, the same tokens in the same order for both recipes); on the device, from the repository's root:",
            "",
            "```bash",
            "python3 -m pip install -q --no-index --no-deps --target /tmp/site build/lease-wheels/90/*.whl \\",
            "    build/lease-wheels/90/deps/*.whl",
            "PYTHONPATH=/tmp/site python3 -m gpt2core.calibrate --budget 540 --data lease_data \\",
            "    --hellaswag hellaswag_val_full.txt --out $OUT/lease --docs $OUT/lease \\",
            "    --commit $(cat build/lease-wheels/90/COMMIT)",
            "```", "",
            "Then copy the page and its JSON from what `$OUT/lease` brought back into docs/gpu here, rerun "
            "`python -m gpt2core.calibrate --index` (this index), and commit them. Steps measured in docs/gpu "
            "for the same commit and GPU kind are skipped by the next lease.", "",
            "## Reports", "",
            "| date | GPU | commit | ok / cut / skipped / failed | page |", "|---|---|---|---|---|", *rows, "",
            "Before the driver: the first leases' notes, [GPU_H100_2026-11-28.md](../GPU_H100_2026-11-28.md) "
            "(an H100 and two H200 leases, driven by scripts outside the repository)."]
    (docs / "README.md").write_text("\n".join(_wrap(text)) + "\n")


def _wrap(lines: list[str], width: int = 120) -> list[str]:
    """Markdown prose lines wrapped at `width`; code blocks, tables and headings as they are."""
    out, code = [], False
    for line in lines:
        code ^= line.startswith("```")
        keep = code or line.startswith(("```", "|", "#")) or len(line) <= width
        out += [line] if keep else textwrap.wrap(line, width, break_long_words=False, break_on_hyphens=False)
    return out


# ------------------------------------------------------------------------------------------ the driver
def build_parser():
    ap = cli.ArgumentParser(prog="python -m gpt2core.calibrate", description=__doc__.split("\n")[0])
    ap.add_argument("--budget", type=cli.Float(0, 86400, lo_open=True), default=None, metavar="SECONDS",
                    help="seconds for all the steps together (default: the sum of their bounds)")
    ap.add_argument("--only", nargs="+", metavar="STEP", default=None,
                    help="run these steps (in value order), measured or not")
    ap.add_argument("--list", action="store_true", help="print the steps in order with their bounds, then exit")
    ap.add_argument("--index", action="store_true",
                    help="rewrite the index (README.md) of the pages in --docs (default docs/gpu), then exit")
    ap.add_argument("--dry-run", action="store_true",
                    help="every step at tiny shapes (seconds each): what a lease would run, on this device")
    ap.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                    help="auto (default): cuda where a GPU is usable, else cpu")
    ap.add_argument("--out", default="calibrate_out", help="the report folder (default calibrate_out)")
    ap.add_argument("--docs", default=None, help="where the Markdown pages and their index go (default: "
                                                 "docs/gpu of the source checkout on a GPU; else OUT)")
    ap.add_argument("--data", default=None, help="learn: scripts/lease_data.py's folder (manifest.json + shards)")
    ap.add_argument("--hellaswag", default=None, help="eval: HellaSwag's validation set (.txt, .jsonl or .npz)")
    ap.add_argument("--core-bundle", default=None, help="eval: a CORE bundle (folder or zip)")
    ap.add_argument("--commit", default=None, help="the commit measured (default: the checkout's; see above)")
    return ap


def list_steps(dry: bool, out=print) -> None:
    for i, s in enumerate(steps(), 1):
        out(f"{i:>2}. {s.name:<10} {bound_of(s, dry):>5.0f} s  {s.what}")


def drive(args, log=print) -> tuple[int, dict]:
    """Runs the steps for parsed args; (exit status, report)."""
    all_steps = steps()
    names = [s.name for s in all_steps]
    if args.only:
        bad = [n for n in args.only if n not in names]
        if bad:
            raise ArgError(f"--only: unknown step {bad[0]!r} (the steps: {', '.join(names)})")
    for flag, path in (("--data", args.data), ("--hellaswag", args.hellaswag), ("--core-bundle", args.core_bundle)):
        if path and not Path(path).exists():
            raise ArgError(f"{flag} {path}: no such file or folder")
    device, gpu, why = find_device(args.device)
    commit = args.commit or code_commit(ROOT)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    checkout = (ROOT / "docs").is_dir() and (ROOT / "python" / "gpt2core").is_dir()
    gpu_report = device == "cuda" and not args.dry_run and checkout
    docs = Path(args.docs).resolve() if args.docs else (ROOT / "docs" / "gpu" if gpu_report else out)
    docs.mkdir(parents=True, exist_ok=True)
    kind = gpu_kind(gpu)
    done = measured(list(dict.fromkeys([docs, ROOT / "docs" / "gpu"])), out, kind, commit)
    name = page_name(gpu, commit, args.dry_run)
    page_json = docs / f"{name}.json"
    previous = json.loads(page_json.read_text()) if page_json.exists() else {}
    report = {"gpu": gpu or None, "commit": commit, "steps": {}}
    ctx = lease_steps.Ctx(device=device, dry=args.dry_run, python=list(PYTHON), root=str(ROOT),
                          data=str(Path(args.data).resolve()) if args.data else None,
                          hellaswag=str(Path(args.hellaswag).resolve()) if args.hellaswag else None,
                          core_bundle=str(Path(args.core_bundle).resolve()) if args.core_bundle else None, gpu=gpu)
    budget = args.budget if args.budget is not None else sum(bound_of(s, args.dry_run) for s in all_steps)
    command = "python -m gpt2core.calibrate " + " ".join(sys.argv[1:]) if sys.argv[1:] else "(in-process)"
    log(f"calibrate: {gpu or 'CPU'} ({kind}), device {device}, commit {commit}, budget {budget:.0f} s"
        + (", dry run" if args.dry_run else "") + (f"; {why}" if why else ""))
    t_start = time.perf_counter()
    status, measured_here = 0, set()
    for s in all_steps:
        if args.only and s.name not in args.only:
            continue
        left = budget - (time.perf_counter() - t_start)
        if not args.only and s.name in done:
            res = {"status": "skipped", "seconds": 0.0, "rows": [{"skipped": f"measured for {commit} on {kind}: "
                                                                             f"{done[s.name]}"}]}
            measured_here.add(s.name)
        elif device == "cpu" and not args.dry_run and s.name != "doctor":
            res = {"status": "skipped", "seconds": 0.0,
                   "rows": [{"skipped": f"{why}: the GPU steps need one (--dry-run runs them at tiny shapes)"}]}
        elif left < MIN_STEP_S:
            res = {"status": "skipped", "seconds": 0.0,
                   "rows": [{"skipped": f"the budget is spent ({left:.0f} s left of {budget:.0f})"}]}
        else:
            bound = min(bound_of(s, args.dry_run), left)
            res = run_bounded(s.name, bound, ctx, out / "steps" / s.name)
            if res["status"] == "failed":
                status = 1
        report["steps"][s.name] = res
        log(f"{s.name:<10} {res['status']:<8} {res['seconds']:>7.1f} s  {len(res['rows'])} rows  {s.what}")
        write_json(out / "report.json", report)
        # the page: this run's steps over the earlier lease's of the same page, whose measurements stay
        merged = {**report, "steps": {**previous.get("steps", {}), **{n: st for n, st in report["steps"].items()
                                                                      if n not in measured_here}}}
        write_json(page_json, merged)
        title = f"GPU report: {gpu or 'CPU'}, commit {commit}" + (" (dry run)" if args.dry_run else "")
        (docs / f"{name}.md").write_text(render_page(merged, title, command))
    write_index(docs)
    log(f"calibrate: wrote {out / 'report.json'} and {docs / (name + '.md')}")
    return status, report


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.list:
        list_steps(args.dry_run)
        return 0
    if args.index:
        docs = Path(args.docs or ROOT / "docs" / "gpu")
        if not docs.is_dir():
            raise ArgError(f"--docs {docs}: no such folder")
        write_index(docs)
        print(f"calibrate: wrote {docs / 'README.md'}")
        return 0
    return drive(args)[0]


def calibrate(report, out=print) -> int:
    """`gpt2core-doctor --calibrate --report FILE`: the driver with its defaults (every step within its bound;
    without a GPU the doctor alone), the report written to FILE as well (and a one-line-per-step summary beside
    it, FILE.txt)."""
    report = Path(report)
    args = build_parser().parse_args(["--out", str(report.with_suffix(""))])
    status, rep = drive(args, out)
    write_json(report, rep)
    report.with_suffix(".txt").write_text("".join(f"{n} {st['status']} {st['seconds']} s\n"
                                                  for n, st in rep["steps"].items()))
    return status


console = cli.entry("python -m gpt2core.calibrate", main)

if __name__ == "__main__":
    sys.exit(console())
