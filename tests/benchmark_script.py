"""A script of ``benchmarks/`` imported as a module, for tests of its pure functions (the scripts are not a
package: each puts its own folder on ``sys.path`` for ``common``)."""

import importlib.util
from pathlib import Path


def load(name: str):
    """``benchmarks/<name>.py`` as a module (executed once per call)."""
    path = Path(__file__).parent.parent / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"benchmark_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
