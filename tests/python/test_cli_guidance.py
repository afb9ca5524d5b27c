"""Flags and messages that send a new user the right way (issue 46, items 3-6): each message names a flag the command
has and advice that works; the evaluators name the model the same way; the plan refuses what training refuses; a
closed standard stream or a model of another vocabulary is one line, not a traceback."""
import io
import json
import os
import subprocess
import sys
import urllib.request

import numpy as np
import pytest

import gpt2core
from gpt2core import GPT2, GPT2Config, _C, train
from gpt2core.data.shards import write_shard
from gpt2core.evaluation import evaluate, lm_eval
from gpt2core.inference import chat_cli, generate_cli

HELLASWAG_TWO = """Roof shingle removal: A man is sitting on a roof. he
3
is using wrap to wrap a pair of skis.
is ripping level tiles off.
is holding a rubik's cube.
starts pulling up roofing on a roof.
Clean and jerk: A lady walks to a barbell. She bends down and grabs the pole. the lady
3
swings and lands in her arms.
pulls the barbell forward.
pulls a rope attached to the barbell.
stands and lifts the weight over her head.
"""


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("guidance")
    rng = np.random.default_rng(0)
    write_shard(d / "data" / "t_val_000000.bin", rng.integers(0, 50257, 600))
    write_shard(d / "data" / "t_train_000001.bin", rng.integers(0, 50257, 5000))
    (d / "hs.txt").write_text(HELLASWAG_TWO)
    return {"dir": d, "data": d / "data", "hs": d / "hs.txt",
            "model": GPT2("tiny", seed=1).save(d / "tiny.bin"),
            # a context shorter than HellaSwag's rows: they are cut, with a warning
            "short": GPT2(GPT2Config(block_size=8, n_layer=1, n_head=1, n_embd=16), seed=1).save(d / "short.bin")}


def run(console, argv, capsys):
    code = console([str(a) for a in argv])
    out, err = capsys.readouterr()
    assert "Traceback" not in err, err
    return code, out, err


# ------------------------------------------------------------------------------------------- item 3: evaluation
def test_hellaswag_offline_names_the_commands_own_flag(files, tmp_path, monkeypatch, capsys):
    def offline(*a, **k):
        raise OSError("network is unreachable")
    monkeypatch.setattr(urllib.request, "urlopen", offline)
    monkeypatch.chdir(tmp_path)  # the download's default folder (data/hellaswag) is relative: none here
    code, _, err = run(evaluate.console, ["hellaswag", "--model", files["model"]], capsys)
    assert code == 1 and "pass a local copy instead, e.g. --data path/to/hellaswag_val.jsonl" in err, err
    assert "--input" not in err
    # training's flag for the same file
    with pytest.raises(SystemExit) as e:
        train.main(["--preset", "tiny", "-B", "1", "-T", "8", "--steps", "1", "--data-dir", str(files["data"]),
                    "--output-dir", str(tmp_path / "o"), "--hellaswag-every", "1", "--sample-tokens", "0"])
    assert "e.g. --hellaswag-path path/to/hellaswag_val.jsonl" in str(e.value), e.value


@pytest.mark.parametrize("flag", ["--model", "-m", "--checkpoint", "-c"])
def test_every_evaluator_takes_the_model_as_model_or_checkpoint(files, tmp_path, capsys, flag):
    code, out, _ = run(evaluate.console, ["val", flag, files["model"], "--data-dir", files["data"], "-B", "2", "-T",
                                          "8", "--steps", "2"], capsys)
    assert code == 0 and out.startswith("val loss "), out
    code, out, _ = run(evaluate.console, ["hellaswag", flag, files["model"], "--data", files["hs"], "--no-progress"],
                       capsys)
    assert code == 0 and out.startswith("hellaswag: 2 items"), out
    # core: the flag is taken (the bundle is what is missing, not the model)
    code, _, err = run(evaluate.console, ["core", flag, files["model"], "--bundle", tmp_path / "none.zip"], capsys)
    assert code == 2 and err.strip().splitlines()[-1].startswith("gpt2core-eval core: error: argument --bundle"), err


def test_evaluators_warn_in_one_line_without_pythons_warning_format(files, capsys):
    code, out, err = run(evaluate.console, ["hellaswag", "--model", files["short"], "--data", files["hs"],
                                            "--no-progress"], capsys)
    lines = err.strip().splitlines()
    assert code == 0 and len(lines) == 1, err
    assert lines[0].startswith("gpt2core-eval: warning: 8 of 8 HellaSwag rows are longer than the model's context")
    assert "UserWarning" not in err and ".py:" not in err


def test_lm_eval_help_shows_the_model_path_flag(capsys):
    pytest.importorskip("lm_eval")
    with pytest.raises(SystemExit) as e:
        lm_eval.main(["--help"])
    out = capsys.readouterr().out
    assert e.value.code in (0, None) and out.startswith("usage: python -m gpt2core.lm_eval --model-path PATH")
    assert "--model_args" in out  # lm-eval's own help follows


# ------------------------------------------------------------------------------------------- item 4: the plan
PLAN = ["--preset", "d12", "--device", "cuda", "--precision", "bf16", "-T", "1024", "--plan", "--gpu-memory", "80GiB"]


@pytest.mark.parametrize("value,tail", [("0", "must be an integer >= 1, got '0'"),
                                        ("70000", "must be an integer >= 1, got '70000' (the most is 65,536)")])
def test_plan_world_size_out_of_range_is_refused(capsys, value, tail):
    code, _, err = run(train.console, PLAN + [f"--world-size={value}"], capsys)
    assert code == 2 and err.strip().endswith(f"argument --world-size: {tail}"), err


def test_plan_refuses_zero2_with_muon_with_trainings_message(files, tmp_path, capsys):
    code, out, err = run(train.console, PLAN + ["--zero", "2", "--optimizer", "muon", "--world-size", "2"], capsys)
    assert code == 2 and out == "", out
    code2, _, err2 = run(train.console, ["--preset", "tiny", "-B", "1", "-T", "8", "--steps", "1", "--zero", "2",
                                         "--optimizer", "muon", "--data-dir", files["data"], "--output-dir",
                                         tmp_path / "o"], capsys)
    assert code2 == 2 and err == err2 == (
        "gpt2core-train: error: --zero 2 shards the gradients, and --optimizer muon orthogonalises whole matrices "
        "from every rank's gradients: use --zero 1 with Muon (it shards the optimizer state), or --optimizer adamw\n")
    # with Muon the plan offers only what Muon trains with: no ZeRO-2 and no offload
    code, out, _ = run(train.console, PLAN + ["--optimizer", "muon", "--world-size", "2", "--json"], capsys)
    table = json.loads(out)["table"]
    assert code == 0 and table and all(r["zero"] != 2 and r["offload"] == "none" for r in table), table
    code, out, _ = run(train.console, PLAN + ["--world-size", "2", "--json"], capsys)
    assert {r["zero"] for r in json.loads(out)["table"]} == {0, 1, 2}


def test_plan_negative_gpu_memory_is_the_size_message(capsys):
    code, _, err = run(train.console, PLAN[:-1] + ["-5GiB"], capsys)
    assert code == 2 and err == ("gpt2core-train: error: --gpu-memory must be a positive size such as 24GiB, 10GB or "
                                 "512MiB, got '-5GiB'\n"), err


# ------------------------------------------------------------------------------------------- item 5: generate
@pytest.mark.parametrize("closed,needle", [("<&-", "--prompts-file -: standard input is closed"),
                                           (">&-", "standard output is closed")])
def test_generate_with_a_closed_standard_stream_is_one_line(files, closed, needle):
    cmd = [sys.executable, "-m", "gpt2core.generate", "--model", str(files["model"]), "--max-new-tokens", "2"]
    if closed == "<&-":
        cmd += ["--prompts-file", "-"]
    r = subprocess.run(" ".join(cmd) + " " + closed, shell=True, stderr=subprocess.PIPE, text=True, timeout=300,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 1 and r.stderr == f"gpt2core-generate: {needle}" + r.stderr.split(needle, 1)[1], r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr


def test_generate_refuses_a_model_whose_vocabulary_is_not_gpt2s(files, tmp_path, capsys):
    small = GPT2(GPT2Config(block_size=16, vocab_size=1000, padded_vocab_size=1024, n_layer=1, n_head=1, n_embd=16),
                 seed=0).save(tmp_path / "v1000.bin")
    code, _, err = run(generate_cli.console, ["--model", small, "hello"], capsys)
    assert code == 2 and err == (
        f"gpt2core-generate: error: --model {small}: its vocabulary has 1,000 tokens, not GPT-2's 50,257: it does not "
        "match GPT-2's tokenizer, which this command encodes and decodes text with (generate from Python with your "
        "own token ids: GPT2.generate)\n"), err


# ------------------------------------------------------------------------------------------- item 6: chat
def test_chat_takes_threads_and_a_run_folder(files, tmp_path):
    """--model out/sft (the run folder gpt2core-train --sft just made) chats with its model.bin; --threads sets the
    CPU backend's threads as train and serve do (and is checked as they check it)."""
    import chat_task
    root = chat_task.trained()
    before = _C.get_num_threads()
    try:
        out = io.StringIO()
        chat_cli.main(["--model", str(root / "run"), "--top-k", "1", "--threads", "1"], stdin=io.StringIO("3,4\n"),
                      stdout=out)
        assert "assistant: 4,3" in out.getvalue().splitlines()
        assert _C.get_num_threads() == 1
    finally:
        _C.set_num_threads(before)
    with pytest.raises(gpt2core.errors.ArgError, match="--threads 100000 is more than the"):
        chat_cli.main(["--model", str(root / "run"), "--threads", "100000"], stdin=io.StringIO(""),
                      stdout=io.StringIO())


def test_a_run_folder_without_model_bin_names_its_newest_checkpoint(tmp_path):
    d = tmp_path / "run"
    (d / "checkpoints" / "step_000004").mkdir(parents=True)
    (d / "checkpoints" / "step_000002").mkdir()
    from gpt2core.formats.llmc import CheckpointError
    with pytest.raises(CheckpointError, match=r"run folder without model.bin \(the run has not finished\): "
                                                       r"give one of its checkpoints, e.g. .*step_000004"):
        gpt2core.load_model(d)
