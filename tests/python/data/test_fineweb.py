"""FineWeb sharding on the local samples: token stream against a direct tiktoken reference, shard
layout, process pool, resume after an interruption, bad input."""
import json
import sys
import types
from pathlib import Path

import numpy as np
import pytest

from gpt2core.data import fineweb
from gpt2core.data.fineweb import InputError, prepare, write_shards
from gpt2core.data.loader import DataLoader
from gpt2core.data.shards import find_shards, load_tokens, read_header
from gpt2core.tokenizer import EOT, get_encoding

HERE = Path(__file__).resolve().parents[2]  # tests/
EDU5 = HERE / "data" / "fineweb_edu_sample5.jsonl"      # a copy of shared/data/fineweb's (see data/SOURCES.md)
SAMPLE300 = HERE.parents[1] / "shared" / "data" / "fineweb" / "fineweb_10BT_sample300.jsonl"
needs_sample300 = pytest.mark.skipif(not SAMPLE300.exists(), reason="shared/data/fineweb not available")


def reference_stream(texts):
    """EOT + tokens of every document, straight from tiktoken: llm.c's dev/data/fineweb.py writes empty and
    whitespace-only documents too (as [EOT] and [EOT, whitespace tokens])."""
    enc = get_encoding()
    out = []
    for t in texts:
        out += [EOT] + enc.encode_ordinary(t)
    return np.array(out, dtype=np.int64)


def all_tokens(out_dir, name="edufineweb"):
    files = sorted(Path(out_dir).glob(f"{name}_*_??????.bin"), key=lambda p: p.name[-10:])
    return files, np.concatenate([np.asarray(load_tokens(f), dtype=np.int64) for f in files])


def texts_of(path):
    return [json.loads(line)["text"] for line in open(path, encoding="utf-8")]


def test_shards_match_reference_stream(tmp_path):
    r = prepare([EDU5], tmp_path, shard_size=3000, num_procs=1, progress=False, log=lambda *a: None)
    ref = reference_stream(texts_of(EDU5))
    files, toks = all_tokens(tmp_path)
    np.testing.assert_array_equal(toks, ref)
    assert r["n_tokens"] == ref.size and r["docs"] == 5
    names = [f.name for f in files]
    n_shards = -(-ref.size // 3000)
    assert names == ["edufineweb_val_000000.bin"] + [f"edufineweb_train_{i:06d}.bin" for i in range(1, n_shards)]
    assert [read_header(f) for f in files] == [3000] * (n_shards - 1) + [ref.size - 3000 * (n_shards - 1)]
    assert find_shards(tmp_path, "val") == [files[0]]
    assert not list(tmp_path.glob("*.tmp"))
    # the documents start with EOT where the reference says
    assert toks[0] == EOT and (toks == EOT).sum() == 5


def test_pool_gives_identical_shards(tmp_path):
    texts = texts_of(EDU5) * 8
    kw = dict(name="p", shard_size=7000, progress=False, log=lambda *a: None, chunk_chars=20_000)
    write_shards(texts, tmp_path / "one", num_procs=1, **kw)
    r2 = write_shards(texts, tmp_path / "two", num_procs=2, **kw)
    f1, t1 = all_tokens(tmp_path / "one", "p")
    f2, t2 = all_tokens(tmp_path / "two", "p")
    assert [f.name for f in f1] == [f.name for f in f2] and len(f1) > 5
    for a, b in zip(f1, f2):
        assert a.read_bytes() == b.read_bytes()
    np.testing.assert_array_equal(t2, reference_stream(texts))
    assert r2["docs"] == 40 and t1.size == r2["n_tokens"]
    # the result feeds the loader
    dl = DataLoader(tmp_path / "two", "train", 4, 64)
    x, y = dl.next_batch()
    assert x.shape == (4, 64) and dl.n_tokens == t1.size - 7000


@needs_sample300
def test_sample300_cli_with_two_processes(tmp_path, capsys):
    from gpt2core.data.__main__ import main
    assert main(["fineweb", "--input", str(SAMPLE300), "--out-dir", str(tmp_path), "--shard-size", "1e5",
                 "-j", "2", "--no-progress"]) == 0
    # the numbers in fineweb.py's docstring
    assert "5 shards, 496,714 tokens" in capsys.readouterr().out
    assert [read_header(p) for p in sorted(tmp_path.glob("*.bin"), key=lambda p: p.name[-10:])] == \
        [100000] * 4 + [96714]


def _flaky_docs(texts, fail_at):
    for i, t in enumerate(texts):
        if i == fail_at:
            raise KeyboardInterrupt("simulated interruption")
        yield t


@pytest.mark.parametrize("chunk_chars", [1, 5000])
def test_resume_after_interruption(tmp_path, chunk_chars):
    rng = np.random.default_rng(0)
    words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "\n"]
    texts = [" ".join(rng.choice(words, size=rng.integers(20, 400))) for _ in range(60)]
    texts[7] = ""          # an empty document: a lone EOT
    kw = dict(name="t", shard_size=997, settings={"src": "x"}, progress=False, log=lambda *a: None,
              chunk_chars=chunk_chars)
    clean = write_shards(texts, tmp_path / "clean", **kw)
    with pytest.raises(KeyboardInterrupt):
        write_shards(_flaky_docs(texts, 41), tmp_path / "run", **kw)
    kept = sorted((tmp_path / "run").glob("t_*.bin"))
    assert 0 < len(kept) < len(clean["shards"])
    assert not list((tmp_path / "run").glob("*.tmp"))
    stamps = {p.name: p.stat().st_mtime_ns for p in kept}
    resumed = write_shards(texts, tmp_path / "run", **kw)
    assert resumed["resumed_shards"] == len(kept)
    for p in kept:   # finished shards were not rewritten
        assert p.stat().st_mtime_ns == stamps[p.name]
    _, a = all_tokens(tmp_path / "clean", "t")
    _, b = all_tokens(tmp_path / "run", "t")
    np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(a, reference_stream(texts))
    assert clean["docs"] == 60
    again = write_shards(texts, tmp_path / "run", **kw)      # complete: nothing to do
    assert again["n_tokens"] == a.size and again["seconds"] == 0.0


def test_resume_refuses_other_settings(tmp_path):
    write_shards(["hello world"] * 20, tmp_path, name="t", shard_size=10, settings={"a": 1},
                 progress=False, log=lambda *a: None)
    with pytest.raises(InputError, match="other settings"):
        write_shards(["x"], tmp_path, name="t", shard_size=11, settings={"a": 1}, progress=False)
    (tmp_path / "t_manifest.json").unlink()
    with pytest.raises(InputError, match="no t_manifest.json"):
        write_shards(["x"], tmp_path, name="t", shard_size=10, settings={"a": 1}, progress=False)
    r = write_shards(["x y"], tmp_path, name="t", shard_size=10, settings={"a": 1}, progress=False,
                     overwrite=True, log=lambda *a: None)
    assert [p.name for p in r["shards"]] == ["t_val_000000.bin"] and r["n_tokens"] == 3


def test_bad_jsonl_lines(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(b'{"text": "fine"}\n{"text": "caf\xff"}\n')
    with pytest.raises(InputError, match=r"bad.jsonl: line 2, byte offset 13: invalid UTF-8.*--utf8-errors"):
        prepare([bad], tmp_path / "o", shard_size=100, progress=False)
    assert not list((tmp_path / "o").glob("*.bin")) and not list((tmp_path / "o").glob("*.tmp"))
    r = prepare([bad], tmp_path / "o2", shard_size=100, utf8_errors="replace", progress=False,
                log=lambda *a: None)
    _, toks = all_tokens(tmp_path / "o2")
    np.testing.assert_array_equal(toks, reference_stream(["fine", "caf\ufffd"]))
    assert r["docs"] == 2

    nofield = tmp_path / "nofield.jsonl"
    nofield.write_text('{"text": "a"}\n{"content": "b", "id": 3}\n')
    with pytest.raises(InputError, match=r"nofield.jsonl: line 2: no 'text' field \(has: content, id\)"):
        prepare([nofield], tmp_path / "o3", progress=False)
    with pytest.raises(InputError, match="line 1: no 'content'"):
        prepare([nofield], tmp_path / "o5", text_field="content", progress=False)
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"text": "a"\n')
    with pytest.raises(InputError, match=r"broken.jsonl: line 1: not valid JSON"):
        prepare([broken], tmp_path / "o6", progress=False)
    with pytest.raises(InputError, match="no such file"):
        prepare([tmp_path / "missing.jsonl"], tmp_path / "o7", progress=False)


def test_empty_documents_and_txt_inputs(tmp_path):
    d = tmp_path / "docs"
    d.mkdir()
    (d / "a.txt").write_text("First document.\nTwo lines.")
    (d / "b.txt").write_text("   \n")                       # whitespace only: EOT and its tokens
    (d / "c.jsonl").write_text('{"text": ""}\n{"text": "Third."}\n{"text": null}\n')   # "" and null: EOT
    msgs = []
    r = prepare([d], tmp_path / "o", shard_size=1000, progress=False, log=msgs.append)
    _, toks = all_tokens(tmp_path / "o")
    np.testing.assert_array_equal(toks, reference_stream(["First document.\nTwo lines.", "   \n", "", "Third.", ""]))
    assert (toks == EOT).sum() == 5 and toks[-1] == EOT and r["docs"] == 5
    assert any("val shard" in m for m in msgs)     # everything fit in shard 0: warned
    (d / "d.txt").write_bytes(b"ok\nline two \xc3\x28 broken")
    with pytest.raises(InputError, match=r"d.txt: line 2, byte offset \d+: invalid UTF-8"):
        prepare([d / "d.txt"], tmp_path / "o2", progress=False)


def test_token_ids_must_fit_uint16(monkeypatch):
    class Wide:
        def encode_ordinary(self, text):
            return [70000]
    monkeypatch.setattr(fineweb, "_ENC", Wide())
    with pytest.raises(InputError, match="token id 70000 does not fit in uint16"):
        fineweb.tokenize_chunk(["anything"])


@pytest.mark.parametrize("name", ["my_val_data", "val_set", "fw_train_x", "train", "val", "", "a/b"])
def test_ambiguous_names_refused(tmp_path, name, capsys):
    """A name with a _val_ / _train_ part would make glob patterns like *_val_*.bin (llm.c's -j) pick
    up the other split: refused before anything is written."""
    with pytest.raises(ValueError, match="name"):
        write_shards(["some text"], tmp_path / "o", name=name, shard_size=10, progress=False)
    assert not (tmp_path / "o").exists() or not list((tmp_path / "o").iterdir())
    if name:
        from gpt2core.data.__main__ import main
        assert main(["fineweb", "--input", str(EDU5), "--out-dir", str(tmp_path / "c"), "--name", name,
                     "--no-progress", "-j", "1"]) == 1
        assert f"{name!r}" in capsys.readouterr().err


def test_names_that_share_a_prefix_stay_apart(tmp_path):
    """Shards of `fw` and `fw_x` in one directory: writing or overwriting one leaves the other alone."""
    kw = dict(shard_size=20, progress=False, log=lambda *a: None)
    first = write_shards(["one document here, long enough for two shards"] * 3, tmp_path, name="fw_x", **kw)
    before = {p: p.read_bytes() for p in first["shards"]}
    r = write_shards(["another text"] * 4, tmp_path, name="fw", **kw)
    write_shards(["a third text"] * 5, tmp_path, name="fw", overwrite=True, **kw)
    assert {p: p.read_bytes() for p in first["shards"]} == before
    assert all(p.name.startswith("fw_val_") or p.name.startswith("fw_train_") for p in r["shards"])


def test_shard_size_checked(tmp_path):
    with pytest.raises(ValueError, match="shard_size"):
        write_shards(["a"], tmp_path, shard_size=2**31, progress=False)


def test_parquet_input(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    texts = texts_of(EDU5)
    pq.write_table(pa.table({"id": list(range(5)), "text": texts}), tmp_path / "x.parquet")
    prepare([tmp_path / "x.parquet"], tmp_path / "o", shard_size=4000, progress=False, log=lambda *a: None)
    _, toks = all_tokens(tmp_path / "o")
    np.testing.assert_array_equal(toks, reference_stream(texts))
    with pytest.raises(InputError, match="no column 'body'"):
        prepare([tmp_path / "x.parquet"], tmp_path / "o2", text_field="body", progress=False)


def test_hub_source_through_datasets(tmp_path, monkeypatch):
    """The Hub path, with a stand-in `datasets` module (no network here)."""
    texts = ["Doc one.", "Doc two is longer.", "", "Three"]
    calls = {}

    class FakeDataset:
        def select_columns(self, cols):
            calls["cols"] = cols
            return self

        def iter(self, batch_size):
            for i in range(0, len(texts), 2):
                yield {"text": texts[i:i + 2]}

    def load_dataset(repo, name, split, cache_dir=None):
        calls["args"] = (repo, name, split)
        return FakeDataset()

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    r = prepare(None, tmp_path, sample="100BT", shard_size=5, progress=False, log=lambda *a: None)
    assert calls["args"] == ("HuggingFaceFW/fineweb-edu", "sample-100BT", "train")
    _, toks = all_tokens(tmp_path)
    np.testing.assert_array_equal(toks, reference_stream(texts))
    assert r["shards"][0].name == "edufineweb_val_000000.bin"

    def offline(*a, **k):
        raise ConnectionError("no network")
    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=offline))
    with pytest.raises(RuntimeError, match="could not load HuggingFaceFW/fineweb .*--input"):
        prepare(None, tmp_path / "b", dataset="fineweb", progress=False)


def test_cli(tmp_path, capsys):
    from gpt2core.data.__main__ import main
    rc = main(["fineweb", "--input", str(EDU5), "--out-dir", str(tmp_path), "--shard-size", "4e3",
               "-j", "1", "--no-progress"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "3 shards" in out and "edufineweb_train_000002.bin" in out
    with pytest.raises(SystemExit) as e:  # a bad argument: argparse's usage error, naming the flag and the file
        main(["fineweb", "--input", str(tmp_path / "nope.jsonl"), "--out-dir", str(tmp_path / "x")])
    assert e.value.code == 2
    assert "argument --input/-i: must be an existing file or directory" in capsys.readouterr().err


def test_cli_dispatches_shakespeare(tmp_path):
    from gpt2core.data.__main__ import main
    assert main(["shakespeare", "--out", str(tmp_path)]) == 0
    # nanoGPT's 90/10 split of Tiny Shakespeare (its prepare.py: 301,966 train and 36,059 val tokens)
    assert [read_header(p) for p in find_shards(tmp_path, "val") + find_shards(tmp_path, "train")] == [36059, 301966]


def test_hub_source_through_huggingface_hub(tmp_path, monkeypatch):
    """Without `datasets`, the sample's parquet files come from huggingface_hub.snapshot_download."""
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    texts = texts_of(EDU5)
    snap = tmp_path / "snap"
    (snap / "sample" / "10BT").mkdir(parents=True)
    pq.write_table(pa.table({"text": texts[:2]}), snap / "sample" / "10BT" / "000_00000.parquet")
    pq.write_table(pa.table({"text": texts[2:]}), snap / "sample" / "10BT" / "001_00000.parquet")
    seen = {}

    def snapshot_download(repo, repo_type, allow_patterns, cache_dir=None):
        seen.update(repo=repo, repo_type=repo_type, patterns=allow_patterns)
        return str(snap)
    monkeypatch.setitem(sys.modules, "datasets", None)      # import datasets -> ImportError
    monkeypatch.setitem(sys.modules, "huggingface_hub", types.SimpleNamespace(snapshot_download=snapshot_download))
    prepare(None, tmp_path / "o", shard_size=3000, progress=False, log=lambda *a: None)
    assert seen == {"repo": "HuggingFaceFW/fineweb-edu", "repo_type": "dataset", "patterns": ["sample/10BT/*.parquet"]}
    _, toks = all_tokens(tmp_path / "o")
    np.testing.assert_array_equal(toks, reference_stream(texts))
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)
    with pytest.raises(RuntimeError, match=r"needs `datasets` or `huggingface_hub`.*--input"):
        prepare(None, tmp_path / "o2", progress=False)


def test_hub_unavailable_writes_nothing(tmp_path, monkeypatch, capsys):
    from gpt2core.data.__main__ import main
    monkeypatch.setitem(sys.modules, "datasets", None)
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)
    assert main(["fineweb", "--out-dir", str(tmp_path / "fw")]) == 1
    assert "pip install 'gpt2core[data]'" in capsys.readouterr().err
    assert not (tmp_path / "fw").exists()
