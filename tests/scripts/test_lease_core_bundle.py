"""scripts/lease_core_bundle.py: a CORE bundle from HellaSwag's items and tiny Shakespeare that core_eval loads and
scores; every HellaSwag item is the source's (read here with json), every Shakespeare item a speech split at its
last word."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from gpt2core import GPT2
from gpt2core.evaluation.core_eval import evaluate_core, load_bundle

ROOT = Path(__file__).resolve().parents[2]
HS = ROOT / "tests" / "data" / "hellaswag_val_120.jsonl"


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    out = tmp_path_factory.mktemp("core")
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "lease_core_bundle.py"), "--hellaswag", str(HS),
                        "--out", str(out)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "120 items each" in r.stdout
    return out


def test_the_bundle_holds_the_sources_items(bundle):
    tasks = {t.label: t for t in load_bundle(bundle)}
    assert [(t, tasks[t].num_fewshot, tasks[t].random_baseline, tasks[t].task_type) for t in tasks] == [
        ("hellaswag_zeroshot", 0, 0.25, "multiple_choice"), ("hellaswag", 10, 0.25, "multiple_choice"),
        ("shakespeare_lambada", 0, 0.0, "language_modeling")]
    src = [json.loads(line) for line in HS.read_text().splitlines()]
    for label in ("hellaswag_zeroshot", "hellaswag"):
        assert [(i["query"], i["choices"], i["gold"]) for i in tasks[label].items] == \
            [(s["ctx"], s["endings"], int(s["label"])) for s in src]
    lm = tasks["shakespeare_lambada"].items
    text = (ROOT / "python" / "gpt2core" / "assets" / "tinyshakespeare.txt").read_text()
    flat = " ".join(text.split())
    assert len(lm) > 1000
    for it in lm[:50] + lm[-50:]:
        word = it["continuation"]
        assert word.startswith(" ") and word[1:].isalpha() and len(it["context"].split()) >= 19
        assert (it["context"] + word) in flat or it["context"] in flat  # the speech as the text has it


def test_core_scores_the_bundle(bundle):
    m = GPT2("tiny", seed=0)
    res = evaluate_core(m, bundle, max_per_task=3)
    assert set(res["tasks"]) == {"hellaswag_zeroshot", "hellaswag", "shakespeare_lambada"}
    assert all(t["n"] == 3 for t in res["tasks"].values()) and -1.0 <= res["core"] <= 1.0


def test_a_missing_hellaswag_file_is_a_one_line_error(tmp_path):
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "lease_core_bundle.py"), "--hellaswag",
                        str(tmp_path / "none.txt"), "--out", str(tmp_path / "o")], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode != 0 and "Traceback" not in r.stderr and "--hellaswag" in r.stderr.strip().splitlines()[-1]
