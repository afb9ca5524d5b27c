"""scripts/lease_data.py on local text (offline): the shards hold exactly the documents' tokens (<|endoftext|> before
each, in the script's fixed shuffled file order), shard 0 is validation, the files never pass --max-mib (a budget
exactly the size of every shard keeps every token, one byte less loses one), and the manifest's sha256 and token
counts are the files'. The Debian packages themselves are fetched only by hand (docs/DATA_SOURCES.md)."""
import gzip
import hashlib
import json
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from gpt2core.data.shards import load_tokens, parse_shard_filename
from gpt2core.tokenizer import EOT, encode

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "lease_data.py"
MIB = 1 << 20


def run(*args, ok=True):
    p = subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], capture_output=True, text=True, timeout=120)
    if ok:
        assert p.returncode == 0, p.stdout + p.stderr
    return p


@pytest.fixture(scope="module")
def texts(tmp_path_factory):
    """A folder of six documents (one gzipped, one in a subfolder, one empty: skipped) and a file of another
    suffix that a folder walk leaves out; the reference token stream in the script's order."""
    d = tmp_path_factory.mktemp("texts")
    rng = random.Random(5)
    words = "the kernel schedules every task once per tick while memory pages move between zones".split()
    docs = {}
    for i in range(6):
        docs[f"doc{i}.txt"] = " ".join(rng.choice(words) for _ in range(40 + 37 * i)) + f" (document {i})"
    docs["doc5.txt"] = ""
    (d / "sub").mkdir()
    for name, text in docs.items():
        if name == "doc1.txt":
            (d / "sub" / "doc1.rst.gz").write_bytes(gzip.compress(text.encode()))
        else:
            (d / name).write_text(text)
    (d / "image.png").write_bytes(b"\x89PNG not text")
    files = sorted([d / n for n in docs if n != "doc1.txt"] + [d / "sub" / "doc1.rst.gz"])
    random.Random(0).shuffle(files)
    stream = []
    for p in files:
        raw = gzip.decompress(p.read_bytes()) if p.suffix == ".gz" else p.read_bytes()
        if raw.decode().strip():
            stream += [EOT, *encode(raw.decode().strip())]
    return d, np.array(stream, dtype=np.uint16)


def shards_of(out: Path):
    m = json.loads((out / "manifest.json").read_text())
    assert set(m) == {"files", "source", "licence"}
    paths = [out / f["path"] for f in m["files"]]
    for f, p in zip(m["files"], paths):
        assert set(f) == {"path", "sha256", "tokens"}
        assert f["sha256"] == hashlib.sha256(p.read_bytes()).hexdigest()
        assert f["tokens"] == load_tokens(p).size
    assert [parse_shard_filename(p.name)[1:] for p in paths] == [("val", 0)] + [("train", i) for i in
                                                                                 range(1, len(paths))]
    return m, paths


def test_local_text_becomes_shards_of_exactly_its_tokens(texts, tmp_path):
    d, ref = texts
    out = tmp_path / "out"
    run(d, "--out", out, "--licence", "CC0-1.0", "--source", "test words", "--val-tokens", 50, "--shard-tokens", 100)
    m, paths = shards_of(out)
    assert m["licence"] == "CC0-1.0" and m["source"] == "test words"
    got = np.concatenate([load_tokens(p) for p in paths])
    np.testing.assert_array_equal(got, ref)
    assert load_tokens(paths[0]).size == 50 and all(load_tokens(p).size == 100 for p in paths[1:-1])
    assert 0 < load_tokens(paths[-1]).size <= 100
    assert not list(out.glob("*.tmp"))


def kept_tokens(n: int, budget: int, val: int, per: int) -> int:
    """The tokens that fit: shards filled in order (validation first), each a 1024-byte header and 2 bytes a token,
    none started without room for one token."""
    kept, used, size = 0, 0, val
    while kept < n and budget - used >= 1024 + 2:
        take = min(size, n - kept, (budget - used - 1024) // 2)
        kept, used, size = kept + take, used + 1024 + 2 * take, per
    return kept


@pytest.mark.parametrize("short", [0, 1, 2, 3, 1024, 1200])
def test_the_byte_budget_is_never_passed_and_cuts_at_a_token(texts, tmp_path, short):
    """Budget = the bytes of every shard, less `short`: 0 keeps every token, 1 and 2 lose the last token, 3 two of
    them; a header's worth drops the last (short) shard; never a file beyond the budget, never an empty shard."""
    d, ref = texts
    val, per = 50, 100
    n_shards = 1 + -(-(ref.size - val) // per)
    budget = n_shards * 1024 + 2 * ref.size - short
    assert ref.size > 400 and (ref.size - val) % per not in (0, 1)  # the last shard is short, and not one token
    out = tmp_path / "out"
    run(d, "--out", out, "--licence", "x", "--val-tokens", val, "--shard-tokens", per, "--max-mib", budget / MIB)
    _, paths = shards_of(out)
    assert sum(p.stat().st_size for p in paths) <= budget
    got = np.concatenate([load_tokens(p) for p in paths])
    kept = kept_tokens(ref.size, budget, val, per)
    if short < 1024:
        assert kept == ref.size - {0: 0, 1: 1, 2: 1, 3: 2}[short] and len(paths) == n_shards
    else:
        assert len(paths) == n_shards - 1
    np.testing.assert_array_equal(got, ref[:kept])
    assert all(load_tokens(p).size > 0 for p in paths)


def test_the_budget_ends_exactly_at_a_shard_boundary_without_an_empty_shard(texts, tmp_path):
    d, ref = texts
    out = tmp_path / "out"
    budget = 2 * 1024 + 2 * (50 + 100) + 1024 + 1  # two full shards, then room for a header and no token
    run(d, "--out", out, "--licence", "x", "--val-tokens", 50, "--shard-tokens", 100, "--max-mib", budget / MIB)
    _, paths = shards_of(out)
    assert [load_tokens(p).size for p in paths] == [50, 100]
    np.testing.assert_array_equal(np.concatenate([load_tokens(p) for p in paths]), ref[:150])


def test_bad_arguments_are_one_line_errors(texts, tmp_path):
    d, _ = texts
    cases = [((d, "--out", tmp_path / "a"), "--licence is required"),
             ((tmp_path / "missing.txt", "--out", tmp_path / "b", "--licence", "x"), "no such file or folder"),
             ((d, "--out", tmp_path / "c", "--licence", "x", "--max-mib", 0), "--max-mib must be positive"),
             ((d, "--out", tmp_path / "c", "--licence", "x", "--max-mib", 1000 / MIB), "too small"),
             ((d, "--out", tmp_path / "d", "--licence", "x", "--val-tokens", 10 ** 6), "not enough text"),
             ((d, "--out", tmp_path / "e", "--licence", "x", "--name", "my_val"), "--name")]
    for args, msg in cases:
        p = run(*args, ok=False)
        assert p.returncode != 0 and "Traceback" not in p.stderr, p.stderr
        assert msg in p.stderr.strip().splitlines()[-1], p.stderr
    out = tmp_path / "g"
    run(d, "--out", out, "--licence", "x", "--val-tokens", 50)
    p = run(d, "--out", out, "--licence", "x", ok=False)
    assert "already holds shards" in p.stderr and "Traceback" not in p.stderr
    p = run("--out", tmp_path / "h", "--packages", "gcc-doc", ok=False)
    assert "no reader for 'gcc-doc'" in p.stderr and "Traceback" not in p.stderr
