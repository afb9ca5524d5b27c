"""scripts/kernel_resources.py: its parsers on cuobjdump's and ptxas's formats, the occupancy arithmetic and the
design check on planted rows (no toolkit needed), and the real thing: the attention kernels compiled for the build's
architectures (CI: 75;90) must not spill and must hold the resident warps the design states (skipped without a CUDA
build of gpt2core or without nvcc). The attention kernels' dynamic shared memory (DYNAMIC_SMEM) is checked against
the emulator's launch log in tests/csrc/cuda/test_cuda_emu_attention_tc.py."""
import json
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
import kernel_resources as kr  # noqa: E402

FWD64 = "void gpt2::cuda::attention_tc_forward_kernel<64, 2, __nv_bfloat16>(__nv_bfloat16*, float*, int)"
DQ128 = "void gpt2::cuda::attention_tc_backward_dq_kernel<128, true, 2, __half>(__half*, int)"

RESOURCE_USAGE = """
Fatbin elf code:
================
arch = sm_90
code version = [1,8]
host = linux
compile_size = 64bit

Resource usage:
 Common:
  GLOBAL:0
 Function _Z3fooPf:
  REG:250 STACK:0 SHARED:0 LOCAL:0 CONSTANT[0]:412 TEXTURE:0 SURFACE:0 SAMPLER:0
 Function _Z3barPf:
  REG:40 STACK:16 SHARED:1056 LOCAL:24 CONSTANT[0]:380 TEXTURE:0 SURFACE:0 SAMPLER:0

Fatbin elf code:
================
arch = sm_75
code version = [1,7]

Resource usage:
 Function _Z3fooPf:
  REG:233 STACK:0 SHARED:0 LOCAL:0 CONSTANT[0]:412 TEXTURE:0 SURFACE:0 SAMPLER:0
"""

ELF = """
Fatbin elf code:
================
arch = sm_90
code version = [1,8]

.nv.info._Z3fooPf
	<0x1>
	Attribute:	EIATTR_KPARAM_INFO
	Format:	EIFMT_SVAL
	Value:	Index : 0x0	Ordinal : 0x0	Offset  : 0x0	Size    : 0x8
	<0x2>
	Attribute:	EIATTR_MAX_THREADS
	Format:	EIFMT_SVAL
	Value:	0x80 0x1 0x1 
.nv.info._Z3barPf
	Attribute:	EIATTR_REGCOUNT
	Format:	EIFMT_SVAL
	Value:	0x28
"""


def test_cuobjdump_resource_usage_and_launch_bounds_are_parsed():
    recs = kr.parse_resource_usage(RESOURCE_USAGE)
    assert [(r["name"], r["arch"], r["regs"], r["smem"], r["spill"]) for r in recs] == [
        ("_Z3fooPf", "90", 250, 0, 0), ("_Z3barPf", "90", 40, 1056, 24), ("_Z3fooPf", "75", 233, 0, 0)]
    assert kr.parse_elf_max_threads(ELF) == {("_Z3fooPf", "90"): 128}  # bar declares no bounds


def test_template_arguments_pick_the_dynamic_shared_memory():
    assert kr.template_args(FWD64) == ["64", "2", "__nv_bfloat16"]
    assert kr.attention_config(FWD64) == (64, 2) and kr.attention_config(DQ128) == (128, 2)
    assert kr.attention_config("void gpt2::cuda::adamw_kernel<float>(float*)") is None
    # by hand from attention_tc.cuh: Q (128 x 64) + 2 stages x (K + V) (64 x 64), 2 bytes each
    assert kr.DYNAMIC_SMEM["attention_tc_forward_kernel"](64, 2) == (128 + 256) * 64 * 2 == 49152
    assert kr.DYNAMIC_SMEM["attention_tc_backward_dq_kernel"](128, 2) == 2 * 64 * (64 + 128) * 2 == 49152
    assert kr.runs_on(FWD64, "90") and not kr.runs_on(FWD64, "75") and not kr.runs_on(DQ128, "75")


def _table(regs, spill=0, smem=0, kernel=FWD64, arch="80"):
    return kr.rows([{"name": kernel, "arch": arch, "regs": regs, "smem": smem, "spill": spill, "threads": 128}])


def test_rows_count_static_plus_dynamic_shared_memory_and_blocks():
    (r,) = _table(250)
    assert set(r) == {"kernel", "arch", "registers", "shared_bytes", "spill_bytes", "threads", "blocks_per_sm"}
    # 250 registers -> 8192 a warp, 32768 a block: 2 blocks by registers; 49152 + 1024 B: 3 by smem (164 KiB)
    assert r["shared_bytes"] == 49152 and r["blocks_per_sm"] == 2


def test_design_check_fails_on_a_spill_and_on_too_few_warps():
    """Planted rows: a spill, and 70000 B of static shared memory on top of the 48 KiB dynamic (one block of 4 warps
    per sm_80 SM, the design says 8); a table without some kernel the design lists is refused too."""
    assert any("spills" in m for m in kr.violations(_table(250, spill=8)))
    assert any("resident warps" in m for m in kr.violations(_table(250, smem=70000)))
    assert any("attention_tc_backward_dq_kernel HS=128 sm_80: no kernel" in m for m in kr.violations(_table(250)))
    ok = [m for m in kr.violations(_table(250)) if FWD64.split("(")[0] in m]
    assert ok == []


def _cuda_archs():
    try:
        from gpt2core import build_info
    except Exception:  # noqa: BLE001
        return []
    info = build_info()
    return kr.build_archs() if info.get("cuda") else []


@pytest.mark.slow
def test_attention_kernels_of_the_build_spill_nothing_and_keep_their_occupancy(capsys):
    """The attention kernels for the build's architectures (cuobjdump on the module where the toolkit has it, else
    compiled again with ptxas -v: about 2 minutes of nvcc): no spill, and at least the design's resident warps."""
    archs = _cuda_archs()
    if not archs:
        pytest.skip("no CUDA build of gpt2core installed")
    cuobjdump = kr.find_tool("cuobjdump")
    args = ["--json", "--attention", "--check", "--archs", ",".join(archs)]
    if not (cuobjdump and kr.installed_module()):
        if kr.find_tool("nvcc") is None:
            pytest.skip("neither cuobjdump nor nvcc found")
        args += ["--compile", "--sources", str(ROOT / "tests" / "csrc" / "cuda" / "cuda_compile" / "attention_tc.cu"),
                 "--cache-dir", str(ROOT / "build" / "kernel-resources")]
    rc = kr.main(args)
    out, err = capsys.readouterr()
    table = json.loads(out)
    assert rc == 0, err
    assert {r["arch"] for r in table} == set(archs)
    assert all(r["spill_bytes"] == 0 for r in table)


@pytest.mark.slow
def test_cuobjdump_of_the_built_module_agrees_with_ptxas(capsys):
    """The two sources of the numbers on the real build: cuobjdump on the installed module (NVIDIA's wheel
    nvidia-cuda-cuobjdump, requirements-dev.txt) and the attention sources compiled again with ptxas -v. Every
    attention kernel of every build architecture in both, with the same registers, spills and launch bounds;
    cuobjdump's shared memory is ptxas's plus at most the 1 KiB it reports on sm_90."""
    archs = _cuda_archs()
    if not archs:
        pytest.skip("no CUDA build of gpt2core installed")
    if not (kr.find_tool("cuobjdump") and kr.installed_module()) or kr.find_tool("nvcc") is None:
        pytest.skip("needs cuobjdump (pip install nvidia-cuda-cuobjdump) and nvcc")
    tables = []
    for extra in ([], ["--compile", "--sources", str(ROOT / "tests" / "csrc" / "cuda" / "cuda_compile" /
                                                     "attention_tc.cu"),
                       "--cache-dir", str(ROOT / "build" / "kernel-resources")]):
        assert kr.main(["--json", "--attention", "--archs", ",".join(archs), *extra]) == 0
        tables.append({(r["kernel"], r["arch"]): r for r in json.loads(capsys.readouterr().out)})
    obj, ptx = tables
    assert set(obj) == set(ptx) and {a for _, a in obj} == set(archs)
    assert {k.split("<")[0] for k, _ in obj} == {f"void gpt2::cuda::{n}" for n in kr.ATTENTION}
    for key, o in obj.items():
        p = ptx[key]
        assert (o["registers"], o["spill_bytes"], o["threads"]) == (p["registers"], p["spill_bytes"], p["threads"]), key
        assert 0 <= o["shared_bytes"] - p["shared_bytes"] <= (1024 if key[1] == "90" else 0), key
