"""pdlab: a hands-on lab for disaggregated prefill/decode serving of LLMs."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from typing import Any

__version__ = "0.1.0"


def lazy_names(package: str, modules: dict[str, tuple[str, ...]]) -> Callable[[str], Any]:
    """A package's module `__getattr__` (PEP 562) that imports each name of `modules` (module -> the names it
    gives) on first use and keeps it: a `pdlab` command that needs none of a room's modules starts without them."""
    where = {name: module for module, names in modules.items() for name in names}

    def __getattr__(name: str) -> Any:
        if name not in where:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(where[name]), name)
        setattr(sys.modules[package], name, value)
        return value

    return __getattr__
