"""An exclusive lock on a run's output folder, so that two runs never write the same metrics and
checkpoints.

The lock is `flock(2)` on `<folder>/gpt2core.lock`, a file that also records the holder (pid, host,
start time, command line) for the message a second run gets. The kernel drops a flock when its process
dies however it dies (SIGKILL, OOM, a crashed node's NFS lease expiring), so a lock left by a dead run is
simply free: the next run takes it over and says whose it was. Released on exit (`with RunLock(dir):`).
"""
from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import sys
import time
import warnings
from pathlib import Path

from ..errors import Error

LOCK_FILE = "gpt2core.lock"


class RunLockedError(Error, RuntimeError):
    """The output folder is locked by another running gpt2core run (named in the message)."""


def pid_alive(pid: int) -> bool:
    """Whether process `pid` exists on this machine (one we may not signal counts as alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _holder(info: dict) -> str:
    return (f"pid {info.get('pid', '?')} on host {info.get('host', '?')}, started {info.get('started', '?')}"
            + (f": {info['argv']}" if info.get("argv") else ""))


class RunLock:
    """`with RunLock(folder):` holds the folder exclusively, or raises RunLockedError naming the holder.

    `previous` is the record of a dead run whose lock was taken over (None if the lock was clean)."""

    def __init__(self, folder, what: str = "run"):
        self.folder = Path(folder)
        self.what = what  # the job, for the messages: "run", "preparation"
        self.path = self.folder / LOCK_FILE
        self.previous: dict | None = None
        self._fd: int | None = None

    def acquire(self) -> "RunLock":
        self.folder.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):  # a file system without flock
                warnings.warn(f"{self.path}: cannot lock the output folder ({e.strerror}); a second run on it "
                              "would not be detected", stacklevel=2)
            else:
                info = self._read(fd)
                os.close(fd)
                raise RunLockedError(
                    f"{self.folder} is in use by another gpt2core {self.what} ({_holder(info)}); wait for it to "
                    f"finish, stop it, or choose another output folder") from None
        self.previous = self._read(fd) or None
        me = {"pid": os.getpid(), "host": socket.gethostname(),
              "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "argv": " ".join(sys.argv)}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(me) + "\n").encode(), 0)
        os.fsync(fd)
        self._fd = fd
        return self

    def describe_previous(self) -> str | None:
        """A line about the dead run whose lock this one took over, or None."""
        if not self.previous:
            return None
        return f"took over the lock of {self.folder} left by a run that is no longer running ({_holder(self.previous)})"

    @staticmethod
    def _read(fd: int) -> dict:
        try:
            info = json.loads(os.pread(fd, 1 << 16, 0) or b"{}")
            return info if isinstance(info, dict) else {}
        except ValueError:
            return {}

    def release(self) -> None:
        if self._fd is None:
            return
        try:
            os.ftruncate(self._fd, 0)  # a clean release leaves no holder to report
        except OSError:
            pass
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)
        self._fd = None

    def __enter__(self) -> "RunLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


__all__ = ["RunLock", "RunLockedError", "LOCK_FILE", "pid_alive"]
