"""Run a function right after a module finishes importing (or now, if it already has).

Used to install instruments without importing heavy modules early: `compilewatch run` arms the
watcher when the program imports torch, and the watcher registers dynamo's compile callbacks when
the program imports torch._dynamo (importing it ourselves would read dynamo's environment-variable
config before the program had a chance to set it).
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
import threading
from typing import Callable

_lock = threading.Lock()
_pending: dict[str, list[Callable[[], None]]] = {}


def _run(fns: list[Callable[[], None]]) -> None:
    for fn in fns:
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - the user's import must succeed whatever we do
            sys.stderr.write(f"compilewatch: post-import hook failed: {type(e).__name__}: {e}\n")


class _Finder(importlib.abc.MetaPathFinder):
    """Finds nothing itself: for a watched name it returns the real spec with a loader whose
    exec_module runs the pending functions after the module's code."""

    def __init__(self) -> None:
        self._busy = threading.local()

    def find_spec(self, name, path, target=None):
        if getattr(self._busy, "on", False):
            return None
        with _lock:
            if name not in _pending:
                return None
        self._busy.on = True  # the lookup below must not come back to us
        try:
            spec = importlib.util.find_spec(name)
        finally:
            self._busy.on = False
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        loader, original = spec.loader, spec.loader.exec_module

        def exec_module(module):
            original(module)
            with _lock:
                fns = _pending.pop(name, [])
            _run(fns)

        loader.exec_module = exec_module
        return spec


_finder = _Finder()


def after_import(name: str, fn: Callable[[], None]) -> None:
    """Call `fn()` once `name` is imported: now if it already is, else right after its import."""
    with _lock:
        if name not in sys.modules:
            _pending.setdefault(name, []).append(fn)
            if _finder not in sys.meta_path:
                sys.meta_path.insert(0, _finder)
            return
    fn()


def cancel(name: str, fn: Callable[[], None]) -> None:
    with _lock:
        fns = _pending.get(name, [])
        if fn in fns:
            fns.remove(fn)
        if not fns:
            _pending.pop(name, None)
