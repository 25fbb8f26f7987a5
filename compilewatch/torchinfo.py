"""Facts about the installed torch that several commands need, each asked of torch itself.

torch is imported lazily: commands that only read files (diff-env, cache ls) stay fast.
Every function here works on a machine without CUDA. Tracing state whose layout changes between torch
releases (the FX flag, the compiling flag) is read through compilewatch.torchcompat.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from pathlib import Path


def torch_module():
    import torch

    return torch


@dataclass(frozen=True, slots=True)
class TorchBuild:
    version: str  # torch.__version__, local label included ("2.11.0+cu130")
    cuda: str | None  # torch.version.cuda
    git_version: str | None
    cudnn: int | None  # torch.backends.cudnn.version(), what torch loads (not the system one)
    nccl: str | None
    arch_list: tuple[str, ...]
    cuda_available: bool
    device_count: int


def torch_build() -> TorchBuild:
    torch = torch_module()
    cudnn = nccl = None
    arch: tuple[str, ...] = ()
    available = torch.cuda.is_available()
    try:
        cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    except Exception:  # noqa: BLE001 - a broken cuDNN install is a fact to report, not a crash
        cudnn = None
    try:
        if torch.cuda.is_available() or torch.version.cuda:
            v = torch.cuda.nccl.version()
            nccl = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
    except Exception:  # noqa: BLE001
        nccl = None
    try:
        arch = tuple(torch.cuda.get_arch_list())
    except Exception:  # noqa: BLE001
        arch = ()
    return TorchBuild(
        version=torch.__version__,
        cuda=torch.version.cuda,
        git_version=getattr(torch.version, "git_version", None),
        cudnn=cudnn,
        nccl=nccl,
        arch_list=arch,
        cuda_available=available,
        device_count=torch.cuda.device_count() if available else 0,
    )


def inductor_cache_dir() -> Path:
    """The inductor cache dir as torch resolves it: TORCHINDUCTOR_CACHE_DIR, else torch's default.

    Unlike torch's own `cache_dir()`, this has no side effects: it neither creates the directory
    nor sets TORCHINDUCTOR_CACHE_DIR in the environment (a diagnostic must not change what it reads).
    Importing `torch._inductor` would: torch 2.13 calls `cache_dir()` while importing `torch._dynamo`
    (`_dynamo/package.py`). So torch's `default_cache_dir()` is loaded from its file without running
    the package init.
    """
    env = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    return Path(os.path.abspath(env or _torch_default_cache_dir()))


@functools.lru_cache(maxsize=1)
def _torch_default_cache_dir() -> str:
    import importlib.util
    import sys

    mod = sys.modules.get("torch._inductor.runtime.cache_dir_utils")
    if mod is None:
        torch = torch_module()
        path = os.path.join(os.path.dirname(torch.__file__), "_inductor", "runtime", "cache_dir_utils.py")
        spec = importlib.util.spec_from_file_location("_compilewatch_cache_dir_utils", path)
        if spec is None or spec.loader is None:  # pragma: no cover - a torch without the file
            from torch._inductor.runtime.cache_dir_utils import default_cache_dir

            return default_cache_dir()
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    return str(mod.default_cache_dir())


def triton_cache_dir(device_index: int = 0) -> Path:
    """TRITON_CACHE_DIR if set, else `<inductor dir>/triton/<device index>` (torch's own rule)."""
    env = os.environ.get("TRITON_CACHE_DIR")
    if env:
        return Path(env)
    return inductor_cache_dir() / "triton" / str(device_index)


@functools.lru_cache(maxsize=1)
def system_key() -> str:
    """The inductor cache's system key hash: `CacheBase.get_system()["hash"]`, never re-derived.

    It covers GPU name, torch.version.cuda and the triton key; if any changes, every entry misses.
    Computed once per process (it takes ~1-2 s on first call).
    """
    from torch._inductor.codecache import CacheBase

    return str(CacheBase.get_system()["hash"])


def system_info() -> dict:
    """The full dict behind the system key (device name, CUDA and triton versions when on GPU)."""
    from torch._inductor.codecache import CacheBase

    return dict(CacheBase.get_system())


def env_flag(name: str) -> str | None:
    return os.environ.get(name)
