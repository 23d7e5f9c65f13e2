"""One exception type for problems the user can fix; the CLI prints its message on one line."""

from __future__ import annotations

import importlib
from typing import Any

INSTALL_HINT = "pip install 'aiayn[export]'"


class AiaynError(Exception):
    """Bad input, flag, file or checkpoint. The message names what is wrong and what to do."""


def first_line(e: BaseException, most: int = 200) -> str:
    """An exception's first line of text (at most `most` characters) for a one-line message, or its
    type's name where it has no text (an empty file's EOFError)."""
    text = str(e).strip()
    return text.splitlines()[0][:most] if text else type(e).__name__


def require(module: str, purpose: str = "exporting") -> Any:
    """Imports an optional package (`transformers`, `ctranslate2`), or says in one line what to install."""
    try:
        return importlib.import_module(module)
    except ImportError:
        top = module.split(".")[0]
        raise AiaynError(f"{purpose} needs the optional package '{top}', which is not installed: "
                         f"{INSTALL_HINT}") from None
