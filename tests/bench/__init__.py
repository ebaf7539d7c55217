"""Tests of `conveyor.bench` and of the scripts in benchmarks/."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCH = Path(__file__).parents[2] / "benchmarks"


def load_script(name: str) -> ModuleType:
    """benchmarks/`name`.py as a module, with benchmarks/ on the path as when it runs as a script
    (the scripts import their siblings by name)."""
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
