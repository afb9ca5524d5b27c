"""The training entry point end to end on the bundled tiny Shakespeare."""
import json
import math

import pytest

from gpt2core import train
from gpt2core import load_model
from gpt2core.data import shakespeare


@pytest.fixture(scope="module")
def shakespeare_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("shakespeare")
    paths = shakespeare.prepare(d)
    return d, paths


def test_shakespeare_shards_have_nanogpt_split(shakespeare_dir):
    from gpt2core.data import read_header
    _, (val, tr) = shakespeare_dir
    assert read_header(val) == 36059
    assert read_header(tr) == 301966


def test_short_run_loss_falls_and_metrics_are_written(shakespeare_dir, tmp_path):
    d, _ = shakespeare_dir
    out = tmp_path / "run"
    last = train.main(["--preset", "s2", "--data-dir", str(d), "-B", "4", "-T", "64", "--steps", "30",
                       "--lr", "3e-3", "--warmup", "3", "--val-every", "15", "--val-steps", "2",
                       "--sample-tokens", "8", "--output-dir", str(out), "--total-batch-tokens", "512"])
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in recs if "loss" in r]
    vals = [r["val_loss"] for r in recs if "val_loss" in r]
    assert len(steps) == 30 and len(vals) == 3
    for r in steps:
        assert set(r) >= {"step", "loss", "lr", "grad_norm", "dt_ms", "tok_per_s"}
        assert math.isfinite(r["loss"]) and r["grad_norm"] > 0
    assert steps[0]["loss"] > 10.0                     # ~ln(50257) at init
    assert last["loss"] < steps[0]["loss"] - 2.5        # learned something real
    assert vals[-1] < vals[0] - 2.0
    assert steps[-1]["lr"] < steps[5]["lr"]            # cosine decay
    m = load_model(out / "model.bin")
    assert m.config.n_layer == 2


def test_total_batch_must_be_multiple_of_micro_batch(shakespeare_dir, tmp_path):
    d, _ = shakespeare_dir
    with pytest.raises(SystemExit, match="not a multiple"):
        train.main(["--preset", "tiny", "--data-dir", str(d), "-B", "2", "-T", "32",
                    "--total-batch-tokens", "100", "--output-dir", str(tmp_path)])


def test_seq_len_above_block_size_is_rejected(shakespeare_dir, tmp_path):
    d, _ = shakespeare_dir
    with pytest.raises(SystemExit, match="block size"):
        train.main(["--preset", "tiny", "--data-dir", str(d), "-T", "65", "--output-dir", str(tmp_path)])


def test_cuda_graphs_need_a_gpu_device(shakespeare_dir, tmp_path, capsys):
    d, _ = shakespeare_dir
    with pytest.raises(SystemExit) as e:  # a usage error, before anything runs
        train.main(["--preset", "tiny", "--data-dir", str(d), "-T", "32", "--cuda-graphs", "--output-dir", str(tmp_path)])
    assert e.value.code == 2 and "--cuda-graphs needs --device cuda" in capsys.readouterr().err


def test_block_size_trains_a_longer_context_than_the_preset(shakespeare_dir, tmp_path):
    d, _ = shakespeare_dir
    train.main(["--preset", "tiny", "--block-size", "128", "-T", "96", "-B", "2", "--steps", "2", "--val-every", "0",
                "--sample-tokens", "2", "--checkpoint-every", "2", "--data-dir", str(d), "--output-dir", str(tmp_path)])
    m = load_model(tmp_path / "model.bin")
    assert m.config.block_size == 128 and m.params["wpe"].shape == (128, m.config.n_embd)  # the preset has 64
    with pytest.raises(SystemExit, match="holds a run of another model .*--block-size"):  # resuming needs the same context
        train.main(["--preset", "tiny", "-T", "32", "--data-dir", str(d), "--output-dir", str(tmp_path),
                    "--resume", "auto"])


def test_every_training_default_is_in_train_config():
    import inspect

    from gpt2core import GPT2
    from gpt2core.config import TrainConfig
    from gpt2core.distributed import DataParallel
    assert train.parse_args([]) == TrainConfig()
    assert train.parse_args(["-B", "3", "--lr", "2e-3", "--no-shuffle", "--device", "cuda", "--matmul-tuning"]) == \
        TrainConfig(batch_size=3, lr=2e-3, no_shuffle=True, device="cuda", matmul_tuning=True)
    for step in (GPT2.step, DataParallel.step):  # the optimizer's defaults are the trainer's
        for name, p in inspect.signature(step).parameters.items():
            if name in ("weight_decay", "beta1", "beta2", "eps", "grad_clip"):
                assert p.default == getattr(TrainConfig(), name), (step, name)
