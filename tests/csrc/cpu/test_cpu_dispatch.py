"""The CPU backend's instruction-set variants (csrc/cpu/backend_cpu.h): the default is the best one this CPU
runs; every variant computes the float64 numpy reference's loss and gradients (tests/numpy_gpt2.py) and its
AdamW step; and the shipped module has no AVX / AVX-512 code outside the variants that cpuid guards, so it
runs on any x86-64 CPU (no -march=native)."""
import platform
import re
from pathlib import Path
import shutil
import subprocess

import numpy as np
import pytest

import numpy_gpt2 as ref
from gpt2core import _C

F32_RTOL = 1e-4  # fp32 vs the float64 reference, as tests/csrc/model/test_model_backward.py (~1e-6 measured)
F64_RTOL = 1e-9  # float64 vs float64: summation order only


@pytest.fixture()
def restore_isa():
    before = _C.cpu_isa()
    yield
    _C.set_cpu_isa(before)


def cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return set(next(ln for ln in f if ln.startswith("flags")).split(":")[1].split())
    except (OSError, StopIteration):
        return set()


def test_default_is_the_best_variant_this_cpu_runs():
    isas = _C.cpu_isas()
    assert _C.cpu_isa() == isas[0] == _C.build_info()["cpu_isa"]
    assert isas[-1] in ("baseline", "native")
    if platform.machine() == "x86_64" and isas[-1] == "baseline":  # a GCC build on x86-64 has all three
        flags = cpu_flags()
        want = ["baseline"]
        if {"avx2", "fma", "bmi2", "movbe"} <= flags:
            want.insert(0, "x86-64-v3")
            if {"avx512f", "avx512bw", "avx512dq", "avx512vl"} <= flags:
                want.insert(0, "x86-64-v4")
        assert isas == want, (isas, sorted(f for f in flags if f.startswith("avx")))


def test_unknown_variant_is_refused_by_name(restore_isa):
    with pytest.raises(ValueError, match=r"'avx9' is not one .* \(choices: .*baseline|native"):
        _C.set_cpu_isa("avx9")


def _loss_grads_step(pb, cls):
    m = pb.model(cls)
    m.zero_grad()
    loss = m.forward(pb.idx, pb.targets)
    m.backward()
    grads = {k: v.copy() for k, v in m.grads().items()}
    m.adamw_update(lr=1e-2, weight_decay=0.0, step=1)
    return loss, grads, {k: v.copy() for k, v in m.params().items()}


def test_every_variant_matches_the_float64_reference(padded, restore_isa):
    pb = padded
    want_loss, _, _ = ref.forward(pb.params, pb.idx, pb.targets, pb.V, pb.NH)
    want_grads = ref.backward(pb.params, pb.idx, pb.targets, pb.V, pb.NH)
    results = {}
    for isa in _C.cpu_isas():
        _C.set_cpu_isa(isa)
        for cls, rtol in ((_C.Model, F32_RTOL), (_C.ModelF64, F64_RTOL)):
            loss, grads, params = _loss_grads_step(pb, cls)
            assert loss == pytest.approx(want_loss, rel=rtol), isa
            for k in ref.NAMES:
                scale = np.abs(want_grads[k]).max()
                np.testing.assert_allclose(grads[k], want_grads[k], rtol=rtol, atol=rtol * scale, err_msg=f"{isa} {k}")
                # AdamW on the model's own gradients (the key bias has a true gradient of 0: its rounding noise
                # would decide the sign of a reference step). The step moves each weight by ~lr = 1e-2; lr reaches
                # the core as float32 (~3e-8 relative) and fp32 weights (~1) round to 6e-8: atol 1e-6 as test_optim
                want = pb.params[k].copy()
                ref.adamw(want, grads[k].astype(np.float64), np.zeros_like(want), np.zeros_like(want), 1, 1e-2)
                np.testing.assert_allclose(params[k], want, rtol=0, atol=1e-6, err_msg=f"{isa} {k}")
            results[isa, cls.__name__] = grads
    # the variants are different machine code: with FMA (x86-64-v3 and up) fp32 gradients round differently
    isas = _C.cpu_isas()
    if "x86-64-v3" in isas:
        differs = any(not np.array_equal(results["x86-64-v3", "Model"][k], results[isas[-1], "Model"][k])
                      for k in ref.NAMES)
        assert differs, "x86-64-v3 and baseline gave bit-identical fp32 gradients: was the variant used?"


def _functions_using_wide_registers(so: str) -> dict[str, int]:
    """Exported function -> count of instructions touching ymm/zmm registers or AVX-512 masks (objdump
    attributes a local function, such as an OpenMP loop body, to the exported symbol before it)."""
    text = subprocess.run(["objdump", "-d", "--no-show-raw-insn", so], capture_output=True, text=True,
                          check=True).stdout
    out: dict[str, int] = {}
    fn = "?"
    for line in text.splitlines():
        m = re.match(r"^[0-9a-f]+ <(.+)>:$", line)
        if m:
            fn = m.group(1)
        elif re.search(r"%[yz]mm\d|%k[1-7]\b", line):
            out[fn] = out.get(fn, 0) + 1
    return out


@pytest.mark.skipif(platform.machine() != "x86_64" or shutil.which("objdump") is None,
                    reason="x86-64 with binutils only")
def test_no_avx_outside_the_guarded_variants():
    """A wheel built here must run on a CPU without AVX-512 or AVX2: wide-register code may only sit in the
    x86_64_v3 / x86_64_v4 variants (namespaces gpt2::cpu::x86_64_v{3,4}, mangled 9x86_64_v3 / 9x86_64_v4)."""
    if _C.cpu_isas()[-1] == "native":
        pytest.skip("a GPT2CORE_NATIVE build (-march=native) is for this machine only")
    # The module exports only PyInit__C (hidden visibility) and is installed stripped, so its code cannot be told
    # apart by function: the core library's objects in the build tree that made this install are read instead,
    # where every function keeps its (namespaced) symbol.
    objs = sorted(Path(__file__).resolve().parents[3].glob("build/*/CMakeFiles/gpt2core_cpu.dir/csrc/**/*.o"))
    if not objs:
        pytest.skip("no build tree with the core library's objects (installed from a wheel)")
    used = {}
    for o in objs:
        used.update({f"{o.name}: {f}": n for f, n in _functions_using_wide_registers(str(o)).items()})
    assert any("9x86_64_v4" in f for f in used) and any("9x86_64_v3" in f for f in used), sorted(used)[:5]
    stray = {f: n for f, n in used.items() if "9x86_64_v3" not in f and "9x86_64_v4" not in f}
    assert not stray, f"AVX code outside the dispatched variants (built with -march=native?): {stray}"
