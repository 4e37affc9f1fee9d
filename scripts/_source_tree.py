"""`import metatp.<x>` from a bare source tree, without `pip install -e .` (a GPU machine has
no network and nothing installed).

setuptools maps the top-level folders ir/, passes/, backends/, tools/, cuda/ into the metatp
package (`[tool.setuptools.package-dir]` in pyproject.toml); `register` does the same mapping
at import time with a meta-path finder. `import scripts` calls it, so the workshop scripts
(`python3 scripts/gpu_check ...`, `python -m scripts.fuzz_gguf`) run from a bare tree; where
metatp is installed it does nothing.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# the package-dir mapping of pyproject.toml (folders relative to the source tree's root)
PACKAGE_DIRS = {"metatp": "metatp", "metatp.ir": "ir", "metatp.ir.models": "ir/models", "metatp.passes": "passes",
                "metatp.backends": "backends", "metatp.tools": "tools", "metatp.cuda": "cuda"}


class SourceTreeFinder(importlib.abc.MetaPathFinder):
    """Finds the mapped packages in their source folders (the rest is found as usual below them)."""

    def __init__(self, root: Path) -> None:
        self.mapping = {name: root / folder for name, folder in PACKAGE_DIRS.items()}

    def find_spec(self, fullname, path=None, target=None):
        folder = self.mapping.get(fullname)
        if folder is None:
            return None
        init = folder / "__init__.py"
        if init.is_file():
            return importlib.util.spec_from_file_location(fullname, init, submodule_search_locations=[str(folder)])
        spec = importlib.machinery.ModuleSpec(fullname, None, is_package=True)
        spec.submodule_search_locations = [str(folder)]
        return spec


def register(root: Path = ROOT) -> None:
    """Make the metatp packages importable from the tree at `root` unless they already are."""
    try:
        import metatp.backends  # noqa: F401
        import metatp.tools  # noqa: F401
        return
    except ImportError:
        pass
    for name in [m for m in sys.modules if m == "metatp" or m.startswith("metatp.")]:
        del sys.modules[name]
    sys.meta_path.insert(0, SourceTreeFinder(root))
