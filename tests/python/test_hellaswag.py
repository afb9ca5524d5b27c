"""HellaSwag: reading both file formats, rendering, scoring (fake model with known per-token losses,
and an untrained GPT2 near chance), validation loss helper, CLIs."""
import json
import re
import warnings
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from gpt2core.data import hellaswag as hs
from gpt2core.data.hellaswag import HellaSwagError
from gpt2core.data.loader import DataLoader
from gpt2core.data.shards import write_shard
from gpt2core.evaluate import evaluate_loss, score_hellaswag
from gpt2core.tokenizer import get_encoding

HERE = Path(__file__).resolve().parents[1]  # tests/
# copies in tests/data (see data/SOURCES.md): the first 120 items of the 1000-item jsonl sample and the
# first 3 items of the 6-line text file; the whole files live in shared/data/hellaswag
SUBSET = HERE / "data" / "hellaswag_val_120.jsonl"
FIRST3 = HERE / "data" / "hellaswag_val_first3.txt"
SHARED = HERE.parents[1] / "shared" / "data" / "hellaswag"
FULL = SHARED / "hellaswag_val_full.txt"
SUBSET1000 = SHARED / "hellaswag_val_subset1000.jsonl"
needs_data = pytest.mark.skipif(not (FULL.exists() and SUBSET1000.exists()),
                                reason="shared/data/hellaswag not available")

# val item ind 24, the first of the 6-line file; tokens of its context and " " + each ending
ROOF_CTX = [32, 582, 318, 5586, 319, 257, 9753, 13, 339]
ROOF_ENDS = [[318, 1262, 14441, 284, 14441, 257, 5166, 286, 1341, 271, 13],
             [318, 34759, 1241, 19867, 572, 13],
             [318, 4769, 257, 6437, 1134, 338, 23441, 13],
             [4940, 10427, 510, 9753, 278, 319, 257, 9753, 13]]


@pytest.fixture(scope="module")
def full_items():
    return hs.load_items(FULL)


@pytest.fixture(scope="module")
def subset_items():
    return hs.load_items(SUBSET)


@pytest.fixture(scope="module")
def first3():
    return hs.load_items(FIRST3)


# ------------------------------------------------------------------------------------ reading
@needs_data
def test_text_format_whole_val_set(full_items):
    assert len(full_items) == 10042
    # the label counts of the full val set
    assert np.bincount([it["label"] for it in full_items]).tolist() == [2515, 2485, 2584, 2458]
    first = full_items[0]
    assert first["ctx"] == "A man is sitting on a roof. he" and first["label"] == 3
    assert first["endings"][3] == "starts pulling up roofing on a roof."


@needs_data
def test_jsonl_agrees_with_text_format(full_items):
    subset_items = hs.load_items(SUBSET1000)
    raw = [json.loads(line) for line in open(SUBSET1000, encoding="utf-8")]
    assert len(subset_items) == 1000 and [it["ind"] for it in subset_items] == [r["ind"] for r in raw]
    by_endings = {tuple(it["endings"]): it for it in full_items}
    n = 0
    for r, it in zip(raw, subset_items):
        if not r["source_id"].startswith("activitynet"):
            continue        # WikiHow items were cleaned of [header]/[step] tags in the text file
        other = by_endings[tuple(it["endings"])]
        assert other["ctx"] == it["ctx"] == r["ctx"]
        assert other["label"] == it["label"] == r["label"]
        n += 1
    assert n == 913


def test_missing_and_bad_fields(tmp_path):
    good = {"ctx": "A cat", "label": 1, "endings": ["a", "b", "c", "d"]}
    p = tmp_path / "x.jsonl"
    p.write_text(json.dumps(good) + "\n" + json.dumps({"ctx": "x", "label": 0}) + "\n")
    with pytest.raises(HellaSwagError, match=r"x.jsonl: line 2: item has no 'endings' field"):
        hs.load_items(p)
    for bad, msg in [({**good, "label": 4}, "'label' must be 0, 1, 2 or 3"),
                     ({**good, "endings": ["a", "b"]}, "list of 4"),
                     ({**good, "ctx": ""}, "'ctx' must be a non-empty")]:
        p.write_text(json.dumps(bad) + "\n")
        with pytest.raises(HellaSwagError, match=msg):
            hs.load_items(p)
    p.write_text(json.dumps(good) + "\n{oops\n")
    with pytest.raises(HellaSwagError, match="line 2: not valid JSON"):
        hs.load_items(p)
    t = tmp_path / "x.txt"
    t.write_text("Act: ctx one\n2\ne1\ne2\ne3\ne4\nAct: ctx two\n1\ne1\ne2\ne3\n")
    with pytest.raises(HellaSwagError, match=r"x.txt: 11 lines, not a multiple of 6.*line 7"):
        hs.load_items(t)
    t.write_text("Act: ctx one\ne0\ne1\ne2\ne3\ne4\n")
    with pytest.raises(HellaSwagError, match="line 2 should be the gold label"):
        hs.load_items(t)
    t.write_text("Act: ctx one\n2\ne1\ne2\ne3\ne4\n")
    assert hs.load_items(t) == [{"ctx": "ctx one", "label": 2, "endings": ["e1", "e2", "e3", "e4"]}]
    t.write_bytes(b"Act: ctx one\r\n2\r\ne1\r\ne2\r\ne3\r\ne4\r\n")       # Windows line ends
    assert hs.load_items(t) == [{"ctx": "ctx one", "label": 2, "endings": ["e1", "e2", "e3", "e4"]}]
    with pytest.raises(HellaSwagError, match="no such file"):
        hs.load_items(tmp_path / "none.jsonl")


def test_download_failure_suggests_a_local_file(tmp_path, monkeypatch):
    import urllib.request

    def fail(*a, **k):
        raise OSError("network is unreachable")
    monkeypatch.setattr(urllib.request, "urlopen", fail)
    with pytest.raises(HellaSwagError, match=r"could not download .*rowanz.*--input .*hellaswag_val"):
        hs.download(tmp_path)
    assert list(tmp_path.iterdir()) == []


# ------------------------------------------------------------------------------------ rendering
def test_render_known_item(first3):
    full_items = first3
    assert len(first3) == 3 and first3[0]["ctx"] == "A man is sitting on a roof. he"
    r = hs.render(full_items[:3])
    tokens, mask, label = r.item(0)
    assert label == 3 and tokens.shape == (4, len(ROOF_CTX) + max(map(len, ROOF_ENDS)))
    for k, end in enumerate(ROOF_ENDS):
        n = len(ROOF_CTX) + len(end)
        assert tokens[k, :n].tolist() == ROOF_CTX + end
        assert (tokens[k, n:] == 0).all()
        assert mask[k].tolist() == [0] * len(ROOF_CTX) + [1] * len(end) + [0] * (tokens.shape[1] - n)
    # every row decodes to ctx + " " + ending
    enc = get_encoding()
    for i, it in enumerate(full_items[:3]):
        for k in range(4):
            assert enc.decode(r.row(i, k).tolist()) == it["ctx"] + " " + it["endings"][k]
    ctx, ends = hs.render_item(full_items[0])
    assert ctx == ROOF_CTX and ends == ROOF_ENDS


def test_prepare_saves_rendered_npz(tmp_path, subset_items):
    out = hs.prepare(SUBSET, tmp_path / "hs.npz", limit=50, log=lambda *a: None)
    r = hs.load(out)
    ref = hs.render(subset_items[:50])
    assert len(r) == 50
    for a in ("tokens", "offsets", "ctx_lens", "labels"):
        np.testing.assert_array_equal(getattr(r, a), getattr(ref, a))
    np.testing.assert_array_equal(hs.load(out, limit=7).tokens, hs.render(subset_items[:7]).tokens)
    assert not list(tmp_path.glob("*.tmp"))
    (tmp_path / "junk.npz").write_bytes(b"not a zip")
    with pytest.raises(HellaSwagError, match="not a rendered HellaSwag file"):
        hs.load(tmp_path / "junk.npz")


# ------------------------------------------------------------------------------------ scoring
class CostModel:
    """Stand-in with the GPT2 interface: the loss of predicting token t is cost[t]. It checks that
    targets line up with the inputs (target at position p is the input at p + 1)."""

    def __init__(self, cost, block_size):
        self.cost = cost
        self.config = SimpleNamespace(block_size=block_size, vocab_size=50257)
        self.shapes = []

    def forward(self, idx, targets=None, return_logits=False):
        assert idx.dtype == np.int32 and targets.dtype == np.int32 and idx.shape[1] <= self.config.block_size
        self.shapes.append(idx.shape)
        inner = (targets[:, :-1] != -1) & (targets[:, 1:] != -1)   # inside an ending
        np.testing.assert_array_equal(targets[:, :-1][inner], idx[:, 1:][inner])
        valid = targets != -1
        self._losses = np.where(valid, self.cost[np.maximum(targets, 0)], 0.0).astype(np.float32)
        return float(self._losses[valid].mean())

    def token_losses(self):
        return self._losses


def reference_scores(items, cost, max_len=None):
    """acc / acc_norm computed directly from the endings' tokens (the first max_len of them), without
    the row machinery."""
    enc = get_encoding()
    hits = hits_norm = differ = 0
    for it in items:
        ends = [enc.encode_ordinary(" " + e)[:max_len] for e in it["endings"]]
        sums = [float(sum(cost[t] for t in toks)) for toks in ends]
        means = [s / len(toks) for s, toks in zip(sums, ends)]
        hits += int(np.argmin(sums) == it["label"])
        hits_norm += int(np.argmin(means) == it["label"])
        differ += int(np.argmin(sums) != np.argmin(means))
    return hits, hits_norm, differ


@pytest.mark.filterwarnings("ignore:.*longer than the model.s context")  # short contexts on purpose
@pytest.mark.parametrize("block_size", [1024, 40])
def test_scoring_matches_reference(subset_items, block_size):
    items = subset_items[:120]
    cost = np.random.default_rng(1).uniform(0.5, 10.0, 50257).astype(np.float32)
    hits, hits_norm, differ = reference_scores(items, cost, max_len=block_size)
    assert differ > 10      # acc and acc_norm really are different rules on these items
    data = hs.render(items)
    model = CostModel(cost, block_size)
    r = score_hellaswag(model, data, items_per_batch=5)
    assert (r["n"], r["correct"], r["correct_norm"]) == (120, hits, hits_norm)
    assert r["acc"] == hits / 120 and r["acc_norm"] == hits_norm / 120
    assert len(set(model.shapes)) == 1 and model.shapes[0][0] == 20     # one shape: 5 items x 4 rows
    if block_size == 40:
        assert data.max_row_len() > 41     # some contexts were cut from the left
    # ranks take items i % world_size == rank; their counts add up to the single-process ones
    parts = [score_hellaswag(CostModel(cost, block_size), data, items_per_batch=3, rank=k, world_size=3)
             for k in range(3)]
    assert sum(p["n"] for p in parts) == 120
    assert sum(p["correct"] for p in parts) == hits and sum(p["correct_norm"] for p in parts) == hits_norm


def test_rows_longer_than_the_context_warn_once_with_the_count(subset_items):
    items = subset_items[:120]
    data = hs.render(items)
    cost = np.random.default_rng(2).uniform(0.5, 10.0, 50257).astype(np.float32)
    n_long = sum(len(data.row(i, r)) > 41 for i in range(120) for r in range(4))   # 41 = block_size + 1
    assert 0 < n_long < 480
    with pytest.warns(UserWarning) as caught:
        score_hellaswag(CostModel(cost, 40), data, items_per_batch=5)
    assert len(caught) == 1
    assert re.search(rf"\b{n_long} of 480 HellaSwag rows .*longer than the model's context", str(caught[0].message))
    with warnings.catch_warnings():
        warnings.simplefilter("error")          # everything fits: no warning
        score_hellaswag(CostModel(cost, 1024), data, items_per_batch=5)


def test_scoring_picks_lowest_sum_and_lowest_mean():
    # hand-made item: ending 0 has the lowest total loss, ending 2 the lowest loss per token
    enc = get_encoding()
    endings = ["zz", "yy", "a b c d e f g h", "xx"]
    item = {"ctx": "Hello there", "label": 2, "endings": endings}
    cost = np.full(50257, 9.0, dtype=np.float32)
    for t in enc.encode_ordinary(" zz"):
        cost[t] = 1.0
    for t in enc.encode_ordinary(" a b c d e f g h"):
        cost[t] = 0.5
    assert len(enc.encode_ordinary(" a b c d e f g h")) * 0.5 > len(enc.encode_ordinary(" zz")) * 1.0
    r = score_hellaswag(CostModel(cost, 64), hs.render([item]))
    assert (r["correct"], r["correct_norm"]) == (0, 1)
    item["label"] = 0
    r = score_hellaswag(CostModel(cost, 64), hs.render([item]))
    assert (r["correct"], r["correct_norm"]) == (1, 0)


@pytest.mark.filterwarnings("ignore:.*longer than the model.s context")  # short contexts on purpose
def test_untrained_model_scores_near_chance(subset_items):
    gpt2core = pytest.importorskip("gpt2core")
    from gpt2core.config import GPT2Config
    # small and short (rows cut to 32 tokens) to keep the test fast; the vocabulary is GPT-2's
    cfg = GPT2Config(block_size=32, vocab_size=50257, padded_vocab_size=50304, n_layer=1, n_head=2, n_embd=32)
    model = gpt2core.GPT2(cfg, seed=0)
    items = subset_items[:120]
    r = score_hellaswag(model, hs.render(items), items_per_batch=6)
    assert r["n"] == 120
    # chance is 0.25, with a standard error of 0.04 on 120 items; bounds are 3 of them. An untrained
    # model's summed loss favours the shortest ending, which is the gold one for 0.325 of these items.
    assert 0.13 <= r["acc_norm"] <= 0.37, r
    assert 0.13 <= r["acc"] <= 0.45, r


# ------------------------------------------------------------------------------------ val loss
class MeanModel:
    """forward returns the mean input token id: a loss whose value says which batch it saw."""
    config = SimpleNamespace(block_size=64, vocab_size=50257)

    def forward(self, idx, targets=None):
        assert (targets[:, :-1] == idx[:, 1:]).all()
        return float(idx.mean())


def test_evaluate_loss_fixed_batches(tmp_path):
    toks = np.random.default_rng(0).integers(0, 50000, 5000)
    write_shard(tmp_path / "d_val_000000.bin", toks)
    B, T, steps = 2, 32, 7
    expected = np.mean([toks[i * B * T:(i + 1) * B * T].mean() for i in range(steps)])
    dl = DataLoader(tmp_path, "val", B, T, shuffle=False)
    dl.next_batch()                       # wherever the loader was, evaluation starts at batch 0
    assert evaluate_loss(MeanModel(), dl, steps) == pytest.approx(expected, rel=1e-12)
    assert evaluate_loss(MeanModel(), dl, steps) == pytest.approx(expected, rel=1e-12)
    with pytest.warns(UserWarning, match="only 78 batches"):
        evaluate_loss(MeanModel(), dl, 100)


# ------------------------------------------------------------------------------------ CLIs
def test_data_cli(tmp_path, capsys):
    from gpt2core.data.__main__ import main
    assert main(["hellaswag", "--input", str(FIRST3), "--out", str(tmp_path / "h.npz")]) == 0
    assert "3 items" in capsys.readouterr().out and len(hs.load(tmp_path / "h.npz")) == 3
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"ctx": "a", "endings": ["a", "b", "c", "d"]}\n')
    assert main(["hellaswag", "--input", str(bad)]) == 1
    assert "no 'label' field" in capsys.readouterr().err


@pytest.mark.filterwarnings("ignore:.*longer than the model.s context")  # short contexts on purpose
def test_evaluate_cli_on_checkpoint(tmp_path, capsys):
    gpt2core = pytest.importorskip("gpt2core")
    from gpt2core.evaluate import main
    path = tmp_path / "m.bin"
    gpt2core.GPT2("tiny", seed=1).save(path)
    assert main(["hellaswag", "--checkpoint", str(path), "--data", str(SUBSET), "--limit", "8",
                 "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "hellaswag: 8 items, acc " in out and "acc_norm" in out


@pytest.mark.filterwarnings("ignore:.*longer than the model.s context")  # short contexts on purpose
def test_train_logs_hellaswag(tmp_path):
    pytest.importorskip("gpt2core._C")
    from gpt2core import train
    from gpt2core.data.shards import write_shard as ws
    d = tmp_path / "data"
    toks = np.random.default_rng(0).integers(0, 50257, 3000)
    ws(d / "x_val_000000.bin", toks[:1000])
    ws(d / "x_train_000001.bin", toks[1000:])
    last = train.main(["--preset", "tiny", "--data-dir", str(d), "-B", "2", "-T", "32", "--steps", "2",
                       "--val-every", "0", "--hellaswag-every", "1", "--hellaswag-path", str(SUBSET),
                       "--hellaswag-limit", "4", "--sample-tokens", "1", "--output-dir", str(tmp_path / "out")])
    recs = [json.loads(line) for line in open(tmp_path / "out" / "metrics.jsonl")]
    hs_recs = [r for r in recs if "hellaswag_acc" in r]
    assert [r["step"] for r in hs_recs] == [0, 1, 2]  # every step, and the final model after the last update
    for r in hs_recs:
        assert r["hellaswag_acc"] * 4 == int(r["hellaswag_acc"] * 4)     # a count out of 4 items
        assert 0 <= r["hellaswag_acc_norm"] <= 1
    assert last["hellaswag_acc_norm"] == hs_recs[-1]["hellaswag_acc_norm"]


def test_batched_losses_equal_one_row_at_a_time(subset_items):
    """Padding and batching change nothing: each ending's loss equals a forward of that row alone."""
    gpt2core = pytest.importorskip("gpt2core")
    from gpt2core.evaluate import hellaswag_losses
    model = gpt2core.GPT2("tiny", seed=3)
    items = [it for it in subset_items[:40] if len(hs.render([it]).tokens) < 4 * 60][:3]
    data = hs.render(items)
    sums, counts = hellaswag_losses(model, data, items_per_batch=2)
    for i in range(len(items)):
        for k in range(4):
            row = data.row(i, k)
            c = int(data.ctx_lens[i])
            tgt = row[1:].copy()
            tgt[:c - 1] = -1
            loss = model.forward(row[None, :-1], tgt[None, :])
            assert counts[i, k] == len(row) - c
            # fp32: other batch shapes change BLAS blocking, so the sums agree to ~1e-6 relative
            assert sums[i, k] == pytest.approx(loss * (len(row) - c), rel=1e-5)
