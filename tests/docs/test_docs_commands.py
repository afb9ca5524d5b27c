"""The commands the documentation shows are run, so a page cannot drift from the code (issue 47).

A shell block of README.md or docs/**/*.md preceded by the line `<!-- runnable -->` (an HTML comment: it renders as
nothing on GitHub and on the site) is run here. The blocks of one page run in order, each with `bash -e -o pipefail`,
in one fresh temporary folder (a later block may use what an earlier one wrote), offline (the Hub's offline
switches), with one OpenMP thread (the machine is shared: the tiny preset's steps then take milliseconds), and with
this interpreter as `python` and its console scripts (gpt2core-train, ...) first on PATH. The marker and its rules
are documented in docs/contributing.md; runnable blocks use the tiny preset and a few steps, seconds each.
"""
import os
import re
import shlex
import stat
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MARKER = "<!-- runnable -->"
SHELLS = ("bash", "sh", "shell")
BLOCK_TIMEOUT_S = 300  # a block takes seconds on an idle machine; the bound is for a CI machine under load
FENCE = re.compile(r"^(?P<indent> {0,3})(?P<fence>`{3,}|~{3,})(?P<info>.*)$")


def pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def runnable_blocks(text: str, name: str = "<text>") -> list[tuple[int, str]]:
    """(line number of the block's first line, its code) for each fenced block that follows the marker. Fences are
    tracked, so a marker shown inside another fenced block (as the contributing page does) is not one. A marker
    that is not followed by a shell block is an error, not a block silently left out."""
    blocks, lines = [], text.splitlines()
    fence, pending, i = None, None, 0
    while i < len(lines):
        line = lines[i]
        m = FENCE.match(line)
        if fence is not None:  # inside a block: only its own closing fence ends it
            if m and m["fence"][0] == fence[0] and len(m["fence"]) >= len(fence) and not m["info"].strip():
                fence = None
            i += 1
            continue
        if line.strip() == MARKER:
            pending = i + 1
        elif m:
            fence = m["fence"]
            if pending is not None:
                lang = m["info"].strip().split(" ")[0].lower() if m["info"].strip() else ""
                if lang not in SHELLS:
                    raise ValueError(f"{name}:{pending}: {MARKER} must be followed by a ```bash block, found {line!r}")
                start, body = i + 2, []
                i += 1
                while i < len(lines):
                    c = FENCE.match(lines[i])
                    if c and c["fence"][0] == fence[0] and len(c["fence"]) >= len(fence) and not c["info"].strip():
                        break
                    body.append(lines[i])
                    i += 1
                else:
                    raise ValueError(f"{name}:{start - 1}: the runnable block is never closed")
                blocks.append((start, "\n".join(body) + "\n"))
                fence, pending = None, None
        elif line.strip() and pending is not None:
            raise ValueError(f"{name}:{pending}: {MARKER} must be followed by a ```bash block, found {line!r}")
        i += 1
    if pending is not None:
        raise ValueError(f"{name}:{pending}: {MARKER} at the end of the page, with no block after it")
    return blocks


def page_blocks() -> list[tuple[Path, list[tuple[int, str]]]]:
    found = []
    for page in pages():
        blocks = runnable_blocks(page.read_text(encoding="utf-8"), str(page.relative_to(ROOT)))
        if blocks:
            found.append((page, blocks))
    return found


def shell_env(tmp: Path) -> dict:
    """This interpreter as `python` / `python3` (a wrapper that execs it, so a venv stays a venv), its console
    scripts next on PATH, offline, one OpenMP thread."""
    shims = tmp / ".bin"
    shims.mkdir()
    for name in ("python", "python3"):
        shim = shims / name
        shim.write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
        shim.chmod(shim.stat().st_mode | stat.S_IXUSR)
    path = [str(shims), sysconfig.get_path("scripts"), os.path.dirname(sys.executable), os.environ.get("PATH", "")]
    env = dict(os.environ, PATH=os.pathsep.join(path), OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1",
               HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONDONTWRITEBYTECODE="1")
    env.pop("PYTHONPATH", None)
    return env


PAGE_BLOCKS = page_blocks()


def test_the_docs_have_runnable_blocks():
    # the README and the pages of the main jobs each carry runnable blocks: a parser that found none would make the
    # test below pass on nothing
    have = {str(p.relative_to(ROOT)) for p, _ in PAGE_BLOCKS}
    for page in ("README.md", "docs/first-run.md", "docs/training/index.md", "docs/data.md", "docs/evaluation.md",
                 "docs/generation.md", "docs/chat.md", "docs/checkpoints.md"):
        assert page in have, f"{page} has no {MARKER} block"


@pytest.mark.parametrize("page,blocks", PAGE_BLOCKS, ids=[str(p.relative_to(ROOT)) for p, _ in PAGE_BLOCKS])
def test_runnable_blocks(page, blocks, tmp_path):
    env = shell_env(tmp_path)
    work = tmp_path / "work"
    work.mkdir()
    rel = page.relative_to(ROOT)
    for line, code in blocks:
        try:
            r = subprocess.run(["bash", "-e", "-o", "pipefail", "-c", code], cwd=work, env=env, text=True,
                               stdin=subprocess.DEVNULL, capture_output=True, timeout=BLOCK_TIMEOUT_S)
        except subprocess.TimeoutExpired as e:
            pytest.fail(f"{rel}:{line}: the block ran over {BLOCK_TIMEOUT_S} s\n{code}\n--- output\n{e.stdout}")
        if r.returncode != 0:
            out = (r.stdout + r.stderr)[-4000:]
            pytest.fail(f"{rel}:{line}: the block exited {r.returncode}\n{code}\n--- output (last 4000 chars)\n{out}")


# The parser's edges, on small texts: what is a runnable block and what is not.

def test_parser_takes_the_marked_block_only():
    text = "intro\n\n<!-- runnable -->\n```bash\necho one\necho two\n```\n\n```bash\necho never\n```\n"
    assert runnable_blocks(text) == [(5, "echo one\necho two\n")]


def test_parser_ignores_a_marker_shown_inside_another_block():
    text = ("````markdown\n<!-- runnable -->\n```bash\necho shown\n```\n````\n"
            "\n<!-- runnable -->\n~~~sh\necho ran\n~~~\n")
    assert runnable_blocks(text) == [(10, "echo ran\n")]


def test_parser_keeps_a_longer_fence_open_over_a_shorter_one():
    text = "<!-- runnable -->\n````bash\ncat <<'X'\n```\nX\n````\n"
    assert runnable_blocks(text) == [(3, "cat <<'X'\n```\nX\n")]


@pytest.mark.parametrize("text,why", [
    ("<!-- runnable -->\n```python\nprint(1)\n```\n", "must be followed by a ```bash block"),
    ("<!-- runnable -->\nsome prose\n```bash\necho\n```\n", "must be followed by a ```bash block"),
    ("text\n<!-- runnable -->\n", "at the end of the page"),
    ("<!-- runnable -->\n```bash\necho never closed\n", "never closed"),
])
def test_parser_refuses_a_marker_without_its_block(text, why):
    with pytest.raises(ValueError, match=re.escape(why)):
        runnable_blocks(text, "page.md")


def test_a_failing_block_fails_the_page(tmp_path):
    # the runner itself: a block whose command fails (here in the middle of a pipe) must fail the test, naming the line
    env = shell_env(tmp_path)
    r = subprocess.run(["bash", "-e", "-o", "pipefail", "-c", "false | cat\necho after\n"], cwd=tmp_path, env=env,
                       capture_output=True, text=True)
    assert r.returncode != 0 and "after" not in r.stdout
    r = subprocess.run(["bash", "-e", "-o", "pipefail", "-c", "python -c 'import sys; print(sys.executable)'"],
                       cwd=tmp_path, env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert os.path.realpath(r.stdout.strip()) == os.path.realpath(sys.executable)


# Every flag a page's commands use exists: the commands of every shell block (runnable or not: those need a GPU, a
# download or hours) are read, and each flag is looked up in the --help of the command it is given to.

PROGRAM = re.compile(r"^(gpt2core-[a-z]+|python3? -m gpt2core(\.[a-z_.]+)?|python3? scripts/[a-z_0-9]+\.py)$")


def shell_blocks(text: str) -> list[str]:
    """The code of every bash / sh / shell block."""
    blocks, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        i += 1
        if not m:
            continue
        fence, body = m["fence"], []
        while i < len(lines):
            c = FENCE.match(lines[i])
            if c and c["fence"][0] == fence[0] and len(c["fence"]) >= len(fence) and not c["info"].strip():
                break
            body.append(lines[i])
            i += 1
        i += 1
        if (m["info"].strip().split(" ")[0].lower() if m["info"].strip() else "") in SHELLS:
            blocks.append("\n".join(body))
    return blocks


def commands(code: str) -> list[tuple[str, list[str]]]:
    """(program, arguments) of each command of gpt2core or of a script in a block: continuation lines joined,
    comments, environment assignments and heredoc bodies left out; `-m gpt2core.X` inside a launcher (torchrun,
    python -m gpt2core.launch) is a command of its own with the arguments after it."""
    found, heredoc = [], None
    for line in code.replace("\\\n", " ").splitlines():
        if heredoc is not None:
            heredoc = None if line.strip() == heredoc else heredoc
            continue
        h = re.search(r"<<-?\s*'?\"?(\w+)", line)
        if h:
            heredoc = h[1]
        line = re.sub(r"(^|\s)#.*$", "", line)
        for seg in re.split(r"&&|\|\||;|(?<![\\'\"])\|(?![\w'\"])", line):
            try:
                toks = shlex.split(seg)
            except ValueError:
                toks = seg.split()
            while toks and re.match(r"^[A-Z_][A-Z0-9_]*=", toks[0]):
                toks = toks[1:]
            for k in range(len(toks) - 1):  # a launcher: the module after -m runs with the arguments after it
                if k >= 2 and toks[k] == "-m" and toks[k + 1].startswith("gpt2core."):  # not python's own -m
                    found.append((f"python -m {toks[k + 1]}", toks[k + 2:]))
                    toks = toks[:k]
                    break
            if not toks:
                continue
            python = toks[0] in ("python", "python3")
            n = (3 if toks[1:2] == ["-m"] else 2) if python else 1  # python -m gpt2core.X, python scripts/x.py
            prog = " ".join(toks[:n])
            if PROGRAM.match(prog):
                found.append((prog, toks[n:]))
    return found


_HELP: dict[tuple[str, ...], str] = {}


def help_text(argv: tuple[str, ...], env: dict) -> str:
    if argv not in _HELP:
        r = subprocess.run(["bash", "-c", " ".join(shlex.quote(a) for a in argv) + " --help"], cwd=ROOT, env=env,
                           capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
        _HELP[argv] = r.stdout + r.stderr if r.returncode == 0 else ""
    return _HELP[argv]


def flags_of(args: list[str]) -> list[str]:
    out = []
    for a in args:
        a = a.strip("[]")
        if re.match(r"^--[a-zA-Z][\w-]*(=.*)?$", a) or re.match(r"^-[A-Za-z]$", a):
            out.append(a.split("=")[0])
    return out


def documented_commands() -> list[tuple[str, str, list[str]]]:
    found = []
    for page in pages():
        for code in shell_blocks(page.read_text(encoding="utf-8")):
            for prog, args in commands(code):
                found.append((str(page.relative_to(ROOT)), prog, args))
    return found


def test_commands_are_read():
    # the reader finds the commands it should: a launcher's module, continuation lines, environment prefixes
    code = ("GPT2CORE_CUDA=OFF gpt2core-train --preset d12 \\\n    --zero 1   # a comment --not-a-flag\n"
            "torchrun --standalone --nproc_per_node=8 -m gpt2core.train --preset d12 --device cuda\n"
            "python -m gpt2core.launch --nproc-per-node 2 -m gpt2core.train -B 4\n"
            "python - <<'PY'\nprint('--not-a-flag')\nPY\npython scripts/bench.py --ladder | tee x\n")
    got = [(p, flags_of(a)) for p, a in commands(code)]
    assert got == [("gpt2core-train", ["--preset", "--zero"]), ("python -m gpt2core.train", ["--preset", "--device"]),
                   ("python -m gpt2core.train", ["-B"]), ("python -m gpt2core.launch", ["--nproc-per-node"]),
                   ("python scripts/bench.py", ["--ladder"])]


def test_documented_flags_exist(tmp_path):
    env = shell_env(tmp_path)
    missing = []
    for page, prog, args in documented_commands():
        argv = tuple(prog.split())
        top = help_text(argv, env)
        assert top, f"{page}: `{prog} --help` failed"
        # a subcommand (gpt2core-eval val, python -m gpt2core.data fineweb, ...): the first word, if --help lists it
        sub = [a for a in args if not a.startswith("-")][:1]
        choices = re.search(r"\{([\w,-]+)\}", top)
        if sub and args and args[0] == sub[0] and choices and sub[0] in choices[1].split(","):
            argv, top = argv + (sub[0],), help_text(argv + (sub[0],), env)
        for flag in flags_of(args):
            if not re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", top):
                missing.append(f"{page}: {' '.join(argv)} {flag}")
    assert not missing, "flags the pages use that the commands do not have:\n" + "\n".join(sorted(set(missing)))
