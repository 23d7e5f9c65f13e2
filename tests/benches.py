"""Loading a script of bench/ as a module, for the tests of the benchmarks."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCH = Path(__file__).resolve().parents[1] / "bench"


def load(script: str) -> ModuleType:
    """bench/`script` as the module `aiayn_bench_<name>`, loaded once."""
    name = "aiayn_bench_" + Path(script).stem
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, BENCH / script)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses look their module up
        spec.loader.exec_module(module)
    return sys.modules[name]
