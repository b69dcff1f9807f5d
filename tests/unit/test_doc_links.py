"""Every link and anchor in the Markdown a reader follows resolves: README.md, BENCHMARKS.md, docs/ and the
other READMEs of the tree.

Each file is read as GitHub renders it (markdown-it, CommonMark: links in code are not links). A relative
link names a file or folder that exists; its `#anchor` (or a bare `#anchor` in the same file) names a heading of
that Markdown file, by GitHub's rule for heading ids: the heading's text in lower case, punctuation other than
`-` and `_` dropped, spaces as `-`, and `-1`, `-2`, ... after repeats. Links to other sites are not fetched.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest
from markdown_it import MarkdownIt
from markdown_it.token import Token

REPOSITORY = Path(__file__).resolve().parents[2]
DOCUMENTS = sorted(
    {
        REPOSITORY / "README.md",
        REPOSITORY / "BENCHMARKS.md",
        *(REPOSITORY / "docs").glob("*.md"),
        *(path for path in REPOSITORY.glob("*/**/README.md") if not {".venv", "tests"} & set(path.parts)),
    }
)
_PARSER = MarkdownIt("commonmark")
_HTML_TARGET = re.compile(r"""(?:href|src)\s*=\s*["']([^"']+)["']""")
_NOT_IN_AN_ID = re.compile(r"[^\w\- ]")


def _tokens(path: Path) -> list[Token]:
    return _PARSER.parse(path.read_text())


def _flat(tokens: list[Token]) -> Iterator[Token]:
    for token in tokens:
        yield token
        yield from _flat(token.children or [])


def _targets(path: Path) -> list[str]:
    """Every link and image target of a Markdown file, and those of its HTML tags."""
    targets = []
    for token in _flat(_tokens(path)):
        if token.type in ("link_open", "image"):
            targets.append(str(token.attrs.get("href") or token.attrs.get("src")))
        elif token.type in ("html_inline", "html_block"):
            targets.extend(_HTML_TARGET.findall(token.content))
    return targets


def heading_ids(path: Path) -> set[str]:
    """The ids GitHub gives a Markdown file's headings."""
    tokens = _tokens(path)
    seen: dict[str, int] = {}
    ids = set()
    for index, token in enumerate(tokens):
        if token.type != "heading_open":
            continue
        text = "".join(
            child.content for child in tokens[index + 1].children or [] if child.type in ("text", "code_inline")
        )
        slug = _NOT_IN_AN_ID.sub("", text.strip().lower()).replace(" ", "-")
        ids.add(f"{slug}-{seen[slug]}" if slug in seen else slug)
        seen[slug] = seen.get(slug, 0) + 1
    return ids


def _broken(document: Path, target: str) -> str | None:
    """Why `target`, a link of `document`, does not resolve, or None."""
    parts = urlsplit(target)
    if parts.scheme or parts.netloc:
        return None  # another site
    linked = (document.parent / unquote(parts.path)).resolve() if parts.path else document
    if not linked.exists():
        return f"{target}: no such file or folder"
    if parts.fragment and linked.suffix == ".md" and unquote(parts.fragment) not in heading_ids(linked):
        return f"{target}: no heading of {linked.name} has the id #{parts.fragment}"
    return None


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda path: str(path.relative_to(REPOSITORY)))
def test_every_link_and_anchor_resolves(document: Path) -> None:
    broken = [problem for target in _targets(document) if (problem := _broken(document, target))]
    assert broken == []


def test_heading_ids_follow_githubs_rule(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "# Wan2.1-1.3B at real size on one GPU\n## Regional compilation (`bench/compile.py`)\n"
        "## Notes\n## Notes\n## The *demo* model: 96% right\n```\n# not a heading\n```\n"
    )
    assert heading_ids(page) == {
        "wan21-13b-at-real-size-on-one-gpu",
        "regional-compilation-benchcompilepy",
        "notes",
        "notes-1",
        "the-demo-model-96-right",
    }


def test_a_missing_file_or_heading_is_reported_and_code_is_not_read(tmp_path: Path) -> None:
    (tmp_path / "other.md").write_text("# Other page\n")
    page = tmp_path / "page.md"
    page.write_text(
        "# Top\n[a](other.md#other-page) [b](#top) [c](https://example.com/x#y) ![d](missing.png)\n"
        "[e](other.md#nope) [f](#nope) `[g](in-code.md)`\n```\n[h](in-a-block.md)\n```\n"
    )
    problems = [problem for target in _targets(page) if (problem := _broken(page, target))]
    assert [problem.partition(":")[0] for problem in problems] == ["missing.png", "other.md#nope", "#nope"]
