"""Start N training processes on this node, torchrun-style, without needing torch:

    python -m gpt2core.launch --nproc-per-node 2 -m gpt2core.train --preset s4 -B 4 -T 128
    python -m gpt2core.launch --nproc-per-node 8 --nnodes 2 --node-rank 0 --master-addr node0 \\
        -m gpt2core.train ...            # on node0; --node-rank 1 on the second node

Each process gets RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR, MASTER_PORT (as
torchrun sets them) and, unless already set, OMP_NUM_THREADS = cores / nproc-per-node. The launcher watches
its processes: when one exits with an error or is killed, it stops the others (SIGTERM, then SIGKILL after
--kill-timeout seconds) and exits with that process's status, so a failed run never leaves ranks waiting.
Across nodes, the ranks on the other nodes notice through the process group (connection closed, or the
--dist-timeout of gpt2core-train) and fail too.
"""
from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time

from .. import cli
from ..errors import ArgError


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free right now on host (the usual bind-to-0 trick; another process could still
    take it before we use it, which the rendezvous then reports)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def build_parser() -> argparse.ArgumentParser:
    ap = cli.ArgumentParser(prog="python -m gpt2core.launch", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nproc-per-node", "--nproc_per_node", type=cli.Int(1, 4096), default=1,
                    help="processes on this node")
    ap.add_argument("--nnodes", type=cli.Int(1, 65536), default=1, help="number of nodes (default 1)")
    ap.add_argument("--node-rank", "--node_rank", type=cli.non_negative_int, default=0,
                    help="this node's index in 0..nnodes-1")
    ap.add_argument("--master-addr", "--master_addr", default="127.0.0.1", help="host of rank 0")
    ap.add_argument("--master-port", "--master_port", type=cli.port_or_auto, default=29500,
                    help="port of the rendezvous at the master ('auto': a free port, single node only)")
    ap.add_argument("--kill-timeout", type=cli.Float(0, 86400), default=10.0,
                    help="seconds between SIGTERM and SIGKILL when stopping the other processes")
    ap.add_argument("-m", "--module", dest="module", action="store_true",
                    help="run the target as a module (python -m TARGET)")
    ap.add_argument("--no-python", action="store_true", help="run the target as a command, not through python")
    ap.add_argument("target", help="script, module (with -m) or command (with --no-python)")
    ap.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the target")
    return ap


def _child_setup():
    """In the child: die with the launcher (Linux PR_SET_PDEATHSIG), so no rank outlives a killed launcher."""
    try:
        import ctypes
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG = 1
    except OSError:
        pass


def _status(code: int) -> str:
    return f"was killed by signal {-code} ({signal.Signals(-code).name})" if code < 0 else f"exited with code {code}"


def launch(args) -> int:
    n, nnodes = args.nproc_per_node, args.nnodes
    if n < 1 or nnodes < 1 or not 0 <= args.node_rank < nnodes:
        raise ArgError(f"--node-rank {args.node_rank} must be in 0..{nnodes - 1} (--nnodes {nnodes})")
    if str(args.master_port) in ("auto", "0"):
        if nnodes > 1:
            raise ArgError("--master-port auto works on one node only; give every node the same port")
        port = free_port()
    else:
        port = int(args.master_port)
    world = n * nnodes
    if args.no_python:
        cmd = [args.target]
    elif args.module:
        cmd = [sys.executable, "-m", args.target]
    else:
        cmd = [sys.executable, args.target]
    cmd += args.args
    threads = max(1, (os.cpu_count() or 1) // n)

    procs: list[subprocess.Popen] = []
    for local in range(n):
        env = dict(os.environ)
        env.pop("TORCHELASTIC_USE_AGENT_STORE", None)  # we are the agent here: rank 0 serves MASTER_PORT
        env.update(RANK=str(args.node_rank * n + local), LOCAL_RANK=str(local), WORLD_SIZE=str(world),
                   LOCAL_WORLD_SIZE=str(n), GROUP_RANK=str(args.node_rank), MASTER_ADDR=args.master_addr,
                   MASTER_PORT=str(port))
        env.setdefault("OMP_NUM_THREADS", str(threads))
        procs.append(subprocess.Popen(cmd, env=env, preexec_fn=_child_setup))

    stopping = {"signal": None}

    def forward(signum, _frame):
        stopping["signal"] = signum
        for p in procs:
            if p.poll() is None:
                p.send_signal(signum)

    old = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        failed = None
        while True:
            codes = [p.poll() for p in procs]
            bad = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]
            if bad:
                failed = bad[0]
                break
            if all(c == 0 for c in codes):
                return 0
            time.sleep(0.05)
        local, code = failed
        rank = args.node_rank * n + local
        alive = [p for p in procs if p.poll() is None]
        if stopping["signal"] is None:
            print(f"gpt2core.launch: rank {rank} (pid {procs[local].pid}) {_status(code)}; stopping the other "
                  f"{len(alive)} process(es)", file=sys.stderr, flush=True)
        for p in alive:
            p.terminate()
        deadline = time.monotonic() + args.kill_timeout
        for p in alive:
            try:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        return 128 - code if code < 0 else code
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    return launch(args)


console = cli.entry("python -m gpt2core.launch", main)

if __name__ == "__main__":
    sys.exit(console())
