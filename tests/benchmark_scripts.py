"""Load a script of ``benchmarks/`` as a module, for tests of its pieces.

Importable from every test directory: pytest puts ``tests/`` (where the root conftest lives) on
``sys.path``.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def load_benchmark(name: str) -> ModuleType:
    """``benchmarks/<name>.py`` as the module ``<name>_script`` (loaded once per session), with
    ``benchmarks/`` on the path for what the scripts import by name (``script_args``)."""
    if str(BENCHMARKS) not in sys.path:
        sys.path.append(str(BENCHMARKS))
    key = f"{name}_script"
    if key not in sys.modules:
        spec = importlib.util.spec_from_file_location(key, BENCHMARKS / f"{name}.py")
        assert spec is not None and spec.loader is not None, f"no benchmarks/{name}.py"
        module = importlib.util.module_from_spec(spec)
        sys.modules[key] = module
        spec.loader.exec_module(module)
    return sys.modules[key]
