"""gpt2core.cli: the typed argument checkers (as argparse types and as Python checks, with the message naming the
argument) and the entry wrapper every console script runs through (exit 0/1/2/75, one line, a traceback only with
--debug or for a bug)."""
import argparse
import errno
import math
import re

import numpy as np
import pytest

from gpt2core import cli
from gpt2core.errors import ArgError, FileFormatError, Preempted, WriteError, write_error


# ------------------------------------------------------------------------------------ checkers
@pytest.mark.parametrize("chk,good,bad", [
    (cli.positive_int, [1, 7, 2**40, np.int64(3)], [0, -1, 1.0, True, "3", None, math.inf]),
    (cli.non_negative_int, [0, 5], [-1, -2**70, 0.5]),
    (cli.fraction, [0, 0.5, 1, np.float32(0.25)], [-0.1, 1.01, math.nan, math.inf, "0.5"]),
    (cli.open_fraction, [1e-9, 0.999], [0, 1, math.nan]),
    (cli.positive_float, [1e-300, 3], [0, -1, math.nan, math.inf, -math.inf]),
    (cli.port, [1, 80, 65535], [0, 65536, 99999, -1]),
    (cli.device, ["cpu", "cuda", "cuda:0", "cuda:12"], ["", "tpu", "cuda:-1", "cpu:1", "cuda:", "CUDA", "cuda:01",
                                                        "cuda:7 ", 0]),
])
def test_python_check_accepts_and_refuses_naming_the_argument(chk, good, bad):
    for v in good:
        chk.check(v, "arg")
    for v in bad:
        with pytest.raises(ArgError, match=rf"^my_arg must be .*, got {v!r}".replace("(", r"\(").replace(")", r"\)")
                           .replace("[", r"\[").replace("+", r"\+")):
            chk.check(v, "my_arg")


@pytest.mark.parametrize("text,value", [("7", 7), (" 12 ", 12), ("1e8", 10**8), ("2.0", 2)])
def test_int_parses_whole_numbers_in_any_notation(text, value):
    assert cli.positive_int(text) == value and type(cli.positive_int(text)) is int


@pytest.mark.parametrize("text", ["0", "-2", "inf", "nan", "1.5", "abc", "", "1e400"])
def test_argparse_type_errors_name_the_flag(text, capsys):
    ap = argparse.ArgumentParser(prog="prog")
    ap.add_argument("--num-procs", type=cli.positive_int)
    with pytest.raises(SystemExit) as e:
        ap.parse_args(["--num-procs", text])
    assert e.value.code == 2
    assert f"prog: error: argument --num-procs: must be a positive integer, got {text!r}" in capsys.readouterr().err


@pytest.mark.parametrize("v,why", [
    (1e39, "it overflows to inf in float32"),
    (1e-50, "it underflows to 0 or a denormal in float32"),
    (1e-40, "it underflows to 0 or a denormal in float32"),  # a float32 denormal: the core may flush it to 0
])
def test_float32_representability(v, why):
    with pytest.raises(ArgError, match=rf"^eps must be .*float32, got {re.escape(repr(v))} \({why}\)"):
        cli.eps.check(v, "eps")
    assert cli.Float(0, lo_open=True).check(v, "x") == v  # fine in float64


def test_beta_that_rounds_to_one_in_float32_is_refused():
    b = 1 - 1e-9
    assert b < 1 and float(np.float32(b)) == 1.0
    with pytest.raises(ArgError, match=r"rounds to 1\.0 in float32"):
        cli.beta.check(b, "beta2")
    assert cli.beta.check(0.999, "beta2") == 0.999


def test_paths(tmp_path):
    f = tmp_path / "f.txt"
    f.write_text("x")
    cli.existing_file.check(str(f), "--data")
    cli.existing_dir.check(tmp_path, "--data-dir")
    for chk, v, why in [(cli.existing_file, tmp_path, "it is a directory"),
                        (cli.existing_file, tmp_path / "nope", "no such file"),
                        (cli.existing_dir, f, "it is a file, not a directory"),
                        (cli.existing_dir, tmp_path / "nope", "no such directory"),
                        (cli.output_dir, f, "it exists and is not a directory"),
                        (cli.output_dir, f / "sub", f"{f} is not a directory"),
                        (cli.output_file, tmp_path, "it is a directory"),
                        (cli.output_dir, "", "an empty name")]:
        with pytest.raises(ArgError, match=rf"^--x must be .*\({why}\)$"):
            chk.check(str(v), "--x")
    assert cli.output_dir.check(str(tmp_path / "new" / "deeper"), "--x")  # made later


def test_threads_beyond_the_cores(monkeypatch):
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1})
    assert cli.threads(2) == 2
    with pytest.raises(ArgError, match=r"^--threads 256 is more than the 2 CPU cores this process may use$"):
        cli.threads(256, "--threads")


def test_optional_and_port_or_auto():
    opt = cli.Optional(cli.positive_int)
    assert opt("none") is None and opt("3") == 3 and opt.check(None, "x") is None
    assert cli.port_or_auto("auto") == "auto" and cli.port_or_auto("0") == "auto" and cli.port_or_auto("29500") == 29500
    with pytest.raises(argparse.ArgumentTypeError, match=r"must be a TCP port in \[1, 65535\] or 'auto', got '99999'"):
        cli.port_or_auto("99999")


# ------------------------------------------------------------------------------------ the entry wrapper
def _console(exc):
    def main(argv):
        raise exc
    return cli.entry("prog", main)


@pytest.mark.parametrize("exc,code,line", [
    (ArgError("--seed must be an integer >= 0, got -1"), 2, "prog: error: --seed must be an integer >= 0, got -1"),
    (FileFormatError("/x/m.bin: bad magic"), 1, "prog: /x/m.bin: bad magic"),
    (IsADirectoryError(errno.EISDIR, "Is a directory", "/o/gpt2core.lock"), 1,
     "prog: /o/gpt2core.lock: Is a directory (EISDIR)"),
    (PermissionError(errno.EACCES, "Permission denied", "/ro/x"), 1, "prog: /ro/x: Permission denied (EACCES)"),
    (FileNotFoundError("no val shards in /d"), 1, "prog: no val shards in /d"),
    (write_error(OSError(errno.ENOSPC, "No space left on device"), "/o/metrics.jsonl", 10), 1,
     "prog: /o/metrics.jsonl: cannot write: No space left on device (ENOSPC); it needs 10 bytes"),
    (Preempted("stopped by SIGTERM after step 3"), 75, "prog: stopped by SIGTERM after step 3"),
    (FloatingPointError("loss is nan at step 4"), 1, "prog: loss is nan at step 4"),
])
def test_expected_failures_are_one_line_with_their_exit_code(exc, code, line, capsys):
    assert _console(exc)([]) == code
    err = capsys.readouterr().err
    assert err.startswith(line) and err.count("\n") == 1 and "Traceback" not in err, err


def test_debug_adds_the_traceback(capsys):
    assert _console(FileFormatError("/x: bad"))(["--debug"]) == 1
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err and err.rstrip().endswith("prog: /x: bad")


def test_a_bug_shows_its_traceback_and_says_so(capsys):
    assert _console(KeyError("oops"))([]) == 1
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err and "KeyError: 'oops'" in err
    assert "this is a bug in gpt2core" in err.splitlines()[-1]


def test_main_statuses_pass_through(capsys):
    assert cli.entry("p", lambda argv: 3)([]) == 3
    assert cli.entry("p", lambda argv: {"loss": 1.0})([]) == 0   # a main returning data: success
    assert cli.entry("p", lambda argv: None)([]) == 0

    def exits(argv):
        raise SystemExit("p: went wrong")
    assert cli.entry("p", exits)([]) == 1 and capsys.readouterr().err == "p: went wrong\n"


def test_every_parser_documents_the_exit_codes():
    ap = cli.ArgumentParser(prog="p", description="d")
    text = ap.format_help()
    for code in ("0 ", "1 ", "2 ", "75"):
        assert f"\n  {code}" in text
    assert "--debug" in text


def test_write_error_one_line_names_path_and_space(tmp_path):
    e = write_error(OSError(errno.EFBIG, "File too large"), tmp_path / "metrics.jsonl", 100)
    assert isinstance(e, WriteError) and isinstance(e, OSError)
    assert cli.classify(e) == (1, f"{tmp_path}/metrics.jsonl: cannot write: File too large (EFBIG); it needs 100 bytes")


def test_a_prefix_of_a_flag_is_refused_not_taken_for_it(capsys):
    """`--prompt` is not `--prompts-file`: a flag counts only as written (allow_abbrev off), exit 2."""
    ap = cli.ArgumentParser(prog="p")
    ap.add_argument("--prompts-file")
    with pytest.raises(SystemExit) as e:
        ap.parse_args(["--prompt", "Hello"])
    assert e.value.code == 2 and "unrecognized arguments: --prompt" in capsys.readouterr().err
    assert ap.parse_args(["--prompts-file", "f"]).prompts_file == "f"
