"""Paragraphs into sentences and back, so that a model trained on sentences can translate a paragraph.

A text is cut at its line ends first (a sentence never spans two lines), then each line into
sentences by `sentencex`, a rule-based splitter that knows the abbreviations and punctuation of
~300 languages (Wikimedia's; Rust, no dependencies, no model to download). What lies between the
sentences, spaces and line ends as written, is kept and put back around their translations, so a
paragraph comes back with its own layout: `Paragraph.join(translations)`.

Used by `aiayn translate --split-sentences` and by the LibreTranslate endpoint of `aiayn serve`.
`sentencex` is imported on first use only, so `import aiayn.translate` stays fast.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cache


@dataclass(frozen=True)
class Paragraph:
    """A text as its sentences (no surrounding whitespace) and the whitespace around each of them:
    `text == lead + sentences[0] + gaps[0] + sentences[1] + gaps[1] + ...`."""

    lead: str
    sentences: tuple[str, ...]
    gaps: tuple[str, ...]

    def join(self, translations: Sequence[str]) -> str:
        """The paragraph with each sentence replaced by its translation, whitespace as it was."""
        if len(translations) != len(self.sentences):
            raise ValueError(f"{len(translations)} translations for {len(self.sentences)} sentences")
        return self.lead + "".join(t + gap for t, gap in zip(translations, self.gaps))


@cache
def _segmenter() -> Callable[[str, str], list[str]]:
    from sentencex import segment  # the splitter, imported once, on first use

    return lambda language, text: list(segment(language, text))


# sentencex 1.0.32 panics on a letter, a space of more than one UTF-8 byte and a full stop ("Z\xa0.",
# "Z\u202f."), and Rust prints the panic on stderr: the splitter reads such spaces as plain ones (one
# character for one), and its sentences are taken from the line as written, at the same places.
_PLAIN_SPACES = str.maketrans({c: " " for c in map(chr, range(0x80, 0x3001)) if c.isspace()})


def _sentences_of_line(line: str, language: str) -> list[str]:
    """The sentences of one line, stripped, in order, as written in it."""
    if not line.strip():
        return []
    plain = line.translate(_PLAIN_SPACES)
    try:
        parts = [p.strip() for p in _segmenter()(language, plain)]
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException:  # a splitter fault must not fail a translation: the line is one sentence (a
        parts = [plain.strip()]  # Rust panic is a BaseException)
    out, at = [], 0
    for p in filter(None, parts):
        k = plain.find(p, at)
        if k < 0:  # not verbatim (it never should be): `split` takes the rest of the line
            out.append(p)
            continue
        out.append(line[k:k + len(p)])
        at = k + len(p)
    return out


def split(text: str, language: str) -> Paragraph:
    """`text` (a paragraph, or several lines of them) as sentences and the whitespace between them.

    `language` is an ISO 639 code (`de`, `en`, ...); one the splitter does not know gets its
    generic rules. Every character of `text` is either in a sentence or in the whitespace kept
    around it: a sentence the splitter would have changed (it never should) is taken whole."""
    lead, sentences, gaps = "", list[str](), list[str]()
    for line in text.splitlines(keepends=True):
        at = 0
        for s in _sentences_of_line(line, language):
            k = line.find(s, at)
            if k < 0:  # not verbatim: the rest of the line is one sentence
                s = line[at:].strip()
                k = line.find(s, at)
            space = line[at:k]
            if sentences:
                gaps[-1] += space
            else:
                lead += space
            sentences.append(s)
            gaps.append("")
            at = k + len(s)
        if sentences:
            gaps[-1] += line[at:]
        else:
            lead += line[at:]
    return Paragraph(lead, tuple(sentences), tuple(gaps))
