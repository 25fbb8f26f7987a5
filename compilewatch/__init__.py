"""compilewatch: torch.compile cache, thread-race and environment diagnostics.

The library never prints; every function returns data (frozen dataclasses) that the CLI in `cli/`
renders. Importing compilewatch does not import torch.
"""

__version__ = "0.1.0"

from compilewatch.errors import BadInput, CheckFailed, CompilewatchError  # noqa: E402

__all__ = ["__version__", "BadInput", "CheckFailed", "CompilewatchError"]
