"""Launch shapes against what ptxas compiled (issue 29, fixes 2 and 3).

The emulator ignores __launch_bounds__ and registers, so an edit that pushes a kernel past what its block can hold
would fail only on a GPU (cudaErrorLaunchOutOfResources). Here:
  - the emulated backend runs a training step in every configuration that picks different kernels (fp32 naive
    unfused, fp32 flash fused, bf16 and fp16 on the tensor-core attention), logging each launch's block and dynamic
    shared memory (GPT2CORE_EMU_LAUNCH_LOG);
  - scripts/check_cuda_compile.py compiles csrc/cuda (and the bf16 / fp16 instantiations) with nvcc for sm_75,
    sm_80, sm_90 and every arch this build was compiled for, and checks from ptxas's report and the kept PTX that
    every kernel declares __launch_bounds__, that its registers fit the register file at that bound, that every
    logged launch is within its kernel's bound and shared-memory limit, and that each
    `occupancy(NAME): >= W warps/SM` comment holds;
  - the fused classifier picks 768-thread blocks where an SM holds 1536 threads (sm_86 / sm_89) and 1024 elsewhere,
    with the same loss and gradients (fp32 rounding apart).
Needs the emulated module (cmake, CUDA headers); the compile check needs nvcc.
"""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from test_cuda_emu import BUILD, ROOT, emu, nvcc_check_cache  # noqa: F401  (fixtures)

# One training step per configuration that launches different kernels; the log gets every launch.
_STEP = """
import sys, numpy as np
sys.path.insert(0, sys.argv[1])
import gpt2core_cuda_emu as E
cfg = dict(max_seq_len=40, vocab_size=97, padded_vocab_size=128, n_layer=1, n_head=3, n_embd=192)
runs = [("Model", dict(attention="naive", fused=False)), ("Model", dict(attention="flash")),
        ("ModelBF16", dict(attention="flash")), ("ModelF16", dict(attention="flash"))]
rng = np.random.default_rng(0)
idx = rng.integers(0, 97, (3, 37)).astype(np.int32)
out = []
for cls, kw in runs[: int(sys.argv[2])]:
    m = getattr(E, cls)(**cfg, device="cuda", **kw)
    for v in m.params().values():
        v[...] = rng.standard_normal(v.shape).astype(np.float32) * 0.02
    m.params_changed()
    m.zero_grad()
    m.forward_backward(idx, idx, 1.0)
    out.append(float(m.take_loss()))
    m.optimizer_step(lr=1e-4, step=1)
    if len(sys.argv) > 3:
        np.save(sys.argv[3], m.grads()["wte"])
print(out)
"""


def _step_log(path, runs=4, cc=None, grads=None):
    env = dict(os.environ, GPT2CORE_EMU_LAUNCH_LOG=str(path))
    if cc:
        env["GPT2CORE_EMU_COMPUTE_CAPABILITY"] = cc
    r = subprocess.run([sys.executable, "-c", _STEP, str(BUILD), str(runs)] + ([str(grads)] if grads else []),
                       env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def _blocks(path):
    out = {}
    for line in path.read_text().splitlines():
        rec = json.loads(line)
        if "kernel" in rec:
            name = rec["kernel"].strip("()").split("<")[0]
            out.setdefault(name, set()).add(int(np.prod(rec["block"])))
    return out


def test_fused_classifier_block_follows_the_sms_thread_count(emu, tmp_path):  # noqa: F811
    """sm_86 (1536 threads per SM): 768-thread blocks, so two fill an SM; sm_90: 1024. Same loss and gradient to
    fp32 rounding (the block's fixed-order reduction has another shape)."""
    got = {}
    for cc in ("86", "90"):
        log = tmp_path / f"cc{cc}.jsonl"
        loss = _step_log(log, runs=2, cc=cc, grads=tmp_path / f"g{cc}.npy")  # fp32 naive unfused, fp32 flash
        got[cc] = (loss[1], np.load(tmp_path / f"g{cc}.npy"), _blocks(log)["crossentropy_forward_backward_kernel"])
    assert got["86"][2] == {768} and got["90"][2] == {1024}
    assert got["86"][0] == pytest.approx(got["90"][0], rel=1e-6)
    g86, g90 = got["86"][1], got["90"][1]
    assert np.max(np.abs(g86 - g90)) <= 1e-5 * np.max(np.abs(g90)) and np.max(np.abs(g90)) > 0


def _archs():
    """sm_75, sm_80, sm_90 and every arch this build of gpt2core was compiled for."""
    archs = {75, 80, 90}
    try:
        from gpt2core import build_info

        archs |= {int(a) for a in str(build_info().get("cuda_archs") or "").replace(";", ",").split(",") if a.strip()}
    except Exception:  # noqa: BLE001  (no installed build: the fixed three)
        pass
    return ",".join(str(a) for a in sorted(archs))


@pytest.mark.slow
def test_every_kernel_launch_fits_what_ptxas_compiled(emu, nvcc_check_cache, tmp_path):  # noqa: F811
    """The compile check with the launch log of a training step in each kernel configuration (about 8 minutes of
    nvcc on 2 cores for three archs; CI runs it). The compile is test_cuda_emu.py's no-spill check's when the archs
    agree (sm_75, sm_80, sm_90 and a build for a subset of them, as CI's): the session's cache holds it."""
    nvcc = shutil.which("nvcc") or ("/usr/local/cuda/bin/nvcc" if Path("/usr/local/cuda/bin/nvcc").exists() else None)
    if nvcc is None:
        pytest.skip("nvcc not found")
    log = tmp_path / "step.jsonl"
    _step_log(log)
    launched = _blocks(log)
    for k in ("layernorm_backward_kernel", "crossentropy_forward_backward_kernel", "attention_tc_forward_kernel",
              "attention_naive_softmax_kernel", "adamw_kernel", "column_reduce_kernel"):
        assert k in launched, k  # the step covered the configurations the check is about
    files = [str(f) for f in sorted((ROOT / "csrc" / "cuda").glob("*.cu")) +
             sorted((ROOT / "tests" / "csrc" / "cuda" / "cuda_compile").glob("*.cu"))]
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "check_cuda_compile.py"), "--archs", _archs(), "-q",
                        "--nvcc", nvcc, "-I", str(ROOT / "csrc"), "--launch-log", str(log),
                        "--cache-dir", str(nvcc_check_cache), *files],
                       capture_output=True, text=True, timeout=1500)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    assert "launch bounds on every csrc kernel" in r.stdout and "launched kernels within them" in r.stdout


def test_the_check_refuses_a_kernel_without_bounds_or_over_its_claim(tmp_path):
    """The checker's own logic on synthetic input (no nvcc): PTX without .maxntid, a launch above the bound, an
    occupancy claim the registers cannot meet."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import check_cuda_compile as c

    ptx = c.parse_ptx(".visible .entry _Z1kPf(\n .param .u64 p\n)\n.maxntid 256, 1, 1\n.minnctapersm 5\n{\n ret;\n}\n"
                      ".visible .entry _Z1jPf(\n .param .u64 p\n)\n{\n ret;\n}\n")
    assert ptx == {"_Z1kPf": {"maxntid": 256, "minnctapersm": 5}, "_Z1jPf": {"maxntid": None, "minnctapersm": None}}
    # 48 registers x 256 threads: 5 blocks (40 warps) on sm_90; sm_75 holds 1024 threads (4 blocks)
    assert c.blocks_per_sm("90", 48, 256, 0) * 8 == 40
    assert c.blocks_per_sm("75", 48, 256, 0) == 4
    # the old layernorm backward: 56 registers x 512 threads -> 2 blocks, 32 warps (not the ~40 its comment said)
    assert c.blocks_per_sm("90", 56, 512, 6144) * 16 == 32
    # llm.c's point: 1024-thread blocks fill 2/3 of an sm_86 SM, 768-thread blocks all of it
    assert c.blocks_per_sm("86", 32, 1024, 0) * 1024 == 1024 and c.blocks_per_sm("86", 32, 768, 0) * 768 == 1536
    assert c.base_name("void gpt2::cuda::layernorm_forward_kernel<float, true, 8>(float*, int)") == \
        "layernorm_forward_kernel"
    assert c.base_name("gpt2::cuda::column_reduce_kernel(float*, float const*, int, int)") == "column_reduce_kernel"
    f = tmp_path / "k.cuh"
    f.write_text("// occupancy(foo_kernel): >= 48 warps/SM on sm_80 sm_90 with 6144 B dynamic smem\n")
    assert c.read_claims([f]) == [("foo_kernel", 48, ["80", "90"], 6144, "k.cuh:1")]
    log = tmp_path / "log.jsonl"
    log.write_text('{"kernel": "(layernorm_backward_kernel<floatX>)", "grid": [9, 1, 1], "block": [256, 1, 1], '
                   '"smem": 1536}\n{"memset": 4}\n{"kernel": "column_reduce_kernel", "block": [32, 32, 1], "smem": 0}\n')
    assert c.read_launch_log(log) == {"layernorm_backward_kernel": {"threads": 256, "smem": 1536},
                                      "column_reduce_kernel": {"threads": 1024, "smem": 0}}


_FAKE_NVCC = r'''#!{python}
import os, re, sys
from pathlib import Path
a = sys.argv[1:]
if a == ["--version"]:
    print("fake nvcc 1.0")
    sys.exit(0)
with open(Path(__file__).with_name("calls.txt"), "a") as f:
    f.write("call\n")
src = Path(a[a.index("-o") - 1])
if "BROKEN" in src.read_text():
    print(f"{{src}}(1): error: broken", file=sys.stderr)
    sys.exit(2)
keep = a[a.index("-keep-dir") + 1]
for g in [a[i + 1] for i, x in enumerate(a) if x == "-gencode"]:
    arch = re.search(r"compute_(\d+)", g).group(1)
    Path(keep, f"{{src.stem}}.compute_{{arch}}.ptx").write_text(
        ".visible .entry _Z1kPf(\n .param .u64 p\n)\n.maxntid 128, 1, 1\n{{\n ret;\n}}\n")
    print(f"ptxas info    : Compiling entry function '_Z1kPf' for 'sm_{{arch}}'\n"
          f"ptxas info    : Function properties for _Z1kPf\n"
          f"    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n"
          f"ptxas info    : Used 32 registers, used 0 barriers, 1024 bytes smem, 360 bytes cmem[0]", file=sys.stderr)
Path(a[a.index("-o") + 1]).write_text("")
'''


def test_the_check_compiles_each_input_once_with_a_cache_dir(tmp_path):
    """--cache-dir (the no-spill and launch-bounds checks share one compile): a second run with the same inputs
    reads the stored report (same verdict, no compile); a changed header or source, other archs or flags compile
    again; a failed compile is not stored. A stand-in nvcc counts the compiles (no toolkit needed)."""
    nvcc = tmp_path / "bin" / "nvcc"
    nvcc.parent.mkdir()
    nvcc.write_text(_FAKE_NVCC.format(python=sys.executable))
    nvcc.chmod(0o755)
    calls = tmp_path / "bin" / "calls.txt"
    inc = tmp_path / "inc"
    inc.mkdir()
    (inc / "k.cuh").write_text("// header\n")
    src = tmp_path / "src" / "k.cu"
    src.parent.mkdir()
    src.write_text('#include "k.cuh"\n')
    cache = tmp_path / "cache"

    def run(*extra):
        r = subprocess.run([sys.executable, str(ROOT / "scripts" / "check_cuda_compile.py"), "--nvcc", str(nvcc),
                            "-I", str(inc), "--cache-dir", str(cache), *extra, str(src)],
                           capture_output=True, text=True, timeout=120)
        n = len(calls.read_text().splitlines()) if calls.exists() else 0
        return r.returncode, r.stdout + r.stderr, n

    rc, out, n = run("--archs", "75,90")
    assert rc == 0 and n == 1 and "k.cu sm_75 kernel k(float*): 32 registers" in out, out
    rc2, out2, n = run("--archs", "75,90")
    assert (rc2, out2, n) == (rc, out, 1)  # from the cache: the same report, no compile
    rc, out, n = run("--archs", "75,80,90")
    assert rc == 0 and n == 2 and "sm_80" in out
    (inc / "k.cuh").write_text("// header, edited\n")
    assert run("--archs", "75,90")[:3:2] == (0, 3)
    assert run("--archs", "75,90", "--extra=-lineinfo")[:3:2] == (0, 4)
    src.write_text('#include "k.cuh"\n// BROKEN\n')
    for expected_calls in (5, 6):  # a failure is compiled (and reported) every time
        rc, out, n = run("--archs", "75,90")
        assert rc == 1 and n == expected_calls and "nvcc failed" in out
