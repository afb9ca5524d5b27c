"""Every command checks its arguments in one place and fails in one line (gpt2core.cli): the cases of issue 25
("accepted without a word", "a traceback instead of an error"), each with its exit code and the message naming the
argument or path; every console script run as a command with a bad argument; a seeded fuzz of every command's
flags (exit 0, or 1/2 with one line and no traceback; never a signal, never a hang)."""
import argparse
import random
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import gpt2core
from gpt2core import cli, doctor, evaluate, generate, launch, plot, train
from gpt2core.data import __main__ as data_main
from gpt2core.data.shards import write_shard
from gpt2core.errors import ArgError
from gpt2core.training import trainer
from gpt2core.model import NoGradientsError

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "scripts" / "bench.py"


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("cases")
    rng = np.random.default_rng(0)
    data = d / "data"
    write_shard(data / "t_val_000000.bin", rng.integers(0, 50257, 600))
    write_shard(data / "t_train_000001.bin", rng.integers(0, 50257, 5000))
    zero = d / "zero"
    write_shard(zero / "t_val_000000.bin", np.zeros(0, np.int64))
    write_shard(zero / "t_train_000001.bin", rng.integers(0, 50257, 5000))
    noval = d / "noval"
    write_shard(noval / "t_train_000001.bin", rng.integers(0, 50257, 5000))
    model = gpt2core.GPT2("tiny", seed=1).save(d / "tiny.bin")
    regular = d / "regular.txt"
    regular.write_text("x")
    return {"data": data, "zero": zero, "noval": noval, "model": model, "regular": regular, "dir": d,
            "shard": data / "t_train_000001.bin"}


def _run(console, argv, capsys):
    code = console([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, err


T = ["--preset", "tiny", "-B", "1", "-T", "8", "--steps", "1", "--val-every", "0", "--sample-tokens", "0"]

# (command, argv given the fixture's files, exit code, message substring)
CASES = [
    # gpt2core-train: accepted without a word before
    ("train", lambda f: ["--lr", "1e39"], 2, "--lr must be a finite number > 0, got 1e+39 (it overflows to inf in float32)"),
    ("train", lambda f: ["--eps", "1e-50"], 2, "--eps must be a finite number > 0, got 1e-50 (it underflows to 0 or a "
                                               "denormal in float32)"),
    ("train", lambda f: ["--weight-decay", "1e39"], 2, "--weight-decay must be a finite number >= 0, got 1e+39 (it "
                                                       "overflows to inf in float32)"),
    ("train", lambda f: ["--beta2", "0.9999999999"], 2, "--beta2 must be a number in [0, 1), got 0.9999999999 (it "
                                                        "rounds to 1.0 in float32)"),
    ("train", lambda f: T + ["--threads", "60000", "--data-dir", f["data"], "--output-dir", f["dir"] / "o1"], 2,
     "--threads 60000 is more than the"),
    ("train", lambda f: ["--matmul-tuning"], 2, "--matmul-tuning needs --device cuda (it does nothing on the CPU)"),
    ("train", lambda f: ["--cuda-graphs"], 2, "--cuda-graphs needs --device cuda"),
    ("train", lambda f: T + ["--zero", "1", "--data-dir", f["data"], "--output-dir", f["dir"] / "o2"], 2,
     "--zero 1 shards the AdamW state over the processes of a data-parallel run, and this run is one process"),
    ("train", lambda f: ["--data-dir", f["shard"]], 2, "--data-dir must be an existing directory, got"),
    ("train", lambda f: T + ["--val-every", "1", "--val-steps", "1000", "--data-dir", f["data"], "--output-dir",
                             f["dir"] / "o3"], 2, "--val-steps 1000 is more than the 74 batches the validation data "
                                                  "hold at -B 1 -T 8"),
    # gpt2core-train: a traceback or an unnamed problem before
    ("train", lambda f: ["--output-dir", f["regular"]], 2, "(it exists and is not a directory)"),
    ("train", lambda f: T + ["--data-dir", f["zero"], "--output-dir", f["dir"] / "o4"], 1,
     "val shards are too small: "),
    ("train", lambda f: T + ["--data-dir", f["noval"], "--output-dir", f["dir"] / "o5"], 1,
     "no 'val' shards in "),
    ("train", lambda f: ["--device", "tpu"], 2, "--device must be a device: 'cpu', 'cuda' or 'cuda:N', got 'tpu'"),
    ("train", lambda f: ["--device", "cpu:1"], 2, "--device must be a device: 'cpu', 'cuda' or 'cuda:N', got 'cpu:1'"),
    ("train", lambda f: ["--device", ""], 2, "--device must be a device: 'cpu', 'cuda' or 'cuda:N', got ''"),
    ("train", lambda f: ["--block-size", str(2**31)], 2, "--block-size must be a positive integer, got 2147483648 (the "
                                                         "most is 1,048,576)"),
    ("train", lambda f: ["--padded-vocab-size", "100"], 2, "--padded-vocab-size 100 with --preset s4: "
                                                           "padded_vocab_size (100) must be >= vocab_size (50257)"),
    ("train", lambda f: ["-B", "1000000000"], 2, "--batch-size must be auto or a positive integer, got 1000000000 (the most "
                                                 "is 16,777,216)"),
    ("train", lambda f: ["--seed", "-1"], 2, "--seed must be an integer >= 0, got -1"),
    ("train", lambda f: ["--steps", "abc"], 2, "argument --steps: must be a positive integer, got 'abc'"),
    # gpt2core-generate
    ("generate", lambda f: ["--model", f["model"], "--max-new-tokens", "-1"], 2,
     "argument --max-new-tokens: must be an integer >= 0, got '-1'"),
    ("generate", lambda f: ["--model", f["model"], "--temperature", "0"], 2,
     "argument --temperature: must be a finite number > 0, got '0'"),
    ("generate", lambda f: ["--model", f["model"], "--temperature", "-1"], 2, "argument --temperature: must be"),
    ("generate", lambda f: ["--model", f["model"], "--temperature", "nan"], 2, "argument --temperature: must be"),
    ("generate", lambda f: ["--model", f["model"], "--num-samples", "0"], 2,
     "argument --num-samples: must be a positive integer, got '0'"),
    ("generate", lambda f: ["--model", f["model"], "--seed", "-1"], 2, "argument --seed: must be an integer >= 0, "
                                                                       "got '-1'"),
    ("generate", lambda f: ["--model", f["model"], "--device", "cuda:7"], 2, "--device cuda:7: "),
    ("generate", lambda f: ["--model", f["dir"] / "missing.bin"], 1, "missing.bin"),
    # gpt2core-eval
    ("eval", lambda f: ["hellaswag", "-c", f["model"], "--limit", "0"], 2, "argument --limit: must be a positive "
                                                                           "integer, got '0'"),
    ("eval", lambda f: ["hellaswag", "-c", f["model"], "--items-per-batch", "-1"], 2,
     "argument --items-per-batch: must be a positive integer, got '-1'"),
    ("eval", lambda f: ["val", "-c", f["model"], "--data-dir", f["data"], "--steps", "0"], 2,
     "argument --steps: must be a positive integer, got '0'"),
    ("eval", lambda f: ["val", "-c", f["model"], "--data-dir", f["regular"]], 2,
     "argument --data-dir: must be an existing directory"),
    # python -m gpt2core.data
    ("data", lambda f: ["fineweb", "--num-procs", "0"], 2, "argument --num-procs/-j: must be a positive integer, got '0'"),
    ("data", lambda f: ["fineweb", "--num-procs", "-2"], 2, "argument --num-procs/-j: must be a positive integer"),
    ("data", lambda f: ["fineweb", "--shard-size", "inf"], 2, "argument --shard-size: must be a positive integer, "
                                                              "got 'inf'"),
    ("data", lambda f: ["shakespeare", "--val-fraction", "0"], 2, "argument --val-fraction: must be a finite number "
                                                                  "in (0, 1), got '0'"),
    ("data", lambda f: ["shakespeare", "--val-fraction", "1"], 2, "argument --val-fraction: must be"),
    ("data", lambda f: ["shakespeare", "--val-fraction", "nan"], 2, "argument --val-fraction: must be"),
    ("data", lambda f: ["hellaswag", "--limit", "-1"], 2, "argument --limit: must be a positive integer, got '-1'"),
    # gpt2core-plot, gpt2core-doctor, python -m gpt2core.launch
    ("plot", lambda f: [f["dir"], "--tokens-per-step", "0"], 2, "argument --tokens-per-step: must be a positive "
                                                                "integer, got '0'"),
    ("plot", lambda f: [f["dir"] / "nowhere"], 1, "nowhere: no metrics file"),
    ("doctor", lambda f: ["--seconds", "-1"], 2, "argument --seconds: must be a finite number in [0, 3600], got '-1'"),
    ("launch", lambda f: ["--master-port", "99999", "x.py"], 2, "argument --master-port/--master_port: must be a TCP "
                                                                "port in [1, 65535] or 'auto', got '99999'"),
    ("launch", lambda f: ["--nproc-per-node", "0", "x.py"], 2, "argument --nproc-per-node/--nproc_per_node: must be"),
    ("launch", lambda f: ["--nnodes", "2", "--node-rank", "3", "x.py"], 2, "--node-rank 3 must be in 0..1 (--nnodes 2)"),
]
CONSOLES = {"train": train.console, "generate": generate.console, "eval": evaluate.console, "data": data_main.console,
            "plot": plot.console, "doctor": doctor.console, "launch": launch.console}


@pytest.mark.parametrize("name,argv,code,needle", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_issue_case(files, capsys, name, argv, code, needle):
    got, err = _run(CONSOLES[name], argv(files), capsys)
    assert "Traceback" not in err, err
    last = err.strip().splitlines()[-1] if err.strip() else ""
    assert (got, needle in last) == (code, True), err


def test_weights_or_a_micro_batch_beyond_the_machines_memory_are_refused(files, capsys, monkeypatch):
    args = T + ["--data-dir", files["data"], "--output-dir", files["dir"] / "o6", "-B", "8", "-T", "64"]
    monkeypatch.setattr(trainer, "_physical_memory", lambda: 16 * 2**20)
    got, err = _run(train.console, args, capsys)
    assert (got, err) == (2, "gpt2core-train: error: --preset tiny needs 50.7 MiB for its weights, gradients and AdamW "
                             "state, more than this machine's 16.0 MiB: choose a smaller --preset\n")
    monkeypatch.setattr(trainer, "_physical_memory", lambda: 60 * 2**20)
    got, err = _run(train.console, args, capsys)
    assert got == 2 and "gpt2core-train: error: -B 8 -T 64 needs " in err and " of memory for preset tiny (weights, " \
        "gradients, optimizer, activations), more than this machine's 60.0 MiB: lower -B" in err, err


def test_python_api_cases():
    m = gpt2core.GPT2("tiny", seed=0)
    for kw, needle in [({"lr": 1e39}, "lr must be"), ({"lr": 1e-3, "eps": 1e-50}, "eps must be"),
                       ({"lr": 1e-3, "weight_decay": 1e39}, "weight_decay must be")]:
        with pytest.raises(ArgError, match=needle + ".*float32"):
            m.step(**kw)
    before = m.params["wte"].copy()
    with pytest.raises(NoGradientsError, match=r"step\(\) before backward\(\): there are no gradients"):
        m.step(lr=1e-3)  # weight decay alone would have shrunk the weights
    np.testing.assert_array_equal(m.params["wte"], before)
    with pytest.raises(TypeError, match=r"'wte' is a view of the model's buffer and cannot be replaced"):
        m.params["wte"] = np.zeros_like(before)
    with pytest.raises(ArgError, match="max_new_tokens must be an integer >= 0, got -1"):
        m.generate(np.array([[1, 2]]), -1)
    with pytest.raises(ArgError, match="GPT2Config.block_size must be a positive int <= 1,048,576, got 2147483648"):
        gpt2core.GPT2Config(block_size=2**31)
    x = np.random.default_rng(0).integers(0, 50257, (1, 9))
    m.forward(x[:, :-1], x[:, 1:])
    m.backward()
    assert np.isfinite(m.step(lr=1e-3))  # with gradients it steps


# ------------------------------------------------------------------------------------ every console script
def _script(name):
    here = Path(sys.executable).parent / name
    return [str(here) if here.exists() else shutil.which(name)]


SCRIPTS = [
    (_script("gpt2core-train"), ["--seed", "-1"], "gpt2core-train: error: --seed must be an integer >= 0, got -1"),
    (_script("gpt2core-generate"), ["--model", "m.bin", "--top-k", "-1"],
     "gpt2core-generate: error: argument --top-k: must be an integer >= 0, got '-1'"),
    (_script("gpt2core-eval"), ["val", "-c", "m.bin", "--data-dir", ".", "-B", "0"],
     "gpt2core-eval val: error: argument --batch-size/-B: must be a positive integer, got '0'"),
    (_script("gpt2core-plot"), [".", "--tokens-per-step", "-5"],
     "gpt2core-plot: error: argument --tokens-per-step: must be a positive integer, got '-5'"),
    (_script("gpt2core-doctor"), ["--seconds", "nan"],
     "gpt2core-doctor: error: argument --seconds: must be a finite number in [0, 3600], got 'nan'"),
    ([sys.executable, "-m", "gpt2core.data"], ["fineweb", "--shard-size", "0"],
     "python -m gpt2core.data fineweb: error: argument --shard-size: must be a positive integer, got '0'"),
    ([sys.executable, "-m", "gpt2core.launch"], ["--master-port", "99999", "x.py"],
     "python -m gpt2core.launch: error: argument --master-port/--master_port: must be a TCP port in [1, 65535] or "
     "'auto', got '99999'"),
    ([sys.executable, str(BENCH)], ["--steps", "0"], "scripts/bench.py: error: argument --steps: must be a positive "
                                                     "integer, got '0'"),
    ([sys.executable, str(BENCH)], ["--warmup", "-1"], "argument --warmup: must be an integer >= 0, got '-1'"),
    ([sys.executable, str(BENCH)], ["--nproc", "0"], "argument --nproc: must be a positive integer, got '0'"),
    ([sys.executable, str(BENCH)], ["--peak-gflops", "nan"], "argument --peak-gflops: must be a finite number > 0"),
    ([sys.executable, "-m", "gpt2core.chat_cli"], ["--model", "m.bin", "--temperature", "0"],
     "gpt2core-chat: error: argument --temperature: must be a finite number > 0, got '0'"),
]


@pytest.mark.parametrize("command,args,line", SCRIPTS, ids=[" ".join(s[0][-1:] + s[1][:1]) for s in SCRIPTS])
def test_every_console_script_one_line_usage_error(tmp_path, command, args, line):
    r = subprocess.run(command + args, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert line in r.stderr.strip().splitlines()[-1]


@pytest.mark.parametrize("command", [s[0] for s in SCRIPTS[:8]], ids=[s[0][-1] for s in SCRIPTS[:8]])
def test_every_console_script_documents_its_exit_codes(command):
    r = subprocess.run(command + ["--help"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0
    assert "exit status:\n  0   success\n  1   failure" in r.stdout and "75  preempted" in r.stdout


# ------------------------------------------------------------------------------------ fuzz
_INTS = ["-1", "0", "1", "2", "3", "-2147483649", "2147483648", "9223372036854775808", "1e3", "1.5", "abc", "",
         "0x10", "nan", "inf", "-inf", " 7 ", "1e400", "-0"]
_FLOATS = ["0", "-0.0", "1e-3", "0.5", "1", "-1", "nan", "inf", "-inf", "1e39", "1e-50", "1e308", "abc", "", "2"]
_STRS = ["", "x", "cuda:7", "cpu", "cuda", "/nonexistent/p", "-", "\u00e9", ".", "auto", "none"]


def _pool(action):
    t = action.type
    if isinstance(t, cli.Float) or t is float:
        return _FLOATS
    if isinstance(t, cli.Int) or t is int:
        return _INTS
    if action.choices:
        return [str(c) for c in action.choices] + ["bogus"]
    return _STRS


def _flags(parser):
    """(option string, value pool) of every option that takes one value; switches with pool None."""
    out = []
    for a in parser._actions:
        if not a.option_strings or isinstance(a, argparse._HelpAction) or a.dest in ("debug", "help"):
            continue
        out.append((a.option_strings[-1], None if a.nargs == 0 else _pool(a)))
    return out


def _fuzz(console, parser, base, n, seed, capsys, skip=(), small=()):
    """n random command lines: base + 1..3 random flags with random values. Flags in `small` (amount-of-work
    flags) only get small values: the fuzz checks the checking, not that the machine can train for 10**9 steps."""
    rng = random.Random(seed)
    flags = [(f, p) for f, p in _flags(parser) if f not in skip]
    for _ in range(n):
        argv = list(base)
        for flag, pool in rng.sample(flags, rng.randint(1, min(3, len(flags)))):
            argv += [flag] if pool is None else [flag, rng.choice(["0", "1", "2", "-1", "x"] if flag in small
                                                                  else pool)]
        try:
            code = console(argv)
        except SystemExit as e:  # pragma: no cover - the wrapper returns, it never raises
            pytest.fail(f"{argv}: SystemExit {e.code} escaped the entry wrapper")
        err = capsys.readouterr().err
        assert code in (0, 1, 2), (argv, code, err)
        assert "Traceback" not in err, (argv, err)
        if code:
            assert err.strip(), argv
            last = err.strip().splitlines()[-1]
            assert ": " in last, (argv, last)


def test_fuzz_train_flags(files, capsys, tmp_path):
    """Each command line checked up to the run (parse, TrainConfig, the Trainer's own checks); the ones that pass
    train one step of the tiny preset."""
    base = T + ["--data-dir", str(files["data"]), "--output-dir", str(tmp_path / "o"), "--overwrite"]
    _fuzz(train.console, train.build_parser(), base, 40, 0, capsys,
          skip=("--preset", "--resume", "--hellaswag-every", "--hellaswag-path", "--output-dir", "--data-dir", "--overwrite"),
          small=("--steps", "--val-steps", "--sample-tokens", "--sample-every", "--total-batch-tokens", "--seq-len",
                 "--batch-size", "--block-size", "--checkpoint-every", "--hellaswag-limit", "--val-every",
                 "--threads", "--warmup"))


def test_fuzz_generate_eval_data_plot_doctor_launch_flags(files, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _fuzz(generate.console, generate.build_parser(), ["--model", str(files["model"]), "--max-new-tokens", "1"], 25, 1,
          capsys, skip=("--model",), small=("--max-new-tokens", "--num-samples"))
    eval_parser = argparse.ArgumentParser()  # the val subcommand's flags
    for flag, t in (("--batch-size", cli.positive_int), ("--seq-len", cli.positive_int), ("--steps", cli.positive_int)):
        eval_parser.add_argument(flag, type=t)
    eval_parser.add_argument("--device", type=cli.device)
    _fuzz(evaluate.console, eval_parser, ["val", "-c", str(files["model"]), "--data-dir", str(files["data"]),
                                          "-B", "1", "-T", "8", "--steps", "1"], 20, 2, capsys,
          small=("--batch-size", "--seq-len", "--steps"))
    sp = argparse.ArgumentParser()
    sp.add_argument("--val-fraction", type=cli.open_fraction)
    sp.add_argument("--out", type=cli.output_dir)
    _fuzz(data_main.console, sp, ["shakespeare", "--out", str(tmp_path / "sh")], 6, 3, capsys, skip=("--out",))
    lp = launch.build_parser()
    _fuzz(launch.console, lp, ["--no-python", "true"], 15, 5, capsys, skip=("--module", "--no-python"),
          small=("--nproc-per-node", "--nnodes"))
