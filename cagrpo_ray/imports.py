"""Importing a user's Python file or module by name, the same way wherever it is needed: reward
functions (`rewards/custom.py`) and algorithm plugins (`config/plugins.py`)."""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType


def import_source(target: str, search_path: str | None = None) -> ModuleType:
    """The module of `target`: a `.py` file (given one module name per file, so that two files
    of the same name do not collide) or an importable module name (also looked up in
    `search_path`). Raises what the import raises."""
    if target.endswith(".py"):
        path = Path(target)
        if not path.is_file():
            raise FileNotFoundError(f"no file {path}")
        module_name = "cagrpo_user_" + hashlib.sha1(str(path).encode()).hexdigest()[:12]
        module_spec = importlib.util.spec_from_file_location(module_name, path)
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[module_name] = module
        try:
            module_spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[module_name]
            raise
        return module
    if search_path and search_path not in sys.path:
        sys.path.append(search_path)
    return importlib.import_module(target)
