#!/usr/bin/env python3
"""Registers, shared memory, spills and resident blocks of every kernel of the built CUDA module, per architecture.

Where the numbers come from:
  - the built module (gpt2core's _C_cuda, or --module PATH) through `cuobjdump --dump-resource-usage` (REG, SHARED,
    LOCAL per function and arch) and `cuobjdump -elf` (each entry's EIATTR_MAX_THREADS: its __launch_bounds__);
    cuobjdump from the toolkit or from NVIDIA's wheel (pip install nvidia-cuda-cuobjdump). Its SHARED is ptxas's
    static shared memory plus 1 KiB on sm_90 (measured on the CI build: registers, spills and launch bounds agree
    exactly; tests/scripts/test_kernel_resources.py);
  - or, where the toolkit has no cuobjdump (or with --compile), the sources the module is built from compiled again
    with `ptxas -v` for the same architectures (scripts/check_cuda_compile.py's compile: registers, spill stores and
    loads, static shared memory, and each entry's .maxntid from the PTX).
Architectures: the build's (gpt2core.build_info()["cuda_archs"]) unless --archs says. Resident blocks per SM follow
the architecture's limits (registers per thread in warp-sized units of 256, threads, blocks, shared memory with 1 KiB
reserved per block: check_cuda_compile.blocks_per_sm) for the kernel's block (its launch bound) and its shared
memory: static, plus, for the attention kernels, the dynamic shared memory their launchers request
(csrc/cuda/attention_tc.cuh; DYNAMIC_SMEM below, checked against the emulator's launch log by
tests/scripts/test_kernel_resources.py). Other kernels' dynamic shared memory is not known here (counted as 0).

--json prints a list of objects {"kernel", "arch" ("80"), "registers", "shared_bytes" (static + dynamic),
"spill_bytes" (ptxas: spill stores + loads; cuobjdump: LOCAL, the per-thread local memory spills land in),
"threads", "blocks_per_sm"}; otherwise a table. --attention keeps the attention kernels only; --check exits 1 when
an attention kernel spills or holds fewer resident warps per SM than the design states (DESIGN_WARPS).

    python scripts/kernel_resources.py                          # the installed module, the build's archs
    python scripts/kernel_resources.py --json --attention
    python scripts/kernel_resources.py --compile --archs 75,80,90 --sources tests/csrc/cuda/cuda_compile/attention_tc.cu
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import check_cuda_compile as ccc  # noqa: E402

ROOT = ccc.ROOT
ATTENTION = ("attention_tc_forward_kernel", "attention_tc_backward_dkdv_kernel", "attention_tc_backward_dq_kernel")


# ------------------------------------------------------------------------------------------- the design's numbers
def _tc_fwd_rows(hs: int) -> int:
    return 128 if hs <= 64 else 64


# Dynamic shared memory of the attention kernels, from their template arguments (as csrc/cuda/attention_tc.cuh's
# tc_fwd_smem_bytes, tc_bwd_smem_bytes, tc_dq_smem_bytes): kernel base name -> f(HS, kStages) bytes.
DYNAMIC_SMEM = {
    "attention_tc_forward_kernel": lambda hs, st: (_tc_fwd_rows(hs) + 2 * st * 64) * hs * 2,
    "attention_tc_backward_dkdv_kernel": lambda hs, st: 2 * 64 * hs * 2 + st * (2 * 32 * hs * 2 + 2 * 32 * 4),
    "attention_tc_backward_dq_kernel": lambda hs, st: st * 64 * (64 + hs) * 2,
}
# Resident warps per SM the design states (docs/attention_kernels.md) for the instantiations each arch runs:
# (kernel, HS) -> {arch class: warps}; "80" covers sm_80 and sm_90 (kStages = 2), "75" sm_75 (kStages = 1, HS = 64).
DESIGN_WARPS = {
    ("attention_tc_forward_kernel", 64): {"80": 8, "75": 4},
    ("attention_tc_forward_kernel", 128): {"80": 8},
    ("attention_tc_backward_dkdv_kernel", 64): {"80": 16, "75": 8},
    ("attention_tc_backward_dkdv_kernel", 128): {"80": 8},
    ("attention_tc_backward_dq_kernel", 64): {"80": 16, "75": 8},
    ("attention_tc_backward_dq_kernel", 128): {"80": 8},
}


def template_args(kernel: str) -> list[str]:
    """`void ns::k<64, true, 2, __half>(...)` -> ['64', 'true', '2', '__half'] (top-level template arguments)."""
    head = kernel.split("(")[0]
    if "<" not in head:
        return []
    inner = head[head.index("<") + 1:head.rindex(">")]
    out, depth, cur = [], 0, ""
    for ch in inner:
        if ch == "," and depth == 0:
            out.append(cur.strip())
            cur = ""
            continue
        depth += ch == "<"
        depth -= ch == ">"
        cur += ch
    return out + [cur.strip()] if cur.strip() else out


def attention_config(kernel: str) -> tuple[int, int] | None:
    """(HS, kStages) of an attention kernel instantiation, else None."""
    base = ccc.base_name(kernel)
    if base not in DYNAMIC_SMEM:
        return None
    a = template_args(kernel)
    hs = int(a[0])
    stages = int(a[1] if base == "attention_tc_forward_kernel" else a[2])
    return hs, stages


def runs_on(kernel: str, arch: str) -> bool:
    """Whether the backend launches this attention instantiation on arch (attention_tc.cuh: tc_stages, tc_arch_runs,
    attention_tc_fits): kStages = 2 from sm_80, 1 on sm_75 with HS = 64 only."""
    cfg = attention_config(kernel)
    if cfg is None:
        return True
    hs, stages = cfg
    if int(arch) >= 80:
        return stages == 2
    return int(arch) >= 75 and stages == 1 and hs <= 64


def design_warps(kernel: str, arch: str) -> int | None:
    cfg = attention_config(kernel)
    if cfg is None or not runs_on(kernel, arch):
        return None
    return DESIGN_WARPS.get((ccc.base_name(kernel), cfg[0]), {}).get("80" if int(arch) >= 80 else "75")


# ------------------------------------------------------------------------------------------- cuobjdump
RE_OBJ_ARCH = re.compile(r"^arch = sm_(\d+)a?", re.M)
RE_OBJ_FUNC = re.compile(r"^\s*Function (\S+):\s*$")
RE_OBJ_RES = re.compile(r"REG:(\d+)\s+STACK:(\d+)\s+SHARED:(\d+)\s+LOCAL:(\d+)")
RE_ELF_INFO = re.compile(r"^\.nv\.info\.(\S+)")
RE_ELF_MAXTHREADS = re.compile(r"EIATTR_MAX_THREADS")
RE_ELF_VALUE = re.compile(r"Value:\s*((?:0x[0-9a-fA-F]+\s*)+)")


def parse_resource_usage(text: str) -> list[dict]:
    """`cuobjdump --dump-resource-usage` -> [{name, arch, regs, smem, spill, stack}] (mangled names)."""
    out, arch, name = [], None, None
    for line in text.splitlines():
        m = RE_OBJ_ARCH.match(line)
        if m:
            arch = m.group(1)
            continue
        m = RE_OBJ_FUNC.match(line)
        if m:
            name = m.group(1)
            continue
        m = RE_OBJ_RES.search(line)
        if m and name and arch:
            out.append({"name": name, "arch": arch, "regs": int(m.group(1)), "stack": int(m.group(2)),
                        "smem": int(m.group(3)), "spill": int(m.group(4))})
            name = None
    return out


def parse_elf_max_threads(text: str) -> dict[tuple[str, str], int]:
    """`cuobjdump -elf` -> {(mangled name, arch): EIATTR_MAX_THREADS x * y * z} (entries with launch bounds)."""
    out, arch, func, want = {}, None, None, False
    for line in text.splitlines():
        m = RE_OBJ_ARCH.match(line)
        if m:
            arch = m.group(1)
            continue
        m = RE_ELF_INFO.match(line.strip())
        if m:
            func, want = m.group(1), False
            continue
        if RE_ELF_MAXTHREADS.search(line):
            want = True
            continue
        m = RE_ELF_VALUE.search(line)
        if m and want and func and arch:
            n = 1
            for v in m.group(1).split()[:3]:
                n *= int(v, 16)
            out[(func, arch)] = n
            want = False
    return out


def find_tool(name: str) -> str | None:
    found = shutil.which(name)
    if found:
        return found
    for base in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if base and Path(base, "bin", name).exists():
            return str(Path(base, "bin", name))
    # NVIDIA's PyPI wheels (pip install nvidia-cuda-cuobjdump: nvidia/cu13/bin/cuobjdump)
    try:
        import nvidia
        for root in nvidia.__path__:
            for found in sorted(Path(root).glob(f"*/bin/{name}")):
                return str(found)
    except ImportError:
        pass
    return None


def from_module(module: Path, cuobjdump: str) -> list[dict]:
    usage = subprocess.run([cuobjdump, "--dump-resource-usage", str(module)], capture_output=True, text=True,
                           check=True).stdout
    elf = subprocess.run([cuobjdump, "-elf", str(module)], capture_output=True, text=True, check=True).stdout
    threads = parse_elf_max_threads(elf)
    recs = parse_resource_usage(usage)
    for r in recs:
        r["threads"] = threads.get((r["name"], r["arch"]))
    return recs


# ------------------------------------------------------------------------------------------- ptxas -v
def default_sources() -> list[Path]:
    return ccc.default_files()


def from_compile(sources: list[Path], archs: list[str], cache_dir: Path | None, nvcc: str) -> list[dict]:
    recs = []
    with tempfile.TemporaryDirectory() as outdir:
        for src in sources:
            _, cmd, rc, text, ptx = ccc.compile_one(nvcc, Path(src), archs, [str(ROOT / "csrc")], [], outdir,
                                                    cache_dir=cache_dir)
            if rc != 0:
                raise SystemExit(f"kernel_resources: nvcc failed on {src}:\n{text[-4000:]}")
            for f in ccc.parse_ptxas(text):
                if not f.get("entry"):
                    continue
                recs.append({"name": f["name"], "arch": f["arch"], "regs": f.get("regs", 0), "smem": f.get("smem", 0),
                             "spill": f.get("spill_stores", 0) + f.get("spill_loads", 0),
                             "threads": ptx.get(f["arch"], {}).get(f["name"], {}).get("maxntid")})
    return recs


# ------------------------------------------------------------------------------------------- the table
def rows(recs: list[dict], attention_only: bool = False) -> list[dict]:
    names = ccc.demangle(sorted({r["name"] for r in recs}))
    out, seen = [], set()
    for r in recs:
        kernel = names.get(r["name"], r["name"])
        if attention_only and ccc.base_name(kernel) not in ATTENTION:
            continue
        key = (kernel, r["arch"])
        if key in seen:  # one module may hold a kernel from several objects
            continue
        seen.add(key)
        cfg = attention_config(kernel)
        shared = r["smem"] + (DYNAMIC_SMEM[ccc.base_name(kernel)](*cfg) if cfg else 0)
        threads = r["threads"] or 0
        blocks = ccc.blocks_per_sm(r["arch"], r["regs"], threads, shared) if threads else None
        out.append({"kernel": kernel, "arch": r["arch"], "registers": r["regs"], "shared_bytes": shared,
                    "spill_bytes": r["spill"], "threads": threads or None, "blocks_per_sm": blocks})
    return sorted(out, key=lambda d: (d["arch"], d["kernel"]))


def violations(table: list[dict]) -> list[str]:
    """What breaks the attention kernels' design in a table of rows(): any spill, or fewer resident warps than
    DESIGN_WARPS for an instantiation the arch runs, or an (kernel, HS) the design lists with no row for an arch."""
    bad, seen = [], set()
    for r in table:
        base = ccc.base_name(r["kernel"])
        if base not in ATTENTION:
            continue
        name = f"{r['kernel'].split('(')[0]} sm_{r['arch']}"
        if r["spill_bytes"]:
            bad.append(f"{name}: {r['spill_bytes']} bytes of spills")
        want = design_warps(r["kernel"], r["arch"])
        if want is None:
            continue
        seen.add((base, attention_config(r["kernel"])[0], r["arch"]))
        got = (r["blocks_per_sm"] or 0) * -(-(r["threads"] or 0) // 32)
        if got < want:
            bad.append(f"{name}: {got} resident warps/SM ({r['registers']} registers, {r['shared_bytes']} B shared "
                       f"memory, {r['threads']} threads), the design states >= {want}")
    for arch in sorted({r["arch"] for r in table}):
        cls = "80" if int(arch) >= 80 else "75"
        for (base, hs), warps in DESIGN_WARPS.items():
            if cls in warps and int(arch) >= 75 and (base, hs, arch) not in seen:
                bad.append(f"{base} HS={hs} sm_{arch}: no kernel in the table")
    return bad


def build_archs() -> list[str]:
    try:
        from gpt2core import build_info

        archs = build_info().get("cuda_archs") or []
    except Exception:  # noqa: BLE001  (no installed build)
        archs = []
    if isinstance(archs, str):  # "75;90" or "75,90"
        archs = archs.replace(";", ",").split(",")
    return [str(a).strip().rstrip("a").split("-")[0] for a in archs if str(a).strip()]


def installed_module() -> Path | None:
    try:
        import importlib.util

        spec = importlib.util.find_spec("gpt2core")
    except Exception:  # noqa: BLE001
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for d in spec.submodule_search_locations:
        found = sorted(Path(d).glob("_C_cuda*.so"))
        if found:
            return found[0]
    return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="print a JSON list of objects instead of a table")
    ap.add_argument("--attention", action="store_true", help="the attention kernels only")
    ap.add_argument("--module", type=Path, help="the CUDA module to read (default: the installed gpt2core's _C_cuda)")
    ap.add_argument("--compile", action="store_true", help="compile the sources with ptxas -v instead of cuobjdump")
    ap.add_argument("--sources", nargs="+", type=Path, help="with --compile: the .cu files (default: the backend's)")
    ap.add_argument("--archs", help="comma-separated compute capabilities (default: the build's)")
    ap.add_argument("--cache-dir", type=Path, help="with --compile: check_cuda_compile.py's compile cache")
    ap.add_argument("--check", action="store_true",
                    help="exit 1 when an attention kernel spills or has fewer resident warps than the design states")
    args = ap.parse_args(argv)
    archs = [a.strip() for a in args.archs.split(",")] if args.archs else build_archs()
    cuobjdump = find_tool("cuobjdump")
    module = args.module or installed_module()
    if args.module is not None and not args.module.exists():
        ap.error(f"--module {args.module}: no such file")
    if not args.compile and cuobjdump and module:
        recs = [r for r in from_module(module, cuobjdump) if not archs or r["arch"] in archs]
    else:
        if not archs:
            ap.error("no CUDA build to read the architectures from: give --archs")
        nvcc = find_tool("nvcc")
        if nvcc is None:
            ap.error("neither cuobjdump with a built module nor nvcc found (CUDA toolkit)")
        recs = from_compile(args.sources or default_sources(), archs, args.cache_dir, nvcc)
    table = rows(recs, args.attention)
    bad = violations(table) if args.check else []
    for msg in bad:
        print(f"kernel_resources: {msg}", file=sys.stderr)
    if args.json:
        print(json.dumps(table, indent=1))
        return 1 if bad else 0
    print(f"{'arch':>5} {'regs':>5} {'smem B':>7} {'spill':>6} {'thr':>5} {'blk/SM':>6}  kernel")
    for r in table:
        print(f"{r['arch']:>5} {r['registers']:>5} {r['shared_bytes']:>7} {r['spill_bytes']:>6} "
              f"{r['threads'] or '-':>5} {r['blocks_per_sm'] if r['blocks_per_sm'] is not None else '-':>6}  "
              f"{r['kernel'].split('(')[0]}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
