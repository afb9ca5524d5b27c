"""Token shards in llm.c's layout: round trip, and corrupt files rejected with the file named."""
import numpy as np
import pytest

from gpt2core.data import ShardError, load_tokens, read_header, write_shard
from gpt2core.data.shards import HEADER_BYTES, MAGIC


def test_round_trip_random_tokens(tmp_path):
    rng = np.random.default_rng(0)
    toks = rng.integers(0, 65536, size=12345, dtype=np.int64)
    p = write_shard(tmp_path / "x_train_000001.bin", toks)
    assert p.stat().st_size == HEADER_BYTES + 2 * toks.size
    assert read_header(p) == toks.size
    np.testing.assert_array_equal(load_tokens(p), toks)
    header = np.fromfile(p, dtype="<i4", count=3)
    assert header.tolist() == [MAGIC, 1, toks.size]
    assert not list(tmp_path.glob("*.tmp"))


def test_rejects_out_of_range_tokens_and_writes_nothing(tmp_path):
    with pytest.raises(ValueError, match="uint16"):
        write_shard(tmp_path / "bad.bin", [1, 2, 70000])
    with pytest.raises(ValueError, match="uint16"):
        write_shard(tmp_path / "neg.bin", [-1, 2])
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("corruption, message", [
    ("truncate", "truncated or corrupt"),
    ("magic", "bad magic"),
    ("version", "unsupported shard version"),
    ("short_header", "truncated shard header"),
    ("extra", "truncated or corrupt"),
])
def test_corrupt_shards_name_the_file(tmp_path, corruption, message):
    p = write_shard(tmp_path / "s_val_000000.bin", np.arange(1000) % 50257)
    raw = bytearray(p.read_bytes())
    if corruption == "truncate":
        raw = raw[:-7]
    elif corruption == "magic":
        raw[0:4] = np.int32(1234).tobytes()
    elif corruption == "version":
        raw[4:8] = np.int32(7).tobytes()
    elif corruption == "short_header":
        raw = raw[:100]
    elif corruption == "extra":
        raw += b"\x00\x00"
    p.write_bytes(bytes(raw))
    with pytest.raises(ShardError) as e:
        load_tokens(p)
    assert message in str(e.value) and str(p) in str(e.value)


def test_missing_file_is_named(tmp_path):
    with pytest.raises(ShardError, match="nothere.bin"):
        read_header(tmp_path / "nothere.bin")


def test_split_is_read_from_the_name_structure(tmp_path):
    """<name>_<split>_<index>.bin: the split is the part right before the index, whatever the name
    holds; llm.c's small sets (tiny_shakespeare_val.bin) have no index."""
    from gpt2core.data.loader import DataLoader
    from gpt2core.data.shards import find_shards
    split_of = {"my_val_data_val_000000.bin": "val", "my_val_data_train_000001.bin": "train",
                "fw_train_x_val_000000.bin": "val", "fw_train_x_train_000001.bin": "train",
                "val_set_train_000002.bin": "train", "train_val_000000.bin": "val",
                "val_000000.bin": "val", "tiny_shakespeare_val.bin": "val", "tiny_shakespeare_train.bin": "train",
                "interval_000001.bin": None, "x_valid_000001.bin": None, "x_train_x.bin": None}
    for name in split_of:
        write_shard(tmp_path / name, np.arange(300))
    for split in ("train", "val"):
        want = sorted(n for n, s in split_of.items() if s == split)
        assert [p.name for p in find_shards(tmp_path, split)] == want
        assert [p.name for p in DataLoader(tmp_path, split, 1, 8).files] == want
