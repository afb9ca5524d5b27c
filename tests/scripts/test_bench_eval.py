"""scripts/bench.py --eval (bench_eval.py): one small run of CORE's and lm-eval's scoring speed, whose lm-eval task
holds the same items CORE scores. The figures themselves are not checked (speed is measured, never asserted)."""
import json
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
sys.path.insert(0, str(SCRIPTS))
import bench  # noqa: E402
import bench_eval as be  # noqa: E402


def test_eval_bench_runs_and_prints_the_core_row(capsys):
    args = bench.build_parser().parse_args(["--eval", "--preset", "tiny", "--threads", "1", "--eval-items", "2",
                                            "--eval-harness", "none"])
    r = be.eval_bench(args)
    out = capsys.readouterr().out
    assert r["items"] == 2 and r["core_items_per_s"] > 0
    assert "2 HellaSwag items" in out and "CORE (gpt2core.core_eval)" in out


def test_lm_eval_task_holds_the_items_core_scores(tmp_path):
    pytest.importorskip("lm_eval")
    items, task = be.load_task(be.DEFAULT_DATA, 3)
    name = be.write_lm_eval_task(items, tmp_path)
    rows = [json.loads(line) for line in (tmp_path / f"{name}.jsonl").read_text().splitlines()]
    assert [(r["text"], r["choices"], r["label"]) for r in rows] == \
        [(t["query"], t["choices"], t["gold"]) for t in task.items]
    assert f"task: {name}" in (tmp_path / f"{name}.yaml").read_text()
    assert (task.task_type, task.num_fewshot, task.delimiter) == ("multiple_choice", 0, " ")
