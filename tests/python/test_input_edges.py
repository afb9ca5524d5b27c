"""Inputs checked where they enter the commands (issue 38): the same bad bytes from standard input and from a file
get the same one-line answer (exit 1); a data file with a token id outside the model's vocabulary is a
FileFormatError naming the file; -T above the model's block size is a usage error (exit 2) naming both numbers;
a metrics file that is not UTF-8 is named. The console entry points run in this process (console(argv) returns the
exit status, the message goes to stderr)."""
import io
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from gpt2core import GPT2, GPT2Config
from gpt2core.data import hellaswag as hs
from gpt2core.data.shards import write_shard
from gpt2core.errors import FileFormatError

CFG = GPT2Config(block_size=16, vocab_size=50257, padded_vocab_size=50304, n_layer=1, n_head=2, n_embd=16)
JUNK = b"Hello\n\xff\xfe\x00binary\x80\n"


@pytest.fixture(scope="module")
def model_file(tmp_path_factory):
    return GPT2(CFG, seed=0).save(tmp_path_factory.mktemp("edges") / "m.bin")


def one_line_error(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    return err


def test_generate_refuses_junk_alike_from_stdin_and_from_a_file(model_file, tmp_path, capsys, monkeypatch):
    from gpt2core import generate
    f = tmp_path / "junk.txt"
    f.write_bytes(JUNK)
    base = ["--model", str(model_file), "--max-new-tokens", "2", "--no-stats"]
    assert generate.console(base + ["--prompts-file", str(f)]) == 1
    from_file = one_line_error(capsys)
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(JUNK)))
    assert generate.console(base + ["--prompts-file", "-"]) == 1
    from_stdin = one_line_error(capsys)
    assert from_file == f"gpt2core-generate: --prompts-file {f}: {f} is not UTF-8 text (byte 0xff on line 2)"
    assert from_stdin == "gpt2core-generate: --prompts-file -: standard input is not UTF-8 text (byte 0xff on line 2)"
    nul = b"Hello\n\x00\x01\n"  # valid UTF-8, still not text
    f.write_bytes(nul)
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(nul)))
    assert generate.console(base + ["--prompts-file", "-"]) == 1
    assert "standard input holds a NUL byte" in one_line_error(capsys)
    assert generate.console(base + ["--prompts-file", str(f)]) == 1
    assert f"{f} holds a NUL byte" in one_line_error(capsys)
    assert generate.console(base + ["Hi", "--max-new-tokens", str(10**18)]) == 2  # argparse: usage, then the line
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert "argument --max-new-tokens" in last and "2,147,483,647" in last, last


def test_eval_val_seq_len_above_block_size_and_out_of_vocab_shard(model_file, tmp_path, capsys):
    from gpt2core import evaluate
    data = tmp_path / "data"
    data.mkdir()
    rng = np.random.default_rng(0)
    write_shard(data / "x_val_000000.bin", rng.integers(0, 50257, 4000).astype(np.uint16))
    assert evaluate.console(["val", "-c", str(model_file), "--data-dir", str(data), "-T", "64", "-B", "1"]) == 2
    err = one_line_error(capsys)
    assert "-T 64" in err and "block_size 16" in err, err
    bad = rng.integers(0, 50257, 4000).astype(np.uint16)
    bad[777] = 60000
    write_shard(data / "x_val_000000.bin", bad)
    assert evaluate.console(["val", "-c", str(model_file), "--data-dir", str(data), "-T", "16", "-B", "2"]) == 1
    err = one_line_error(capsys)
    assert "x_val_000000.bin" in err and "60000" in err, err


def test_hellaswag_npz_with_an_out_of_vocab_id_names_the_file(model_file, tmp_path, capsys):
    from gpt2core import evaluate
    items = hs.read_jsonl(Path(__file__).resolve().parents[1] / "data" / "hellaswag_val_120.jsonl", limit=2)
    r = hs.render(items)
    r.tokens[5] = 65000
    path = hs.save(r, tmp_path / "hs.npz")
    assert evaluate.console(["hellaswag", "-c", str(model_file), "--data", str(path), "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err and f"{path}: token id 65000" in err and "50257" in err, err
    model = GPT2(CFG, seed=0, training=False)
    with pytest.raises(FileFormatError, match=r"hs\.npz: token id 65000 \(position 5\)"):
        evaluate.score_hellaswag(model, str(path))


def test_plot_names_a_log_that_is_not_utf8(tmp_path, capsys):
    from gpt2core import plot
    log = tmp_path / "main.log"
    log.write_bytes(b"s:0 trl:10.9\n\xff\xfe s:1 trl:10.1\n")
    assert plot.console([str(log), "-o", str(tmp_path / "p.png")]) == 1
    assert one_line_error(capsys) == f"gpt2core-plot: {log} is not UTF-8 text (byte 0xff on line 2): give a " \
                                     "metrics.jsonl or an llm.c main.log"


def test_bench_seq_len_above_block_size_is_a_usage_error():
    bench = Path(__file__).resolve().parents[2] / "scripts" / "bench.py"
    p = subprocess.run([sys.executable, str(bench), "--preset", "tiny", "-T", "100000", "--steps", "1"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
    assert "-T/--seq-len 100000" in p.stderr and "block_size" in p.stderr, p.stderr
