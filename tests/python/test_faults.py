"""Faults done for real: a disk that fills up (a small tmpfs in a private mount namespace, or RLIMIT_FSIZE)
or turns read-only while a checkpoint is written, permission denied, a save killed with SIGKILL, two
processes on one output folder; and the guards that keep NaN off the disk: hyperparameters out of range,
non-finite state, token ids beyond the vocabulary, loss / grad-norm outliers."""
import errno
import json
import math
import os
import resource
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from gpt2core import GPT2, GPT2Config, _C
from gpt2core import checkpoint as ck
from gpt2core.data.loader import DataLoader
from gpt2core.data.shards import ShardError, write_shard
from gpt2core.errors import WriteError, write_error
from gpt2core.outliers import OutlierDetector
from gpt2core.runlock import RunLock, RunLockedError

CFG = dict(block_size=16, vocab_size=97, padded_vocab_size=128, n_layer=2, n_head=2, n_embd=32)

# a child process: the same small trained model in every process (seeded), then what the test asks for
PRELUDE = textwrap.dedent(f"""
    import json, os, signal, sys
    import numpy as np
    from gpt2core import GPT2, GPT2Config, _C
    from gpt2core import checkpoint as ck
    from gpt2core.errors import WriteError
    _C.set_num_threads(1)

    def trained(steps=2):
        m = GPT2(GPT2Config(**{CFG!r}), seed=1)
        x = np.random.default_rng(0).integers(0, 97, (2, 16)).astype(np.int32)
        for _ in range(steps):
            m.zero_grad(); m.forward(x, np.roll(x, -1, 1)); m.backward(); m.step(1e-3)
        return m
""")


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny models on a shared machine: one thread avoids OpenMP barriers stalling; restored afterwards."""
    n = _C.get_num_threads()
    _C.set_num_threads(1)
    yield
    _C.set_num_threads(n)


def trained(steps=2):
    m = GPT2(GPT2Config(**CFG), seed=1)
    x = np.random.default_rng(0).integers(0, 97, (2, 16)).astype(np.int32)
    for _ in range(steps):
        m.zero_grad()
        m.forward(x, np.roll(x, -1, 1))
        m.backward()
        m.step(1e-3)
    return m


def run_child(code: str, *args, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", PRELUDE + textwrap.dedent(code), *map(str, args)],
                          capture_output=True, text=True, timeout=120, **kw)


def checkpoint_bytes() -> int:
    n = GPT2Config(**CFG).num_parameters()
    return 1024 + 4 * n + 2 * (128 + 4 * n)


def assert_intact(root, steps):
    """Only the complete checkpoints `steps` under root, each loadable, no temporary left behind."""
    assert sorted(os.listdir(root)) == [f"step_{s:06d}" for s in steps], os.listdir(root)
    for s in steps:
        ck.load_checkpoint(ck.checkpoint_dir(root, s)).restore(GPT2(GPT2Config(**CFG), init=False))


# ------------------------------------------------------------------------------------ disk faults
def test_file_size_limit_mid_checkpoint(tmp_path):
    """RLIMIT_FSIZE below the size of model.bin: the write fails part-way with EFBIG (Python ignores SIGXFSZ).
    The error names the file and the bytes needed; the previous checkpoint stays loadable; nothing is left."""
    ck.save_checkpoint(tmp_path, 2, trained(2))
    limit = 1024 + 4 * GPT2Config(**CFG).num_parameters() // 2
    r = run_child(f"""
        import resource
        m = trained(3)
        resource.setrlimit(resource.RLIMIT_FSIZE, ({limit}, {limit}))
        try:
            ck.save_checkpoint(sys.argv[1], 3, m)
        except WriteError as e:
            print(json.dumps({{"errno": e.errno, "msg": str(e)}}))
    """, tmp_path)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["errno"] == errno.EFBIG
    assert f"{tmp_path}/step_000003/model.bin: cannot write checkpoint: File too large (EFBIG); it needs " in out["msg"]
    needed = int(out["msg"].split("needs ")[1].split(" bytes")[0].replace(",", ""))
    assert checkpoint_bytes() < needed < checkpoint_bytes() + (64 << 10), out["msg"]
    assert_intact(tmp_path, [2])


# runs as root in a private mount namespace (unshare -m): a tmpfs of 600 KiB holds one checkpoint of ~370 KB
NAMESPACE_SCRIPT = """
    root = sys.argv[1]
    report = {}
    first = ck.save_checkpoint(root, 1, trained(1))
    free0 = os.statvfs(root).f_bavail
    # 1. the disk fills up during the second checkpoint
    try:
        ck.save_checkpoint(root, 2, trained(2))
    except WriteError as e:
        report["enospc"] = {"errno": e.errno, "msg": str(e)}
    report["after_enospc"] = sorted(os.listdir(root))
    report["free_restored"] = os.statvfs(root).f_bavail == free0
    # 2. a save killed (SIGKILL) after model.bin: its temporary folder fills the disk until cleaned
    pid = os.fork()
    if pid == 0:
        ck.save_flat = lambda *a: os.kill(os.getpid(), signal.SIGKILL)
        ck.save_checkpoint(root, 3, trained(3))
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    report["killed_by"] = os.WTERMSIG(status)
    report["left_behind"] = sorted(os.listdir(root))
    report["removed"] = [os.path.basename(p) for p in ck.remove_stale_temporaries(root)]
    report["free_after_clean"] = os.statvfs(root).f_bavail == free0
    # 3. the file system turns read-only
    import subprocess
    subprocess.run(["mount", "-o", "remount,ro", root], check=True)
    try:
        ck.save_checkpoint(root, 4, trained(4))
    except WriteError as e:
        report["erofs"] = {"errno": e.errno, "msg": str(e)}
    subprocess.run(["mount", "-o", "remount,rw", root], check=True)
    report["final"] = sorted(os.listdir(root))
    ck.load_checkpoint(first).restore(trained(0))
    print(json.dumps(report))
"""


def test_full_and_read_only_disk_in_a_private_tmpfs(tmp_path):
    if not shutil.which("unshare") or subprocess.run(["unshare", "-m", "true"], capture_output=True).returncode:
        pytest.skip("unshare -m is not permitted here (needs root or user namespaces)")
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    code = PRELUDE + textwrap.dedent(NAMESPACE_SCRIPT)
    r = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c",
                        f'mount -t tmpfs -o size=600k tmpfs "$1" || exit 77; exec "$0" -c "$2" "$1"',
                        sys.executable, str(mnt), code], capture_output=True, text=True, timeout=180)
    if r.returncode == 77:
        pytest.skip(f"cannot mount a tmpfs in a private namespace: {r.stderr.strip()}")
    assert r.returncode == 0, r.stderr
    rep = json.loads(r.stdout)
    assert rep["enospc"]["errno"] == errno.ENOSPC, rep
    msg = rep["enospc"]["msg"]
    assert msg.startswith(f"{mnt}/step_000002/") and "No space left on device (ENOSPC)" in msg, msg
    assert "; it needs " in msg and "free on that file system" in msg, msg
    assert rep["after_enospc"] == ["step_000001"] and rep["free_restored"], rep
    assert rep["killed_by"] == signal.SIGKILL
    stale = [n for n in rep["left_behind"] if n.startswith(".step_000003.tmp-")]
    assert len(stale) == 1 and rep["removed"] == stale and rep["free_after_clean"], rep
    assert rep["erofs"]["errno"] == errno.EROFS and f"{mnt}/step_000004" in rep["erofs"]["msg"], rep
    assert "check the permissions" in rep["erofs"]["msg"]
    assert rep["final"] == ["step_000001"]
    assert not (mnt / "step_000001").exists()  # the tmpfs was private to the child's namespace


def test_permission_denied(tmp_path):
    """EACCES for real: a process without the right to write the folder (as root: after dropping to nobody)."""
    root = tmp_path / "ro"
    ck.save_checkpoint(root, 1, trained(1))
    os.chmod(root, 0o555)
    os.chmod(tmp_path, 0o755)
    try:
        r = run_child("""
            m = trained(2)
            if os.geteuid() == 0:
                os.setgid(65534); os.setuid(65534)
            try:
                ck.save_checkpoint(sys.argv[1], 2, m)
            except WriteError as e:
                print(json.dumps({"errno": e.errno, "msg": str(e)}))
        """, root)
    finally:
        os.chmod(root, 0o755)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["errno"] == errno.EACCES and out["msg"].startswith(f"{root}/step_000002: cannot write checkpoint: "
                                                                   "Permission denied (EACCES)"), out
    assert f"check the permissions of {root}" in out["msg"]
    assert_intact(root, [1])


def test_write_error_message_for_io_errors(tmp_path):
    """EIO cannot be provoked without a failing device; the message it would get:"""
    e = write_error(OSError(errno.EIO, os.strerror(errno.EIO)), tmp_path / "step_000001" / "adam_m.npy", 3 << 20,
                    what="write checkpoint")
    assert isinstance(e, OSError) and e.errno == errno.EIO
    assert str(e) == (f"{tmp_path}/step_000001/adam_m.npy: cannot write checkpoint: Input/output error (EIO); it "
                      "needs 3,145,728 bytes (3.0 MiB)")


def test_checkpoints_are_written_without_memory_maps(tmp_path, monkeypatch):
    """No writer maps its output (a full disk under a memory map is SIGBUS, not an error); reading may."""
    def read_only(real):
        def open_map(*a, **k):
            assert k.get("mode", "r+") == "r", "a memory-mapped write"
            return real(*a, **k)
        return open_map
    monkeypatch.setattr(np.lib.format, "open_memmap", read_only(np.lib.format.open_memmap))
    monkeypatch.setattr(np, "memmap", read_only(np.memmap))
    d = ck.save_checkpoint(tmp_path, 1, trained(1))
    ck.load_checkpoint(d).restore(trained(0))


# ------------------------------------------------------------------------------------ the run-folder lock
LOCK_HOLDER = """
    import sys
    from gpt2core.runlock import RunLock
    with RunLock(sys.argv[1]):
        print("locked", flush=True)
        sys.stdin.readline()  # hold it until the test says so (or kills us)
"""


def test_run_lock_excludes_names_the_holder_and_is_taken_over_from_the_dead(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(LOCK_HOLDER), str(tmp_path)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "locked\n"
        with pytest.raises(RunLockedError) as e:
            RunLock(tmp_path).acquire()
        assert (f"{tmp_path} is in use by another gpt2core run (pid {holder.pid} on host {socket.gethostname()}"
                in str(e.value)), str(e.value)
        holder.kill()  # SIGKILL: no clean-up ran, the lock file still names it
        holder.wait()
        with RunLock(tmp_path) as lock:
            assert lock.previous["pid"] == holder.pid
            assert f"no longer running (pid {holder.pid} on host" in lock.describe_previous()
        # released on exit: a third run gets it cleanly
        with RunLock(tmp_path) as lock:
            assert lock.previous is None
    finally:
        holder.kill()
        holder.wait()


def test_run_lock_released_when_the_holder_exits_normally(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(LOCK_HOLDER), str(tmp_path)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline() == "locked\n"
    holder.communicate("\n", timeout=60)
    assert holder.returncode == 0
    with RunLock(tmp_path) as lock:
        assert lock.previous is None


# ------------------------------------------------------------------------------------ hyperparameters
@pytest.mark.parametrize("name,value", [("lr", math.inf), ("lr", math.nan), ("lr", -1e-3), ("weight_decay", math.nan),
                                        ("weight_decay", -0.1), ("beta1", 1.5), ("beta1", 1.0), ("beta2", -0.1),
                                        ("beta2", math.nan), ("eps", 0.0), ("eps", math.inf), ("grad_clip", math.nan),
                                        ("grad_clip", -1.0), ("lr", "1e-3"), ("lr", True)])
def test_step_rejects_bad_hyperparameters_up_front(name, value):
    m = trained(1)
    before = {k: v.copy() for k, v in m.params.items()}
    mom = [{k: a.copy() for k, a in d.items()} for d in m.opt_state()]
    x = np.random.default_rng(3).integers(0, 97, (2, 16)).astype(np.int32)
    m.zero_grad()
    m.forward(x, np.roll(x, -1, 1))
    m.backward()
    with pytest.raises(ValueError, match=rf"^{name} must be a finite number in .*got {value!r}"):
        m.step(**{"lr": 1e-3, name: value})
    assert m.step_count == 1
    for k, v in m.params.items():
        np.testing.assert_array_equal(v, before[k])
    for d, saved in zip(m.opt_state(), mom):
        for k in d:
            np.testing.assert_array_equal(d[k], saved[k])
    assert math.isfinite(m.step(lr=1e-3, grad_clip=None))  # the same gradients, good values: accepted


# ------------------------------------------------------------------------------------ token shards
def test_shard_ids_beyond_the_vocabulary_are_found_when_the_shard_is_opened(tmp_path, monkeypatch):
    rng = np.random.default_rng(0)
    good = rng.integers(0, 97, 2000).astype(np.uint16)
    bad = good.copy()
    bad[1234] = 97
    bad[1500] = 65535
    write_shard(tmp_path / "t_val_000000.bin", good)
    write_shard(tmp_path / "t_train_000001.bin", good)
    write_shard(tmp_path / "t_train_000002.bin", bad)
    calls = []
    from gpt2core.data import shards
    real = shards.check_tokens
    monkeypatch.setattr(shards, "check_tokens", lambda t, v, p, **kw: (calls.append(p.name), real(t, v, p, **kw))[1])
    dl = DataLoader(tmp_path, "train", 2, 16, shuffle=False, vocab_size=97)
    with pytest.raises(ShardError, match=rf"t_train_000002\.bin: token id 97 at token offset 1,234 \(byte "
                                         rf"{1024 + 2 * 1234:,}\) is not below the vocabulary size 97"):
        for _ in range(dl.batches_per_epoch):
            dl.next_batch()
    assert calls == ["t_train_000001.bin", "t_train_000002.bin"]  # each shard checked once, when opened
    assert dl.step == (1999 // 32)  # every batch of the good shard was served first
    dl = DataLoader(tmp_path, "train", 2, 16, shuffle=False, vocab_size=98)
    with pytest.raises(ShardError, match="token id 65535 at token offset 1,500"):
        for _ in range(2 * dl.batches_per_epoch):
            dl.next_batch()


# ------------------------------------------------------------------------------------ outliers
def test_outlier_z_scores_match_numpy_over_the_previous_window():
    rng = np.random.default_rng(0)
    xs = 3.0 + 0.1 * rng.standard_normal(300)
    xs[[150, 260]] = [4.5, 2.0]  # a spike and a dip
    det = OutlierDetector(window=64)
    zs = np.array([det.update(x) for x in xs])
    assert np.isnan(zs[:64]).all()
    ref = np.array([(xs[i] - xs[i - 64:i].mean()) / xs[i - 64:i].std() for i in range(64, 300)])
    np.testing.assert_allclose(zs[64:], ref, rtol=1e-12)
    flagged = np.nonzero(np.abs(zs) > 5)[0].tolist()
    assert flagged == [150, 260], flagged
    assert det.update(math.nan) == math.inf and len(det.values) == 64  # non-finite: flagged, not kept
    # the window survives a checkpoint exactly (JSON), so a resumed run flags the same steps
    again = OutlierDetector(window=64)
    again.load_state_dict(json.loads(json.dumps(det.state_dict())))
    assert [again.update(x) for x in xs[:20]] == [det.update(x) for x in xs[:20]]
