"""Resolve the `module:attribute` import paths that configs use for rewards, tools and environments.

A user's own modules live next to their config file or in the directory they run from: both are
searched, after the installed packages (appended to `sys.path`, never shadowing them). Process-pool
reward workers are spawned with the parent's `sys.path`, so they find the same modules.
"""

from __future__ import annotations

import os
import pkgutil
import sys
from pathlib import Path
from typing import Any

from grpoflow.tasks.config.allowlist import check_import_path, check_imported

_SEARCH_DIRS: list[str] = []  # directories of loaded config files, in load order


def add_search_dir(directory: str | Path) -> None:
    """Make modules in `directory` (a config file's folder) importable by config import paths."""
    d = str(Path(directory).resolve())
    if d not in _SEARCH_DIRS:
        _SEARCH_DIRS.append(d)


def search_dirs() -> list[str]:
    """Where a user's modules are looked for beyond the installed packages: config dirs, then cwd."""
    return [*_SEARCH_DIRS, os.getcwd()]


def extend_sys_path() -> None:
    """Make the search dirs importable by a plain `import` too (a verifiers environment's package)."""
    for d in search_dirs():
        if d not in sys.path:
            sys.path.append(d)


def import_object(path: str) -> Any:
    """Import `module:attr` (attr may be dotted); raises ImportError/AttributeError/ValueError."""
    module, sep, attr = path.partition(":")
    if not sep or not module or not attr:
        raise ValueError(f"expected an import path 'module:attribute', got {path!r}")
    check_import_path(path)  # a worker-started run: allowed modules only, checked before importing
    extend_sys_path()
    try:
        obj = pkgutil.resolve_name(path)
    except ModuleNotFoundError as e:
        # Name the places searched only when the configured module itself is missing, not when it
        # exists and fails on an import of its own (that error is the user's to read as it is).
        if e.name and (module == e.name or module.startswith(e.name + ".")):
            where = ", ".join(search_dirs())
            raise ModuleNotFoundError(
                f"no module named {e.name!r} in the installed packages or in {where}", name=e.name
            ) from e
        raise
    check_imported(path, obj)
    return obj
