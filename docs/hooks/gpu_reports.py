"""MkDocs hook: the GPU reports under docs/gpu/ join the navigation by themselves (issue 48's lease driver,
`python -m gpt2core.calibrate`, writes one page per lease there, with its index docs/gpu/README.md), under
Measurements > GPU reports: the index first, then the pages, newest first (their names start with the date).
Listed in mkdocs.yml's `hooks:`; tests/docs/test_docs_build.py uses gpu_pages() for its every-page-in-the-nav check."""
from __future__ import annotations

from pathlib import Path

SECTION = "Measurements"
TITLE = "GPU reports"
FOLDER = "gpu"


def gpu_pages(docs_dir: str | Path) -> list[str]:
    """The pages of docs/gpu (paths relative to docs/), the index first, then the others newest first."""
    folder = Path(docs_dir) / FOLDER
    if not folder.is_dir():
        return []
    pages = sorted((p.name for p in folder.glob("*.md") if p.name not in ("README.md", "index.md")), reverse=True)
    index = [n for n in ("index.md", "README.md") if (folder / n).exists()][:1]
    return [f"{FOLDER}/{n}" for n in index + pages]


def on_config(config, **kwargs):
    pages = gpu_pages(config["docs_dir"])
    if not pages or not config.get("nav"):
        return config
    for entry in config["nav"]:
        if isinstance(entry, dict) and SECTION in entry:
            entry[SECTION].append({TITLE: pages})
            return config
    raise ValueError(f"mkdocs.yml's nav has no {SECTION!r} section for the GPU reports (docs/hooks/gpu_reports.py)")
