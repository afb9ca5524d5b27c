"""The documentation site builds with `mkdocs build --strict` (a broken link, a missing page or an API reference that
does not resolve fails it), every public name of gpt2core has a reference page, and the README stays the short
entry point it is meant to be (issue 47)."""
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"

# The set-up commands, exactly: CI (.ci/run) runs the second one, and users copy both.
TRAIN_COMMAND = "pip install -r requirements-dev.txt && pip install --no-build-isolation . && python -m gpt2core.train"
TEST_COMMAND = "pip install -r requirements-dev.txt && pip install --no-build-isolation . && python -m pytest -q tests"


def have_docs_tools() -> bool:
    return all(importlib.util.find_spec(m) for m in ("mkdocs", "material", "mkdocstrings", "mkdocstrings_handlers"))


@pytest.mark.skipif(not have_docs_tools(), reason="mkdocs not installed (pip install -r docs/requirements.txt)")
def test_site_builds_strict(tmp_path):
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    r = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    problems = [line for line in (r.stdout + r.stderr).splitlines() if line.startswith(("WARNING", "ERROR"))]
    assert r.returncode == 0, "mkdocs build --strict failed:\n" + "\n".join(problems or [r.stderr[-4000:]])
    # the API reference really rendered from the docstrings (not an empty page): GPT2's own methods are on it, also
    # those it inherits from its parts
    html = (tmp_path / "site" / "reference" / "GPT2" / "index.html").read_text(encoding="utf-8")
    for method in ("forward_backward", "step", "generate", "chat", "save", "from_pretrained"):
        assert f'id="gpt2core.GPT2.{method}"' in html, f"GPT2.{method} is missing from its reference page"
    # GitHub's `\|` inside a table's code span shows as a pipe on the site (docs/hooks/table_pipes.py)
    for page in (tmp_path / "site").rglob("*.html"):
        stray = re.search(r"<code>[^<]*\\\|", page.read_text(encoding="utf-8"))
        assert not stray, f"{page.relative_to(tmp_path)}: a backslash before a pipe in {stray[0]!r}"
    # a name listed in a page's `members:` that no longer exists there (moved by a regroup) is left out without a
    # warning by mkdocstrings: every listed member must have rendered
    for page, ident, member in listed_members():
        html = (tmp_path / "site" / "reference" / page / "index.html").read_text(encoding="utf-8")
        name = f"{ident}.{member}" if member else ident
        assert f'id="{name}"' in html, f"docs/reference/{page}.md: {name} did not render (moved or renamed?)"


def listed_members() -> list[tuple[str, str, str]]:
    """(page, identifier, member or "") for each `::: identifier` of docs/reference/*.md and each name of its
    `members: [...]` option."""
    found = []
    for md in sorted((ROOT / "docs" / "reference").glob("*.md")):
        if md.stem == "index":
            continue
        text = md.read_text(encoding="utf-8")
        for m in re.finditer(r"^::: ([\w.]+)\n((?:[ \t]+\S.*\n)*)", text, re.M):
            found.append((md.stem, m[1], ""))
            members = re.search(r"members:\s*\[([^\]]*)\]", m[2])
            for member in (members[1].split(",") if members else []):
                found.append((md.stem, m[1], member.strip()))
    return found


def test_the_member_lists_are_read():
    # the check above must see the lists it checks: the inference page lists the scheduler's classes
    assert ("inference", "gpt2core.inference.scheduler", "Scheduler") in listed_members()
    assert ("GPT2", "gpt2core.GPT2", "") in listed_members()


def nav_pages() -> set[str]:
    return set(re.findall(r"([\w./-]+\.md)\s*$", (ROOT / "mkdocs.yml").read_text(encoding="utf-8"), re.M))


def test_every_public_name_has_a_reference_page():
    import gpt2core
    names = [n for n in gpt2core.__all__ if not n.startswith("__")]
    assert {"GPT2", "GPT2Config", "PRESETS", "build_info", "load_model", "plan"} <= set(names)
    nav = nav_pages()
    for name in names:
        page = ROOT / "docs" / "reference" / f"{name}.md"
        assert page.exists(), f"gpt2core.{name} has no reference page ({page.relative_to(ROOT)})"
        assert f"::: gpt2core.{name}" in page.read_text(encoding="utf-8"), f"{page.name} does not render {name}"
        assert f"reference/{name}.md" in nav, f"{page.name} is not in mkdocs.yml's nav"


def hook_pages() -> list[str]:
    return load_hook().gpu_pages(ROOT / "docs")


def test_every_page_is_in_the_nav():
    docs = ROOT / "docs"
    pages = {str(p.relative_to(docs)) for p in docs.rglob("*.md")}
    missing = sorted(pages - nav_pages() - set(hook_pages()))
    assert not missing, (f"pages no reader can reach from the navigation: {missing}; add each to mkdocs.yml's nav "
                         "(a GPU report in docs/gpu/ joins it by itself: docs/hooks/gpu_reports.py)")


def test_readme_is_short_and_keeps_the_set_up_commands():
    text = README.read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 250
    blocks = re.findall(r"```bash\n(.*?)```", text, re.S)
    assert TRAIN_COMMAND + "\n" in blocks and TEST_COMMAND + "\n" in blocks


def test_readme_links_resolve():
    # the README is read on GitHub, outside the site: its relative links must name files of the repository (the
    # site's own links are checked by mkdocs --strict)
    text = README.read_text(encoding="utf-8")
    links = re.findall(r"\]\(([^)\s]+)\)", text)
    assert links
    for link in links:
        if re.match(r"[a-z]+://", link) or link.startswith("#"):
            continue
        target = ROOT / link.split("#")[0]
        assert target.exists(), f"README.md links to {link}, which does not exist"


def test_changelog_lists_every_old_module_path():
    # the old paths users may import keep working (gpt2core.MOVED, the alias finder); the changelog names each
    import gpt2core
    text = (ROOT / "CHANGELOG.md").read_text(encoding="utf-8")
    assert gpt2core.MOVED
    for old, new in gpt2core.MOVED.items():
        assert f"`gpt2core.{old}`" in text or f"`.{old}`" in text, f"CHANGELOG.md does not list gpt2core.{old}"
        assert f"gpt2core.{new}`" in text or f"gpt2core.{new.split('.')[0]}.<same" in text, \
            f"CHANGELOG.md does not give gpt2core.{old}'s new place, gpt2core.{new}"


def load_hook():
    spec = importlib.util.spec_from_file_location("gpu_reports", ROOT / "docs" / "hooks" / "gpu_reports.py")
    hook = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hook)
    return hook


def test_gpu_reports_join_the_nav(tmp_path):
    hook = load_hook()
    assert hook.gpu_pages(tmp_path) == []  # no docs/gpu: nothing added
    (tmp_path / "gpu").mkdir()
    for name in ("2026-11-28_H100_aaa.md", "README.md", "2026-11-29_H200_bbb.md", "report.json"):
        (tmp_path / "gpu" / name).write_text("# x\n")
    pages = ["gpu/README.md", "gpu/2026-11-29_H200_bbb.md", "gpu/2026-11-28_H100_aaa.md"]
    assert hook.gpu_pages(tmp_path) == pages
    nav = [{"Home": "index.md"}, {"Measurements": ["measurements/index.md"]}, {"Changelog": "changelog.md"}]
    hook.on_config({"docs_dir": str(tmp_path), "nav": nav})
    assert nav[1] == {"Measurements": ["measurements/index.md", {"GPU reports": pages}]}
    with pytest.raises(ValueError, match="no 'Measurements' section"):
        hook.on_config({"docs_dir": str(tmp_path), "nav": [{"Home": "index.md"}]})


def load_table_pipes():
    spec = importlib.util.spec_from_file_location("table_pipes", ROOT / "docs" / "hooks" / "table_pipes.py")
    hook = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hook)
    return hook


def test_table_pipes_unescaped_in_code_spans_of_tables_only():
    unescape = load_table_pipes().unescape_table_pipes
    html = "<table><tr><td><code>a\\|b</code> c \\| d</td><td><code class='x'>x\\|y</code></td></tr></table>"
    want = "<table><tr><td><code>a|b</code> c \\| d</td><td><code class='x'>x|y</code></td></tr></table>"
    assert unescape(html) == want
    text = "<p><code>a\\|b</code></p><pre><code>a\\|b</code></pre>"  # outside tables: untouched
    assert unescape(text) == text
