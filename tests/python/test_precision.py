"""Precision selection from Python (the CPU side; the bf16 / fp16 numerics are in test_cuda_emu_bf16_*.py and
test_cuda_emu_f16*.py)."""
import importlib.util
from pathlib import Path

import numpy as np
import pytest

from gpt2core import GPT2, _C
from gpt2core.model import DeviceError

ROOT = Path(__file__).resolve().parents[2]


def test_cpu_defaults_to_fp32_and_rejects_bf16_and_fp16():
    m = GPT2("tiny", seed=0)
    assert m.precision == "fp32" and m._m.dtype == "float32"
    for p, cls in (("bf16", _C.ModelBF16), ("fp16", _C.ModelF16)):
        with pytest.raises(ValueError, match=f"precision='{p}'.*need device='cuda'"):
            GPT2("tiny", precision=p)
        with pytest.raises(ValueError, match=f"{p} mixed precision needs device='cuda'"):  # the C++ layer says it too
            cls(max_seq_len=8, vocab_size=10, padded_vocab_size=16, n_layer=1, n_head=2, n_embd=8, device="cpu")
    with pytest.raises(ValueError, match="precision must be"):
        GPT2("tiny", precision="fp4")  # fp8 exists now (sm_89 / sm_90: tests/python/test_fp8_precision.py)


@pytest.mark.skipif(_C.cuda_status() == "", reason="a CUDA device is available here")
def test_bf16_on_a_machine_without_gpu_is_a_device_error():
    assert _C.cuda_capability(0) == -1 and _C.cuda_device_name(0) == ""
    for p in ("bf16", "fp16"):
        with pytest.raises((DeviceError, ValueError)):
            GPT2("tiny", device="cuda", precision=p)


def test_step_count_sets_the_rounding_seed():
    """GPT2.step_count (restored on resume) is also the seed of the bf16 copy's stochastic rounding."""
    m = GPT2("tiny", seed=0)
    x = np.arange(8, dtype=np.int32)[None]
    m.forward(x, x)
    m.backward()
    m.step(lr=1e-3)
    assert m.step_count == 1 and m._m.param_round_seed == 1
    m.step_count = 42
    assert m._m.param_round_seed == 42


def test_bench_finds_the_gpu_peak_for_the_precision():
    spec = importlib.util.spec_from_file_location("bench", ROOT / "scripts" / "bench.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.gpu_peak_tflops("NVIDIA H100 80GB HBM3", "bf16") == (989.0, "H100 SXM")
    assert bench.gpu_peak_tflops("NVIDIA H100 PCIe", "tf32") == (378.0, "H100 PCIe")
    assert bench.gpu_peak_tflops("NVIDIA A100-SXM4-80GB", "fp32") == (19.5, "A100")
    assert bench.gpu_peak_tflops("Some Future GPU", "bf16") is None
    assert bench.gpu_peak_tflops("Tesla T4", "fp16") == (65.0, "T4")
    assert bench.gpu_peak_tflops("Tesla V100-SXM2-32GB", "fp16") == (125.0, "V100")


def test_precision_follows_the_gpu_generation():
    """What a CUDA model picks on each GPU generation (the capability a real GPU would report): bf16 from
    sm_80 (A100, H100); fp16 on a T4 or V100 (sm_75 / sm_70: fp16 tensor cores, no bf16 or tf32, which are
    refused there); fp32 below (P100, sm_60), where fp16 is refused too."""
    from gpt2core.model import pick_precision
    assert pick_precision(None, 90) == pick_precision(None, 80) == "bf16"
    assert pick_precision(None, 75) == pick_precision(None, 70) == "fp16"
    assert pick_precision(None, 61) == pick_precision(None, 60) == "fp32"
    assert pick_precision(None, 90, dtype="float64") == pick_precision(None, 75, dtype="float64") == "fp32"
    assert pick_precision("tf32", 86) == "tf32" and pick_precision("fp32", 75) == "fp32"
    assert pick_precision("fp16", 90) == pick_precision("fp16", 70) == "fp16"
    for p in ("bf16", "tf32"):
        with pytest.raises(DeviceError, match=rf"precision='{p}' needs an sm_80\+ GPU .* sm_75: use precision='fp16'"):
            pick_precision(p, 75)
    with pytest.raises(DeviceError, match=r"precision='fp16' needs fp16 tensor cores \(sm_70\+.* sm_60: use precision='fp32'"):
        pick_precision("fp16", 60)


def test_bench_profile_maps_the_config_onto_the_gpu_model(monkeypatch, capsys):
    """`bench.py --profile` on a GPU builds gpu_model's Config from the preset. It read `cfg.max_seq_len`, which
    does not exist (the first H100 run crashed there), and no GPU-free test reached it. Here the emulator-backed
    parts of gpu_model (launch counts, the per-kernel model) are replaced by recorders. The real Config must be
    built from the real preset, and the modelled step printed beside the measured one."""
    from types import SimpleNamespace

    spec = importlib.util.spec_from_file_location("bench", ROOT / "scripts" / "bench.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    gm = bench.gpu_model_module()
    seen = {}

    def launch_counts(att, logdir, target, reuse=False, precision="bf16"):
        seen["att"], seen["target"] = att, target
        return {}

    monkeypatch.setattr(gm, "launch_counts", launch_counts)
    monkeypatch.setattr(gm, "model", lambda counts, cfg, gpu, ptxas, es: [SimpleNamespace(seconds=0.05)])
    monkeypatch.setattr(bench, "gpu_model_module", lambda: gm)  # it loads the file anew on every call
    monkeypatch.setattr(_C, "cuda_device_name", lambda i: "NVIDIA H100 80GB HBM3")
    cfg = bench.bench_config(SimpleNamespace(preset="d12", padded_vocab_size=None))
    args = SimpleNamespace(batch_size=8, seq_len=256, attention="auto")
    bench.modelled_vs_measured(args, cfg, 0.1)
    t = seen["target"]
    assert (t.B, t.T, t.C, t.NH, t.L, t.V, t.Vp, t.maxT) == (8, 256, 768, 12, 12, 50257, 50304, 1024)
    assert seen["att"] == "cudnn"
    assert "measured 100.00 ms | MODELLED 50.00 ms" in capsys.readouterr().out
