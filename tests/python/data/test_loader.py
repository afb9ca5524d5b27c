"""DataLoader: windows, shuffling, epochs, ranks, resume, errors.

Shards are filled with tokens that encode their own position (shard k holds k*10000 + 0, 1, 2, ...),
so every batch can be checked against where it must have come from.
"""
import json

import numpy as np
import pytest

from gpt2core.data.loader import DataLoader
from gpt2core.data.shards import ShardError, write_shard

SIZES = [1500, 2100, 900, 1300]   # train shards 1..4; val shard 0 has 1000 tokens


@pytest.fixture()
def data_dir(tmp_path):
    write_shard(tmp_path / "tst_val_000000.bin", np.arange(1000))
    for k, n in enumerate(SIZES, start=1):
        write_shard(tmp_path / f"tst_train_{k:06d}.bin", k * 10000 + np.arange(n))
    return tmp_path


def locate(x):
    """(shard, offset) of each row, from the position-encoding token values."""
    return [(int(r[0]) // 10000, int(r[0]) % 10000) for r in x]


def check_contiguous(x, y):
    # each row is consecutive tokens; y is x shifted by one
    assert x.dtype == np.int32 and y.dtype == np.int32
    np.testing.assert_array_equal(np.diff(x, axis=1), 1)
    np.testing.assert_array_equal(y, x + 1)


def take(loader, n):
    return [loader.next_batch() for _ in range(n)]


def test_sequential_reads_shards_in_order(data_dir):
    B, T = 2, 16
    dl = DataLoader(data_dir, "train", B, T, shuffle=False)
    W = B * T
    expected = []   # independent enumeration of (shard, window start)
    for k, n in enumerate(SIZES, start=1):
        expected += [(k, w * W) for w in range((n - 1) // W)]
    assert dl.batches_per_epoch == len(expected)
    assert dl.n_tokens == sum(SIZES)
    for epoch in range(2):
        for k, start in expected:
            x, y = dl.next_batch()
            assert x.shape == (B, T) and y.shape == (B, T)
            check_contiguous(x, y)
            assert locate(x) == [(k, start), (k, start + T)]
        assert dl.epoch == epoch + 1


def test_last_target_is_next_token_in_shard(data_dir):
    # a window uses B*T+1 tokens: the final target is the token after the window
    dl = DataLoader(data_dir / "tst_val_000000.bin", "val", 3, 333, shuffle=False)
    assert dl.batches_per_epoch == 1           # 999 + 1 tokens fit exactly once
    x, y = dl.next_batch()
    assert y[-1, -1] == 999 and x[0, 0] == 0


def test_shuffle_is_a_permutation_per_epoch(data_dir):
    B, T = 2, 16
    W = B * T
    dl = DataLoader(data_dir, "train", B, T, shuffle=True, seed=7)
    all_windows = sorted((k, w * W) for k, n in enumerate(SIZES, start=1) for w in range((n - 1) // W))
    epochs = []
    for epoch in range(3):
        seen = []
        for _ in range(dl.batches_per_epoch):
            x, y = dl.next_batch()
            check_contiguous(x, y)
            (k, s0), (k1, s1) = locate(x)
            assert k1 == k and s1 == s0 + T
            seen.append((k, s0))
        assert sorted(seen) == all_windows        # every window exactly once per epoch
        shard_seq = [k for k, _ in seen]
        # shards are read one after another (not interleaved)
        blocks = [k for i, k in enumerate(shard_seq) if i == 0 or shard_seq[i - 1] != k]
        assert sorted(blocks) == [1, 2, 3, 4]
        epochs.append(seen)
    assert epochs[0] != epochs[1] != epochs[2]
    # the window order inside a shard is shuffled, not sequential
    in_shard2 = [s for k, s in epochs[0] if k == 2]
    assert in_shard2 != sorted(in_shard2)
    # the same seed replays; another seed differs
    again = DataLoader(data_dir, "train", B, T, shuffle=True, seed=7)
    assert [locate(again.next_batch()[0])[0] for _ in range(10)] == epochs[0][:10]
    other = DataLoader(data_dir, "train", B, T, shuffle=True, seed=8)
    assert [locate(other.next_batch()[0])[0] for _ in range(len(all_windows))] != epochs[0]


@pytest.mark.parametrize("shuffle", [False, True])
def test_ranks_split_the_global_batch(data_dir, shuffle):
    B, T, ws = 2, 8, 3
    single = DataLoader(data_dir, "train", ws * B, T, shuffle=shuffle, seed=3)
    ranks = [DataLoader(data_dir, "train", B, T, rank=r, world_size=ws, shuffle=shuffle, seed=3)
             for r in range(ws)]
    assert all(r.batches_per_epoch == single.batches_per_epoch for r in ranks)
    for _ in range(single.batches_per_epoch + 5):      # crosses an epoch boundary
        xs, ys = single.next_batch()
        parts = [r.next_batch() for r in ranks]
        np.testing.assert_array_equal(np.concatenate([p[0] for p in parts]), xs)
        np.testing.assert_array_equal(np.concatenate([p[1] for p in parts]), ys)
        starts = [set(locate(p[0])) for p in parts]
        assert not (starts[0] & starts[1]) and not (starts[1] & starts[2])


@pytest.mark.parametrize("stop", [3, 40, 95])
def test_state_dict_resumes_exactly(data_dir, stop):
    B, T = 2, 16
    ref = DataLoader(data_dir, "train", B, T, seed=11)
    batches = take(ref, 120)
    dl = DataLoader(data_dir, "train", B, T, seed=11)
    take(dl, stop)
    state = json.loads(json.dumps(dl.state_dict()))      # must survive JSON
    fresh = DataLoader(data_dir, "train", B, T, seed=999)  # the saved seed wins
    fresh.load_state_dict(state)
    for want, got in zip(batches[stop:], take(fresh, 120 - stop)):
        np.testing.assert_array_equal(want[0], got[0])
        np.testing.assert_array_equal(want[1], got[1])
    assert fresh.epoch == ref.epoch and fresh.step == 120


def test_state_resumes_across_world_sizes(data_dir):
    # the position is global: 2 ranks of B=2 can resume a run made with 1 process of B=4
    one = DataLoader(data_dir, "train", 4, 8, seed=5)
    take(one, 17)
    state = one.state_dict()
    nxt = one.next_batch()[0]
    ranks = [DataLoader(data_dir, "train", 2, 8, rank=r, world_size=2, seed=5) for r in range(2)]
    for r in ranks:
        r.load_state_dict(state)
    np.testing.assert_array_equal(np.concatenate([r.next_batch()[0] for r in ranks]), nxt)


def test_state_rejects_other_batch_or_files(data_dir):
    dl = DataLoader(data_dir, "train", 2, 16)
    state = dl.state_dict()
    with pytest.raises(ValueError, match="global batch"):
        DataLoader(data_dir, "train", 4, 16).load_state_dict(state)
    with pytest.raises(ValueError, match="shards"):
        DataLoader(sorted(data_dir.glob("*train*"))[:2], "train", 2, 16).load_state_dict(state)


@pytest.mark.parametrize("shuffle", [False, True])
def test_val_same_batches_after_reset(data_dir, shuffle):
    dl = DataLoader(data_dir, "val", 2, 32, shuffle=shuffle)
    first = take(dl, 5)
    take(dl, 3)
    dl.reset()
    for a, b in zip(first, take(dl, 5)):
        np.testing.assert_array_equal(a[0], b[0])
    assert dl.files == [data_dir / "tst_val_000000.bin"]


def test_glob_and_file_list(data_dir):
    a = DataLoader(str(data_dir / "tst_train_*.bin"), "train", 2, 16, seed=1)
    b = DataLoader(sorted(data_dir.glob("tst_train_*.bin")), "train", 2, 16, seed=1)
    c = DataLoader(data_dir, "train", 2, 16, seed=1)
    for _ in range(10):
        xa, xb, xc = a.next_batch()[0], b.next_batch()[0], c.next_batch()[0]
        np.testing.assert_array_equal(xa, xb)
        np.testing.assert_array_equal(xa, xc)


def test_no_shards_of_split(tmp_path):
    write_shard(tmp_path / "x_train_000001.bin", np.arange(100))
    with pytest.raises(FileNotFoundError, match=r"no 'val' shards in .*" + tmp_path.name):
        DataLoader(tmp_path, "val", 1, 8)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        DataLoader(tmp_path / "nope", "train", 1, 8)


def test_shards_too_small(tmp_path):
    write_shard(tmp_path / "x_val_000000.bin", np.arange(100))
    with pytest.raises(ValueError, match=r"x_val_000000.bin has 100 tokens.*101 tokens"):
        DataLoader(tmp_path, "val", 4, 25)
    DataLoader(tmp_path, "val", 3, 33)   # 99 + 1 fits


def test_small_shard_skipped_with_warning(data_dir):
    with pytest.warns(UserWarning, match="tst_train_000003.bin"):
        dl = DataLoader(data_dir, "train", 4, 256, shuffle=False)   # 1025 > 900 tokens of shard 3
    assert [p.name for p in dl.files] == ["tst_train_000001.bin", "tst_train_000002.bin",
                                          "tst_train_000004.bin"]
    assert dl.n_tokens == sum(SIZES)


def test_corrupt_shard_is_named(data_dir):
    bad = data_dir / "tst_train_000002.bin"
    bad.write_bytes(bad.read_bytes()[:-2])
    with pytest.raises(ShardError, match="tst_train_000002.bin"):
        DataLoader(data_dir, "train", 2, 16)


def test_bad_arguments(data_dir):
    with pytest.raises(ValueError, match="rank"):
        DataLoader(data_dir, "train", 2, 16, rank=2, world_size=2)
    with pytest.raises(ValueError, match="B must"):
        DataLoader(data_dir, "train", 0, 16)
