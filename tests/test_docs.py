"""The README and the pages under docs/ link to each other and to pictures and logs: every relative
link must lead to a file that exists, and every #anchor to a heading of its page. The commands they
show are copied as they stand: every flag after `aiayn COMMAND` must be one of that command's
options. docs/layout.md maps the code: it names every module and bench script."""
import argparse
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


def _options(parser) -> set[str]:
    """Every option string of `parser` and of its subcommands (plot's pictures)."""
    found = set()
    for action in parser._actions:
        found.update(action.option_strings)
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                found |= _options(sub)
    return found


def _commands(page: Path) -> list[str]:
    """The `aiayn COMMAND ...` command lines a page shows: in code blocks (continuation lines joined)
    and in inline code, each up to a comment, pipe, redirection or the next command."""
    text = page.read_text()
    blocks = [b.replace("\\\n", " ") for b in re.findall(r"```[a-z]*\n(.*?)```", text, flags=re.S)]
    inline = re.findall(r"`([^`\n]+)`", re.sub(r"```.*?```", "", text, flags=re.S))
    indented = re.findall(r"^    (.+)$", re.sub(r"```.*?```", "", text, flags=re.S), flags=re.M)
    lines = [line for b in blocks for line in b.splitlines()] + inline + indented
    return [m.group(0) for line in lines for m in re.finditer(r"\baiayn (\w+)(?: +[^#|;&<>]*)?", line)]


def test_command_flags_exist():
    """A flag shown after `aiayn COMMAND` on any page is an option of that command (a renamed or
    removed flag left in a page fails a user who copies the line)."""
    from aiayn.cli import COMMANDS, build_parser

    options = {name: _options(build_parser(name)) for name in COMMANDS}  # only `name` gets its arguments
    wrong, seen = [], 0
    for page in PAGES:
        for command in _commands(page):
            name = command.split()[1]
            if name not in options:
                continue
            seen += 1
            for flag in re.findall(r"(?<![\w-])--?[a-zA-Z][\w-]*", command.split(name, 1)[1]):
                if flag not in options[name]:
                    wrong.append(f"{page.name}: {flag} in `{command.strip()}`")
    assert seen >= 100, f"only {seen} commands found: the check sees too little"
    assert not wrong, "; ".join(wrong)


def test_layout_names_every_module_and_bench():
    """docs/layout.md is the map of the code: every module of src/aiayn and every bench script has its line."""
    layout = (ROOT / "docs" / "layout.md").read_text()
    files = [f for f in (ROOT / "src" / "aiayn").rglob("*.py") if f.name not in ("__init__.py", "__main__.py")]
    files += [f for f in (ROOT / "bench").iterdir() if f.suffix in (".py", ".sh")]
    missing = sorted(str(f.relative_to(ROOT)) for f in files if not re.search(rf"(?<![\w.]){re.escape(f.name)}", layout))
    assert not missing, f"docs/layout.md does not name: {', '.join(missing)}"
