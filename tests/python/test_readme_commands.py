"""The README's fine-tuning (SFT + chat), evaluation and memory-plan commands, run as written (issue 46).

The commands are read from README.md when the test runs (its fenced shell blocks; a `\\` continuation joined, a
trailing `# comment` kept aside), so the test follows the README: the SFT pair (`gpt2core-train --sft ...`,
`gpt2core-chat ...`), every `gpt2core-eval` / `python -m gpt2core.evaluate` line, and every `--plan` line. They run in
one fresh folder with this interpreter's console scripts first on PATH, offline, one OpenMP thread, after what the
README's own first block and the user would have made:

- out/model.bin: the README's first training command (the tiny preset) with --block-size 1024, because the README's
  SFT command fine-tunes with -T 1024 and an --init model's shape is the file's (a tiny model with that context);
- conversations.jsonl: forty conversations in the README's format (one {"messages": [...]} a line).

Each command must exit 0; the chat reads one message and /quit from standard input and must answer it; a plan line
whose comment says `fits: ...` must print that line (`does not fit` lines must exit 2 saying so)."""
import json
import os
import re
import shlex
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
TIMEOUT_S = 600  # seconds of CPU on an idle machine; the bound is for a CI machine under load


def shell_lines(text: str) -> list[tuple[str, str]]:
    """(command, comment) of every line of every ```bash / ```sh block, continuation lines joined."""
    out, block, pending = [], None, ""
    for line in text.splitlines():
        if line.startswith("```"):
            block = None if block is not None else line[3:].strip().lower()
            continue
        if block not in ("bash", "sh", "shell"):
            continue
        line = pending + line.strip()
        if line.endswith("\\"):
            pending = line[:-1].rstrip() + " "
            continue
        pending = ""
        cmd, _, comment = line.partition(" #")
        if cmd.strip():
            out.append((cmd.strip(), comment.strip()))
    return out


def readme_commands() -> dict[str, list[tuple[str, str]]]:
    lines = shell_lines(README.read_text(encoding="utf-8"))
    return {"base": [c for c in lines if c[0].startswith("gpt2core-train --preset tiny") and "--plan" not in c[0]],
            "sft": [c for c in lines if c[0].startswith(("gpt2core-train --sft", "gpt2core-chat"))],
            "eval": [c for c in lines if c[0].startswith(("gpt2core-eval ", "python -m gpt2core.evaluate "))],
            "plan": [c for c in lines if c[0].startswith("gpt2core-train ") and " --plan" in c[0]]}


def test_the_readme_shows_each_kind_of_command():
    found = readme_commands()
    assert {k: bool(v) for k, v in found.items()} == {"base": True, "sft": True, "eval": True, "plan": True}, found
    assert any(c.startswith("gpt2core-chat") for c, _ in found["sft"]), found["sft"]


@pytest.mark.slow
def test_readme_sft_evaluation_and_plan_commands_run_as_written(tmp_path):
    found = readme_commands()
    bindir = Path(sysconfig.get_path("scripts"))
    env = {**os.environ, "PATH": os.pathsep.join([str(bindir), str(Path(sys.executable).parent), os.environ["PATH"]]),
           "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}

    def run(cmd: str, stdin: str | None = None) -> subprocess.CompletedProcess:
        return subprocess.run(["bash", "-e", "-o", "pipefail", "-c", cmd], cwd=tmp_path, env=env, input=stdin,
                              capture_output=True, text=True, timeout=TIMEOUT_S)

    base = found["base"][0][0]
    r = run(f"{base} --block-size 1024")
    assert r.returncode == 0 and (tmp_path / "out" / "model.bin").is_file(), r.stderr
    with open(tmp_path / "conversations.jsonl", "w") as f:
        for i in range(40):
            f.write(json.dumps({"messages": [{"role": "system", "content": "Be brief."},
                                             {"role": "user", "content": f"{i}+{i}?"},
                                             {"role": "assistant", "content": str(2 * i)}]}) + "\n")
    for cmd, _ in found["sft"]:
        if cmd.startswith("gpt2core-chat"):
            r = run(cmd, stdin="Hello!\n/quit\n")
            assert r.returncode == 0 and "Traceback" not in r.stderr, (cmd, r.stderr)
            assert "assistant: " in r.stdout, (cmd, r.stdout)
        else:
            r = run(cmd)
            assert r.returncode == 0, (cmd, r.stderr[-2000:])
            out = Path(tmp_path, shlex.split(cmd)[shlex.split(cmd).index("--output-dir") + 1])
            assert (out / "model.bin").is_file() and "sample (reply to" in r.stdout, r.stdout[-2000:]
    for cmd, _ in found["eval"]:
        r = run(cmd)
        assert r.returncode == 0 and "Traceback" not in r.stderr, (cmd, r.stderr)
    for cmd, comment in found["plan"]:
        r = run(cmd)
        if comment.startswith("does not fit"):
            assert r.returncode == 2 and "does not fit" in r.stderr, (cmd, r.stderr)
            continue
        assert r.returncode == 0, (cmd, r.stderr)
        if comment.startswith("fits:"):
            said = re.split(r"\s*\(", comment, maxsplit=1)[0]  # "fits: largest micro-batch B=12"
            assert said in r.stdout.splitlines(), (cmd, said, r.stdout[-1500:])
