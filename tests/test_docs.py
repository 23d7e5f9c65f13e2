"""The README and the pages under docs/ link to each other and to pictures and logs: every relative
link must lead to a file that exists, and every #anchor to a heading of its page."""
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    return {_slug(m) for m in re.findall(r"^#+ (.+)$", text, flags=re.M)}


def _links(page: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # code blocks hold no links
    return [t for t in LINK.findall(text) if not re.match(r"[a-z]+:", t)]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
    broken = []
    for target in _links(page):
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(f"{target}: no heading #{anchor}")
    assert not broken, f"{page.name}: " + "; ".join(broken)


def test_the_check_sees_links():
    """A check that finds no links would pass on anything."""
    assert len(_links(ROOT / "README.md")) >= 10
    assert _slug("Look inside: `aiayn plot`") == "look-inside-aiayn-plot"


def test_readme_stays_short():
    """The README is for a first read; the rest lives in docs/."""
    assert len((ROOT / "README.md").read_text().splitlines()) <= 260


def test_readme_size_claim_holds():
    """The README's "about N lines of Python" counts the package's code lines (neither blank nor a
    comment) to within 15%: a claim of size is part of why one picks the package."""
    claim = re.search(r"about ([\d,]+) lines of Python", (ROOT / "README.md").read_text())
    assert claim, "the README no longer states the package's size"
    lines = [line for f in (ROOT / "src").rglob("*.py") for line in f.read_text().splitlines()]
    code = sum(1 for line in lines if line.strip() and not line.strip().startswith("#"))
    assert abs(code / int(claim.group(1).replace(",", "")) - 1) <= 0.15, f"{code} code lines"
