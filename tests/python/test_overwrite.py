"""--overwrite never destroys a run for a run that cannot start (issue 46, item 1).

A finished run (model.bin, metrics.jsonl, run.json, checkpoints/) sits in `out`; a new command with --overwrite and
one bad input of each kind (arguments, data shards, SFT conversations, the --init weights, the plan, the machine's
memory, HellaSwag and CORE inputs, the device) must fail with one line and leave every file of the old run byte for
byte as it was, the --init source included when it is the old run's own model.bin. A good --overwrite run whose
--init is that model.bin reads the weights before the folder is cleared: it trains exactly what the same command
trains from a copy of the file elsewhere."""
import json
import os
import shutil
from pathlib import Path

import pytest

from gpt2core import train
from gpt2core.training import trainer

from test_run_folder import BASE, data  # noqa: E402,F401  (data: the shards fixture, shared)


@pytest.fixture(scope="module")
def finished(data, tmp_path_factory):
    """A finished run with checkpoints: the folder every case copies and then tries to overwrite."""
    out = tmp_path_factory.mktemp("finished") / "run"
    train.main(BASE + ["--data-dir", str(data), "--output-dir", str(out), "--steps", "2", "--checkpoint-every", "1"])
    assert (out / "model.bin").is_file() and (out / "checkpoints").is_dir()
    return out


def snapshot(folder: Path) -> dict:
    """Every file under folder (the lock file aside: it is the folder's, not the run's) -> its bytes."""
    return {p.relative_to(folder): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file() and not p.name.startswith(".")}


def conversations(path: Path, n: int = 30) -> Path:
    with open(path, "w") as f:
        for i in range(n):
            f.write(json.dumps({"messages": [{"role": "user", "content": f"{i} plus {i}?"},
                                             {"role": "assistant", "content": f"{2 * i}"}]}) + "\n")
    return path


def _bad_shard_dir(tmp: Path, data: Path) -> Path:
    d = tmp / "badshards"
    d.mkdir()
    shutil.copy(data / "t_val_000000.bin", d)
    raw = bytearray((data / "t_train_000001.bin").read_bytes())
    raw[0:4] = (12345).to_bytes(4, "little")  # not a shard's magic
    (d / "t_train_000001.bin").write_bytes(bytes(raw))
    return d


def _bad_sft(tmp: Path, data: Path) -> Path:
    p = tmp / "bad.jsonl"
    p.write_text(json.dumps("a string, not an object") + "\n")  # the file: line 1 is a JSON string
    return p


# (id, extra flags given `out` (the old run), the data dir and a scratch dir; the words the one line must hold).
# Those marked `late` were checked only after the old run was removed before the fix (they failed then).
CASES = [
    ("sft-line-not-an-object-init-from-the-run", lambda out, data, tmp: [
        "--sft", _bad_sft(tmp, data), "--init", out / "model.bin"], "messages", True),
    ("sft-bad-role-init-from-a-checkpoint-of-the-run", lambda out, data, tmp: [
        "--sft", _write(tmp / "role.jsonl", '{"messages": [{"role": "bot", "content": "x"}]}\n'),
        "--init", out / "checkpoints" / "step_000002"], "messages[0].role", True),
    ("data-dir-without-shards", lambda out, data, tmp: [
        "--data-dir", _mkdir(tmp / "empty")], "empty", True),
    ("data-shard-damaged", lambda out, data, tmp: [
        "--data-dir", _bad_shard_dir(tmp, data)], "t_train_000001.bin", True),
    ("plan-val-steps-beyond-the-val-data", lambda out, data, tmp: [
        "--data-dir", data, "--val-every", "1", "--val-steps", "1000"], "--val-steps 1000", True),
    ("hellaswag-file-damaged", lambda out, data, tmp: [
        "--data-dir", data, "--hellaswag-every", "1", "--hellaswag-path", _write(tmp / "hs.txt", "one line\n")],
        "hs.txt", True),
    ("core-every-without-bundle", lambda out, data, tmp: [
        "--data-dir", data, "--core-every", "1"], "--core-bundle", True),
    ("init-not-a-model", lambda out, data, tmp: [
        "--data-dir", data, "--init", _write(tmp / "junk.bin", "not a model file\n")], "junk.bin", False),
    ("argument-T-beyond-the-init-models-block-size", lambda out, data, tmp: [
        "--sft", conversations(tmp / "c.jsonl"), "--init", out / "model.bin", "-T", "1024"], "-T 1024", False),
    ("argument-total-batch-not-a-multiple", lambda out, data, tmp: [
        "--data-dir", data, "--total-batch-tokens", "17"], "--total-batch-tokens 17", False),
    ("device-not-on-this-machine", lambda out, data, tmp: [
        "--data-dir", data, "--device", "cuda:7"], "cuda", False),
]


def _write(p: Path, text: str) -> Path:
    p.write_text(text)
    return p


def _mkdir(p: Path) -> Path:
    p.mkdir()
    return p


@pytest.mark.parametrize("flags,needle", [c[1:3] for c in CASES], ids=[c[0] for c in CASES])
def test_overwrite_with_a_bad_input_leaves_the_old_run_byte_for_byte(finished, data, tmp_path, flags, needle):
    out = tmp_path / "run"
    shutil.copytree(finished, out)
    before = snapshot(out)
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    argv = [*BASE, "--output-dir", out, "--steps", "3", "--overwrite", *flags(out, data, scratch)]
    if "--data-dir" not in argv and "--sft" not in argv:
        argv += ["--data-dir", data]
    with pytest.raises(SystemExit) as e:
        train.main([str(a) for a in argv])
    assert needle in str(e.value), e.value
    after = snapshot(out)
    assert sorted(after) == sorted(before), "files of the old run went or came"
    assert after == before, [str(k) for k in before if after.get(k) != before[k]]


def test_overwrite_beyond_the_machines_memory_leaves_the_old_run(finished, data, tmp_path, monkeypatch, capsys):
    """The memory check (weights, gradients and AdamW within RAM) runs before the folder is taken."""
    out = tmp_path / "run"
    shutil.copytree(finished, out)
    before = snapshot(out)
    monkeypatch.setattr(trainer, "_physical_memory", lambda: 16 * 2**20)
    with pytest.raises(SystemExit):
        train.main([*BASE, "--data-dir", str(data), "--output-dir", str(out), "--steps", "3", "--overwrite"])
    assert "more than this machine's 16.0 MiB" in capsys.readouterr().err
    assert snapshot(out) == before


def test_overwrite_whose_init_is_the_runs_own_model_reads_it_before_clearing(finished, tmp_path, capsys):
    """--sft --init out/model.bin --output-dir out --overwrite fine-tunes the old model: the same bytes as the
    same command with --init pointing at a copy of that file in another folder."""
    convs = conversations(tmp_path / "c.jsonl")
    sft = [*BASE, "--sft", str(convs), "--steps", "2", "--seed", "3"]
    copy = tmp_path / "copy.bin"
    shutil.copy(finished / "model.bin", copy)
    train.main(sft + ["--init", str(copy), "--output-dir", str(tmp_path / "elsewhere")])
    out = tmp_path / "run"
    shutil.copytree(finished, out)
    train.main(sft + ["--init", str(out / "model.bin"), "--output-dir", str(out), "--overwrite"])
    assert "--overwrite: removed the previous run" in capsys.readouterr().out
    assert (out / "model.bin").read_bytes() == (tmp_path / "elsewhere" / "model.bin").read_bytes()
    assert not (out / "checkpoints").exists()
    assert os.path.getsize(out / "model.bin") > 0
