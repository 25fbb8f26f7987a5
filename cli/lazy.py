"""Library modules imported on first use: `--help` and quick commands (lock) skip what they do not run.

`archive = lazy("compilewatch.cache.archive.save")` at the top of a command module; `archive.save(...)`
imports the module the first time an attribute is read. (Annotations stay strings under
`from __future__ import annotations`, so `r: archive.SaveResult` costs nothing.)
"""

from __future__ import annotations

import importlib
import types
from typing import Any


class _LazyModule(types.ModuleType):
    def __getattr__(self, attr: str) -> Any:
        module = importlib.import_module(self.__name__)
        return getattr(module, attr)


def lazy(name: str) -> Any:
    return _LazyModule(name)
