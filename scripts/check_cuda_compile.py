#!/usr/bin/env python3
"""Compile CUDA sources with the real nvcc and check what ptxas reports for every kernel.

Each file is compiled (-c, host and device code) for the given architectures with warnings as errors
(`-Werror all-warnings` for nvcc and ptxas, `-Wall -Wextra -Werror` for the host compiler) and
`-Xptxas -v`. The check fails when a file does not compile, when any function reports register spills
(spill stores or spill loads > 0), or when a kernel's static shared memory exceeds the architecture's
per-block limit. No GPU is needed, only the CUDA toolkit.

Launch bounds and occupancy (the PTX nvcc keeps: `.maxntid`, `.minnctapersm` of each entry):
  - every kernel of a file under csrc/ must declare __launch_bounds__ (ptxas then budgets registers for it; without
    it a kernel may compile to more registers than its block can hold and fail only on a GPU with
    cudaErrorLaunchOutOfResources);
  - each kernel's registers (allocated per warp in units of 256) times its bound must fit the 64K-register file;
  - --launch-log FILE (the emulator's GPT2CORE_EMU_LAUNCH_LOG of a training step): every launched kernel's block
    must be within its bound on every arch, and its static + dynamic shared memory within the arch's limit;
  - a comment `occupancy(NAME): >= W warps/SM on sm_A sm_B [with D B dynamic smem]` in a compiled file is a claim:
    the warps per SM that NAME's registers, block (its bound) and shared memory allow on those archs must be >= W.

    python scripts/check_cuda_compile.py            # the CUDA backend: DEFAULT_FILES
    python scripts/check_cuda_compile.py tests/csrc/emu/*.cu
    python scripts/check_cuda_compile.py --archs 75,80,90 -I csrc csrc/cuda/*.cu
    python scripts/check_cuda_compile.py --archs 75,90 --launch-log step.jsonl
    python scripts/check_cuda_compile.py --archs 75,80,90 --cache-dir build/nvcc-check   # compile once, check twice

--cache-dir DIR keeps what nvcc reported for each file (exit status, ptxas -v output, the entries' bounds from the
PTX), keyed by a hash of everything the compile depends on: the nvcc command (archs, flags, include directories),
NVCC_CCBIN / NVCC_PREPEND_FLAGS / NVCC_APPEND_FLAGS, `nvcc --version` and g++'s `--version`, this script, the
source and every file under the include directories and the source's folder. A second run with the same inputs (e.g. the no-spill test and the launch-bounds test of one pytest
session) repeats only the checks, never the compile.

Prints one line per (file, arch, function) with registers, spills and shared memory, then "OK" or the
failures; exit status 0 when everything passes, 1 otherwise, 2 when nvcc is missing.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Maximum shared memory per block (bytes, with the opt-in) by compute capability.
SMEM_LIMIT = {
    "70": 96 * 1024,
    "75": 64 * 1024,
    "80": 163 * 1024,
    "86": 99 * 1024,
    "87": 163 * 1024,
    "89": 99 * 1024,
    "90": 227 * 1024,
    "100": 227 * 1024,
    "120": 99 * 1024,
}

RE_ENTRY = re.compile(r"Compiling entry function '([^']+)' for '(?:sm|compute)_(\d+)a?'")
RE_PROPS = re.compile(r"Function properties for (\S+)")
RE_SPILLS = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
RE_USED = re.compile(r"Used (\d+) registers(?:.*?(\d+) bytes smem)?")
RE_ARCH = re.compile(r"for '(?:sm|compute)_(\d+)a?'")
RE_PTX_ENTRY = re.compile(r"\.entry\s+(\S+?)\s*\((.*?)\)\s*((?:\.(?:maxntid|minnctapersm|reqntid|maxnreg)[^\n]*\n\s*)*)\{",
                          re.S)
RE_CLAIM = re.compile(r"occupancy\((\w+)\):\s*>=\s*(\d+)\s*warps/SM\s+on\s+((?:sm_\d+\s*)+)"
                      r"(?:with\s+(\d+)\s*B\s+dynamic\s+smem)?")

# Per-SM limits by compute capability (CUDA C++ Programming Guide, "Technical Specifications per Compute
# Capability"): threads, resident blocks, shared memory (bytes, usable by blocks), 32-bit registers.
SM_THREADS = {"70": 2048, "75": 1024, "80": 2048, "86": 1536, "87": 2048, "89": 1536, "90": 2048, "100": 2048,
              "120": 1536}
SM_BLOCKS = {"70": 32, "75": 16, "80": 32, "86": 16, "87": 32, "89": 24, "90": 32, "100": 32, "120": 24}
SM_SMEM = {"70": 96 * 1024, "75": 64 * 1024, "80": 164 * 1024, "86": 100 * 1024, "87": 164 * 1024,
           "89": 100 * 1024, "90": 228 * 1024, "100": 228 * 1024, "120": 100 * 1024}
SM_REGS = 65536
REG_UNIT = 256  # registers are allocated per warp in units of 256


def warp_regs(regs: int) -> int:
    """Registers one warp holds for a kernel of `regs` registers per thread."""
    return -(-regs * 32 // REG_UNIT) * REG_UNIT


def blocks_per_sm(arch: str, regs: int, threads: int, smem: int) -> int:
    """Resident blocks per SM of a kernel (regs per thread, threads per block, static + dynamic smem per block)."""
    warps = -(-threads // 32)
    by_regs = SM_REGS // (warp_regs(max(regs, 1)) * warps)
    by_threads = SM_THREADS.get(arch, 2048) // (warps * 32)
    by_smem = SM_SMEM.get(arch, 48 * 1024) // (smem + 1024) if smem else 10**9  # + 1 KiB reserved per block
    return max(0, min(by_regs, by_threads, by_smem, SM_BLOCKS.get(arch, 32)))


def parse_ptx(text: str) -> dict[str, dict]:
    """Entries of a PTX file: mangled name -> {"maxntid": threads or None, "minnctapersm": n or None}."""
    out = {}
    for m in RE_PTX_ENTRY.finditer(text):
        d = {"maxntid": None, "minnctapersm": None}
        for line in m.group(3).splitlines():
            parts = line.strip().split(None, 1)
            if len(parts) == 2 and parts[0] in (".maxntid", ".reqntid"):
                n = 1
                for v in parts[1].split(","):
                    n *= int(v)
                d["maxntid"] = n
            elif len(parts) == 2 and parts[0] == ".minnctapersm":
                d["minnctapersm"] = int(parts[1])
        out[m.group(1)] = d
    return out


def base_name(demangled: str) -> str:
    """`void gpt2::cuda::layernorm_backward_kernel<float>(float*, ...)` -> `layernorm_backward_kernel`."""
    head = demangled.split("(")[0]
    depth, cut = 0, len(head)
    for i in range(len(head) - 1, -1, -1):  # drop a trailing template argument list
        if head[i] == ">":
            depth += 1
        elif head[i] == "<":
            depth -= 1
            if depth == 0:
                cut = i
                break
    head = head[:cut] if head.endswith(">") else head
    return head.split()[-1].split("::")[-1]


def csrc_kernels() -> set[str]:
    """Names of the __global__ functions defined under csrc/ (the backend's kernels)."""
    names = set()
    for f in list((ROOT / "csrc").rglob("*.cuh")) + list((ROOT / "csrc").rglob("*.cu")):
        names |= set(re.findall(r"__global__\s+void\s+(?:__launch_bounds__\([^)]*\)\s+)?(\w+)\s*\(", f.read_text()))
    return names


def read_launch_log(path: Path) -> dict[str, dict]:
    """Kernel base name -> the largest block (threads) and dynamic shared memory it was launched with."""
    import json

    out: dict[str, dict] = {}
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if "kernel" not in rec:
            continue
        name = rec["kernel"].strip("()").split("<")[0].split("::")[-1].strip()
        block = rec.get("block", [1, 1, 1])
        threads = block[0] * block[1] * block[2] if isinstance(block, list) else int(block)
        d = out.setdefault(name, {"threads": 0, "smem": 0})
        d["threads"] = max(d["threads"], threads)
        d["smem"] = max(d["smem"], int(rec.get("smem", 0)))
    return out


def read_claims(files: list[Path]) -> list[tuple[str, int, list[str], int, str]]:
    """The occupancy claims in the files' comments: (kernel, warps/SM, archs, dynamic smem bytes, where)."""
    claims = []
    for f in files:
        for i, line in enumerate(f.read_text().splitlines(), 1):
            m = RE_CLAIM.search(line)
            if m:
                claims.append((m.group(1), int(m.group(2)), re.findall(r"sm_(\d+)", m.group(3)), int(m.group(4) or 0),
                               f"{f.name}:{i}"))
    return claims


def default_files() -> list[Path]:
    """csrc/cuda/*.cu (the backend, float instantiations) and tests/csrc/cuda/cuda_compile/*.cu (compile-only files that
    instantiate the kernel templates for the other storage types, e.g. bf16)."""
    return sorted((ROOT / "csrc" / "cuda").glob("*.cu")) + sorted((ROOT / "tests" / "csrc" / "cuda" / "cuda_compile").glob("*.cu"))


def find_nvcc(explicit: str | None) -> str | None:
    if explicit:
        return explicit
    found = shutil.which("nvcc")
    if found:
        return found
    for base in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if base and Path(base, "bin", "nvcc").exists():
            return str(Path(base, "bin", "nvcc"))
    return None


def parse_ptxas(text: str) -> list[dict]:
    """Function records from `-Xptxas -v` output: name, arch, entry, regs, spills, smem."""
    funcs: dict[tuple[str, str], dict] = {}
    arch = None
    current = None
    for line in text.splitlines():
        m = RE_ENTRY.search(line)
        if m:
            arch = m.group(2)
            current = funcs.setdefault((m.group(1), arch), {"name": m.group(1), "arch": arch, "entry": True})
            continue
        m = RE_ARCH.search(line)
        if m and "Compiling" in line:  # "Compiling function ... for 'sm_80'" (non-entry)
            arch = m.group(1)
        m = RE_PROPS.search(line)
        if m and arch is not None:
            key = (m.group(1), arch)
            current = funcs.setdefault(key, {"name": m.group(1), "arch": arch, "entry": False})
            continue
        m = RE_SPILLS.search(line)
        if m and current is not None:
            current["stack"] = int(m.group(1))
            current["spill_stores"] = int(m.group(2))
            current["spill_loads"] = int(m.group(3))
            continue
        m = RE_USED.search(line)
        if m and current is not None:
            current["regs"] = int(m.group(1))
            current["smem"] = int(m.group(2) or 0)
    return list(funcs.values())


def demangle(names: list[str]) -> dict[str, str]:
    tool = shutil.which("cu++filt") or shutil.which("c++filt")
    if not tool or not names:
        return {n: n for n in names}
    try:
        out = subprocess.run([tool], input="\n".join(names), capture_output=True, text=True, check=True).stdout
        return dict(zip(names, out.splitlines()))
    except (OSError, subprocess.CalledProcessError):
        return {n: n for n in names}


_SOURCE_SUFFIXES = {".h", ".hpp", ".hh", ".cuh", ".cu", ".cpp", ".cc", ".inc", ".inl"}


def _version(tool: str) -> bytes:
    try:
        return subprocess.run([tool, "--version"], capture_output=True).stdout
    except OSError:
        return b"(not found)"


def cache_key(nvcc: str, cmd: list[str], src: Path, includes: list[str]) -> str:
    """A hash of everything one compile depends on (see --cache-dir): over-inclusive on purpose (any change to a
    file under an include directory invalidates every file's entry)."""
    h = hashlib.sha256()
    env = " ".join(f"{k}={os.environ.get(k, '')}" for k in ("NVCC_CCBIN", "NVCC_PREPEND_FLAGS", "NVCC_APPEND_FLAGS"))
    for part in (" ".join(cmd).encode(), env.encode(), _version(nvcc), _version(shutil.which("g++") or "g++"),
                 Path(__file__).read_bytes(), src.read_bytes()):
        h.update(len(part).to_bytes(8, "little") + part)
    for inc in [*includes, str(src.resolve().parent)]:  # the include directories and the source's own folder
        for f in sorted(p for p in Path(inc).rglob("*") if p.is_file() and p.suffix in _SOURCE_SUFFIXES):
            h.update(str(f).encode() + b"\0" + hashlib.sha256(f.read_bytes()).digest())
    return h.hexdigest()


def compile_one(nvcc: str, src: Path, archs: list[str], includes: list[str], extra: list[str], outdir: str,
                device_only: bool = False, cache_dir: Path | None = None):
    """Compiles src; returns (src, cmd, exit status, nvcc's output, {arch: PTX entries}). With cache_dir, a compile
    whose inputs were compiled before returns the stored result instead."""
    cmd = [nvcc, "-std=c++17", "-O3", "-Xptxas", "-v", "-Werror", "all-warnings"]
    if device_only:  # device code only (about half the time): no host compilation
        cmd += ["-fatbin"]
    else:
        cmd += ["-c", "-Xcompiler", "-Wall,-Wextra,-Werror"]
    for a in archs:
        cmd += ["-gencode", f"arch=compute_{a},code=sm_{a}"]
    for inc in includes:
        cmd += ["-I", inc]
    cmd += extra
    entry = None
    if cache_dir is not None:  # the key leaves out the scratch paths (outdir differs per run)
        entry = Path(cache_dir, cache_key(nvcc, cmd + [str(src)], src, includes) + ".json")
        if entry.exists():
            d = json.loads(entry.read_text())
            return src, d["cmd"], d["rc"], d["output"], d["ptx"]
    keep = os.path.join(outdir, src.stem + ".keep")  # the PTX of each arch: .maxntid / .minnctapersm per entry
    os.makedirs(keep, exist_ok=True)
    cmd += ["-keep", "-keep-dir", keep]
    cmd += [str(src), "-o", os.path.join(outdir, src.stem + (".fatbin" if device_only else ".o"))]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    ptx = {}
    for a in archs:
        f = Path(keep, f"{src.stem}.compute_{a}.ptx")
        if f.exists():
            ptx[a] = parse_ptx(f.read_text())
    if entry is not None and proc.returncode == 0:  # failures are compiled again (and reported again)
        entry.parent.mkdir(parents=True, exist_ok=True)
        tmp = entry.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"cmd": cmd, "rc": proc.returncode, "output": proc.stdout + proc.stderr,
                                   "ptx": ptx}))
        tmp.replace(entry)
    return src, cmd, proc.returncode, proc.stdout + proc.stderr, ptx


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="*", type=Path,
                    help=".cu files to compile (default: csrc/cuda/*.cu and tests/csrc/cuda/cuda_compile/*.cu)")
    ap.add_argument("--archs", default="80,90", help="comma-separated compute capabilities (default 80,90)")
    ap.add_argument("-I", dest="includes", action="append", default=None,
                    help="include directory (default: <repo>/csrc)")
    ap.add_argument("--nvcc", default=None, help="nvcc to use (default: PATH, $CUDA_HOME, /usr/local/cuda)")
    ap.add_argument("-j", "--jobs", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--extra", action="append", default=[], help="extra nvcc argument (repeatable)")
    ap.add_argument("--device-only", action="store_true",
                    help="compile device code only (-fatbin): skips the host compiler's -Werror pass")
    ap.add_argument("-q", "--quiet", action="store_true", help="only print failures and the summary")
    ap.add_argument("--launch-log", type=Path, default=None,
                    help="the emulator's launch log (GPT2CORE_EMU_LAUNCH_LOG) of a training step: each launched "
                         "kernel's block and shared memory are checked against its bound and the arch's limits")
    ap.add_argument("--cache-dir", type=Path, default=None,
                    help="keep each file's compile result here, keyed by a hash of all its inputs, and reuse it")
    args = ap.parse_args(argv)

    nvcc = find_nvcc(args.nvcc)
    if not nvcc:
        print("check_cuda_compile: nvcc not found", file=sys.stderr)
        return 2
    if not args.files:
        args.files = default_files()
    archs = [a.strip() for a in args.archs.split(",") if a.strip()]
    includes = args.includes or [str(ROOT / "csrc")]
    failures: list[str] = []
    launched = read_launch_log(args.launch_log) if args.launch_log else {}
    kernels: dict[tuple[str, str], list[dict]] = {}  # (base name, arch) -> its instantiations' records
    ours = csrc_kernels()  # the project's kernels must carry launch bounds (test-only kernels need not)
    with tempfile.TemporaryDirectory() as outdir, \
            concurrent.futures.ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        jobs = [pool.submit(compile_one, nvcc, f, archs, includes, args.extra, outdir, args.device_only,
                            args.cache_dir) for f in args.files]
        for job in jobs:
            src, cmd, rc, text, ptx = job.result()
            if rc != 0:
                failures.append(f"{src}: nvcc failed (exit {rc}):\n  {' '.join(cmd)}\n{text.rstrip()}")
                continue
            funcs = parse_ptxas(text)
            if not funcs:
                if not args.quiet:
                    print(f"{src}: no device functions")
                continue
            names = demangle(sorted({f["name"] for f in funcs}))
            for f in sorted(funcs, key=lambda f: (f["arch"], f["name"])):
                name = names.get(f["name"], f["name"])
                spills = f.get("spill_stores", 0) + f.get("spill_loads", 0)
                smem = f.get("smem", 0)
                limit = SMEM_LIMIT.get(f["arch"], 48 * 1024)
                line = (f"{src.name} sm_{f['arch']} {'kernel' if f['entry'] else 'function'} {name}: "
                        f"{f.get('regs', '?')} registers, {f.get('spill_stores', 0)}/{f.get('spill_loads', 0)} "
                        f"bytes spill stores/loads, {smem} bytes smem")
                if not args.quiet:
                    print(line)
                if spills > 0:
                    failures.append(f"{line}: register spills")
                if smem > limit:
                    failures.append(f"{line}: shared memory above the sm_{f['arch']} limit of {limit} bytes")
                if not f["entry"]:
                    continue
                bounds = ptx.get(f["arch"], {}).get(f["name"], {})
                nt = bounds.get("maxntid")
                if nt is None:
                    if base_name(name) in ours:
                        failures.append(f"{line}: no __launch_bounds__ (its block size is unchecked by ptxas)")
                    continue
                regs = f.get("regs", 0)
                if warp_regs(regs) * -(-nt // 32) > SM_REGS:
                    failures.append(f"{line}: {regs} registers x {nt} threads exceed the {SM_REGS}-register file")
                kernels.setdefault((base_name(name), f["arch"]), []).append(
                    {"name": name, "regs": regs, "smem": smem, "maxntid": nt, "min_blocks": bounds.get("minnctapersm")})
    for kname, use in sorted(launched.items()):
        for a in archs:
            for k in kernels.get((kname, a), []):
                what = f"{k['name']} sm_{a} (launched with {use['threads']} threads, {use['smem']} B dynamic smem)"
                if use["threads"] > k["maxntid"]:
                    failures.append(f"{what}: block above its __launch_bounds__ of {k['maxntid']}")
                if k["smem"] + use["smem"] > SMEM_LIMIT.get(a, 48 * 1024):
                    failures.append(f"{what}: {k['smem']} B static + dynamic shared memory above the sm_{a} limit")
    # the backend's headers make claims only when the backend is compiled (the emulator's test kernels are not it)
    backend = any(Path(f).resolve().parent == ROOT / "csrc" / "cuda" for f in args.files)
    headers = [*(ROOT / "csrc" / "cuda").glob("*.cuh"), *(ROOT / "csrc" / "cuda").glob("*.cu")] if backend else []
    sources = sorted({*map(Path, args.files), *headers})
    for kname, warps, claim_archs, dyn, where in read_claims([f for f in sources if Path(f).exists()]):
        for a in claim_archs:
            if a not in archs:
                continue
            found = kernels.get((kname, a), [])
            if not found:
                failures.append(f"{where}: occupancy claim for {kname} on sm_{a}, but ptxas reported no such kernel")
            for k in found:
                got = blocks_per_sm(a, k["regs"], k["maxntid"], k["smem"] + dyn) * -(-k["maxntid"] // 32)
                line = (f"{where}: {k['name']} sm_{a}: {k['regs']} registers, {k['maxntid']} threads, "
                        f"{k['smem'] + dyn} B smem -> {got} warps/SM (claimed >= {warps})")
                if not args.quiet:
                    print(line)
                if got < warps:
                    failures.append(line)
    if failures:
        print("\nFAILED:", file=sys.stderr)
        for msg in failures:
            print("  " + msg, file=sys.stderr)
        return 1
    print(f"OK: {len(args.files)} file(s) for sm_{', sm_'.join(archs)}: no spills, shared memory within limits, "
          f"launch bounds on every csrc kernel" + (f", {len(launched)} launched kernels within them" if launched else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
