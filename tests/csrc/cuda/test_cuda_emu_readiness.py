"""GPU-readiness behaviour of the CUDA backend that the emulator can show (issue 29): a refused bias-gradient
epilogue is remembered per shape, said once and counted; every backend entry point makes its own GPU current.
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
