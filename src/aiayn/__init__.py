"""aiayn: the encoder-decoder Transformer of "Attention Is All You Need" (Vaswani et al., 2017).

The public face, `aiayn.Transformer`, `aiayn.ModelConfig`, `aiayn.preset` and `aiayn.Translator`, is
imported on first use (PEP 562): `import aiayn` alone loads no torch, so the command line's `--help`
stays quick.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_PUBLIC = {"Transformer": "aiayn.model", "ModelConfig": "aiayn.config", "preset": "aiayn.config",
           "Translator": "aiayn.translator"}  # name -> its module
__all__ = ["__version__", *_PUBLIC]

if TYPE_CHECKING:  # what type checkers and editors see; at run time `__getattr__` imports them
    from aiayn.config import ModelConfig, preset
    from aiayn.model import Transformer
    from aiayn.translator import Translator


def __getattr__(name: str) -> Any:
    if name not in _PUBLIC:
        raise AttributeError(f"module 'aiayn' has no attribute {name!r}")
    value = getattr(importlib.import_module(_PUBLIC[name]), name)
    globals()[name] = value  # (found directly from now on)
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_PUBLIC})
