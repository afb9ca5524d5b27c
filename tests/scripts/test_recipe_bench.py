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
    rows = rb.rows(with_arch=False)
    labels = [label for label, _ in rows]
    assert labels[0] == "gpt2" and labels[-2:] == ["+ Muon", "+ WSD schedule"]
    muon, wsd = rows[-2][1], rows[-1][1]
    assert "muon" in muon and wsd[:len(muon)] == muon and "wsd" in wsd[len(muon):]
    with_arch = [label for label, _ in rb.rows(with_arch=True)]
    assert "+ modern architecture" in with_arch and with_arch[-1].endswith("(= modern)")


def test_iter_docs_reads_gzipped_rst_and_skips_html(rb, tmp_path):
    (tmp_path / "Documentation").mkdir()
    (tmp_path / "Documentation" / "a.rst.gz").write_bytes(gzip.compress("Linux kernel release 6.x\n".encode()))
    (tmp_path / "Documentation" / "b.txt").write_text("plain text\n")
    (tmp_path / "html").mkdir()
    (tmp_path / "html" / "c.txt").write_text("html copy\n")
    assert sorted(rb.iter_docs(tmp_path)) == ["Linux kernel release 6.x", "plain text"]
