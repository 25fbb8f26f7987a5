"""Loaded at interpreter start in processes that `compilewatch run` starts (this directory is put
first on PYTHONPATH). It arms the watcher (compilewatch.tracing.autowatch) when COMPILEWATCH_RUN_DIR is
set, and has torch's remote-cache reads verified (compilewatch.cache.remote.verified), then runs the
sitecustomize it shadows, if there is one, so the user's setup still happens.
"""

import os
import sys


def _chain() -> None:
    import importlib.machinery
    import importlib.util

    here = os.path.dirname(os.path.abspath(__file__))
    path = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", path)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules["sitecustomize"] = module
    spec.loader.exec_module(module)


if os.environ.get("COMPILEWATCH_RUN_DIR"):
    try:
        from compilewatch.tracing import autowatch

        autowatch.arm()
    except Exception as e:  # noqa: BLE001 - never stop the user's program from starting
        sys.stderr.write(f"compilewatch: watcher not armed: {type(e).__name__}: {e}\n")
    try:  # torch's remote-cache reads verified before torch unpickles them (compilewatch.cache.remote.verified)
        from compilewatch.cache.remote import verified
        from compilewatch.tracing.importhook import after_import

        verified.arm(after_import)
    except Exception as e:  # noqa: BLE001 - never stop the user's program from starting
        sys.stderr.write(f"compilewatch: remote-cache reads not verified: {type(e).__name__}: {e}\n")
_chain()
