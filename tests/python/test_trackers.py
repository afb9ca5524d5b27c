"""Runs in TensorBoard and W&B (gpt2core.trackers) and bits per byte: a short training run with --log tensorboard
whose event files, read back with TensorBoard's own reader, hold every number of metrics.jsonl (val_bpb
included); W&B offline writing its run folder; a tracker that fails being one warning; val_bpb against numpy on
random text with multi-byte characters."""
import json
import math
import sys

import numpy as np
import pytest

from gpt2core import tokenizer, trackers
from gpt2core.data.shards import write_shard
from gpt2core.errors import ArgError
from gpt2core.evaluate import bits_per_byte, bpb_counts, evaluate_val

ALPHABET = list("abcdef xyz.,") + ["é", "ß", "ü", "中", "文", "字", "😀", "🚀", "🙂", "\n", "ﬁ", "€"]


def random_docs(rng, n):
    return ["".join(rng.choice(ALPHABET, size=int(rng.integers(30, 90)))) for _ in range(n)]


def test_bpb_counts_utf8_bytes_of_multibyte_text():
    rng = np.random.default_rng(0)
    docs = random_docs(rng, 8)
    per_doc = [tokenizer.encode(d) for d in docs]
    enc = tokenizer.get_encoding()
    split = [t for ids in per_doc for t in ids if _not_utf8(enc.decode_single_token_bytes(t))]
    assert split, "the text must hold tokens that carry part of a multi-byte character"
    stream = [t for ids in per_doc for t in [tokenizer.EOT] + ids]
    targets = np.array(stream, dtype=np.int64)
    losses = rng.uniform(0.1, 9.0, targets.shape)
    # independent: every document's bytes are its UTF-8 encoding; <|endoftext|> has none and its loss is left out
    nats, nbytes = bpb_counts(losses, targets)
    assert nbytes == sum(len(d.encode("utf-8")) for d in docs)
    assert nats == pytest.approx(losses[targets != tokenizer.EOT].sum(), rel=1e-12)
    # ignored targets (-1, -100) count in neither: drop the first document's tokens
    k = 1 + len(per_doc[0])
    masked = targets.copy()
    masked[:k] = np.where(np.arange(k) % 2 == 0, -1, -100)
    nats2, nbytes2 = bpb_counts(losses, masked)
    assert nbytes2 == nbytes - len(docs[0].encode("utf-8"))
    assert nats2 == pytest.approx(losses[k:][targets[k:] != tokenizer.EOT].sum(), rel=1e-12)
    assert bits_per_byte(nats, nbytes) == pytest.approx(nats / (math.log(2) * nbytes))
    assert math.isnan(bits_per_byte(0.0, 0))


def _not_utf8(b: bytes) -> bool:
    try:
        b.decode("utf-8")
        return False
    except UnicodeDecodeError:
        return True


def test_evaluate_val_bpb_equals_numpy_over_the_model_losses(tmp_path):
    pytest.importorskip("gpt2core._C")
    from gpt2core import GPT2
    from gpt2core.data.loader import DataLoader
    rng = np.random.default_rng(1)
    ids = [t for d in random_docs(rng, 30) for t in [tokenizer.EOT] + tokenizer.encode(d)]
    write_shard(tmp_path / "x_val_000000.bin", np.array(ids[:1500]))
    write_shard(tmp_path / "x_train_000001.bin", np.array(ids[:600]))
    loader = DataLoader(tmp_path, "val", 2, 32, shuffle=False)
    model = GPT2("tiny", seed=3)
    r = evaluate_val(model, loader, 3)
    nats = nbytes = 0
    loader.reset()
    for _ in range(3):
        x, y = loader.next_batch()
        model.forward(x, y)
        losses = np.asarray(model.token_losses(), dtype=np.float64)
        keep = (y != tokenizer.EOT)
        nats += losses[keep].sum()
        nbytes += sum(len(tokenizer.get_encoding().decode_single_token_bytes(int(t))) for t in y[keep])
    assert r["val_bpb"] == pytest.approx(nats / (math.log(2) * nbytes), rel=1e-9)
    assert r["val_bytes"] == nbytes


def read_tensorboard(logdir):
    from tensorboard.backend.event_processing.plugin_event_accumulator import EventAccumulator
    from tensorboard.util import tensor_util
    acc = EventAccumulator(str(logdir), size_guidance={"tensors": 0})  # 0: keep every point
    acc.Reload()
    return {tag: {e.step: float(tensor_util.make_ndarray(e.tensor_proto)) for e in acc.Tensors(tag)}
            for tag in acc.Tags()["tensors"]}


def test_train_logs_to_tensorboard_and_survives_a_broken_wandb(tmp_path, monkeypatch, capsys):
    pytest.importorskip("tensorboard")
    pytest.importorskip("gpt2core._C")
    from gpt2core import train
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` fails: one warning, the run goes on
    rng = np.random.default_rng(0)
    ids = [t for d in random_docs(rng, 40) for t in [tokenizer.EOT] + tokenizer.encode(d)]
    d = tmp_path / "data"
    write_shard(d / "x_val_000000.bin", np.array(ids[:1200]))
    write_shard(d / "x_train_000001.bin", np.array(ids[1200:]))
    from test_core_eval import write_bundle
    bundle = write_bundle(tmp_path)  # CORE too, on two of its tasks, two items each
    (bundle / "core.yaml").write_text("icl_tasks:\n- {label: mc_zeroshot, dataset_uri: world/mc.jsonl, num_fewshot: "
                                      "[0], icl_task_type: multiple_choice}\n- {label: lm, dataset_uri: sym/lm.jsonl, "
                                      "num_fewshot: [1], icl_task_type: language_modeling}\n")
    out = tmp_path / "out"
    train.main(["--preset", "tiny", "--data-dir", str(d), "-B", "2", "-T", "32", "--steps", "3", "--val-every", "2",
                "--val-steps", "2", "--sample-tokens", "1", "--output-dir", str(out), "--log", "tensorboard,wandb",
                "--core-every", "3", "--core-bundle", str(bundle), "--core-max-per-task", "2"])
    log = capsys.readouterr().out
    assert log.count("warning: --log wandb") == 1
    recs = [json.loads(line) for line in open(out / "metrics.jsonl")]
    vals = [r for r in recs if "val_loss" in r]
    assert [r["step"] for r in vals] == [0, 2, 3] and all(0 < r["val_bpb"] < 20 for r in vals)
    cores = [r for r in recs if "core" in r]
    assert [r["step"] for r in cores] == [0, 3] and all(set(r["core_tasks"]) == {"mc_zeroshot", "lm"} for r in cores)
    for r in cores:  # the mean of the centered scores; accuracies are counts out of 2 items
        assert r["core"] == pytest.approx(sum(r["core_tasks"].values()) / 2)
        assert r["core_tasks"]["lm"] * 2 == int(r["core_tasks"]["lm"] * 2)
    got = read_tensorboard(out / "tensorboard")
    want = {}
    for r in recs:
        for tag, v in trackers.scalars(r).items() if "step" in r else ():
            want.setdefault(tag, {})[r["step"]] = v
    assert {"train/loss", "train/lr", "train/grad_norm", "train/tok_per_s", "eval/val_loss", "eval/val_bpb",
            "eval/core", "eval/core_tasks/lm", "eval/core_tasks/mc_zeroshot"} <= set(want)
    assert set(got) == set(want)
    for tag, pts in want.items():
        assert sorted(got[tag]) == sorted(pts)
        for step, v in pts.items():
            assert got[tag][step] == pytest.approx(v, rel=1e-6)  # stored as float32


def test_wandb_offline_writes_its_run_folder(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_SILENT", "true")
    msgs = []
    t = trackers.open_trackers("wandb", tmp_path, project="p", run_name="r1", mode="offline", warn=msgs.append)
    t.log({"run": {"preset": "tiny", "steps": 2}})
    t.log({"step": 1, "loss": 3.5, "lr": 1e-3})
    t.log({"step": 2, "val_loss": 3.25, "val_bpb": 1.5})
    t.close()
    assert msgs == []
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and list(runs[0].glob("run-*.wandb"))


def test_a_failing_tracker_is_one_warning():
    msgs = []

    class Broken(trackers._Tracker):
        name = "Broken"
        writes = 0

        def _write(self, step, values):
            Broken.writes += 1
            raise OSError("disk full")

        def _close(self):
            raise RuntimeError("never reached")

    t = trackers.Trackers([Broken(msgs.append)])
    for s in range(4):
        t.log({"step": s, "loss": 1.0})
    t.close()
    assert Broken.writes == 1 and len(msgs) == 1 and "Broken write failed (OSError: disk full)" in msgs[0]


def test_log_flag_values():
    assert trackers.parse_kinds("tensorboard,wandb") == ["tensorboard", "wandb"]
    assert trackers.parse_kinds(["wandb", "wandb"]) == ["wandb"]
    with pytest.raises(ArgError, match="--log: mlflow is not a tracker"):
        trackers.parse_kinds("tensorboard,mlflow")
    assert trackers.scalars({"step": 3, "loss": 2.0, "skipped": True, "grad_norm": None, "val_bpb": 1.25}) == \
        {"train/loss": 2.0, "eval/val_bpb": 1.25}
    assert trackers.scalars({"step": 3, "core": 0.1, "core_tasks": {"a": 0.2, "b": float("nan")}}) == \
        {"eval/core": 0.1, "eval/core_tasks/a": 0.2}
    from gpt2core import train
    with pytest.raises(SystemExit):
        train.parse_args(["--log", "mlflow"])
