"""scripts/recipe_bench.py's bookkeeping (the benchmark itself is run by hand, never timed in a test): tokens to
reach a target by linear interpolation between evaluations, the ablation's rows, and the prepared text."""
import gzip
import importlib.util
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
    from gpt2core import train
    rows = rb.rows(warmup=5)
    cfgs = [train.parse_args(["--preset", "s4", *flags]).to_dict() for _, flags in rows]
    diffs = [sorted(k for k in cfgs[i] if cfgs[i][k] != cfgs[i - 1][k] and k != "recipe") for i in range(1, len(rows))]
    assert [label for label, _ in rows][0] == "gpt2" and "(control)" in rows[1][0]
    assert diffs == [["beta1", "lr", "weight_decay"], ["position"], ["no_bias", "norm", "qk_norm"], ["activation"],
                     ["logit_softcap", "untied", "zero_init_proj"], ["optimizer"],
                     ["min_lr_frac", "schedule", "warmup"]]
    assert rows[-1][1] == ["--recipe", "modern"] and cfgs[-1]["recipe"] == "modern"
    assert cfgs[0]["warmup"] == 5 and cfgs[-1]["warmup"] == 0
    models = [train.parse_args(["--preset", "s4", *flags]).model_config() for _, flags in rows]
    assert models[0].is_gpt2 and models[-2] == models[-1]


def test_report_tokens_to_target_and_ratio(rb, tmp_path):
    """write_report: the tokens each row needs to reach the GPT-2 row's and the control's final val loss, the
    ratios, a row that never reaches them, and the JSON beside the table."""
    import argparse
    import json
    a = argparse.Namespace(preset="s4", batch_size=2, seq_len=256, steps=4, out=tmp_path)
    res = [{"label": "gpt2", "curve": [(0, 11.0), (512, 9.0), (1024, 8.0)], "final_val": 8.0, "tokens": 1024,
            "tok_per_s": 100.0, "seconds": 10.0},
           {"label": "x (control)", "curve": [(0, 11.0), (512, 8.0), (1024, 7.0)], "final_val": 7.0, "tokens": 1024},
           {"label": "never", "curve": [(0, 11.0), (1024, 8.5)], "final_val": 8.5, "tokens": 1024}]
    rb.write_report(a, res)
    assert res[0]["ratio"] == 1.0 and res[1]["tokens_to_target"] == 512 and res[1]["ratio"] == 2.0
    assert res[1]["ratio_to_control"] == 1.0 and res[0]["tokens_to_control"] is None
    assert res[2]["tokens_to_target"] is None and res[2]["ratio"] is None
    md = (tmp_path / "recipe_bench.md").read_text()
    assert "| x (control) | 7.0000 | 512 (2.00x) | 1,024 (1.00x) | - | - |" in md
    assert "| never | 8.5000 | not reached | not reached |" in md and "| 100 | 10 |" in md
    assert json.loads((tmp_path / "recipe_bench.json").read_text())[1]["ratio"] == 2.0


def test_iter_docs_reads_gzipped_rst_and_skips_html(rb, tmp_path):
    (tmp_path / "Documentation").mkdir()
    (tmp_path / "Documentation" / "a.rst.gz").write_bytes(gzip.compress("Linux kernel release 6.x\n".encode()))
    (tmp_path / "Documentation" / "b.txt").write_text("plain text\n")
    (tmp_path / "html").mkdir()
    (tmp_path / "html" / "c.txt").write_text("html copy\n")
    assert sorted(rb.iter_docs(tmp_path)) == ["Linux kernel release 6.x", "plain text"]
