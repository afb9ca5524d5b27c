"""GPU-readiness behaviour of the CUDA backend that the emulator can show (issue 29): a refused bias-gradient
epilogue is remembered per shape, said once and counted; every backend entry point makes its own GPU current (two
models on two emulated devices, GPT2CORE_EMU_DEVICES=2, interleaved while "another library" switches the current
device between calls); the GPU steps of `python -m gpt2core.doctor --calibrate` run on the emulated device at a tiny
preset.
Each case runs in a subprocess (the emulator's test knobs are environment variables read by the seam)."""
import json
import os
import subprocess
import sys

import pytest

from test_cuda_emu import BUILD, emu  # noqa: F401  (fixture)

_STEPS = """
import sys, numpy as np
sys.path.insert(0, sys.argv[1])
import gpt2core_cuda_emu as E
m = E.Model(max_seq_len=16, vocab_size=97, padded_vocab_size=128, n_layer=2, n_head=2, n_embd=64, device="cuda")
rng = np.random.default_rng(0)
for v in m.params().values():
    v[...] = rng.standard_normal(v.shape).astype(np.float32) * 0.02
m.params_changed()
idx = rng.integers(0, 97, (2, 16)).astype(np.int32)
for step in (1, 2, 3):
    m.zero_grad()
    m.forward_backward(idx, idx, 1.0)
    m.take_loss()
    m.optimizer_step(lr=1e-4, step=step)
db = {k: v.copy() for k, v in m.grads().items() if k.endswith("b")}
info = E.build_info()
print(json.dumps({"shapes": info["bgradb_refused_shapes"], "fallbacks": info["bgradb_fallbacks"],
                  "db": {k: v.ravel().tolist() for k, v in db.items()}}))
""".replace("import sys,", "import json, sys,")


def _run(tmp_path, refuse):
    log = tmp_path / f"log{int(refuse)}.jsonl"
    env = dict(os.environ, GPT2CORE_EMU_LAUNCH_LOG=str(log))
    env.pop("GPT2CORE_EMU_REFUSE_BIAS_GRAD_EPILOGUE", None)
    if refuse:
        env["GPT2CORE_EMU_REFUSE_BIAS_GRAD_EPILOGUE"] = "1"
    r = subprocess.run([sys.executable, "-c", _STEPS, str(BUILD)], env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    recs = [json.loads(line) for line in log.read_text().splitlines()]
    return json.loads(r.stdout.strip().splitlines()[-1]), r.stderr, recs


def test_refused_bias_gradient_epilogue_is_remembered_said_once_and_counted(emu, tmp_path):  # noqa: F811
    """3 steps x 2 layers x 4 biased Linear layers: the seam is asked once per distinct dW shape (qkv, attproj,
    fc, fcproj: 4), stderr says so once per shape, build_info() counts 4 refused shapes and 24 fallbacks, and
    dbias equals the accepted epilogue's to fp32 rounding of the tensor's scale (the fallback sums the same column
    sums; qkv's query part is ~1e-9 after cancellation, so each tensor is judged whole against its largest entry)."""
    ok, ok_err, ok_log = _run(tmp_path, refuse=False)
    assert ok["shapes"] == 0 and ok["fallbacks"] == 0 and "BGRADB" not in ok_err
    assert sum(1 for r in ok_log if r.get("seam") == "matmul" and r.get("bias_grad")) == 3 * 2 * 4
    got, err, log = _run(tmp_path, refuse=True)
    asked = [(r["m"], r["n"], r["k"]) for r in log if r.get("refused") == "bias_grad"]
    assert len(asked) == 4 and len(set(asked)) == 4, asked
    assert err.count("refused the bias-gradient epilogue (BGRADB)") == 4, err
    assert got["shapes"] == 4 and got["fallbacks"] == 3 * 2 * 4
    assert not any(r.get("seam") == "matmul" and r.get("bias_grad") for r in log)
    for k, want in ok["db"].items():
        scale = max(abs(v) for v in want)
        assert scale > 0 and max(abs(a - b) for a, b in zip(got["db"][k], want)) <= 1e-5 * scale, k


# Two models on two emulated devices, one step at a time in turn, with the current device switched to the other
# GPU before every call (as another library sharing the process might): every entry point must make its own
# device current again, or the emulator refuses the launch on a stream of the other device (as CUDA does).
_TWO_DEVICES = """
import json, sys
import numpy as np
sys.path.insert(0, sys.argv[1])
import gpt2core_cuda_emu as E
cfg = dict(max_seq_len=16, vocab_size=97, padded_vocab_size=128, n_layer=2, n_head=2, n_embd=64)
rng = np.random.default_rng(0)
a = E.Model(**cfg, device="cuda:0")
b = E.Model(**cfg, device="cuda:1")
for name, v in a.params().items():
    v[...] = rng.standard_normal(v.shape).astype(np.float32) * 0.05
    b.params()[name][...] = v
for m in (a, b):
    m.params_changed()
idx = rng.integers(0, 97, (2, 16)).astype(np.int32)
losses = {"a": [], "b": []}
for step in (1, 2, 3):
    for key, m, other in (("a", a, 1), ("b", b, 0)):
        E.set_device(other); m.zero_grad()
        E.set_device(other); m.forward_backward(idx, idx, 1.0)
        E.set_device(other); losses[key].append(m.take_loss())
        E.set_device(other); norm = m.grad_norm()
        E.set_device(other); m.optimizer_step(lr=1e-3, step=step)
same = all(np.array_equal(a.params()[k], b.params()[k]) for k in a.params())
free = [E.cuda_mem_info(d)[0] for d in (0, 1)]
# the control: an op called without making its device current (Ops calls the backend directly) is refused
ops = E.Ops("cuda:0")
E.set_device(1)
try:
    ops.relu2_forward(np.ones(8, np.float32))
    refused = ""
except Exception as e:
    refused = str(e)
print(json.dumps({"losses": losses, "same": same, "free": free, "total": E.cuda_mem_info(0)[1],
                  "refused": refused}))
"""


def test_each_entry_point_makes_its_own_gpu_current(emu, tmp_path):  # noqa: F811
    log = tmp_path / "launches.jsonl"
    env = dict(os.environ, GPT2CORE_EMU_DEVICES="2", GPT2CORE_EMU_LAUNCH_LOG=str(log))
    r = subprocess.run([sys.executable, "-c", _TWO_DEVICES, str(BUILD)], env=env, capture_output=True, text=True,
                       timeout=900)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert res["losses"]["a"] == res["losses"]["b"] and res["same"], res["losses"]
    assert res["losses"]["a"][2] < res["losses"]["a"][0]
    # each model's memory is on its own device
    assert all(f < res["total"] for f in res["free"]), res
    # the launches of both devices are there, and the control was refused by the emulator's rule
    devices = {json.loads(line).get("device") for line in log.read_text().splitlines() if '"kernel"' in line}
    assert devices == {0, 1}, devices
    assert "stream of device 0 while device 1 is current" in res["refused"], res["refused"]


# The lease driver's dry run (python -m gpt2core.calibrate --dry-run, issue 48) with gpt2core's core the emulated
# module: the driver, every step's process and the processes a step starts (its ranks, its training runs) run
# through this wrapper (calibrate.PYTHON), which puts the emulated module in place of gpt2core._C first
_EMU_PYTHON = """
import runpy, sys
build = sys.argv[1]
sys.path.insert(0, build)
import gpt2core_cuda_emu
sys.modules["gpt2core._C"] = gpt2core_cuda_emu
import gpt2core._libs
gpt2core._libs.driver_problem = lambda: ""
import gpt2core._cuda
gpt2core._cuda.load = lambda: []  # the emulated plugin stays: never the real _C_cuda
import gpt2core._plugins
gpt2core._plugins.find = lambda: "emulated"  # also in a build without a CUDA backend of its own
import gpt2core
gpt2core.build_info = gpt2core_cuda_emu.build_info  # what the emulated backend counted (bgradb's refusals)
args = sys.argv[2:]
if args[:2] == ["-m", "gpt2core.calibrate"]:  # the driver: its steps start through this wrapper too
    from gpt2core.runtime import calibrate
    calibrate.PYTHON = [sys.executable, __file__, build]
    sys.exit(calibrate.console(args[2:]))
if args[0] == "-m":  # sys.argv as python -m would set it: [the module's path, its arguments...]
    sys.argv = args[1:]
    runpy.run_module(args[1], run_name="__main__", alter_sys=True)
else:  # a script: [the script, its arguments...]
    sys.argv = args
    runpy.run_path(args[0], run_name="__main__")
"""
# The steps whose CUDA paths the emulator can run at the dry run's tiny shapes in a test's time: the timings (cuDNN's
# attention and ours), the scale step's recompute levels and offload, fp16 with loss scaling against bf16, two ranks
# over Gloo at ZeRO 0/1/2 with and without offload, FP8 against bf16 (the emulated device is an sm_90: throughput
# and two short gpt2core-train runs), the bit-for-bit and bias-gradient checks and the CPU comparison. learn, serve,
# eval and resume run the same code on the CPU dry run (tests/python/test_calibrate.py).
EMU_STEPS = ["d12_step", "scale", "dp", "fp16", "fp8", "bitwise", "bgradb", "vs_cpu"]


@pytest.mark.slow
def test_calibrate_dry_run_on_the_emulated_device(emu, tmp_path):  # noqa: F811
    wrapper = tmp_path / "emu_python.py"
    wrapper.write_text(_EMU_PYTHON)
    r = subprocess.run([sys.executable, str(wrapper), str(BUILD), "-m", "gpt2core.calibrate", "--dry-run",
                        "--device", "cuda", "--out", str(tmp_path / "out"), "--only", *EMU_STEPS],
                       capture_output=True, text=True, timeout=1500)
    rep = json.loads((tmp_path / "out" / "report.json").read_text())
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:] + json.dumps(rep)[-4000:]
    s = rep["steps"]
    assert list(s) == EMU_STEPS and all(st["status"] == "ok" for st in s.values()), json.dumps(s)[-4000:]
    runs = s["d12_step"]["rows"]
    assert [x["attention"] for x in runs] == ["cudnn", "flash"]
    assert all(x["tokens_per_s"] > 0 and x["ms_per_step"] > 0 and x["precision"] == "bf16" for x in runs), runs
    scale = s["scale"]["rows"]
    assert [(x["attention"], x["recompute"]) for x in scale if "recompute" in x and "offload" not in x] == \
        [(a, r) for a in ("cudnn", "flash") for r in ("none", "gelu", "layer")]
    assert [(x["offload"], x["prefetch"]) for x in scale[-2:]] == [("optimizer", True), ("optimizer", False)]
    assert all(x["tokens_per_s"] > 0 for x in scale[-2:])
    dp = [x for x in s["dp"]["rows"] if "replicas_bit_identical" in x]
    assert len(dp) == 6 and all(x["replicas_bit_identical"] for x in dp), dp
    assert [x["same_bits_as_without_offload"] for x in dp if "offload" in x["run"]] == [True] * 3, dp
    fp16 = {x["precision"]: x for x in s["fp16"]["rows"] if "precision" in x}
    assert fp16["fp16"]["loss_scale"] > 0 and fp16["bf16"]["loss_scale"] is None
    assert s["fp16"]["rows"][-1]["max_relative_difference"] < 2e-2
    fp8 = s["fp8"]["rows"]  # both precisions timed, then both trained through gpt2core-train --precision
    assert [x["precision"] for x in fp8 if "tokens_per_s" in x] == ["bf16", "fp8"], fp8
    res = fp8[-1]["result"]
    assert res["all_finite"] and abs(res["relative"]) < 1e-2, res  # emulated: 5e-5 after 6 tiny steps
    assert {x["deterministic"]: x["bit_identical"] for x in s["bitwise"]["rows"]}[True] is True
    assert s["bgradb"]["rows"] == [{"accepted": True, "refused_shapes": 0, "fallbacks": 0}]
    # the emulated device computes in bf16 there (the default on sm_90): within bf16's training tolerance of the CPU
    assert s["vs_cpu"]["rows"][0]["max_relative_difference"] < 2e-2
