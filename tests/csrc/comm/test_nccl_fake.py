"""The NCCL communicator (csrc/comm/comm_nccl.cpp) against a scripted fake NCCL (tests/csrc/comm/fake_nccl.cpp) on the
CUDA-on-CPU emulator: the lifecycle nccl.h prescribes for a non-blocking communicator (finalize polled while
ncclInProgress, then destroy; abort at once on an error or a timeout, also of a half-built communicator) and
collectives on a stream of the communicator's own. Real NCCL needs GPUs; these rules do not.

Needs g++, cmake (for the emulator library, built as in tests/csrc/emu/test_emu.py) and nccl.h; skipped without them.
"""
import shutil
import socket
import subprocess
from pathlib import Path

import pytest

from test_emu import ROOT, _build, _cuda_include

SOURCES = [ROOT / "tests" / "csrc" / "comm" / "fake_nccl.cpp"] + [ROOT / "csrc" / "comm" / f for f in
                                                           ("comm_nccl.cpp", "rendezvous.cpp", "tcp_store.cpp")]


def _nccl_include():
    for d in (_cuda_include(), Path("/usr/local/include"), Path("/usr/include")):
        if d and (d / "nccl.h").exists():
            return d
    return None


def _free_port_block(n=6):
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port + n < 65536:
            return port
    pytest.skip("no free TCP port")


def test_nccl_communicator_lifecycle_against_a_fake_nccl():
    if shutil.which("g++") is None or _nccl_include() is None:
        pytest.skip("needs g++ and nccl.h")
    emu = _build(ROOT / "build" / "emu", targets=["gpt2core_emu"])
    exe = emu / "fake_nccl"
    inputs = SOURCES + [ROOT / "csrc" / "comm" / h for h in ("comm.h", "comm_nccl.h", "rendezvous.h", "tcp_store.h")]
    if not exe.exists() or any(p.stat().st_mtime > exe.stat().st_mtime for p in inputs + [emu / "libgpt2core_emu.a"]):
        cmd = ["g++", "-std=c++17", "-O1", "-Wall", "-Wextra", "-Werror", f"-I{ROOT / 'csrc'}",
               f"-isystem{_cuda_include()}", f"-isystem{_nccl_include()}", *map(str, SOURCES),
               str(emu / "libgpt2core_emu.a"), "-pthread", "-o", str(exe)]
        r = subprocess.run(cmd, capture_output=True, text=True)
        assert r.returncode == 0, r.stderr[-4000:]
    r = subprocess.run([str(exe), str(_free_port_block())], capture_output=True, text=True, timeout=120)
    out = r.stdout + r.stderr
    assert r.returncode == 0 and "FAIL" not in r.stdout, out
    assert r.stdout.count("ok ") == 6, out
    assert "did not complete" not in r.stderr, out  # the clean shutdown finalized
