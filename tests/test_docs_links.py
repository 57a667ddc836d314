"""The user docs stay navigable and short.

Every relative link in docs/*.md, README.md and reports/*/JOURNAL.md points to a file that exists (and, with a
`#fragment` into a markdown page, to a heading that exists); every `reports/...` path a page
names exists; no page is longer than MAX_LINES; no page speaks of how the project is organised
(issues, sessions, shared notes) rather than of what it does.
"""

from __future__ import annotations

import re
import unicodedata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]
JOURNALS = sorted((ROOT / "reports").glob("*/JOURNAL.md"))  # lab notes: their links must hold too
MAX_LINES = 300
# Pages allowed past MAX_LINES, each with its reason. docs/l3.md is being cut to <= 250 lines
# separately; it is the only one.
LONGER = {"docs/l3.md": "rewritten to <= 250 lines on its own branch"}
INTERNAL = re.compile(
    r"\bissue #?\d+|\bissues #\d+|\bsessions?\b|\.\./shared/|\bthe lead\b", re.IGNORECASE
)
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REPORT_PATH = re.compile(r"(?<![\w/.])reports/[A-Za-z0-9_.\-/*]+")


def _rel(p: Path) -> str:
    return p.relative_to(ROOT).as_posix()


def _prose(text: str) -> str:
    """The page without its fenced code blocks (links in code are not links)."""
    out, fenced = [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if not fenced:
            out.append(line)
    return "\n".join(out)


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).strip().lower()
    kept = [
        c
        for c in text
        if c in " -_" or unicodedata.category(c)[0] in "LN"
    ]
    return "".join(kept).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    out: set[str] = set()
    for line in _prose(page.read_text(encoding="utf-8")).splitlines():
        m = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        base = _slug(m.group(1))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def _broken_links(page: Path) -> list[str]:
    bad = []
    for target in LINK.findall(_prose(page.read_text(encoding="utf-8"))):
        if re.match(r"[a-z][a-z0-9+.-]*:", target, re.IGNORECASE):
            continue  # http:, https:, mailto:
        path, _, frag = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            bad.append(f"{target} (no such file)")
        elif frag and dest.suffix == ".md" and frag not in _anchors(dest):
            bad.append(f"{target} (no such heading)")
    return bad


def _missing_reports(page: Path) -> list[str]:
    bad = []
    for ref in REPORT_PATH.findall(page.read_text(encoding="utf-8")):
        ref = ref.rstrip(".,;:)")
        found = any(ROOT.glob(ref)) if "*" in ref else (ROOT / ref).exists()
        if not found:
            bad.append(ref)
    return bad


@pytest.mark.parametrize("page", PAGES + JOURNALS, ids=_rel)
def test_relative_links_resolve(page):
    assert _broken_links(page) == [], f"{_rel(page)} links to what is not there"


@pytest.mark.parametrize("page", PAGES + JOURNALS, ids=_rel)
def test_report_paths_exist(page):
    assert _missing_reports(page) == [], f"{_rel(page)} names reports that do not exist"


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_page_length(page):
    if _rel(page) in LONGER:
        pytest.skip(LONGER[_rel(page)])
    n = len(page.read_text(encoding="utf-8").splitlines())
    assert n <= MAX_LINES, (
        f"{_rel(page)} has {n} lines (> {MAX_LINES}): move histories, per-version tables and "
        "test inventories to reports/<name>/JOURNAL.md"
    )


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_no_internal_organisation_words(page):
    hits = [
        f"{i}: {line.strip()[:120]}"
        for i, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1)
        if INTERNAL.search(line)
    ]
    assert hits == [], f"{_rel(page)} speaks of the project's organisation"


def test_checks_catch_what_they_claim(tmp_path):
    page = tmp_path / "p.md"
    (tmp_path / "there.md").write_text("# A `b`: c (d)\n\n## A `b`: c (d)\n", encoding="utf-8")
    page.write_text(
        "[ok](there.md#a-b-c-d) [dup](there.md#a-b-c-d-1) [web](https://x.y/z)\n"
        "[gone](nothere.md) [bad anchor](there.md#nope)\n```\n[code](ignored.md)\n```\n",
        encoding="utf-8",
    )
    assert _broken_links(page) == ["nothere.md (no such file)", "there.md#nope (no such heading)"]
    assert INTERNAL.search("see issue #37") and INTERNAL.search("this session")
    assert not INTERNAL.search("the step issues 40% fewer kernels")
