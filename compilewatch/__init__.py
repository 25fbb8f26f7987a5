"""compilewatch: torch.compile cache, thread-race and environment diagnostics.

The library never prints; every function returns data (frozen dataclasses) that the CLI in `cli/`
renders. Importing compilewatch does not import torch: the public names below that need torch are
loaded on first use (module-level __getattr__).
"""

__version__ = "0.1.0"

from compilewatch.errors import BadInput, CheckFailed, CompilewatchError  # noqa: E402

# public name -> (module, attribute or None for the module itself), imported on first access
_LAZY = {
    "watch": ("compilewatch.tracing.watcher", "watch"),
    "Watcher": ("compilewatch.tracing.watcher", "Watcher"),
    "guard": ("compilewatch.tracing.guard", None),
    "CompileGuard": ("compilewatch.tracing.guard", "CompileGuard"),
    "GuardError": ("compilewatch.tracing.guard", "GuardError"),
}

__all__ = ["__version__", "BadInput", "CheckFailed", "CompilewatchError", *_LAZY]


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        module_name, attr = _LAZY[name]
        module = importlib.import_module(module_name)
        return module if attr is None else getattr(module, attr)
    raise AttributeError(f"module 'compilewatch' has no attribute {name!r}")
