"""Public names of a package that load when first used (PEP 562), so that importing one
engine module (a Spark Python worker unpickling a shard task) does not import every
library the package's API reaches (PyIceberg, SQLAlchemy, delta-rs, pandas)."""

from __future__ import annotations

import importlib
import sys
from typing import Any, Callable


def lazy_exports(package: str, exports: dict[str, tuple[str, ...]]) -> Callable[[str], Any]:
    """The package's module ``__getattr__``: ``exports`` maps each module to the names it
    gives; a name's module is imported when the name is first asked for, then kept."""
    module_of = {name: module for module, names in exports.items() for name in names}

    def __getattr__(name: str) -> Any:
        module = module_of.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        setattr(sys.modules[package], name, value)
        return value

    return __getattr__
