"""HTML in, HTML out: the text nodes of a fragment are translated, its markup is kept byte for byte.

LibreTranslate's `format: "html"` (Mastodon sends every post so). The fragment is read with the
standard library's `html.parser`, an HTML5-tolerant tokenizer (unclosed tags, bare `&`, attributes
without quotes), chosen over lxml or BeautifulSoup because they re-serialize the tree (quotes,
entity spellings and void tags come back rewritten) while the positions of the tokenizer's events
let every tag, attribute, comment and entity be copied from the source as written.

A text node is a run of text and character references between two tags. It is translated unless
it has no letter, shows the address of the link it is in or part of it (a URL that Mastodon or
another server made a link of), or lies inside an element whose text is not prose: `script`,
`style`, `code`, `pre` (and the like), `translate="no"`, `class="notranslate"`, or the link parts
Mastodon marks (`mention`, `hashtag`, `invisible`, `ellipsis`). Its translation is escaped back,
each character that the source wrote as an entity (`&nbsp;`, `&#8217;`) written the same way again.
"""

from __future__ import annotations

import html
import re
from dataclasses import dataclass
from html.parser import HTMLParser

SKIP_TAGS = frozenset({"script", "style", "code", "pre", "kbd", "samp", "var", "template", "textarea", "svg", "math"})
SKIP_CLASSES = frozenset({"notranslate", "mention", "hashtag", "invisible", "ellipsis"})
VOID_TAGS = frozenset({"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "source",
                       "track", "wbr"})
_ENTITY = re.compile(r"&(#[0-9]+;?|#[xX][0-9a-fA-F]+;?|[A-Za-z][A-Za-z0-9]*;?)")
# A `&#` the tokenizer does not read as a character reference: no digits after it (`&#`, `&#x `, `&#xyz`), or decimal
# ones run on into a hex letter (`&#1a`); HTML reads the first as the characters themselves, the second as a reference
# (U+0001 and "a"): text, either way. The tokenizer gave up there, and sent the rest, tags and all, on as text.
_UNREAD_CHARREF = re.compile(r"&(?=#(?![0-9]+[^0-9a-fA-F]|[xX][0-9a-fA-F]+[^0-9a-fA-F]))")


@dataclass(frozen=True)
class Fragment:
    """An HTML fragment cut into raw pieces; the pieces at `slots` are text nodes to translate."""

    pieces: tuple[str, ...]
    slots: tuple[int, ...]
    texts: tuple[str, ...]  # the decoded text of each slot's piece (entities resolved)

    def render(self, translations: list[str]) -> str:
        """The fragment with each text node replaced by its translation, the markup as it was."""
        if len(translations) != len(self.slots):
            raise ValueError(f"{len(translations)} translations for {len(self.slots)} text nodes")
        out = list(self.pieces)
        for slot, text in zip(self.slots, translations):
            out[slot] = escape_like(text, self.pieces[slot])
        return "".join(out)


def escape_like(text: str, source: str) -> str:
    """`text` escaped for HTML text, each character that `source` wrote as an entity written so again."""
    spelled = {"&": "&amp;", "<": "&lt;", ">": "&gt;"}
    for m in _ENTITY.finditer(source):
        char = html.unescape(m.group(0))
        if len(char) == 1 and char != m.group(0):
            spelled[char] = m.group(0) if m.group(0).endswith(";") else m.group(0) + ";"
    return "".join(spelled.get(c, c) for c in text)


# An address-like text is looked for in the innermost open link's address, its first this many characters:
# a bounded cost per text (a link inside a link is not HTML: a browser closes the first; and an autolink
# shows the start of its address).
ADDRESS_CHARS = 2048


class _Events(HTMLParser):
    """Records where each tokenizer event starts and whether text there is to be translated.
    Each event costs its own length, whatever the tags open (`<b>` nested, end tags that close
    nothing, address-like text: each once cost the whole stack), an address-like text at most
    ADDRESS_CHARS more."""

    def __init__(self, source: str) -> None:
        super().__init__(convert_charrefs=False)
        # the tokenizer counts lines by "\n" alone (a lone "\r" is within a line for `getpos`)
        self.line_starts = [0] + [m.end() for m in re.finditer("\n", source)]
        self.events: list[tuple[int, bool]] = []  # (offset, is translatable text)
        # (tag, its text is not prose (or an outer one's is not), it is a link with an address); the second
        # is kept for the whole stack so that each event asks the top alone
        self.open: list[tuple[str, bool, bool]] = []
        self.places: dict[str, list[int]] = {}  # tag -> where in `open` it is open, innermost last
        self.links: list[str] = []  # the open links' href values (their first ADDRESS_CHARS), innermost last

    def _at(self) -> int:
        line, col = self.getpos()
        return self.line_starts[line - 1] + col

    def _skipping(self) -> bool:
        return bool(self.open) and self.open[-1][1]

    def _in_address(self, data: str) -> bool:
        """Whether `data` is an address, or part of one, shown as the text of a link to it: one word
        with a "." or "/" in it, within the innermost open link's href (not "help" in a link to /help).
        (Not every open link's: links in links are not HTML, and asking each made them quadratic.)"""
        shown = data.strip()
        return (bool(shown) and not any(c.isspace() for c in shown) and ("." in shown or "/" in shown)
                and bool(self.links) and shown in self.links[-1])

    def _mark(self, text: bool) -> None:
        self.events.append((self._at(), text and not self._skipping()))

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self._mark(False)
        if tag in VOID_TAGS:
            return
        a = dict(attrs)
        classes = set((a.get("class") or "").split())
        skip = (self._skipping() or tag in SKIP_TAGS or (a.get("translate") or "").lower() == "no"
                or bool(classes & SKIP_CLASSES))
        address = (a.get("href") or "") if tag == "a" else ""
        if address:
            self.links.append(address[:ADDRESS_CHARS])
        self.places.setdefault(tag, []).append(len(self.open))
        self.open.append((tag, skip, bool(address)))

    def handle_startendtag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self._mark(False)

    def handle_endtag(self, tag: str) -> None:
        self._mark(False)
        places = self.places.get(tag)
        if places:  # close up to the innermost open tag of this name; without one, nothing
            innermost = places[-1]
            while len(self.open) > innermost:
                name, _, linked = self.open.pop()
                self.places[name].pop()
                if linked:
                    self.links.pop()

    def handle_data(self, data: str) -> None:
        self._mark(not self._skipping() and not self._in_address(data))

    def handle_entityref(self, name: str) -> None:
        self._mark(True)

    def handle_charref(self, name: str) -> None:
        self._mark(True)

    def handle_comment(self, data: str) -> None:
        self._mark(False)

    def handle_decl(self, decl: str) -> None:
        self._mark(False)

    def handle_pi(self, data: str) -> None:
        self._mark(False)

    def unknown_decl(self, data: str) -> None:
        self._mark(False)


class NotHtml(ValueError):
    """A fragment the tokenizer cannot read (Python 3.11-3.12's, on a malformed `<![`), or whose text
    cannot be translated as written (a reference to no character)."""


def parse(source: str) -> Fragment:
    """`source` cut into markup and text nodes; the pieces joined give `source` back exactly.
    Raises `NotHtml` where the tokenizer gives up, or a text to translate refers to no character."""
    parser = _Events(source)
    try:
        # a NUL is read as U+FFFD, as HTML does; in a tag name it otherwise ended the tag there and sent the rest
        # of the tag on as text. The `&` of an `&#` the tokenizer cannot read is fed as U+FFFD too: plain text to
        # it, as the `&#` is to HTML (the text itself is taken from `source`). Same lengths: the positions hold.
        parser.feed(_UNREAD_CHARREF.sub("\ufffd", source.replace("\0", "\ufffd")))
        if parser.rawdata.startswith("<") and not parser.cdata_elem:
            # a tag, comment or declaration left open runs to the end (so HTML reads it): markup, kept as
            # written (`close` made text of it, for the model to drop)
            parser.events.append((len(source) - len(parser.rawdata), False))
        else:
            parser.close()
    except AssertionError as e:  # the standard library's tokenizer asserts on some malformed declarations
        raise NotHtml(str(e)) from None
    starts = [(0, False)] + parser.events + [(len(source), False)]
    pieces: list[str] = []
    slots: list[int] = []
    texts: list[str] = []
    run_start = None  # where the current run of text events began
    for (start, text), (end, _) in zip(starts, starts[1:]):
        if text and run_start is None:
            run_start = start
        if not text and run_start is not None:  # a run of text ends where markup begins
            _add_text(source[run_start:start], pieces, slots, texts)
            run_start = None
        if not text and end > start:
            pieces.append(source[start:end])
    if run_start is not None:
        _add_text(source[run_start:], pieces, slots, texts)
    return Fragment(tuple(pieces), tuple(slots), tuple(texts))


def _add_text(raw: str, pieces: list[str], slots: list[int], texts: list[str]) -> None:
    decoded = html.unescape(raw)
    if any(c.isalpha() for c in decoded):
        _refuse_lost_references(raw)
        slots.append(len(pieces))
        texts.append(decoded)
    pieces.append(raw)


def _refuse_lost_references(raw: str) -> None:
    """`NotHtml` for a reference to no character in a text to translate (`&#xD800;`, half of a pair of
    UTF-16 surrogates; `&#0;`; past U+10FFFF): HTML reads it as U+FFFD, which a translation drops, and
    the reference could not be written back. One to a control character or a noncharacter (`&#1;`,
    `&#x7F;`, `&#xFFFE;`) is refused too: the text is read with `html.unescape`, which drops it, so it
    went from the answer without a word."""
    for m in _ENTITY.finditer(raw):
        ref = m.group(0)
        if ref.startswith("&#") and html.unescape(ref) == "":
            raise NotHtml(f"{ref} refers to a control character or a noncharacter, which a translation drops: leave it out")
        if ref.startswith("&#") and html.unescape(ref) == "\ufffd":
            digits = ref[2:].rstrip(";")
            code = int(digits[1:], 16) if digits[0] in "xX" else int(digits)
            if code != 0xFFFD:
                raise NotHtml(f"{ref} refers to no character, which HTML reads as U+FFFD: write the character itself")
