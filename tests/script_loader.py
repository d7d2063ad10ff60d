"""Benchmark and data scripts imported by the tests from their files (they are scripts, not package modules)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]


def load_script(path: Path | str, name: str) -> ModuleType:
    """The script at ``path`` (relative to the repository root, or absolute) imported as module ``name``, which
    is registered in ``sys.modules`` (dataclasses look their module up there); unregister it with
    ``sys.modules.pop(name)`` when a second copy under the same name must be fresh."""
    spec = importlib.util.spec_from_file_location(name, ROOT / path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod
