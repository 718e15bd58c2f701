"""Old import paths of modules that moved, kept working with a DeprecationWarning.

The trace-replay tool lived flat in the package (``kvoffload.simulate``, ``kvoffload.traces``,
...) and the conformance kit at ``kvoffload.conformance``. Code written against those names
keeps importing them: each old name is the new module itself (same object, same state), so
monkeypatching either name patches both. Each old name warns once per process, at import.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings
from collections.abc import Sequence
from types import ModuleType

MOVED: dict[str, str] = {
    "kvoffload.simulate": "kvoffload.replay.simulate",
    "kvoffload.sweep": "kvoffload.replay.sweep",
    "kvoffload.traces": "kvoffload.replay.traces",
    "kvoffload.belady": "kvoffload.replay.belady",
    "kvoffload.device_cache": "kvoffload.replay.device_cache",
    "kvoffload.conformance": "kvoffload.checking.conformance",
}


class _Alias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None,
        target: ModuleType | None = None,
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in MOVED:
            return None
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        new_name = MOVED[spec.name]
        warnings.warn(
            f"{spec.name} moved to {new_name}; import it from there "
            "(the old name will be removed in a later release)",
            DeprecationWarning,
            stacklevel=2,
        )
        return importlib.import_module(new_name)

    def exec_module(self, module: ModuleType) -> None:
        """The new module ran already when it was imported."""


def install() -> None:
    if not any(isinstance(finder, _Alias) for finder in sys.meta_path):
        sys.meta_path.append(_Alias())
