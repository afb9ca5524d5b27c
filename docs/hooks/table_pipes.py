"""MkDocs hook: a pipe written `\\|` inside a code span of a table shows as `|` on the site, as it does on GitHub.

GitHub's tables need `\\|` for a pipe inside a code span (`--recompute gelu\\|layer`, `<\\|user_start\\|>`), or the
pipe splits the cell; Python-Markdown's tables keep code spans whole and print the backslash. So the pages (and the
files they include, such as csrc/emu/README.md) keep GitHub's spelling, and this hook drops the backslash from the
code of each rendered table. Listed in mkdocs.yml's `hooks:`."""
from __future__ import annotations

import re

TABLE = re.compile(r"<table\b.*?</table>", re.S)
CODE = re.compile(r"(<code\b[^>]*>)(.*?)(</code>)", re.S)


def unescape_table_pipes(html: str) -> str:
    def table(m: re.Match) -> str:
        return CODE.sub(lambda c: c[1] + c[2].replace("\\|", "|") + c[3], m[0])
    return TABLE.sub(table, html)


def on_page_content(html, **kwargs):
    return unescape_table_pipes(html)
