"""Progress output: tqdm bars on stderr only on a terminal (a real pseudo-terminal here) and not with
--no-progress; elapsed / ETA arithmetic of the training log line."""
import fcntl
import os
import pty
import struct
import subprocess
import sys
import termios
from pathlib import Path

from gpt2core.progress import eta, hms

SUBSET = Path(__file__).resolve().parents[1] / "data" / "hellaswag_val_120.jsonl"


def stderr_of(args, tty: bool, cwd) -> str:
    """Run `python -m args...` with stderr on a pseudo-terminal (tty) or a pipe; returns what it wrote."""
    cmd = [sys.executable, "-m", *map(str, args)]
    if not tty:
        p = subprocess.run(cmd, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, timeout=300)
        assert p.returncode == 0, p.stderr
        return p.stderr
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # 24 x 100, as a terminal has
    p = subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.DEVNULL, stderr=slave)
    os.close(slave)
    chunks = []
    while True:  # read as it comes (a full pty buffer would block the child) until the child closes it
        try:
            data = os.read(master, 4096)
        except OSError:  # EIO: the child exited and closed the slave
            break
        if not data:
            break
        chunks.append(data)
    os.close(master)
    out = b"".join(chunks).decode(errors="replace")
    assert p.wait(timeout=300) == 0, out
    return out


def test_hellaswag_preparation_bar_only_on_a_terminal(tmp_path):
    args = ["gpt2core.data", "hellaswag", "--input", SUBSET, "--out", tmp_path / "hs.npz"]
    on_tty = stderr_of(args, True, tmp_path)
    assert "hellaswag: tokenizing" in on_tty and "120/120" in on_tty, on_tty
    assert "tokenizing" not in stderr_of(args, False, tmp_path)


def test_hellaswag_bar_inside_training_and_no_progress(tmp_path):
    base = ["gpt2core.train", "--preset", "tiny", "-B", "2", "-T", "16", "--steps", "2", "--val-every", "0",
            "--hellaswag-every", "1", "--hellaswag-path", SUBSET, "--hellaswag-limit", "8", "--sample-tokens", "1",
            "--output-dir", tmp_path / "run", "--threads", "1"]
    shown = stderr_of(base, True, tmp_path)
    assert "hellaswag:" in shown and "batch" in shown and "acc_norm=" in shown, shown
    quiet = stderr_of(base + ["--no-progress", "--overwrite"], True, tmp_path)  # the same folder: a new run  # (the long-row warning may still name hellaswag)
    assert "hellaswag:" not in quiet and "acc_norm=" not in quiet, quiet


def test_eta_is_remaining_steps_at_the_mean_step_time():
    assert hms(0) == "0:00" and hms(59.6) == "1:00" and hms(3723) == "1:02:03" and hms(36000) == "10:00:00"
    assert eta(10.0, 2, 3) == "elapsed 0:10 | eta 0:15"  # 5 s per step so far, 3 steps to go
    assert eta(90.0, 9, 0) == "elapsed 1:30 | eta 0:00"
    assert eta(0.0, 0, 5) == "elapsed 0:00 | eta ?"
