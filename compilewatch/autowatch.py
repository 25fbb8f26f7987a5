"""The watcher inside a process started by `compilewatch run`, without editing the user's code.

`arm()` (called from compilewatch/_boot/sitecustomize.py) adds an import hook: when the program
imports torch, a Watcher is installed right after torch finishes importing, writing
`$COMPILEWATCH_RUN_DIR/watch-<pid>.jsonl`, and closed at exit. Processes that never import torch
(a shell wrapper, a tokenizer helper) are left alone and write nothing. Settings come from the
environment `compilewatch run` sets: COMPILEWATCH_STALL_AFTER, COMPILEWATCH_REPAIR.
"""

from __future__ import annotations

import atexit
import importlib.abc
import importlib.util
import os
import sys

_watcher = None


def _start() -> None:
    global _watcher
    if _watcher is not None:
        return
    from compilewatch.watcher import Watcher

    run_dir = os.environ["COMPILEWATCH_RUN_DIR"]
    _watcher = Watcher(os.path.join(run_dir, f"watch-{os.getpid()}.jsonl"),
                       stall_after=float(os.environ.get("COMPILEWATCH_STALL_AFTER", "300")),
                       repair=os.environ.get("COMPILEWATCH_REPAIR") == "1").install()
    atexit.register(_watcher.close)


class _AfterTorchImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: for `torch`, returns torch's own spec with a loader that installs the
    watcher after torch's module code has run."""

    def find_spec(self, name, path, target=None):
        if name != "torch":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec("torch")
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        loader = spec.loader
        original = loader.exec_module

        def exec_module(module):
            original(module)
            try:
                _start()
            except Exception as e:  # noqa: BLE001 - the user's program runs on without the watcher
                sys.stderr.write(f"compilewatch: watcher not installed: {type(e).__name__}: {e}\n")

        loader.exec_module = exec_module
        return spec


def arm() -> None:
    """Install the watcher now if torch is already imported, else when it is."""
    if "torch" in sys.modules:
        _start()
    elif not any(isinstance(f, _AfterTorchImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterTorchImport())
