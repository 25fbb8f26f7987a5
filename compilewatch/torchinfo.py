"""Facts about the installed torch that several commands need, each asked of torch itself.

torch is imported lazily: commands that only read files (diff-env, cache ls) stay fast.
Every function here works on a machine without CUDA. Tracing state whose layout changes between torch
releases (the FX flag, the compiling flag) is read through compilewatch.tracing.torchcompat.
"""

from __future__ import annotations

import errno
import functools
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from compilewatch.env.systemkey import DeviceView, SystemKey


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
    # "torch": every field asked of torch; "files": read from torch's files and NVML without importing
    # torch (fast): cudnn, nccl and arch_list are then unknown (None / ()), cuda_available/device_count
    # are the GPUs NVML sees that CUDA_VISIBLE_DEVICES leaves visible, for a CUDA build of torch.
    source: str = "torch"


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


def torch_build_from_files(devices: "DeviceView | None | str" = "read") -> TorchBuild | None:
    """A TorchBuild from torch's files (`torch/version.py`) and NVML, without importing torch; None
    when torch is not installed."""
    from compilewatch.env import systemkey

    torch_dir = systemkey.package_dir("torch")
    if torch_dir is None:
        return None
    facts = systemkey.torch_version_facts(torch_dir)
    view = systemkey.read_devices() if devices == "read" else devices
    count = systemkey.visible_count(view) if facts.get("cuda") else 0
    return TorchBuild(version=str(facts["__version__"]), cuda=facts.get("cuda"), git_version=facts.get("git_version"),
                      cudnn=None, nccl=None, arch_list=(), cuda_available=count > 0, device_count=count,
                      source="files")


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


def check_cache_dir_usable() -> None:
    """BadInput when torch could not create its inductor cache dir: TORCHINDUCTOR_CACHE_DIR (or the
    default) is a file (or FIFO, dangling symlink, link loop), lies under one, or does not exist under a
    folder that cannot be written. torch 2.13 calls `cache_dir()`, an `os.makedirs`, while
    importing `torch._dynamo`, so every compile (and `doctor`, `warm`, `probe`) would stop there with a
    FileExistsError / NotADirectoryError / PermissionError traceback. Only stats: nothing is created."""
    from compilewatch.errors import BadInput
    from compilewatch.fsutil import nearest_existing
    from compilewatch.inputs import file_kind

    path = inductor_cache_dir()
    where = "TORCHINDUCTOR_CACHE_DIR" if os.environ.get("TORCHINDUCTOR_CACHE_DIR") else "torch's default cache dir"
    p = nearest_existing(path)
    if p is not None and not os.path.isdir(p):
        if os.path.islink(p):  # a dangling link or a link loop: os.makedirs fails on it as on a file
            try:
                kind = f"a symlink to {file_kind(os.stat(p).st_mode)}"
            except OSError as e:
                kind = "a symlink loop" if e.errno == errno.ELOOP else f"a dangling symlink (to {os.readlink(p)})"
        else:
            mode = os.stat(p).st_mode
            kind = "a file" if stat.S_ISREG(mode) else file_kind(mode)
        what = f"is {kind}" if p == path else f"lies under {p}, which is {kind}"
        raise BadInput(f"the inductor cache dir {path} ({where}) {what}: torch cannot create its cache there, "
                       "and every torch.compile would fail", hint="point TORCHINDUCTOR_CACHE_DIR at a directory "
                       "(or move the file away); nothing was changed")
    if p is not None and p != path and not os.access(p, os.W_OK | os.X_OK):
        raise BadInput(f"the inductor cache dir {path} ({where}) does not exist and cannot be created: {p} is not "
                       "writable (permissions or a read-only filesystem), so torch's os.makedirs would fail and "
                       "every torch.compile with it", hint="point TORCHINDUCTOR_CACHE_DIR at a directory you may "
                       "write; nothing was changed")


def default_cache_dir() -> Path:
    """torch's default inductor cache dir (`/tmp/torchinductor_<user>`), whatever TORCHINDUCTOR_CACHE_DIR
    says: torch keeps its precompiled headers there (codecache._HEADER_DIR). No side effects."""
    return Path(os.path.abspath(_torch_default_cache_dir()))


@functools.lru_cache(maxsize=1)
def _torch_default_cache_dir() -> str:
    """torch's `default_cache_dir()`, run from its file. Its one torch import (`torch._environment`,
    a file with no dependencies) is loaded from its file too, so torch itself is never imported."""
    import sys

    mod = sys.modules.get("torch._inductor.runtime.cache_dir_utils")
    if mod is not None:
        return str(mod.default_cache_dir())
    from compilewatch.env.systemkey import package_dir

    torch_dir = package_dir("torch")
    if torch_dir is None:
        raise ImportError("torch is not installed")
    env_src = (torch_dir / "_environment.py").read_text(encoding="utf-8")
    src = (torch_dir / "_inductor" / "runtime" / "cache_dir_utils.py").read_text(encoding="utf-8")
    line = "from torch._environment import is_fbcode"
    if line not in src:  # pragma: no cover - a torch that imports more: ask it
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir

        return default_cache_dir()
    env_ns: dict = {"__name__": "_compilewatch_torch_environment"}
    exec(compile(env_src, str(torch_dir / "_environment.py"), "exec"), env_ns)  # noqa: S102 - torch's own file
    ns: dict = {"__name__": "_compilewatch_cache_dir_utils", "is_fbcode": env_ns["is_fbcode"]}
    exec(compile(src.replace(line, ""), "cache_dir_utils.py", "exec"), ns)  # noqa: S102 - torch's own file
    return str(ns["default_cache_dir"]())


def torch_version() -> str:
    """torch.__version__ (local label included), from torch/version.py unless torch is imported."""
    import sys

    torch = sys.modules.get("torch")
    if torch is not None and hasattr(torch, "__version__"):
        return str(torch.__version__)
    from compilewatch.env import systemkey

    torch_dir = systemkey.package_dir("torch")
    if torch_dir is None:
        raise ImportError("torch is not installed")
    return str(systemkey.torch_version_facts(torch_dir)["__version__"])


def triton_cache_dir(device_index: int = 0) -> Path:
    """TRITON_CACHE_DIR if set, else `<inductor dir>/triton/<device index>` (torch's own rule)."""
    env = os.environ.get("TRITON_CACHE_DIR")
    if env:
        return Path(env)
    return inductor_cache_dir() / "triton" / str(device_index)


@functools.lru_cache(maxsize=1)
def system_key_info() -> "SystemKey":
    """The inductor cache's system key, `CacheBase.get_system()["hash"]`, and how it was found:
    from torch's and triton's files when `compilewatch.env.systemkey` is sure it computes what torch
    computes (tested equal), else from torch's own function. Once per process."""
    from compilewatch.env import systemkey

    return systemkey.key()


def system_key() -> str:
    """The inductor cache's system key hash (see `system_key_info`).

    It covers GPU name, torch.version.cuda and the triton key; if any changes, every entry misses.
    """
    k = system_key_info().key
    if k is None:  # pragma: no cover - systemkey.key always returns one
        raise RuntimeError("no inductor system key")
    return k


def system_info() -> dict:
    """The full dict behind the system key (device name, CUDA and triton versions when on GPU)."""
    from torch._inductor.codecache import CacheBase

    return dict(CacheBase.get_system())


def env_flag(name: str) -> str | None:
    return os.environ.get(name)
