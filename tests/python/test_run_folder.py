"""Nothing lost: a run folder belongs to one run, metrics.jsonl never tears, a shard truncated under a run is an
error naming it (never SIGBUS), preparations into one folder are serialised. Real faults where the kernel makes
them: a tmpfs of a few KiB in a private mount namespace (`unshare -m`, needs root), RLIMIT_FSIZE, a read-only bind
mount, a shard truncated while a run reads it, a second process holding the folder."""
import json
import os
import resource
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from gpt2core import plot, runfolder, train
from gpt2core.data.shards import write_shard
from gpt2core.runlock import RunLock

SHARED = Path(__file__).resolve().parents[2] / ".." / "shared" / "data"
BASE = ["--preset", "tiny", "-B", "1", "-T", "16", "--val-every", "0", "--sample-tokens", "0", "--warmup", "0",
        "--no-progress"]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    d = tmp_path_factory.mktemp("data")
    rng = np.random.default_rng(0)
    write_shard(d / "t_val_000000.bin", rng.integers(0, 50257, 3000))
    write_shard(d / "t_train_000001.bin", rng.integers(0, 50257, 200_000))
    return d


def cmd(name):
    here = Path(sys.executable).parent / name
    return str(here) if here.exists() else shutil.which(name)


def one_line(stderr: str) -> str:
    """The failure line: the last line, and no traceback anywhere."""
    assert "Traceback" not in stderr, stderr
    return stderr.strip().splitlines()[-1]


def records(path) -> list[dict]:
    """Every line of a metrics file parses (nothing torn)."""
    text = Path(path).read_text()
    assert text == "" or text.endswith("\n"), text[-200:]
    return [json.loads(line) for line in text.splitlines()]


def run_train(data, out, *extra):
    return train.main(BASE + ["--data-dir", str(data), "--output-dir", str(out), *map(str, extra)])


# ------------------------------------------------------------------------------------ one run per folder
def test_fresh_run_in_a_finished_run_folder_is_refused_and_overwrite_starts_clean(data, tmp_path, capsys):
    out = tmp_path / "out"
    run_train(data, out, "--steps", "2", "--checkpoint-every", "1")
    run_id = json.loads((out / "run.json").read_text())["run_id"]
    before = {p: p.read_bytes() for p in (out / "model.bin", out / "metrics.jsonl", out / "run.json")}
    with pytest.raises(SystemExit) as e:
        run_train(data, out, "--steps", "3", "--seed", "5")
    assert str(e.value) == (f"gpt2core-train: {out} holds another run (run {run_id}, at step 2 of 2, checkpoints up "
                            "to step 2, finished (model.bin)); continue it with --resume auto, start over with "
                            "--overwrite (deletes its model.bin, metrics.jsonl and checkpoints/), or choose another "
                            "--output-dir")
    assert {p: p.read_bytes() for p in before} == before  # nothing of the finished run touched
    (out / "run.json").unlink()  # a folder of an older version (no run.json): still recognised
    with pytest.raises(SystemExit, match=rf"{out} holds another run \(a run, at step 2, checkpoints up to step 2"):
        run_train(data, out, "--steps", "3")
    run_train(data, out, "--steps", "1", "--seed", "5", "--overwrite")
    assert not (out / "checkpoints").exists()  # the old run's checkpoints cannot be resumed by mistake
    recs = records(out / "metrics.jsonl")
    assert [r["step"] for r in recs if "loss" in r] == [1] and recs[0]["run"]["steps"] == 1
    assert json.loads((out / "run.json").read_text())["run_id"] != run_id
    with pytest.raises(SystemExit) as e:
        run_train(data, out, "--resume", "auto", "--overwrite")
    assert e.value.code == 2 and capsys.readouterr().err == (
        "gpt2core-train: error: --overwrite starts over and --resume auto continues: give one of them\n")


def test_resume_auto_refuses_another_runs_checkpoint_and_a_finished_run_without_checkpoints(data, tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    run_train(data, a, "--steps", "1", "--checkpoint-every", "1")
    run_train(data, b, "--steps", "2", "--checkpoint-every", "2", "--seed", "9")
    shutil.copytree(b / "checkpoints" / "step_000002", a / "checkpoints" / "step_000002")  # newer, of run b
    ids = {k: json.loads((k / "run.json").read_text())["run_id"] for k in (a, b)}
    with pytest.raises(SystemExit) as e:
        run_train(data, a, "--steps", "3", "--resume", "auto")
    assert (f"{a}/checkpoints/step_000002 belongs to run {ids[b]}, but {a} holds run {ids[a]} (run.json)"
            in str(e.value)), e.value
    c = tmp_path / "c"
    run_train(data, c, "--steps", "1")
    with pytest.raises(SystemExit, match=rf"{c} holds a finished run without checkpoints .*--resume auto has nothing "
                                         "to continue; start over with --overwrite"):
        run_train(data, c, "--steps", "2", "--resume", "auto")
    # the folder's own run continues
    shutil.rmtree(a / "checkpoints" / "step_000002")
    run_train(data, a, "--steps", "2", "--resume", "auto")
    assert [r["step"] for r in records(a / "metrics.jsonl") if "loss" in r] == [1, 2]


# ------------------------------------------------------------------------------------ metrics never tear
def test_append_line_is_whole_or_nothing_under_rlimit_fsize(tmp_path):
    """A real EFBIG: the line would cross RLIMIT_FSIZE; the file is cut back to its previous length."""
    p = tmp_path / "metrics.jsonl"
    p.write_text('{"step": 1}\n' * 80)  # 960 bytes
    code = (f"import resource; resource.setrlimit(resource.RLIMIT_FSIZE, (1000, 1000))\n"
            f"from gpt2core import runfolder\n"
            f"runfolder.append_line({str(p)!r}, '{{\"step\": 2, \"pad\": \"' + 'x' * 100 + '\"}}')\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "File too large (EFBIG)" in r.stderr and f"{p}: cannot append to" in r.stderr
    assert p.stat().st_size == 960 and len(records(p)) == 80


def test_readers_skip_a_torn_last_line(tmp_path):
    p = tmp_path / "run" / "metrics.jsonl"
    p.parent.mkdir()
    p.write_text('{"run": {"tokens_per_step": 16}}\n{"step": 1, "loss": 5.0}\n{"step": 2, "loss": 4.0}\n{"step": 3, "lo')
    assert [r.get("step") for r in runfolder.read_records(p)] == [None, 1, 2]
    assert plot.read_run(p.parent).series["loss"][0].tolist() == [1, 2]
    assert runfolder.whole_lines(p.read_bytes()).endswith(b'"loss": 4.0}\n')
    assert runfolder.whole_lines(b'{"st') == b""
    p.write_text('{"step": 1, "lo\n{"step": 2, "loss": 4.0}\n')  # torn in the middle: damage, not a write in flight
    with pytest.raises(runfolder.RunFolderError, match=r"metrics.jsonl: line 1: not valid JSON"):
        runfolder.read_records(p)


def test_efbig_stops_the_run_with_one_line_and_whole_lines(data, tmp_path):
    """RLIMIT_FSIZE (a real EFBIG): metrics.jsonl reaches the limit mid-run; the run stops with one line that
    names the file and says whether a checkpoint could be written (here not: model.bin is over the limit too)."""
    out = tmp_path / "out"
    limit = 4000  # the run record (every TrainConfig field) plus more than 5 step lines

    def lim():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    r = subprocess.run([cmd("gpt2core-train"), *BASE, "--steps", "200", "--data-dir", data, "--output-dir", out,
                        "--checkpoint-every", "1000"], capture_output=True, text=True, timeout=300, preexec_fn=lim)
    line = one_line(r.stderr)
    assert r.returncode == 1, r.stderr
    assert line.startswith(f"gpt2core-train: {out}/metrics.jsonl: cannot append to: File too large (EFBIG); it needs"), line
    assert "; the run stopped after step " in line and "no checkpoint could be written either" in line
    assert "File too large (EFBIG)" in line.split("no checkpoint could be written either")[1]
    recs = records(out / "metrics.jsonl")  # whole lines only, up to the limit
    steps = [x["step"] for x in recs if "loss" in x]
    assert steps == list(range(1, len(steps) + 1)) and 5 < len(steps) < 200
    assert (out / "metrics.jsonl").stat().st_size <= limit


# ------------------------------------------------------------------------------------ namespaces (root)
def _unshare_ok() -> bool:
    if os.geteuid() != 0 or not shutil.which("unshare"):
        return False
    r = subprocess.run(["unshare", "-m", "sh", "-c", "mount -t tmpfs -o size=4k tmpfs /mnt"], capture_output=True)
    return r.returncode == 0


needs_unshare = pytest.mark.skipif(not _unshare_ok(), reason="needs root and unshare -m (a private mount namespace)")


def in_namespace(script: str, timeout=300):
    return subprocess.run(["unshare", "-m", "sh", "-c", "set -e; mount --make-rprivate / 2>/dev/null || true; "
                           + script], capture_output=True, text=True, timeout=timeout)


@needs_unshare
def test_full_disk_stops_after_a_checkpoint_and_resume_continues(data, tmp_path):
    """The output folder on an 8 KiB tmpfs (full after the lock and run.json), the checkpoints on a real disk
    (a bind mount): the metrics append fails with ENOSPC, the run stops after one step with a checkpoint and one
    line, and --resume auto from that checkpoint continues to the end."""
    out, ckpts, keep = tmp_path / "out", tmp_path / "ckpts", tmp_path / "keep"
    for d in (out, ckpts, keep):
        d.mkdir()
    train_cmd = " ".join(map(str, [cmd("gpt2core-train"), *BASE, "--steps", "3", "--data-dir", data,
                                   "--output-dir", out]))
    r = in_namespace(f"mount -t tmpfs -o size=8k tmpfs {out}; mkdir {out}/checkpoints; "
                     f"mount --bind {ckpts} {out}/checkpoints; set +e; {train_cmd}; rc=$?; "
                     f"cp {out}/metrics.jsonl {keep}/; exit $rc")
    line = one_line(r.stderr)
    assert r.returncode == 1, r.stderr
    assert line.startswith(f"gpt2core-train: {out}/metrics.jsonl: cannot append to: No space left on device "
                           "(ENOSPC); it needs"), line
    assert line.endswith(f"the run stopped after step 1 of 3: checkpoint {out}/checkpoints/step_000001 written; fix "
                         "that, then continue with --resume auto"), line
    records(keep / "metrics.jsonl")  # nothing torn
    again = tmp_path / "again"
    again.mkdir()
    shutil.copytree(ckpts, again / "checkpoints")
    run_train(data, again, "--steps", "3", "--resume", "auto")
    assert [x["step"] for x in records(again / "metrics.jsonl") if "loss" in x] == [2, 3]
    assert (again / "model.bin").exists()


@needs_unshare
def test_read_only_output_folder_and_full_disk_preparations_are_one_line(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    train_ = cmd("gpt2core-train")
    r = in_namespace(f"mount --bind {ro} {ro}; mount -o remount,bind,ro {ro}; set +e; "
                     f"{train_} --output-dir {ro} --steps 1; echo rc=$? >&2; "
                     f"{train_} --output-dir {ro}/sub --steps 1; echo rc=$? >&2")
    lines = r.stderr.strip().splitlines()
    assert "Traceback" not in r.stderr, r.stderr
    assert lines == [f"gpt2core-train: {ro}/gpt2core.lock: Read-only file system (EROFS)", "rc=1",
                     f"gpt2core-train: {ro}/sub: Read-only file system (EROFS)", "rc=1"], r.stderr
    full = tmp_path / "full"
    full.mkdir()
    fw = SHARED / "fineweb" / "fineweb_edu_sample5.jsonl"
    hs = SHARED / "hellaswag" / "hellaswag_val_subset1000.jsonl"
    py = sys.executable
    r = in_namespace(f"mount -t tmpfs -o size=8k tmpfs {full}; set +e; "
                     f"{py} -m gpt2core.data fineweb --input {fw} --out-dir {full}/fw --shard-size 2000 -j 1 "
                     f"--no-progress; echo rc=$? >&2; "
                     f"{py} -m gpt2core.data hellaswag --input {hs} --out {full}/h.npz; echo rc=$? >&2")
    assert "Traceback" not in r.stderr, r.stderr
    err = [x for x in r.stderr.strip().splitlines() if x.startswith(("python -m", "rc="))]
    assert err[0].startswith(f"python -m gpt2core.data: {full}/fw/edufineweb_val_000000.bin: cannot write: No space "
                             "left on device (ENOSPC)") and err[1] == "rc=1", r.stderr
    assert err[2].startswith(f"python -m gpt2core.data: {full}/h.npz: cannot write: No space left on device "
                             "(ENOSPC)") and err[3] == "rc=1", r.stderr


def test_lock_file_that_is_a_directory_is_one_line(tmp_path):
    (tmp_path / "gpt2core.lock").mkdir()
    r = subprocess.run([cmd("gpt2core-train"), "--output-dir", tmp_path, "--steps", "1"], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 1 and one_line(r.stderr) == f"gpt2core-train: {tmp_path}/gpt2core.lock: Is a directory (EISDIR)"


# ------------------------------------------------------------------------------------ shards under a run
def test_a_shard_truncated_under_a_running_run_is_an_error_naming_it_with_a_checkpoint(tmp_path):
    d = tmp_path / "data"
    rng = np.random.default_rng(1)
    write_shard(d / "t_val_000000.bin", rng.integers(0, 50257, 3000))
    shard = write_shard(d / "t_train_000001.bin", rng.integers(0, 50257, 400_000))
    out = tmp_path / "out"
    p = subprocess.Popen([cmd("gpt2core-train"), *BASE, "--steps", "100000", "--data-dir", d, "--output-dir", out],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        for line in p.stdout:
            if line.startswith("step     3/"):
                break
        os.truncate(shard, 1024 + 2 * 100)  # in place, as a re-run preparation or a shared file system does
        _, err = p.communicate(timeout=120)
    finally:
        p.kill()
    assert p.returncode == 1, (p.returncode, err)  # never -SIGBUS
    line = one_line(err)
    assert line.startswith(f"gpt2core-train: {shard}: the shard shrank while in use: it had 801,024 bytes when "
                           "opened, now 1,224"), line
    assert f"; the run stopped after step " in line and f"checkpoint {out}/checkpoints/step_" in line, line
    step = int(line.split("; the run stopped after step ")[1].split()[0])
    ck = out / "checkpoints" / f"step_{step:06d}"
    assert (ck / "manifest.json").exists()
    assert [x["step"] for x in records(out / "metrics.jsonl") if "loss" in x] == list(range(1, step + 1))


# ------------------------------------------------------------------------------------ two processes at once
def test_a_second_preparation_into_the_same_folder_is_refused(tmp_path):
    out = tmp_path / "fw"
    fw = SHARED / "fineweb" / "fineweb_edu_sample5.jsonl"
    with RunLock(out, what="preparation"):  # this process is the first preparation
        r = subprocess.run([sys.executable, "-m", "gpt2core.data", "fineweb", "--input", fw, "--out-dir", out,
                            "-j", "1", "--no-progress"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 1
    assert one_line(r.stderr).startswith(f"error: {out} is in use by another gpt2core preparation (pid {os.getpid()}")
    assert not list(out.glob("*.bin"))


def test_an_input_without_text_is_an_error_not_zero_shards(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    r = subprocess.run([sys.executable, "-m", "gpt2core.data", "fineweb", "--input", empty, "--out-dir",
                        tmp_path / "o", "-j", "1", "--no-progress"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 1
    assert one_line(r.stderr) == f"error: the input holds no text (0 documents, 0 tokens): no shards written to {tmp_path}/o"
