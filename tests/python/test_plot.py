"""gpt2core.plot and gpt2core-plot: figures from synthetic metrics files (checked through the matplotlib
objects, not pixels), the run record gpt2core-train writes, and the speed-ladder bar chart."""
import json

import numpy as np
import pytest

pytest.importorskip("matplotlib")

from gpt2core import plot, train  # noqa: E402
from gpt2core.config import get_preset  # noqa: E402

TPS = 524288  # tokens per step of the 124M recipe
RNG = np.random.default_rng(7)


def write_run(d, params=124_475_904, steps=60, val_every=20, hs_every=30, tokens_per_step=TPS):
    """A synthetic run directory: the run record, then step / val / HellaSwag records as gpt2core-train
    writes them. Returns the expected curves {key: (steps, values)}."""
    d.mkdir(parents=True, exist_ok=True)
    want = {k: ([], []) for k in ("loss", "lr", "grad_norm", "val_loss", "hellaswag_acc_norm")}
    recs = [{"run": {"preset": "d12", "params": params, "tokens_per_step": tokens_per_step, "start_step": 0,
                     "steps": steps}}]
    for step in range(steps):
        if step % val_every == 0 or step == steps - 1:
            recs.append({"step": step, "val_loss": float(RNG.uniform(3, 11))})
        if step % hs_every == 0 or step == steps - 1:
            recs.append({"step": step, "hellaswag_acc": 0.26, "hellaswag_acc_norm": float(RNG.uniform(0.25, 0.3))})
        recs.append({"step": step + 1, "loss": float(RNG.uniform(3, 11)), "lr": float(RNG.uniform(0, 6e-4)),
                     "grad_norm": float(RNG.uniform(0.2, 5)), "dt_ms": 1.0, "tok_per_s": 1.0})
    for r in recs:
        for k, (xs, ys) in want.items():
            if k in r:
                xs.append(r["step"])
                ys.append(r[k])
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    return want


def lines(ax):
    return {ln.get_label(): ln for ln in ax.get_lines()}


def test_one_124m_run_has_four_panels_and_reference_lines(tmp_path):
    want = write_run(tmp_path / "gpt2_124m")
    png = tmp_path / "out.png"
    fig = plot.plot_runs([tmp_path / "gpt2_124m"], path=png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    ax_loss, ax_hs, ax_lr, ax_norm = fig.axes
    assert [a.get_title() for a in fig.axes] == ["loss", "HellaSwag", "learning rate",
                                                 "gradient norm (before clipping)"]
    assert ax_lr.get_xlabel() == ax_norm.get_xlabel() == "tokens seen"
    got = lines(ax_loss)
    assert set(got) == {"gpt2_124m train", "gpt2_124m val", "GPT-2 124M (val, llm.c)"}
    for label, key in (("gpt2_124m train", "loss"), ("gpt2_124m val", "val_loss")):
        steps, ys = want[key]
        np.testing.assert_array_equal(got[label].get_xdata(), np.array(steps, dtype=float) * TPS)
        np.testing.assert_array_equal(got[label].get_ydata(), ys)
    assert list(got["GPT-2 124M (val, llm.c)"].get_ydata()) == [3.2924, 3.2924]
    hs = lines(ax_hs)
    assert set(hs) == {"gpt2_124m", "GPT-2 124M", "GPT-3 124M"}
    assert hs["GPT-2 124M"].get_ydata()[0] == 0.2955 and hs["GPT-3 124M"].get_ydata()[0] == 0.337
    np.testing.assert_array_equal(hs["gpt2_124m"].get_ydata(), want["hellaswag_acc_norm"][1])
    np.testing.assert_array_equal(lines(ax_lr)["gpt2_124m"].get_ydata(), want["lr"][1])
    np.testing.assert_array_equal(lines(ax_norm)["gpt2_124m"].get_ydata(), want["grad_norm"][1])
    assert ax_norm.get_yscale() == "log" and ax_lr.get_xscale() == "linear"
    assert {t.get_text() for t in ax_loss.get_legend().get_texts()} == set(got)


def test_several_runs_overlaid_small_models_have_no_reference_lines(tmp_path):
    want_a = write_run(tmp_path / "lr3e-4", params=16_000_000, tokens_per_step=1024)
    write_run(tmp_path / "lr6e-4", params=16_000_000, tokens_per_step=2048, hs_every=10**6)
    fig = plot.plot_runs([tmp_path / "lr3e-4", tmp_path / "lr6e-4"], log_x=True)
    ax_loss, ax_hs, ax_lr, _ = fig.axes
    got = lines(ax_loss)
    assert set(got) == {"lr3e-4 train", "lr3e-4 val", "lr6e-4 train", "lr6e-4 val"}  # no 124M references
    assert got["lr3e-4 train"].get_color() != got["lr6e-4 train"].get_color()
    assert got["lr3e-4 train"].get_color() == got["lr3e-4 val"].get_color()
    np.testing.assert_array_equal(got["lr6e-4 train"].get_xdata(), np.arange(1, 61) * 2048.0)
    np.testing.assert_array_equal(lines(ax_hs)["lr3e-4"].get_xdata(), np.array(want_a["hellaswag_acc_norm"][0]) * 1024.0)
    assert ax_lr.get_xscale() == "log"
    assert plot.plot_runs([tmp_path / "lr3e-4"], references=True).axes[1].get_lines()[-1].get_label() == "GPT-3 124M"


def test_resume_and_rerun_records_supersede_earlier_ones(tmp_path):
    """A resume from step s drops the crashed run's records after s; a fresh start in the same directory
    drops everything before it; a half-written last line is skipped."""
    run = lambda s: json.dumps({"run": {"params": 10, "tokens_per_step": 4, "start_step": s}})  # noqa: E731
    step = lambda i, loss: json.dumps({"step": i, "loss": loss})  # noqa: E731
    val = lambda i, v: json.dumps({"step": i, "val_loss": v})  # noqa: E731
    f = tmp_path / "metrics.jsonl"
    f.write_text("\n".join([run(0), val(0, 9.0), step(1, 8.0), step(2, 7.0), val(2, 6.5), step(3, 6.0),
                            step(4, 5.0), val(4, 4.5), run(2), val(2, 6.4), step(3, 6.1), step(4, 5.1)])
                 + "\n" + '{"step": 5, "lo')
    r = plot.read_run(f)
    assert r.name == tmp_path.name and r.tokens_per_step == 4
    np.testing.assert_array_equal(r.series["loss"][0], [1, 2, 3, 4])
    np.testing.assert_array_equal(r.series["loss"][1], [8.0, 7.0, 6.1, 5.1])
    np.testing.assert_array_equal(r.series["val_loss"][1], [9.0, 6.4])
    f.write_text("\n".join([run(0), step(1, 8.0), step(2, 7.0), run(0), step(1, 3.0)]) + "\n")
    np.testing.assert_array_equal(plot.read_run(f).series["loss"][1], [3.0])


def test_llmc_log_and_bad_files(tmp_path, capsys):
    log = tmp_path / "main.log"
    log.write_text("s:0 tel:10.9810\ns:0 trl:10.9876 lr:0.000001 norm:15.07\ns:1 trl:10.5000 lr:0.000002 "
                   "norm:9.50\ns:1 eval:0.2500\n")
    r = plot.read_run(log, tokens_per_step=TPS)
    np.testing.assert_array_equal(r.series["loss"][0], [1, 2])  # llm.c's s is the step about to run
    np.testing.assert_array_equal(r.series["grad_norm"][1], [15.07, 9.5])
    np.testing.assert_array_equal(r.series["val_loss"][0], [0])
    np.testing.assert_array_equal(r.curve("hellaswag_acc_norm")[0], [TPS])
    assert not r.is_124m  # nothing says so: --references on draws the lines
    bad = tmp_path / "bad" / "metrics.jsonl"
    bad.parent.mkdir()
    bad.write_text('{"step": 1, "loss": 3}\n{"step": 2, "lo\n{"step": 3, "loss": 2}\n')
    with pytest.raises(ValueError, match=r"bad/metrics.jsonl: line 2: not valid JSON"):
        plot.read_run(bad.parent)
    assert plot.main([str(tmp_path / "nowhere")]) == 1
    assert "nowhere: no metrics file" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        plot.main([str(log), str(log), "--labels", "a"])


def test_cli_writes_png_next_to_one_run_and_summarises(tmp_path, capsys):
    want = write_run(tmp_path / "run")
    assert plot.main([str(tmp_path / "run"), "--log-x"]) == 0
    out = capsys.readouterr().out
    assert (tmp_path / "run" / "metrics.png").read_bytes()[:4] == b"\x89PNG"
    assert f"val loss {want['val_loss'][1][-1]:.4f} (step 59)" in out and "step 60 (31.5M tokens)" in out


def test_a_file_without_the_run_record_is_plotted_against_steps_and_says_so(tmp_path, capsys):
    """metrics.jsonl written before the {"run": ...} record existed (or by another tool): no TypeError, the curves'
    x values are the optimizer steps themselves, the axis says "step", and stderr says why."""
    want = write_run(tmp_path / "old")
    f = tmp_path / "old" / "metrics.jsonl"
    f.write_text("".join(line + "\n" for line in f.read_text().splitlines()[1:]))  # drop the run record
    assert plot.main([str(tmp_path / "old")]) == 0
    cap = capsys.readouterr()
    assert "records no tokens per step" in cap.err and "against optimizer steps" in cap.err
    assert "step 60 |" in cap.out and "tokens)" not in cap.out
    fig = plot.plot_runs([plot.read_run(tmp_path / "old")])
    ax_loss = fig.axes[0]
    np.testing.assert_array_equal(lines(ax_loss)["old train"].get_xdata(), want["loss"][0])
    np.testing.assert_array_equal(lines(ax_loss)["old val"].get_xdata(), want["val_loss"][0])
    assert ax_loss.get_xlabel() == "step" or fig.axes[2].get_xlabel() == "step"


def test_training_run_records_what_the_plot_needs(tmp_path, capsys):
    """gpt2core-train's run record: params and tokens per step; the log line carries elapsed time and ETA."""
    out = tmp_path / "run"
    train.main(["--preset", "tiny", "-B", "2", "-T", "16", "--steps", "3", "--val-every", "2", "--val-steps", "1",
                "--sample-tokens", "2", "--output-dir", str(out), "--no-progress"])
    log = capsys.readouterr().out
    assert "step     3/3 |" in log and "| elapsed 0:" in log and "| eta 0:00" in log
    r = plot.read_run(out)
    assert r.info["params"] == get_preset("tiny").num_parameters() and r.tokens_per_step == 32 and not r.is_124m
    np.testing.assert_array_equal(r.curve("loss")[0], [32, 64, 96])
    np.testing.assert_array_equal(r.series["val_loss"][0], [0, 2, 3])  # and after the last update


def test_ladder_bar_chart():
    rows = [{"rung": "baseline", "ms_per_step": 400.0, "tok_per_s": 1000.0},
            {"rung": "vocab 50304", "ms_per_step": 200.0, "tok_per_s": 2000.0}]
    fig = plot.plot_ladder(rows)
    ax_ms, ax_up = fig.axes
    assert [t.get_text() for t in ax_ms.get_yticklabels()] == ["baseline", "vocab 50304"]
    assert [p.get_width() for p in ax_ms.patches] == [400.0, 200.0]
    assert [p.get_width() for p in ax_up.patches] == [1.0, 2.0]
    assert [t.get_text() for t in ax_up.texts] == ["1.00x", "2.00x"]


def test_bench_ladder_plot_writes_the_chart(tmp_path):
    """scripts/bench.py --ladder --plot: the rungs measured on this device, one bar each."""
    import subprocess
    import sys
    from pathlib import Path
    bench = Path(__file__).resolve().parents[2] / "scripts" / "bench.py"
    png = tmp_path / "ladder.png"
    p = subprocess.run([sys.executable, str(bench), "--preset", "tiny", "--steps", "2", "--warmup", "1", "-B", "2",
                        "-T", "16", "--threads", "1", "--ladder", "--plot", str(png)],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and f"wrote {png}" in p.stdout, p.stdout + p.stderr
    assert png.read_bytes()[:4] == b"\x89PNG"
