"""The memory plan (gpt2core.memplan, `gpt2core-train --plan`) and --recompute on the CPU backend (issue 37).

- the plan against what the CPU backend really allocates (its byte count, backend_bytes_in_use) after a training
  step, for every recompute level, in float32 and float64, GPT-2's and the modern architecture: within 2%;
- the plan's parts against independent arithmetic (16 bytes a parameter for bf16 + AdamW, shards under ZeRO) and
  against the activations issue 37 quotes for d12 (B=4, T=1024: 5,875 MiB kept, 5,347 MiB with GELU recomputed);
- --recompute none / gelu / layer: losses, gradients and weights bit for bit the same over several steps with
  gradient accumulation and clipping active, every architecture field on;
- `--plan` / `--plan --json`: exit 0 with the largest B, exit 2 with one line naming the smallest change that fits.
The emulated CUDA device's allocation accounting and the bit-identity in bf16 / fp16 are in
tests/csrc/cuda/test_cuda_emu_memplan.py."""
import json
import subprocess
import sys

import numpy as np
import pytest

from gpt2core import GPT2, GPT2Config, memplan, plan, train
from gpt2core.config import get_preset
from gpt2core.errors import ArgError

MiB = 2**20
TINY = GPT2Config(block_size=32, vocab_size=97, padded_vocab_size=128, n_layer=2, n_head=2, n_embd=64)
MODERN = GPT2Config.modern(2, 64, n_head=2, block_size=32, vocab_size=97, padded_vocab_size=128)


def batch(seed, B, T, V):
    rng = np.random.default_rng(seed)
    x = rng.integers(0, V, (B, T)).astype(np.int32)
    y = rng.integers(0, V, (B, T)).astype(np.int32)
    y[0, 1] = -1  # an ignored target
    return x, y


@pytest.mark.parametrize("config,dtype", [(TINY, "float32"), (MODERN, "float32"), (TINY, "float64"),
                                          ("s4", "float32")], ids=["tiny", "modern", "tiny-f64", "s4"])
def test_plan_matches_what_the_cpu_backend_allocates(config, dtype):
    c = GPT2Config(**{**config.to_dict()}) if isinstance(config, GPT2Config) else config
    B, T = (3, 32) if config != "s4" else (1, 64)
    m = GPT2(c, device="cpu", dtype=dtype)
    for level in ("none", "gelu", "layer"):
        m.recompute = level  # a new layout: the activations are freed and laid out again by the next forward
        x, y = batch(0, B, T, m.config.vocab_size)
        m.zero_grad()
        m.forward_backward(x, y)
        m.step(lr=1e-3)  # the AdamW moments exist after the first step
        used = m._m.backend_bytes_in_use
        o = memplan.Options(device="cpu", precision="float64" if dtype == "float64" else "fp32", recompute=level)
        planned = memplan.total(memplan.memory(c, B, T, o))
        assert abs(planned - used) <= 0.02 * used, (level, planned, used)


def test_recompute_levels_shrink_the_activations_as_laid_out():
    o = memplan.Options(device="cuda", precision="bf16")
    acts = {r: memplan.memory("d12", 4, 1024, memplan.Options(device="cuda", precision="bf16", recompute=r))
            ["activations"] for r in memplan.RECOMPUTE}
    L, BT, C = 12, 4 * 1024, 768
    # independent arithmetic: gelu keeps one (B, T, 4C) output instead of L; layer keeps one block's buffers
    # (ln1, qkv 3C, atty, attproj, residual2, ln2, fch 4C, fcproj: 13C per row in bf16, and the block's fp32
    # statistics) instead of L, plus the residual stream between blocks (residual3, L rows of C)
    assert acts["none"] - acts["gelu"] == (L - 1) * BT * 4 * C * 2
    per_block_t = 13 * C * 2
    per_block_m = (4 + 12) * 4  # ln1 mean/rstd, ln2 mean/rstd; the flash logsumexp (NH per row)
    assert acts["gelu"] - acts["layer"] == (L - 1) * BT * (per_block_t + per_block_m)
    assert memplan.memory("d12", 4, 1024, o)["logits"] == BT * 50304 * 2


def test_plan_agrees_with_the_figures_issue_37_quotes_for_d12():
    """Issue 37: d12, B=4, T=1024, activations 5,875 -> 5,347 MiB with GELU recomputed (the model's own report on
    the CPU, fp32, materialised attention and logits included)."""
    for level, want in (("none", 5875), ("gelu", 5347)):
        p = memplan.memory("d12", 4, 1024, memplan.Options(device="cpu", precision="fp32", recompute=level))
        assert round((p["activations"] + p["logits"]) / MiB) == want, (level, p)


def test_per_parameter_bytes_and_shards_are_the_arithmetic():
    n = GPT2Config(n_layer=48, n_head=25, n_embd=1600).num_parameters()
    p = memplan.memory("d48", 1, 1024, memplan.Options(precision="bf16"))
    assert (p["weights"], p["master_weights"], p["gradients"], p["optimizer"], p["host"]) == (2 * n, 4 * n, 4 * n,
                                                                                              8 * n, 0)
    z1 = memplan.memory("d48", 1, 1024, memplan.Options(precision="bf16", world_size=2, zero=1))
    assert z1["optimizer"] == 8 * -(-n // 2) and z1["master_weights"] == 4 * n
    z2 = memplan.memory("d48", 1, 1024, memplan.Options(precision="bf16", world_size=2, zero=2))
    assert z2["master_weights"] == 4 * n and z2["optimizer"] == z1["optimizer"]
    assert z2["gradients"] == 4 * (-(-n // 2) + memplan.grad_bucket_values(get_preset("d48"))) < 4 * n
    off = memplan.memory("d48", 1, 1024, memplan.Options(precision="bf16", offload="optimizer"))
    assert off["optimizer"] == off["master_weights"] == 0 and off["host"] == 16 * n + 2 * n  # + the bf16 staging
    cost = memplan.step_costs("d48", 1, 1024, memplan.Options(precision="bf16", offload="optimizer"))
    assert cost["offload_pcie_bytes"] == 6 * n and cost["offload_host_bytes"] == 36 * n
    assert cost["offload_host_ms"] == pytest.approx(36 * n / (memplan.HOST_GBS * 1e9) * 1e3)
    # ZeRO-2 with offload on 2 ranks: the whole master on each host, the rest of the optimizer state by the shard; the
    # device keeps the staging buffer of the gather; PCIe: the shard's gradients down and weights up, the other
    # ranks' new master weights to the host
    o = memplan.Options(precision="bf16", world_size=2, zero=2, offload="optimizer")
    zo, own = memplan.memory("d48", 1, 1024, o), -(-n // 2)
    assert zo["host"] == 4 * n + 12 * own + 2 * own and zo["optimizer"] == 0  # master; moments, grads; staging
    assert zo["master_weights"] == 4 * min(memplan.STAGE_VALUES, own) and zo["gradients"] == z2["gradients"]
    cost = memplan.step_costs("d48", 1, 1024, o)
    assert cost["offload_pcie_bytes"] == 6 * own + 4 * (n - own) and cost["offload_host_bytes"] == 36 * own


def test_the_issue_goals_as_planned():
    """Issue 37's goals (planned: no GPU here): d48 on one 24 GiB card with offload + layer recompute at B >= 4,
    and on two without offload (ZeRO-2 + layer); d36 on one 24 GiB card without offload; d24 on a 10 GiB card at
    B >= 8 (layer recompute)."""
    assert plan("d48", 4, 1024, "24GiB", recompute="layer", offload="optimizer").fits
    assert plan("d48", None, 1024, "24GiB", world_size=2, zero=2, recompute="layer").max_batch_size >= 1
    assert not plan("d48", 1, 1024, "24GiB").fits
    assert plan("d36", None, 1024, "24GiB", recompute="layer").max_batch_size >= 1
    assert plan("d24", 8, 1024, "10GiB", recompute="layer").fits


def test_largest_batch_is_the_boundary():
    o = memplan.Options(precision="bf16", recompute="gelu")
    p = plan("d12", None, 1024, "24GiB", o)
    b = p.max_batch_size
    need = lambda B: memplan.total(memplan.memory("d12", B, 1024, o))  # noqa: E731
    assert need(b) <= p.budget < need(b + 1)
    assert p.budget == int((24 * 2**30 - memplan.CUDA_CONTEXT) * (1 - memplan.SAFETY))
    assert memplan.parse_bytes("10GiB") == 10 * 2**30 and memplan.parse_bytes("80 GB") == 80 * 10**9
    with pytest.raises(ArgError, match="--gpu-memory must be a size"):
        memplan.parse_bytes("lots")


def test_recompute_is_bit_identical_over_steps_with_accumulation_and_clipping():
    """Losses, gradients and weights of the three levels bit for bit, three optimizer steps of two micro-steps
    each, clipping active (a clip far below the gradient norm), every architecture field on (MODERN) and GPT-2's;
    float32 and float64."""
    for c, dtype in ((MODERN, "float32"), (TINY, "float32"), (MODERN, "float64")):
        runs = {}
        for level in ("none", "gelu", "layer"):
            m = GPT2(c, device="cpu", dtype=dtype, seed=3)
            m.recompute = level
            trace = []
            for step in range(3):
                m.zero_grad()
                for micro in range(2):
                    x, y = batch(10 * step + micro, 2, 24, c.vocab_size)
                    m.forward_backward(x, y, grad_scale=0.5)
                trace.append(m.take_loss())
                trace.append(m.flat_grads().copy())
                norm = m.step(lr=1e-2, grad_clip=0.05)
                assert norm > 0.05  # the clip is active
                trace.append(m.flat_params().copy())
            runs[level] = trace
        for level in ("gelu", "layer"):
            for a, b in zip(runs["none"], runs[level]):
                assert np.array_equal(np.asarray(a), np.asarray(b)), (c.position, dtype, level)


def test_recompute_flag_and_its_alias(tmp_path):
    assert train.parse_args(["--recompute", "layer", "--output-dir", str(tmp_path)]).recompute == "layer"
    cfg = train.parse_args(["--recompute-gelu", "--output-dir", str(tmp_path)])
    assert cfg.recompute == "gelu" and cfg.recompute_gelu
    with pytest.raises(SystemExit):
        train.parse_args(["--recompute-gelu", "--recompute", "layer", "--output-dir", str(tmp_path)])
    m = GPT2(TINY)
    m.recompute_gelu = True
    assert m.recompute == "gelu"
    with pytest.raises(ValueError, match="recompute must be"):
        m.recompute = "most"


def _cli(capsys, *args):
    """gpt2core-train's main in this process: (exit status, stdout, stderr)."""
    try:
        train.main(list(args))
        code = 0
    except SystemExit as e:
        code = e.code
    out = capsys.readouterr()
    return code, out.out, out.err


def test_plan_command_fits_and_refuses(capsys):
    code, out, err = _cli(capsys, "--preset", "d48", "--device", "cuda", "--precision", "bf16", "-T", "1024",
                          "--plan", "--gpu-memory", "24GiB", "--world-size", "2", "--zero", "2", "--recompute",
                          "layer", "--json")
    assert code == 0, err
    d = json.loads(out)
    assert d["fits"] and d["max_batch_size"] >= 1 and set(d["per_gpu_bytes"]) == set(memplan.PARTS)
    assert isinstance(d["host_bytes"], int)
    want = memplan.memory("d48", d["max_batch_size"], 1024,
                          memplan.Options(precision="bf16", world_size=2, zero=2, recompute="layer"))
    assert d["per_gpu_bytes"] == {k: want[k] for k in memplan.PARTS}
    code, out, err = _cli(capsys, "--preset", "d48", "--device", "cuda", "--precision", "bf16", "-T", "1024", "-B",
                          "4", "--plan", "--gpu-memory", "24GiB")
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "does not fit" in lines[0] and "smallest change that fits: " in lines[0], err
    assert "--offload optimizer" in lines[0] or "--world-size" in lines[0], lines[0]
    code, out, err = _cli(capsys, "--preset", "d24", "--device", "cuda", "--precision", "bf16", "-T", "1024",
                          "--plan", "--gpu-memory", "10GiB", "--recompute", "layer")
    assert code == 0 and "fits: largest micro-batch B=" in out and "option combinations" in out, err
    assert "of the step's FLOPs" in out  # the cost of layer recompute


def test_plan_command_as_a_console_script():
    r = subprocess.run([sys.executable, "-m", "gpt2core.train", "--preset", "d48", "--device", "cuda", "-T", "1024",
                        "-B", "8", "--plan", "--gpu-memory", "24GiB"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert r.stderr.startswith("gpt2core-train: error: does not fit"), r.stderr


def test_planned_options_are_refused_for_training(tmp_path):
    with pytest.raises(SystemExit) as e:
        train.main(["--preset", "tiny", "--offload", "optimizer", "--device", "cpu", "--output-dir", str(tmp_path)])
    assert e.value.code == 2
