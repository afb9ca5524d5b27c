"""scripts/recipe_bench.py's bookkeeping (the benchmark itself is run by hand, never timed in a test): tokens to
reach a target by linear interpolation between evaluations, the ablation's rows, spikes, the report over seeds and
scales, and the prepared text."""
import gzip
import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def rb():
    spec = importlib.util.spec_from_file_location("recipe_bench", ROOT / "scripts" / "recipe_bench.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_tokens_to_reach_interpolates_between_evaluations(rb):
    curve = [(0, 10.0), (100, 8.0), (200, 6.0), (300, 5.5)]
    assert rb.tokens_to_reach(curve, 7.0) == pytest.approx(150.0)
    assert rb.tokens_to_reach(curve, 8.0) == 100.0
    assert rb.tokens_to_reach(curve, 11.0) == 0.0
    assert rb.tokens_to_reach(curve, 5.0) is None


def test_ablation_rows_add_one_ingredient_at_a_time(rb):
    """Each row's TrainConfig differs from the previous row's in exactly its ingredient's fields, and the last row
    is --recipe modern itself (so the rows add up to the recipe)."""
    from gpt2core import config, train
    rows = rb.rows(warmup=5)
    cfgs = [train.parse_args(["--preset", "s4", *flags]).to_dict() for _, flags in rows]
    diffs = [sorted(k for k in cfgs[i] if cfgs[i][k] != cfgs[i - 1][k] and k != "recipe") for i in range(1, len(rows))]
    assert [label for label, _ in rows][0] == "gpt2" and "(control)" in rows[1][0]
    modern = config.RECIPES["modern"]
    groups = sorted(k for k in rb.GROUP_LRS if modern.get(k) is not None)
    assert groups  # the recipe sets AdamW's group LRs
    # Muon's row: the optimizer, and Muon's settings where the recipe's differ from TrainConfig's defaults
    muon = sorted(["optimizer"] + [k for k in ("muon_lr", "muon_momentum", "muon_momentum_warmup", "muon_weight_decay",
                                               "muon_ns_dtype")
                                   if k in modern and modern[k] != getattr(config.TrainConfig, k)])
    assert diffs == [["beta1", "lr", "weight_decay"], ["position"], ["no_bias", "norm", "qk_norm"], ["activation"],
                     ["logit_softcap", "untied", "zero_init_proj"], muon, groups,
                     sorted(["min_lr_frac", "schedule"] + (["warmup"] if modern["warmup"] != 5 else [])
                            + (["newton_schulz_share"] if modern.get("newton_schulz_share") else []))]
    assert rows[-1][1] == ["--recipe", "modern"] and cfgs[-1]["recipe"] == "modern"
    assert cfgs[0]["warmup"] == 5 and cfgs[-1]["warmup"] == modern["warmup"]
    models = [train.parse_args(["--preset", "s4", *flags]).model_config() for _, flags in rows]
    assert models[0].is_gpt2 and models[-2] == models[-1]
    assert [rb.row_label(label) for label, _ in rows[:2]] == ["gpt2", "control"]
    assert rb.row_label(rows[-1][0]) == "modern"


def test_spikes_are_steps_above_the_recent_median(rb, tmp_path):
    """A spike: a step's training loss above the median of the `window` steps before it (the first steps: above the
    initial val loss) by more than the margin; a single low batch does not make the next step a spike."""
    d = tmp_path / "a"
    d.mkdir()
    losses = [10.5, 9.0, 8.0, 7.0, 2.0, 7.2, 9.5, 7.0]
    recs = [{"run": {}}, {"step": 0, "val_loss": 10.0}] + [{"step": i + 1, "loss": v} for i, v in enumerate(losses)]
    recs.insert(5, {"step": 3, "val_loss": 6.5})
    (d / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in recs) + "\n")
    got = rb.spikes(d, margin=2.0, window=3)
    assert [(s["step"], s["ref"]) for s in got] == [(7, 7.0)] and got[0]["excess"] == pytest.approx(2.5)
    assert [s["step"] for s in rb.spikes(d, margin=0.4, window=3)] == [1, 7]
    assert rb.spikes(d, margin=3.0, window=3) == []


def test_report_over_seeds_and_scales(rb, tmp_path):
    """write_report: per scale and row, the mean and spread over seeds of the final val loss, of the tokens to the
    GPT-2 row's final val loss of the same seed and of the ratio; a seed that never reaches it; the spikes."""
    import argparse
    a = argparse.Namespace(preset="s4", batch_size=2, seq_len=256, steps=4, out=tmp_path, data_name="d",
                           val_every=1, val_steps=1, seeds=[1, 2], spike_margin=1.0,
                           spike_window=8)

    def run(label, seed, curve, spikes=()):
        return {"label": label, "scale": 1, "seed": seed, "curve": curve, "final_val": curve[-1][1],
                "tokens": curve[-1][0], "spikes": list(spikes), "tok_per_s": 100.0}

    res = [run("gpt2", 1, [(0, 11.0), (512, 9.0), (1024, 8.0)]), run("gpt2", 2, [(0, 11.0), (1024, 7.0)]),
           run("m", 1, [(0, 11.0), (256, 8.0), (1024, 6.0)],
               [{"step": 3, "loss": 9.5, "ref": 8.0, "excess": 1.5}]),
           run("m", 2, [(0, 11.0), (1024, 7.5)]),
           {**run("gpt2", 1, [(0, 11.0), (4096, 7.0)]), "scale": 4}]
    summary = rb.write_report(a, res)
    m = next(s for s in summary if s["label"] == "m")
    assert res[2]["tokens_to_target"] == 256 and res[2]["ratio"] == 4.0 and res[3]["ratio"] is None
    assert m["reached"] == 1 and m["ratio"] == (4.0, 0.0) and m["final_val"] == (6.75, pytest.approx(1.0607, 1e-4))
    g = next(s for s in summary if s["label"] == "gpt2" and s["scale"] == 1)
    assert g["ratio"] == (1.0, 0.0) and g["reached"] == 2 and m["spikes"] == 1
    assert [s["scale"] for s in summary] == [1, 1, 4]
    md = (tmp_path / "recipe_bench.md").read_text()
    assert ("| m | - | 6.7500 ± 1.0607 | 256 ± 0 | 4.00x ± 0.00 (4.00–4.00) | - | - | 1/2 | 1 (step 3: 9.50 vs 8.00) |"
            in md)
    assert "### scale 4x: B=8, 16 steps, 4,096 tokens per run" in md
    assert json.loads((tmp_path / "recipe_bench.json").read_text())["runs"][2]["ratio"] == 4.0


def test_iter_docs_reads_gzipped_rst_and_skips_html(rb, tmp_path):
    (tmp_path / "Documentation").mkdir()
    (tmp_path / "Documentation" / "a.rst.gz").write_bytes(gzip.compress("Linux kernel release 6.x\n".encode()))
    (tmp_path / "Documentation" / "b.txt").write_text("plain text\n")
    (tmp_path / "html" / "_sources").mkdir(parents=True)
    (tmp_path / "html" / "c.txt").write_text("html copy\n")
    (tmp_path / "html" / "_sources" / "d.rst.txt").write_text("sphinx source\n")
    assert sorted(rb.iter_docs(tmp_path)) == ["Linux kernel release 6.x", "plain text"]
    assert list(rb.iter_docs(tmp_path, html_sources=True)) == ["sphinx source"]


def test_seconds_to_the_target_from_the_steps_wall_times(rb, tmp_path):
    """Seconds to the baseline's final val loss: the steps' own wall times (dt_ms) summed up to the tokens at which
    the val curve reaches the target (linear within a step); the ratio is the baseline run's whole training time
    over it."""
    def write(name, per_step, dts, vals):
        d = tmp_path / name
        d.mkdir()
        recs = [{"run": {"tokens_per_step": per_step}}, {"step": 0, "val_loss": 10.0}]
        recs += [{"step": i + 1, "loss": 9.0, "dt_ms": dt} for i, dt in enumerate(dts)]
        recs += [{"step": s, "val_loss": v} for s, v in vals]
        (d / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in recs) + "\n")
        return d
    base = write("base", 100, [500.0] * 4, [(2, 8.0), (4, 7.0)])  # 400 tokens in 2.0 s, final 7.0
    fast = write("fast", 200, [1000.0, 3000.0], [(1, 7.5), (2, 6.0)])  # 400 tokens in 4.0 s
    assert rb.seconds_curve(base) == [(0, 0.0), (100, 0.5), (200, 1.0), (300, 1.5), (400, 2.0)]
    assert rb.seconds_at(rb.seconds_curve(fast), 300) == pytest.approx(2.5)  # halfway through the second step
    assert rb.seconds_at(rb.seconds_curve(fast), None) is None and rb.seconds_at(rb.seconds_curve(fast), 401) is None
    runs = [{"label": "gpt2", "scale": 1, "seed": 1, "curve": rb.val_curve(base), "final_val": 7.0, "tokens": 400,
             "spikes": [], "seconds_curve": rb.seconds_curve(base)},
            {"label": "m", "scale": 1, "seed": 1, "curve": rb.val_curve(fast), "final_val": 6.0, "tokens": 400,
             "spikes": [], "seconds_curve": rb.seconds_curve(fast)}]
    summary = rb.summarize(runs)
    m = runs[1]
    assert m["tokens_to_target"] == pytest.approx(200 + 200 / 3)  # 7.5 -> 6.0 over 200 tokens; 7.0 a third in
    assert m["seconds_to_target"] == pytest.approx(1.0 + 3.0 / 3)
    assert m["seconds_ratio"] == pytest.approx(2.0 / 2.0) and m["ratio"] == pytest.approx(400 / (800 / 3))
    assert summary[1]["seconds_ratio"] == (pytest.approx(1.0), 0.0)


def test_accumulation_rows_train_the_same_tokens(rb):
    """A row's micro-steps per optimizer step, as gpt2core-train settles them: its last --total-batch-tokens, else
    its recipe's rule (modern: until Newton-Schulz is --newton-schulz-share of the step's FLOPs), else 1; a total
    that is not a multiple of B*T is refused."""
    from gpt2core.config import TrainConfig, get_preset, modern_config
    assert rb.accumulation("s4", ["--recipe", "gpt2"], 4, 128) == 1
    assert rb.accumulation("s4", ["--recipe", "gpt2", "--total-batch-tokens", "2048"], 4, 128) == 4
    assert rb.accumulation("s4", ["--total-batch-tokens", "1024", "--total-batch-tokens", "4096"], 4, 128) == 8
    assert rb.accumulation("s4", ["--recipe", "modern", "--total-batch-tokens", "512"], 4, 128) == 1
    # the modern recipe's rule, from the FLOPs: s4 at T=128: Newton-Schulz 20.1 GFLOP per step, 97 MFLOP per token
    m = modern_config(get_preset("s4"))
    assert m.newton_schulz_flops(5) == 5 * 4 * (4 * (6 * 256 ** 3) + 2 * (4 * 256 ** 2 * 1024 + 2 * 256 ** 3))
    need = m.newton_schulz_flops(5) / (0.2 * m.flops_per_token(128))
    assert 1024 < need <= 1536
    assert rb.accumulation("s4", ["--recipe", "modern"], 4, 128) == 3
    assert rb.accumulation("s4", ["--recipe", "modern", "--newton-schulz-share", "1"], 4, 128) == 1
    assert rb.accumulation("s4", ["--recipe", "modern", "--optimizer", "adamw"], 4, 128) == 1
    assert TrainConfig.from_recipe("modern").newton_schulz_share == 0.2
    with pytest.raises(SystemExit, match="not a multiple of B\\*T = 512"):
        rb.accumulation("s4", ["--total-batch-tokens", "700"], 4, 128)


def test_modern_fraction_and_tokens_runs_get_their_own_steps_and_folders(rb, tmp_path, monkeypatch):
    """--modern-fraction 0.5 with --modern-tokens 512 1536: the GPT-2 row trains --steps micro-batches, each modern
    variant half of them (its optimizer steps: those micro-batches over its tokens per step, rounded up), every run
    in a folder of its own (two variants in one folder would overwrite each other's run), and a fraction outside
    (0, 1] is refused naming the flag. gpt2core-train is stood in for: it writes the metrics a run would."""
    data = tmp_path / "data"
    data.mkdir()
    (data / "x_val_000000.bin").write_bytes(b"")
    calls = []

    def fake_run(cmd, **kw):
        if "gpt2core.train" in cmd:
            args = cmd[cmd.index("gpt2core.train") + 1:]
            steps, out = int(args[args.index("--steps") + 1]), Path(args[args.index("--output-dir") + 1])
            tps = 512 * (3 if "--total-batch-tokens" not in args and "modern" in args else 1)
            if "--total-batch-tokens" in args:
                tps = int(args[args.index("--total-batch-tokens") + 1])
            calls.append((str(out.relative_to(tmp_path / "o")), steps, tps))
            recs = [{"run": {"tokens_per_step": tps}}]
            recs += [{"step": s, "loss": 5.0, "dt_ms": 100.0, "tok_per_s": 1.0} for s in range(1, steps + 1)]
            recs += [{"step": steps, "val_loss": 4.0 + steps / 100}]
            (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
        return type("R", (), {"returncode": 0, "stdout": ""})()

    monkeypatch.setattr(rb.subprocess, "run", fake_run)
    common = ["--data-dir", str(data), "--out", str(tmp_path / "o"), "--preset", "s4", "-B", "4", "-T", "128",
              "--steps", "12", "--val-every", "4", "--seeds", "7", "--scales", "1", "--only", "gpt2", "modern"]
    assert rb.main([*common, "--modern-tokens", "512", "1536", "--modern-fraction", "0.5"]) == 0
    assert [(steps, tps) for _, steps, tps in calls] == [(12, 512), (6, 512), (2, 1536)]
    assert len({folder for folder, _, _ in calls}) == 3
    summary = json.loads((tmp_path / "o" / "recipe_bench.json").read_text())["summary"]
    assert [s["tokens"] for s in summary] == [6144, 3072, 3072]
    for bad in ("0", "1.5", "-0.5"):
        with pytest.raises(SystemExit):
            rb.main([*common, "--modern-fraction", bad])
