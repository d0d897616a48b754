"""Resolve the `module:attribute` import paths that configs use for rewards, tools and environments."""

from __future__ import annotations

import importlib
from typing import Any


def import_object(path: str) -> Any:
    """Import `module:attr` (attr may be dotted); raises ImportError/AttributeError/ValueError."""
    module, sep, attr = path.partition(":")
    if not sep or not module or not attr:
        raise ValueError(f"expected an import path 'module:attribute', got {path!r}")
    obj: Any = importlib.import_module(module)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj
