"""Mutation test of the GPU-free verification: how many single bugs injected into the CUDA kernels
(csrc/cuda) the emulated op tests catch, and how.

Each mutation in MUTATIONS replaces one exact snippet of one file. The script copies csrc/cuda into a
scratch folder (<build-dir>/src/cuda), applies one mutation at a time, builds the test module against
it (tests/csrc/cuda/cuda_emu/CMakeLists.txt with GPT2CORE_EMU_CUDA_DIR; only backend_cuda.cu recompiles between
mutants) and runs tests/csrc/cuda/cuda_emu/compare_ops.py (every op against the CPU backend) under each emulator
schedule. A mutant is
  killed by report   a launch failed with an emulator report (race, bounds, uninitialised shared memory,
                     barrier or warp rule); "line" when the report names the mutated line (file:line),
  killed by mismatch an op differs from the CPU backend (normwise error > 1e-5, or not finite),
  killed by error    any other failure (a crash, an exception),
  survived           every schedule passed.
Schedules are deterministic (seeded), so a verdict is reproducible; --repeat N reruns each mutant to
show it.

    python scripts/mutation_test.py                        # every mutation, schedules fwd,low,high,ahead:1
    python scripts/mutation_test.py --only block_sum_first_barrier gelu_tail_guard
    GPT2CORE_EMU_RACECHECK=0 python scripts/mutation_test.py --schedules fwd,rev,random:7   # checker off

Prints one line per mutant and the score; --json writes the table. A full run takes ~20 s per mutant to
build plus ~8 s per schedule on one core (the first build of <build-dir> takes a few minutes).
"""
import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CUDA = ROOT / "csrc" / "cuda"
# what an emulator report says (csrc/emu: racecheck.cpp and the scheduler's rule checks)
REPORT = re.compile(r"shared-memory race|device-memory race|out-of-bounds|uninitialised shared memory|"
                    r"__syncthreads \(|divergent __syncthreads|_sync \(|__syncwarp \(|deadlock")


BASELINE_SCHEDULES = ["fwd", "rev", "random:7"]


@dataclass
class Mutation:
    name: str
    file: str   # in csrc/cuda
    old: str    # exact snippet, must occur once
    new: str
    why: str


MUTATIONS = [
    Mutation("block_sum_first_barrier", "common.cuh",
             "  v = warp_sum(v);\n  __syncthreads();  // scratch may still be read by a previous call\n",
             "  v = warp_sum(v);\n",
             "block_sum's scratch write races with the reads of the previous block_max / block_sum"),
    Mutation("block_sum_second_barrier", "common.cuh",
             "  if (lane == 0) scratch[warp] = v;\n  __syncthreads();\n  v = lane < nwarps ? scratch[lane] : T(0);",
             "  if (lane == 0) scratch[warp] = v;\n  v = lane < nwarps ? scratch[lane] : T(0);",
             "block_sum reads the per-warp sums before every warp wrote its own"),
    # (block_max's first barrier is not in the list: every caller uses block_max first, so no earlier reads of
    # scratch exist and removing that barrier is an equivalent mutant; the full run of the first list showed it)
    Mutation("block_max_second_barrier", "common.cuh",
             "  if (lane == 0) scratch[warp] = v;\n  __syncthreads();\n  v = lane < nwarps ? scratch[lane] : -INFINITY;",
             "  if (lane == 0) scratch[warp] = v;\n  v = lane < nwarps ? scratch[lane] : -INFINITY;",
             "block_max reads the per-warp maxima before every warp wrote its own"),
    Mutation("block_sum_lane_le_nwarps", "common.cuh",
             "  v = lane < nwarps ? scratch[lane] : T(0);",
             "  v = lane <= nwarps ? scratch[lane] : T(0);",
             "block_sum reads one scratch slot no warp wrote"),
    Mutation("warp_sum_shuffle_mask", "common.cuh",
             "for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(kFullMask, v, o);",
             "for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0x7fffffffu, v, o);",
             "warp_sum's mask leaves out lane 31"),
    Mutation("dkdv_stats_after_barrier", "attention.cuh",
             "  extra();\n  __syncthreads();\n}",
             "  __syncthreads();\n  extra();\n}",
             "the dk/dv kernel's row statistics are stored after the barrier its readers pass"),
    Mutation("refill_first_barrier", "attention.cuh",
             "                                    int r0, int T, int hs, bool vec, Extra&& extra) {\n  __syncthreads();\n",
             "                                    int r0, int T, int hs, bool vec, Extra&& extra) {\n",
             "attention tiles are overwritten while other warps still read the previous ones"),
    Mutation("group_sum_xor_offset", "attention.cuh",
             "  v += __shfl_xor_sync(kFullMask, v, 2);\n  return v;",
             "  v += __shfl_xor_sync(kFullMask, v, 4);\n  return v;",
             "attention's 4-lane group sum combines the wrong lanes"),
    Mutation("column_sum_barrier", "reduce.cuh",
             "  sh[threadIdx.y][threadIdx.x] = s;\n  __syncthreads();\n",
             "  sh[threadIdx.y][threadIdx.x] = s;\n",
             "the column partial sum reads other rows' shared slots before they are written"),
    Mutation("column_reduce_bound", "reduce.cuh",
             "for (int r = threadIdx.y; r < R; r += kReduceRows) s += partial[size_t(r) * C + c];",
             "for (int r = threadIdx.y; r <= R; r += kReduceRows) s += partial[size_t(r) * C + c];",
             "the column reduction adds one partial row too many"),
    Mutation("layernorm_backward_chunk_end", "layernorm.cuh",
             "const int r0 = blockIdx.x * rows_per_chunk, r1 = min(N, r0 + rows_per_chunk);",
             "const int r0 = blockIdx.x * rows_per_chunk, r1 = r0 + rows_per_chunk;",
             "layernorm backward's last chunk of rows reads past row N"),
    Mutation("gelu_tail_guard", "gelu.cuh",
             "    for (size_t k = iv; k < N; k++) out[k] = store_t<floatX>(gelu(load_f(inp[k])));",
             "    for (size_t k = iv; k <= N; k++) out[k] = store_t<floatX>(gelu(load_f(inp[k])));",
             "gelu's vector tail writes one element past the end"),
    Mutation("classifier_plain_rmw", "classifier.cuh",
             "      atomicAdd(valid, 1);",
             "      *valid += 1;",
             "the count of non-ignored rows as a plain read-modify-write from many blocks"),
    Mutation("naive_attention_syncwarp", "attention_naive.cuh",
             "  __syncwarp();  // the row of dS is read across lanes below\n",
             "",
             "lanes read other lanes' dS values without __syncwarp"),
    Mutation("residual_index", "residual.cuh",
             "    if (i < N) out[i] = store_t<floatX>(load_f(a[i]) + load_f(b[i]));",
             "    if (i < N) out[i] = store_t<floatX>(load_f(a[i]) + load_f(b[i + 1]));",
             "residual reads b one element ahead (the last one past the end)"),
    Mutation("norm_partial_index", "global_norm.cuh",
             "  if (threadIdx.x == 0) partial[blockIdx.x] = s;",
             "  if (threadIdx.x == 0) partial[blockIdx.x / 2] = s;",
             "two blocks store their partial sum of squares in one slot"),
]


def mutated_line(text, m):
    """1-based line of the mutation in the mutated file (the first changed line, or the one after a deletion)."""
    start = text.index(m.old)
    common = len(os.path.commonprefix([m.old, m.new]))
    return text[:start + common].count("\n") + 1


def sync_tree(src, dst):
    """Makes dst a copy of src, rewriting only files that differ (so the build stays incremental)."""
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file():
            target = dst / f.name
            data = f.read_bytes()
            if not target.exists() or target.read_bytes() != data:
                target.write_bytes(data)


def build(build_dir, scratch):
    if not (build_dir / "CMakeCache.txt").exists():
        cfg = ["cmake", "-S", str(ROOT / "tests" / "csrc" / "cuda" / "cuda_emu"), "-B", str(build_dir), "-DCMAKE_BUILD_TYPE=Release",
               f"-DPython_EXECUTABLE={sys.executable}", f"-DGPT2CORE_EMU_CUDA_DIR={scratch}",
               "-DCMAKE_INTERPROCEDURAL_OPTIMIZATION=OFF"]  # no LTO: each mutant relinks the whole module
        if shutil.which("ninja"):
            cfg += ["-G", "Ninja"]
        subprocess.run(cfg, check=True, capture_output=True, text=True)
    r = subprocess.run(["cmake", "--build", str(build_dir), "-j2"], capture_output=True, text=True)
    return r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]


def run_ops(build_dir, sched, timeout, checker=True):
    env = dict(os.environ, GPT2CORE_EMU_SCHED=sched)
    if not checker:
        env["GPT2CORE_EMU_RACECHECK"] = "0"
    env.pop("GPT2CORE_EMU_TRACE", None)
    try:
        r = subprocess.run([sys.executable, str(ROOT / "tests" / "csrc" / "cuda" / "cuda_emu" / "compare_ops.py"), str(build_dir)],
                           env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return "error", "timed out"
    out = r.stdout + r.stderr
    if r.returncode != 0:
        report = [line for line in out.splitlines() if REPORT.search(line)]
        return ("report", report[-1]) if report else ("error", out.strip().splitlines()[-1] if out.strip() else "")
    errors = json.loads(r.stdout.strip().splitlines()[-1])
    bad = {k: v for k, v in errors.items() if not v <= 1e-5}
    return ("mismatch", f"{len(bad)} ops differ, e.g. {sorted(bad)[:3]}") if bad else ("pass", "")


def run_schedules(m, line, build_dir, schedules, timeout, stop_early, checker=True):
    """{schedule: [kind, detail]} for the built mutant, and the verdict (the first killing kind, or survived)."""
    runs = {}
    for sched in schedules:
        kind, detail = run_ops(build_dir, sched, timeout, checker)
        if kind == "report" and re.search(re.escape(f"{m.file}:{line}") + r"\b", detail):
            kind = "report (line)"
        runs[sched] = [kind, detail]
        if stop_early and kind != "pass":
            break
    kinds = [k for k, _ in runs.values() if k != "pass"]
    return runs, kinds[0] if kinds else "survived"


def evaluate(m, build_dir, scratch, schedules, timeout, stop_early, baseline):
    """Applies m in scratch, builds, runs the schedules; returns a result dict."""
    sync_tree(CUDA, scratch)
    path = scratch / m.file
    text = path.read_text()
    if text.count(m.old) != 1:
        raise SystemExit(f"mutation {m.name}: snippet found {text.count(m.old)} times in csrc/cuda/{m.file}")
    line = mutated_line(text, m)
    path.write_text(text.replace(m.old, m.new))
    ok, log = build(build_dir, scratch)
    result = {"name": m.name, "where": f"{m.file}:{line}", "why": m.why, "runs": {}}
    if not ok:
        result.update(verdict="build error", detail=log.strip().splitlines()[-1] if log.strip() else "")
        return result
    result["runs"], result["verdict"] = run_schedules(m, line, build_dir, schedules, timeout, stop_early)
    result["detail"] = next((d for k, d in result["runs"].values() if k != "pass"), "")
    if baseline:  # the emulator before the memory checker and the run-ahead schedules
        result["baseline_runs"], result["baseline"] = run_schedules(m, line, build_dir, BASELINE_SCHEDULES, timeout,
                                                                    stop_early, checker=False)
    return result


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", nargs="+", metavar="NAME", help="mutations to run (default: all)")
    ap.add_argument("--schedules", default="fwd,low,high,ahead:1", help="comma-separated emulator schedules")
    ap.add_argument("--build-dir", default=str(ROOT / "build" / "emu-mut"), help="build folder (reused)")
    ap.add_argument("--stop-early", action="store_true", help="stop a mutant at its first killing schedule")
    ap.add_argument("--repeat", type=int, default=1, help="run each mutant this many times (verdicts must agree)")
    ap.add_argument("--timeout", type=float, default=600, help="seconds per compare_ops run")
    ap.add_argument("--baseline", action="store_true",
                    help="also score each mutant as the emulator did before its memory checker: checker off "
                         "(GPT2CORE_EMU_RACECHECK=0), lock-step schedules " + ",".join(BASELINE_SCHEDULES))
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--list", action="store_true", help="list the mutations and exit")
    args = ap.parse_args(argv)
    if args.list:
        for m in MUTATIONS:
            print(f"{m.name:28s} {m.file:22s} {m.why}")
        return 0
    chosen = [m for m in MUTATIONS if not args.only or m.name in args.only]
    unknown = set(args.only or []) - {m.name for m in MUTATIONS}
    if unknown:
        ap.error(f"unknown mutations: {sorted(unknown)}")
    build_dir = Path(args.build_dir).resolve()
    scratch = build_dir / "src" / "cuda"
    schedules = args.schedules.split(",")
    results = []
    try:
        for m in chosen:
            t0 = time.time()
            runs = [evaluate(m, build_dir, scratch, schedules, args.timeout, args.stop_early, args.baseline)
                    for _ in range(args.repeat)]
            r = runs[0]
            r["deterministic"] = all(x["verdict"] == r["verdict"] for x in runs)
            r["seconds"] = round(time.time() - t0, 1)
            results.append(r)
            killers = ",".join(s for s, (k, _) in r["runs"].items() if k != "pass") or "-"
            base = f" (before: {r['baseline']})" if args.baseline else ""
            print(f"{r['name']:28s} {r['where']:24s} {r['verdict']:15s} by {killers:24s}{base} {r['detail'][:300]}",
                  flush=True)
    finally:
        sync_tree(CUDA, scratch)  # leave the scratch copy unmutated
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    killed = score("score", [r["verdict"] for r in results])
    if args.baseline:
        score("before (checker off, lock-step schedules)", [r["baseline"] for r in results])
    print(f"{sum(not r['deterministic'] for r in results)} verdicts changed between repeats")
    return 0 if killed == len(results) else 1


def score(title, verdicts):
    killed = [v for v in verdicts if v not in ("survived", "build error")]
    print(f"{title}: {len(killed)}/{len(verdicts)} killed; {sum(v.startswith('report') for v in killed)} by an "
          f"emulator report ({killed.count('report (line)')} naming the mutated line), {killed.count('mismatch')} "
          f"by numeric mismatch, {killed.count('error')} by another error")
    return len(killed)


if __name__ == "__main__":
    sys.exit(main())
