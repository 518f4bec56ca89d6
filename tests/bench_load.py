"""Import a script of ``benchmarks/`` as a module for its tests."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


def load_bench(name: str, module_name: str | None = None) -> ModuleType:
    """Return ``benchmarks/<name>.py`` imported as ``module_name`` (default ``<name>_bench``,
    so it never shadows an installed module), with ``benchmarks/`` on ``sys.path`` while it
    imports (its ``_bench`` and sibling imports)."""
    sys.path.insert(0, str(BENCH))
    try:
        spec = importlib.util.spec_from_file_location(module_name or f"{name}_bench",
                                                      BENCH / f"{name}.py")
        assert spec is not None and spec.loader is not None
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    finally:
        sys.path.remove(str(BENCH))
    return mod
