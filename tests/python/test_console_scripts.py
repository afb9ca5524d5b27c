"""The installed console scripts (pyproject.toml [project.scripts]) run as a user runs them: as commands,
checked by exit status. A successful run exits 0 and prints nothing to stderr but progress; a failure exits
non-zero with the reason."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from gpt2core import GPT2
from gpt2core.data import shakespeare


def command(name: str) -> str:
    """The installed script: beside this Python (a venv's bin/) or on PATH (pip install into /usr/local)."""
    here = Path(sys.executable).parent / name
    found = str(here) if here.exists() else shutil.which(name)
    assert found, f"console script {name} is not installed (pip install . puts it beside {sys.executable})"
    return found


def run(name, *args):
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    return subprocess.run([command(name), *map(str, args)], capture_output=True, text=True, timeout=300, env=env)


@pytest.fixture(scope="module")
def model_file(tmp_path_factory):
    return GPT2("tiny", seed=1).save(tmp_path_factory.mktemp("m") / "tiny.bin")


def test_train_exits_0_after_a_run(tmp_path):
    data = shakespeare.prepare(tmp_path / "data")[0].parent
    p = run("gpt2core-train", "--preset", "tiny", "--data-dir", data, "-B", "2", "-T", "16", "--steps", "2",
            "--val-every", "0", "--sample-tokens", "0", "--output-dir", tmp_path / "out")
    assert p.returncode == 0, p.stdout + p.stderr
    assert "step" in p.stdout and "{" not in p.stderr   # no metrics dict dumped by sys.exit
    assert (tmp_path / "out" / "model.bin").exists()


def test_generate_exits_0_and_prints_only_the_text(model_file):
    p = run("gpt2core-generate", "Hello", "--model", model_file, "--max-new-tokens", "3")
    assert p.returncode == 0, p.stdout + p.stderr
    assert p.stdout.startswith("Hello")
    assert "tokens/s" in p.stderr and len(p.stderr.strip().splitlines()) == 1  # only the speed line


def test_eval_exits_0(model_file, tmp_path):
    from gpt2core.data.shards import write_shard
    import numpy as np
    write_shard(tmp_path / "x_val_000000.bin", np.random.default_rng(0).integers(0, 50257, 500).astype(np.uint16))
    p = run("gpt2core-eval", "val", "--checkpoint", model_file, "--data-dir", tmp_path, "-B", "2", "-T", "16",
            "--steps", "2")
    assert p.returncode == 0, p.stdout + p.stderr
    assert p.stdout.startswith("val loss")


def test_failures_exit_non_zero_with_the_reason(tmp_path):
    bad = tmp_path / "bad.bin"
    bad.write_bytes(b"\0" * 100)
    p = run("gpt2core-generate", "--model", bad)
    assert p.returncode != 0 and "bad.bin" in p.stderr
    p = run("gpt2core-eval", "val", "--checkpoint", bad, "--data-dir", tmp_path)
    assert p.returncode == 1 and "bad.bin" in p.stderr
