"""precision="fp8" from Python and the command line (issue 49): where it runs (sm_89 / sm_90 only; everywhere else a
clear error naming the device and those architectures, exit 2 from gpt2core-train), its flags, and the memory plan's
FP8 bytes against what the core allocates. The FP8 arithmetic itself is tested against float64 numpy of the same
quantisation in tests/csrc/cuda/test_fp8*.py and tests/csrc/test_fp8_cast.py."""
import subprocess
import sys

import pytest

from gpt2core import GPT2
from gpt2core.config import TrainConfig, get_preset
from gpt2core.errors import ArgError
from gpt2core.model import gpt2 as gpt2_module
from gpt2core.model.gpt2 import DeviceError, check_fp8_device
from gpt2core.planning import memplan


def test_fp8_on_the_cpu_is_refused_naming_the_architectures_that_have_it():
    with pytest.raises(DeviceError, match=r"device 'cpu' has none") as e:
        GPT2("tiny", precision="fp8")
    assert "sm_89" in str(e.value) and "sm_90" in str(e.value)


@pytest.mark.parametrize("cap,ok", [(75, False), (80, False), (86, False), (89, True), (90, True), (100, False)])
def test_fp8_runs_on_sm_89_and_sm_90_only(monkeypatch, cap, ok):
    """The architecture gate, with the GPU's answers stood in for: every other capability is refused with the GPU's
    name and its sm, one below and one above the two included."""
    monkeypatch.setattr(gpt2_module._C, "cuda_capability", lambda i: cap)
    monkeypatch.setattr(gpt2_module._C, "cuda_device_name", lambda i: f"Test GPU {i}")
    if ok:
        check_fp8_device("cuda:1")
        return
    with pytest.raises(DeviceError) as e:
        check_fp8_device("cuda:1")
    msg = str(e.value)
    assert f"cuda:1 is Test GPU 1, sm_{cap}" in msg and "sm_89" in msg and "sm_90" in msg


def test_fp8_head_needs_precision_fp8():
    with pytest.raises(ValueError, match="fp8_head=True .* needs precision='fp8'"):
        GPT2("tiny", fp8_head=True)
    with pytest.raises(ArgError, match="--fp8-head needs --precision fp8"):
        TrainConfig(fp8_head=True)
    with pytest.raises(ArgError, match="--fp8-head needs --precision fp8"):
        memplan.Options(precision="bf16", fp8_head=True)


def test_train_config_refuses_fp8_on_the_cpu_and_unaligned_batches():
    with pytest.raises(ArgError, match=r"--precision fp8 needs .* sm_89 .* sm_90 .*--device cpu has none"):
        TrainConfig(precision="fp8")
    with pytest.raises(ArgError, match=r"-B \* -T = 21 must be a multiple of 16"):
        TrainConfig(precision="fp8", device="cuda", batch_size=3, seq_len=7)
    TrainConfig(precision="fp8", device="cuda", batch_size=2, seq_len=8)  # 16: accepted


def test_gpt2core_train_precision_fp8_on_the_cpu_is_one_line_and_exit_2(tmp_path):
    r = subprocess.run([sys.executable, "-m", "gpt2core.train", "--preset", "tiny", "--precision", "fp8",
                        "--output-dir", str(tmp_path / "run")], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "sm_89" in lines[0] and "sm_90" in lines[0] and "cpu" in lines[0], r.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("head", [False, True])
@pytest.mark.parametrize("B,T", [(2, 16), (1, 48)])
def test_the_plan_counts_what_the_core_allocates_for_fp8(head, B, T):
    """memplan.fp8_bytes against the core's own count (GPT2Model::fp8_bytes, memory_bytes()['fp8']) of a model
    with its FP8 layers on: the CPU backend runs them (it is the reference), so the count is real here."""
    cfg = get_preset("tiny")
    m = GPT2(cfg, seed=0)
    if not hasattr(m._m, "set_fp8"):
        pytest.skip("this build of gpt2core._C has no FP8 layers")
    m._m.set_fp8(True, head=head)
    assert m._m.memory_bytes(B, T)["fp8"] == memplan.fp8_bytes(cfg, B * T, head)
    o = memplan.Options(precision="fp8", fp8_head=head)
    parts = memplan.memory(cfg, B, T, o)
    bf16 = memplan.memory(cfg, B, T, memplan.Options(precision="bf16"))
    assert parts["fp8"] == memplan.fp8_bytes(cfg, B * T, head) > 0 and bf16["fp8"] == 0
    assert memplan.total(parts) == memplan.total(bf16) + parts["fp8"]


def test_plan_of_a_gpu_run_shows_the_fp8_line():
    r = subprocess.run([sys.executable, "-m", "gpt2core.train", "--plan", "--preset", "d12", "--device", "cuda",
                        "--precision", "fp8", "-B", "8", "-T", "1024", "--gpu-memory", "80GiB"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert any(line.split()[:1] == ["fp8"] for line in r.stdout.splitlines()), r.stdout
    r = subprocess.run([sys.executable, "-m", "gpt2core.train", "--plan", "--preset", "d12", "--device", "cuda",
                        "--precision", "bf16", "-B", "8", "-T", "1024", "--gpu-memory", "80GiB"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and not any(line.split()[:1] == ["fp8"] for line in r.stdout.splitlines()), r.stdout
