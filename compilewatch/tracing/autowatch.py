"""The watcher inside a process started by `compilewatch run`, without editing the user's code.

`arm()` (called from compilewatch/tracing/_boot/sitecustomize.py) adds an import hook: when the program
imports torch, a Watcher is installed right after torch finishes importing, writing
`$COMPILEWATCH_RUN_DIR/watch-<pid>.jsonl`, and closed at exit. Processes that never import torch
(a shell wrapper, a tokenizer helper) are left alone and write nothing. Settings come from the
environment `compilewatch run` sets: COMPILEWATCH_STALL_AFTER, COMPILEWATCH_REPAIR.
"""

from __future__ import annotations

import atexit
import os

_watcher = None


def _start() -> None:
    global _watcher
    if _watcher is not None:
        return
    from compilewatch.tracing.watcher import Watcher

    run_dir = os.environ["COMPILEWATCH_RUN_DIR"]
    _watcher = Watcher(os.path.join(run_dir, f"watch-{os.getpid()}.jsonl"),
                       stall_after=float(os.environ.get("COMPILEWATCH_STALL_AFTER", "300")),
                       repair=os.environ.get("COMPILEWATCH_REPAIR") == "1").install()
    atexit.register(_watcher.close)


def arm() -> None:
    """Install the watcher now if torch is already imported, else right after it is."""
    from compilewatch.tracing.importhook import after_import

    after_import("torch", _start)
