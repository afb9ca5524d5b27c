#!/usr/bin/env python3
"""Compile CUDA sources with the real nvcc and check what ptxas reports for every kernel.

Each file is compiled (-c, host and device code) for the given architectures with warnings as errors
(`-Werror all-warnings` for nvcc and ptxas, `-Wall -Wextra -Werror` for the host compiler) and
`-Xptxas -v`. The check fails when a file does not compile, when any function reports register spills
(spill stores or spill loads > 0), or when a kernel's static shared memory exceeds the architecture's
per-block limit. No GPU is needed, only the CUDA toolkit.

    python scripts/check_cuda_compile.py            # the CUDA backend: DEFAULT_FILES
    python scripts/check_cuda_compile.py tests/csrc/emu/*.cu
    python scripts/check_cuda_compile.py --archs 75,80,90 -I csrc csrc/cuda/*.cu

Prints one line per (file, arch, function) with registers, spills and shared memory, then "OK" or the
failures; exit status 0 when everything passes, 1 otherwise, 2 when nvcc is missing.
"""

from __future__ import annotations

import argparse
import concurrent.futures
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


def compile_one(nvcc: str, src: Path, archs: list[str], includes: list[str], extra: list[str], outdir: str,
                device_only: bool = False):
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
    cmd += [str(src), "-o", os.path.join(outdir, src.stem + (".fatbin" if device_only else ".o"))]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    return src, cmd, proc.returncode, proc.stdout + proc.stderr


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
    with tempfile.TemporaryDirectory() as outdir, \
            concurrent.futures.ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        jobs = [pool.submit(compile_one, nvcc, f, archs, includes, args.extra, outdir, args.device_only)
                for f in args.files]
        for job in jobs:
            src, cmd, rc, text = job.result()
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
    if failures:
        print("\nFAILED:", file=sys.stderr)
        for msg in failures:
            print("  " + msg, file=sys.stderr)
        return 1
    print(f"OK: {len(args.files)} file(s) for sm_{', sm_'.join(archs)}: no spills, shared memory within limits")
    return 0


if __name__ == "__main__":
    sys.exit(main())
