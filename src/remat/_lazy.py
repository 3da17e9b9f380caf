"""Imports deferred to first use, so a package imports without torch, numpy or scipy.

NOTE [import cost]
``import remat`` and ``import remat.plan`` load no torch, numpy or scipy (tests/test_imports.py
runs them under ``python -S``, where none of the three is importable). The planners are pure
arithmetic on profiled numbers, and the ``remat`` command must be able to catch a Ctrl-C during
torch's import (NOTE [exit codes] in remat.cli.main). Two tools keep it so:

- :func:`lazy_exports`: a package whose public names live in torch-importing submodules
  (``remat``, ``remat.profile``, ``remat.measure``) maps each such name to its submodule, and
  loads the submodule on the first read of the name (PEP 562 ``__getattr__``), while
  ``dir(package)`` lists the names from the start. A name equal to a submodule's name (e.g.
  ``remat.profile.fingerprint``) must be imported eagerly instead: once the submodule is imported,
  Python binds the name to the submodule and ``__getattr__`` is never asked.
- :class:`LazyModule`: ``np = LazyModule("numpy")`` reads like ``import numpy as np`` and
  imports numpy at the first ``np.<name>`` a function runs (``remat.plan.cost``, ``.planners``).
"""

from __future__ import annotations

import sys
from importlib import import_module
from types import ModuleType
from typing import Any, Callable, Mapping


def lazy_exports(package: str, names: Mapping[str, str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The ``__getattr__`` and ``__dir__`` of ``package`` whose ``names`` (name -> absolute module) load on first read."""

    def __getattr__(name: str) -> Any:
        if name in names:
            return getattr(import_module(names[name]), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(names))

    return __getattr__, __dir__


class LazyModule(ModuleType):
    """A module imported at its first attribute read (NOTE [import cost])."""

    def __getattr__(self, attr: str) -> Any:
        module = import_module(self.__name__)
        self.__dict__.update(vars(module))   # later reads find the attributes directly
        return getattr(module, attr)
