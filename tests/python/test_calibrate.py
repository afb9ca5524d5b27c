"""The GPU lease driver, `python -m gpt2core.calibrate` (issue 48), without a GPU: the steps' value order and bounds,
the report's exact schema, a step killed at its bound keeping the rows it wrote (its children killed with it), a
failing step reported "failed" while the driver goes on, a step that cannot run here "skipped" with the reason, the
budget, a step measured for this commit and GPU kind skipped unless named with --only, the Markdown page and its
index; and (slow) the dry run of every real step on the CPU backend. The dry run on the emulated CUDA device is
tests/csrc/cuda/test_cuda_emu_readiness.py's.

The driver's own tests run steps of a module written here (fake_lease_steps: rows, a hang, an error, a Skip),
through the same subprocess machinery as the real steps (calibrate.STEPS_MODULE)."""
import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from gpt2core.runtime import calibrate, lease_steps

ROOT = Path(__file__).resolve().parents[2]
VALUE_ORDER = ["doctor", "gpu_tests", "learn", "d12_step", "recipe_profile", "scale", "serve", "dp", "fp16", "fp8", "eval", "resume",
               "bitwise", "bgradb", "ladder", "vs_cpu", "gemm"]

FAKE = textwrap.dedent('''
    import os, subprocess, sys, time
    from gpt2core.runtime.lease_steps import Skip, Step, main

    def step_fine(budget, ctx):
        yield {"i": 1, "budget": budget, "dry": ctx.dry, "device": ctx.device}
        yield {"i": 2}

    def step_hang(budget, ctx):
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        yield {"measured": "before the hang", "child": child.pid}
        time.sleep(600)
        yield {"never": True}

    def step_boom(budget, ctx):
        yield {"measured": "before the error"}
        raise RuntimeError("planted failure")

    def step_nogpu(budget, ctx):
        raise Skip("needs a GPU (planted)")
        yield

    def step_after(budget, ctx):
        yield {"ran": "after the others"}

    STEPS = [Step("fine", "two rows", 30, 30), Step("hang", "a row, then hangs", 30, 4),
             Step("boom", "a row, then an error", 30, 30), Step("nogpu", "cannot run here", 30, 30),
             Step("after", "runs last", 30, 30)]
    FUNCS = {s.name: globals()["step_" + s.name] for s in STEPS}

    if __name__ == "__main__":
        sys.exit(main(sys.argv[1:], FUNCS))
''')


@pytest.fixture()
def fake(tmp_path, monkeypatch):
    d = tmp_path / "mods"
    d.mkdir()
    (d / "fake_lease_steps.py").write_text(FAKE)
    monkeypatch.syspath_prepend(str(d))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(d), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setattr(calibrate, "STEPS_MODULE", "fake_lease_steps")
    monkeypatch.setattr(calibrate, "MIN_STEP_S", 2.0)
    return tmp_path


def drive(tmp_path, *args):
    lines = []
    a = calibrate.build_parser().parse_args(["--out", str(tmp_path / "out"), "--dry-run", "--device", "cpu",
                                             "--commit", "c0ffee", *map(str, args)])
    status, rep = calibrate.drive(a, lines.append)
    on_disk = json.loads((tmp_path / "out" / "report.json").read_text())
    assert on_disk == rep
    return status, rep, lines


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie (killed, not yet reaped by init) is not alive
        return f.read().split(")")[-1].split()[0] != "Z"


def test_list_prints_the_steps_in_value_order_with_their_bounds():
    for dry in (False, True):
        r = subprocess.run([sys.executable, "-m", "gpt2core.calibrate", "--list"] + (["--dry-run"] if dry else []),
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        rows = [line.split() for line in r.stdout.splitlines()]
        assert [x[1] for x in rows] == VALUE_ORDER
        assert [x[0] for x in rows] == [f"{i}." for i in range(1, len(VALUE_ORDER) + 1)]
        bounds = {s.name: (s.dry_bound if dry else s.bound) for s in lease_steps.STEPS}
        assert [float(x[2]) for x in rows] == [bounds[n] for n in VALUE_ORDER] and all(x[3] == "s" for x in rows)
    assert [s.name for s in lease_steps.STEPS] == VALUE_ORDER and set(lease_steps.FUNCS) == set(VALUE_ORDER)
    # the first four fit one 10-minute lease with the build's minutes left over
    assert sum(s.bound for s in lease_steps.STEPS[:4]) <= 600


def test_report_schema_cut_failed_skipped_and_the_driver_goes_on(fake):
    t0 = time.perf_counter()
    status, rep, lines = drive(fake)
    assert time.perf_counter() - t0 < 60
    assert status == 1  # a step failed
    assert set(rep) == {"gpu", "commit", "steps"} and rep["gpu"] is None and rep["commit"] == "c0ffee"
    assert list(rep["steps"]) == ["fine", "hang", "boom", "nogpu", "after"]
    for st in rep["steps"].values():
        assert set(st) == {"status", "seconds", "rows"} and st["status"] in calibrate.STATUSES
        assert isinstance(st["seconds"], float) and isinstance(st["rows"], list)
    s = rep["steps"]
    assert s["fine"]["status"] == "ok"
    assert s["fine"]["rows"] == [{"i": 1, "budget": 30.0, "dry": True, "device": "cpu"}, {"i": 2}]
    # cut at its bound (4 s in a dry run): the row written before the hang is kept, the child is killed too
    assert s["hang"]["status"] == "cut" and 4.0 <= s["hang"]["seconds"] < 15
    assert s["hang"]["rows"][0]["measured"] == "before the hang"
    assert "killed at its bound" in s["hang"]["rows"][-1]["cut"]
    assert not any("never" in r for r in s["hang"]["rows"])
    assert not alive(s["hang"]["rows"][0]["child"])
    assert s["boom"]["status"] == "failed" and s["boom"]["rows"][0] == {"measured": "before the error"}
    assert "planted failure" in s["boom"]["rows"][-1]["log_tail"]
    assert s["nogpu"] == {"status": "skipped", "seconds": s["nogpu"]["seconds"],
                          "rows": [{"skipped": "needs a GPU (planted)"}]}
    assert s["after"]["status"] == "ok" and s["after"]["rows"] == [{"ran": "after the others"}]
    assert [line.split()[:2] for line in lines[1:6]] == [["fine", "ok"], ["hang", "cut"], ["boom", "failed"],
                                                         ["nogpu", "skipped"], ["after", "ok"]]
    # the page and its index (a dry run writes them under --out)
    page = fake / "out" / f"{calibrate.page_name('', 'c0ffee', True)}.md"
    assert "| [hang](#hang) | cut |" in page.read_text() and "before the hang" in page.read_text()
    assert page.stem in (fake / "out" / "README.md").read_text()


def test_a_measured_step_is_skipped_unless_named_and_another_commit_runs_it(fake):
    drive(fake)
    _, rep, _ = drive(fake)
    s = rep["steps"]
    for n in ("fine", "after"):  # ok in the first run: skipped, saying where they were measured
        assert s[n]["status"] == "skipped" and s[n]["seconds"] == 0.0
        assert s[n]["rows"][0]["skipped"].startswith("measured for c0ffee on cpu: ")
    # the steps that were not ok run again: the cut, the failed and the skipped ones
    assert s["hang"]["status"] == "cut" and s["boom"]["status"] == "failed" and s["nogpu"]["status"] == "skipped"
    # the page keeps the first run's measurements of the skipped steps
    page = json.loads((fake / "out" / f"{calibrate.page_name('', 'c0ffee', True)}.json").read_text())
    assert page["steps"]["fine"]["status"] == "ok" and page["steps"]["fine"]["rows"][0]["i"] == 1
    assert page["steps"]["hang"]["status"] == "cut"
    # named, they run again
    _, rep, _ = drive(fake, "--only", "fine", "after")
    assert list(rep["steps"]) == ["fine", "after"] and rep["steps"]["fine"]["status"] == "ok"
    assert rep["steps"]["fine"]["rows"][0]["i"] == 1 and rep["steps"]["after"]["status"] == "ok"
    # another commit measures again (the same --out, whose report and pages say c0ffee measured them)
    a = calibrate.build_parser().parse_args(["--out", str(fake / "out"), "--dry-run", "--device", "cpu", "--commit",
                                             "beef"])
    _, rep = calibrate.drive(a, lambda line: None)
    assert rep["steps"]["fine"]["status"] == "ok" and rep["steps"]["fine"]["rows"][0]["i"] == 1
    assert rep["steps"]["after"]["status"] == "ok"


def test_skip_if_measured_reads_an_earlier_report_of_the_same_commit_and_gpu_kind(fake):
    """A lease continues the list: steps "ok" in a report of this commit on this GPU kind (here: an earlier page
    in --docs) are skipped with where they were measured; another GPU kind's report does not count."""
    docs = fake / "docs"
    docs.mkdir()
    ok = {"status": "ok", "seconds": 1.0, "rows": [{"earlier": True}]}
    (docs / "2026-01-01_cpu_c0ffee.json").write_text(json.dumps({"gpu": None, "commit": "c0ffee",
                                                                   "steps": {"fine": ok}}))
    (docs / "2026-01-01_H200_c0ffee.json").write_text(json.dumps({"gpu": "NVIDIA H200", "commit": "c0ffee",
                                                                    "steps": {"after": ok}}))
    _, rep, _ = drive(fake, "--docs", docs)
    assert rep["steps"]["fine"]["status"] == "skipped"
    assert "measured for c0ffee on cpu" in rep["steps"]["fine"]["rows"][0]["skipped"]
    assert "2026-01-01_cpu_c0ffee.json" in rep["steps"]["fine"]["rows"][0]["skipped"]
    assert rep["steps"]["after"]["status"] == "ok" and rep["steps"]["after"]["rows"] == [{"ran": "after the others"}]
    _, rep, _ = drive(fake, "--docs", docs, "--only", "fine")
    assert list(rep["steps"]) == ["fine"] and rep["steps"]["fine"]["rows"][0]["i"] == 1
    index = (docs / "README.md").read_text()
    assert "2026-01-01_H200_c0ffee" in index and "NVIDIA H200" in index


def test_the_budget_bounds_each_step_and_stops_starting_them(fake):
    """Budget 5.9 s: "fine" runs, "hang" is cut at its own bound of 4 s (the least of 4 and what is left), and then
    less than MIN_STEP_S (2 s) is left whatever the machine's speed (5.9 - 4 - fine's time), so the rest are not
    started, saying so. With --only hang and a budget of 3 s the budget is the lesser: hang is cut at 3 s."""
    t0 = time.perf_counter()
    _, rep, _ = drive(fake, "--budget", 5.9)
    assert time.perf_counter() - t0 < 5.9 + 8  # the kills and the reports
    s = rep["steps"]
    assert s["fine"]["status"] == "ok" and s["hang"]["status"] in ("cut", "skipped")
    assert sum(st["seconds"] for st in s.values()) <= 5.9 + 2
    for name in ("boom", "nogpu", "after"):
        assert s[name]["status"] == "skipped" and "the budget is spent" in s[name]["rows"][0]["skipped"], s[name]
    _, rep, _ = drive(fake, "--budget", 3, "--only", "hang")
    h = rep["steps"]["hang"]
    assert h["status"] == "cut" and 2.9 <= h["seconds"] < 3.9 and h["rows"][-1]["cut"] == "killed at its bound of 3 s"


def test_bad_arguments_are_one_line_errors(tmp_path):
    for args, msg in [(["--only", "nope"], "--only: unknown step 'nope'"),
                      (["--budget", "0"], "--budget"),
                      (["--data", str(tmp_path / "missing")], "--data"),
                      (["--device", "tpu"], "--device")]:
        r = subprocess.run([sys.executable, "-m", "gpt2core.calibrate", "--out", str(tmp_path / "o"), *args],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 2 and "Traceback" not in r.stderr and msg in r.stderr, (args, r.stderr)


def test_gpu_kind_and_page_name():
    assert calibrate.gpu_kind("NVIDIA H200") == "H200"
    assert calibrate.gpu_kind("NVIDIA H100 80GB HBM3") == "H100"
    assert calibrate.gpu_kind("NVIDIA A100-SXM4-80GB") == "A100"
    assert calibrate.gpu_kind(None) == "cpu" and calibrate.gpu_kind("") == "cpu"
    assert calibrate.page_name("NVIDIA H200", "abc123", False, "2026-11-29") == "2026-11-29_H200_abc123"


def test_the_paper_model_past_its_time_leaves_a_reason_not_an_error(tmp_path):
    """On the first H100 the model side of d12_step ran past the step's bound and the kill took the measured rows
    with it. Now the measured rows are written before the model runs, and the model has its own timeout."""
    ctx = lease_steps.Ctx(work=str(tmp_path), root=str(ROOT), gpu="NVIDIA H200")
    r = lease_steps.paper_model(ctx, ["--attention", "cudnn"], 0.05)
    assert set(r) == {"model_skipped"} and "took over" in r["model_skipped"]
    assert lease_steps.gpu_model_key("NVIDIA H200") == "H100" and lease_steps.gpu_model_key("NVIDIA A100") == "A100"


def test_reach_interpolates_between_evaluations():
    curve = [{"tokens": 0, "train_seconds": 0.0, "val_loss": 10.0}, {"tokens": 100, "train_seconds": 2.0,
                                                                      "val_loss": 8.0},
             {"tokens": 200, "train_seconds": 6.0, "val_loss": 6.0}]
    assert lease_steps.reach(curve, 7.0, "tokens") == pytest.approx(150.0)
    assert lease_steps.reach(curve, 7.0, "train_seconds") == pytest.approx(4.0)
    assert lease_steps.reach(curve, 8.0, "tokens") == 100.0
    assert lease_steps.reach(curve, 11.0, "tokens") == 0.0
    assert lease_steps.reach(curve, 5.9, "tokens") is None


@pytest.mark.slow
def test_dry_run_of_every_step_on_the_cpu(tmp_path):
    """Every real step at tiny shapes on the CPU backend (about 3 minutes on 2 cores): none fails or is cut; the
    GPU-only ones are skipped saying why; each step's rows are what it measures."""
    hs = ROOT / "tests" / "data" / "hellaswag_val_120.jsonl"
    args = [sys.executable, "-m", "gpt2core.calibrate", "--dry-run", "--device", "cpu", "--out", str(tmp_path / "o")]
    if hs.exists():
        args += ["--hellaswag", str(hs)]
    r = subprocess.run(args, capture_output=True, text=True, timeout=900, cwd=ROOT)
    rep = json.loads((tmp_path / "o" / "report.json").read_text())
    assert r.returncode == 0, r.stdout + r.stderr + json.dumps(rep)[-3000:]
    s = rep["steps"]
    assert list(s) == VALUE_ORDER
    gpu_only = {"fp16", "fp8", "bgradb", "ladder", "vs_cpu", "gemm"}
    for n, st in s.items():
        if n in gpu_only:
            assert st["status"] == "skipped" and "needs a GPU" in st["rows"][0]["skipped"], (n, st)
        elif n == "eval" and not hs.exists():
            assert st["status"] == "skipped"
        else:
            assert st["status"] == "ok", (n, st)
    assert s["gpu_tests"]["rows"][0]["collect_only"] is True
    learn = {k: v for r in s["learn"]["rows"] for k, v in r.items()}
    share = learn["muon_share"]
    assert set(share) == {"gpt2", "modern", "ratio"} and 0 < share["modern"]["optimizer_share"] < 1
    # each recipe's time per token with its own micro-batches per step, and their ratio
    for r in ("gpt2", "modern"):
        p, k = share[r]["phase_ms"], share[r]["micro_batches_per_step"]
        want = (k * (p["forward"] + p["backward"]) + p["optimizer"]) / (k * 2 * 32) * 1e3  # dry: B=2, T=32
        assert k >= 1 and share[r]["ms_per_1k_tokens"] == pytest.approx(want, rel=1e-2)  # phases rounded
    assert share["ratio"] == pytest.approx(share["modern"]["ms_per_1k_tokens"] / share["gpt2"]["ms_per_1k_tokens"],
                                           rel=1e-3)
    assert [r["recipe"] for r in s["learn"]["rows"] if "recipe" in r].count("modern") == 9  # steps 0..8
    assert learn["result"]["target_val_loss"] > 0 and "tokens_ratio" in learn["result"]
    assert [r["streams"] for r in s["serve"]["rows"] if "streams" in r] == [1, 2]
    assert [r["generate_batch"] for r in s["serve"]["rows"] if "generate_batch" in r] == [1, 2]
    dp = [r for r in s["dp"]["rows"] if "replicas_bit_identical" in r]
    # both ranks' replicas bit for bit; ZeRO and one process equal to fp32 rounding (the CPU's own tests say so)
    assert len(dp) == 3 and all(r["replicas_bit_identical"] and r["max_abs_diff_to_one_process"] < 2e-5 for r in dp)
    ev = {k: v for r in s["eval"]["rows"] for k, v in r.items()}
    assert ev["hellaswag"]["n"] == 16 and ev["items_per_s"] > 0
    assert isinstance(ev["core"], float) and ev["items"] == 12  # 3 tasks of the built bundle, 4 items each
    assert s["resume"]["rows"][-1]["bit_identical"] is True and s["resume"]["rows"][0]["killed_with"] == -9
    assert all(r["bit_identical"] for r in s["bitwise"]["rows"])
    assert [r["recompute"] for r in s["scale"]["rows"] if "recompute" in r] == ["none", "gelu", "layer"]


def test_learn_checks_the_carried_shards_against_their_manifest(tmp_path):
    """A damaged copy of scripts/lease_data.py's folder is refused before any training, naming the file."""
    import hashlib

    import numpy as np

    from gpt2core.data.shards import write_shard
    files = []
    for i, name in enumerate(["lease_val_000000.bin", "lease_train_000001.bin"]):
        p = write_shard(tmp_path / name, np.arange(100 + i, dtype=np.uint16))
        files.append({"path": name, "sha256": hashlib.sha256(p.read_bytes()).hexdigest(), "tokens": 100 + i})
    (tmp_path / "manifest.json").write_text(json.dumps({"files": files, "source": "test", "licence": "CC0-1.0"}))
    assert lease_steps.check_manifest(tmp_path)["licence"] == "CC0-1.0"
    raw = bytearray((tmp_path / "lease_train_000001.bin").read_bytes())
    raw[-1] ^= 1
    (tmp_path / "lease_train_000001.bin").write_bytes(bytes(raw))
    with pytest.raises(ValueError, match="lease_train_000001.bin: sha256 differs"):
        lease_steps.check_manifest(tmp_path)
