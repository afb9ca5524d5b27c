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
