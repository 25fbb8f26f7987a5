"""A Hugging Face checkpoint's safetensors straight onto a device, and the model built around them
(issue 39): no random init of weights that are overwritten anyway, no full copy in host memory, and
the read can start before transformers' model stack is imported.

    files = safetensors_files(path)                 # None: not a safetensors checkpoint (the loader falls back)
    state = read_weights(files, device)             # name -> tensor on `device`, in the stored dtype
    model = model_from_weights(config, state, dtype, device)   # None: not a layout this path handles

- read_weights, for a GPU, reads each file's data buffer in large chunks (`CHUNK`) with `os.preadv`
  from `READERS` threads into pinned staging buffers, each copied on to one device allocation per file
  while the next chunk is read; the tensors are views of that allocation, at the offsets of the file's
  checked header (dflash.model.safetensors_layout). Reads of a cold page cache then keep the disk's
  queue full, where a copy out of a memory mapping faults its pages in one small read at a time
  (`benchmarks/weights_read.py` measures both). A file with a dtype that layout does not know is read
  the mapping's way. Every read releases the GIL, so the read runs beside imports.
- For the CPU it memory-maps each file (safetensors' own `safe_open`: a CPU tensor is a view of the
  mapping, nothing is copied) and returns the views: model_from_weights copies them out of the
  mapping (weights never alias a file someone may rewrite), in the model's dtype, in one copy.
- model_from_weights builds the model with its parameters on the meta device (a parameter
  registration hook, for the calling thread only) and its buffers computed for real on the CPU as
  its `__init__` computes them (RoPE frequencies: the same bits as transformers' loader), then
  assigns the read tensors as the parameters (`load_state_dict(assign=True)`), casting only those
  whose dtype differs from the model's, ties tied weights and moves the buffers to the device.
  Anything it does not handle exactly as `from_pretrained` would (renamed or missing keys, other
  shapes, fp32-kept modules, quantized, fused or remote-code models) returns None: the caller loads with
  `from_pretrained` instead. tests/test_fast_start.py holds both paths to bit-identical weights.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Iterator

import torch
from torch import nn

from dflash.model.prefetch import INDEX, SINGLE, safetensors_files  # noqa: F401 - re-exported: the loader's names
from dflash.model.safetensors_layout import Layout, Unsupported, read_layout

BUILDING = threading.Lock()
"""Held while a thread builds modules whose dtype comes from torch's default: transformers sets the
process's default dtype (torch.set_default_dtype, global) while it builds a model, so a drafter built
at that moment in another thread would come out in the target's bf16. Every model a start builds
beside another (the target's, the drafter) is built under it; nothing else waits on it."""
WORKERS = 4  # copy threads of the mapped read; transformers 5 uses min(4, cpus)
READERS = 8  # reader threads of the direct (GPU) read: a cold page cache is read at the disk's queue depth
CHUNK = 32 << 20  # bytes a reader reads and copies at once


class Stopped(Exception):
    """read_weights was told to stop (the start failed elsewhere)."""


def read_weights(files: list[Path], device: torch.device,
                 stop: threading.Event | None = None) -> dict[str, torch.Tensor]:
    """Every tensor of `files` on `device`, in the dtype it is stored in (on the CPU: views of the
    files' mappings, see the module doc). `stop` set: Stopped is raised before the next tensor or chunk.
    Raises ValueError naming what is wrong for a damaged file (or what safetensors raises for it)."""
    device = torch.device(device)
    if device.type == "cuda":
        try:
            layouts = [read_layout(f) for f in files]
        except Unsupported:
            layouts = None
        if layouts is not None:
            return _read_direct(layouts, device, stop)
    return _read_mapped(files, device, stop)


def _read_mapped(files: list[Path], device: torch.device, stop: threading.Event | None) -> dict[str, torch.Tensor]:
    """safetensors' `safe_open` views, copied to the device (not the CPU) in WORKERS threads."""
    from safetensors import safe_open

    out: dict[str, torch.Tensor] = {}
    if device.type == "cuda":
        _reserve(device, sum(f.stat().st_size for f in files))

    def copy(view: torch.Tensor) -> torch.Tensor:
        return view if device.type == "cpu" else view.to(device)

    with ThreadPoolExecutor(max_workers=WORKERS, thread_name_prefix="dflash-start-weights") as pool:
        for f in files:
            with safe_open(str(f), framework="pt", device="cpu") as fh:
                futures = {}
                for n in fh.keys():
                    if stop is not None and stop.is_set():
                        raise Stopped("the weights read was stopped")
                    futures[n] = pool.submit(copy, fh.get_tensor(n))
                for n, fut in futures.items():
                    if n in out:
                        raise ValueError(f"tensor {n!r} is stored twice ({f.name} and an earlier shard)")
                    out[n] = fut.result()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return out


def _read_direct(layouts: list[Layout], device: torch.device, stop: threading.Event | None) -> dict[str, torch.Tensor]:
    """The GPU read of the module doc: chunks taken in file order by READERS threads (so the disk sees
    a few sequential streams), each read into one of its thread's two pinned buffers and copied on the
    thread's own stream while the other buffer is read into."""
    out: dict[str, torch.Tensor] = {}
    for lay in layouts:  # names first: a duplicate is found before anything is read
        for e in lay.entries:
            if e.name in out:
                raise ValueError(f"tensor {e.name!r} is stored twice ({lay.path.name} and an earlier shard)")
            out[e.name] = None  # type: ignore[assignment]
    bufs = [torch.empty(lay.size, dtype=torch.uint8, device=device) for lay in layouts]
    jobs = [(i, off, min(CHUNK, lay.size - off)) for i, lay in enumerate(layouts) for off in range(0, lay.size, CHUNK)]
    taken = itertools.count()  # next() on it is atomic: each job goes to one thread
    fds: list[int] = []
    try:
        for lay in layouts:
            fds.append(os.open(lay.path, os.O_RDONLY))

        failed = threading.Event()  # one reader's error ends the others at their next chunk

        def reader() -> None:
            try:
                _reader()
            except BaseException:
                failed.set()
                raise

        def _reader() -> None:
            staging = [torch.empty(CHUNK, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
            copied: list[torch.cuda.Event | None] = [None, None]
            stream = torch.cuda.Stream(device)
            k = 0
            while not failed.is_set() and (j := next(taken)) < len(jobs):
                if stop is not None and stop.is_set():
                    raise Stopped("the weights read was stopped")
                i, off, n = jobs[j]
                buf = staging[k % 2]
                if copied[k % 2] is not None:
                    copied[k % 2].synchronize()  # its last copy is done: the buffer can be written
                _read_exactly(fds[i], buf.numpy()[:n], layouts[i].data_start + off, layouts[i].path)
                with torch.cuda.stream(stream):
                    bufs[i][off:off + n].copy_(buf[:n], non_blocking=True)
                    copied[k % 2] = torch.cuda.Event()
                    copied[k % 2].record(stream)
                k += 1
            stream.synchronize()

        with ThreadPoolExecutor(max_workers=READERS, thread_name_prefix="dflash-start-weights") as pool:
            for fut in [pool.submit(reader) for _ in range(min(READERS, len(jobs)))]:
                fut.result()
    finally:
        for fd in fds:
            os.close(fd)
    for lay, buf in zip(layouts, bufs):
        for e in lay.entries:
            raw = buf[e.begin:e.end]
            if e.begin % e.dtype.itemsize:  # packed after an odd-sized tensor: an aligned copy
                raw = raw.clone()
            out[e.name] = raw.view(e.dtype).view(e.shape)
    return out


def _read_exactly(fd: int, into, offset: int, path: Path) -> None:
    """Fill the numpy byte array `into` from `fd` at `offset`; a file that ends first is a ValueError."""
    view = memoryview(into)
    got = 0
    while got < len(view):
        n = os.preadv(fd, [view[got:]], offset + got)
        if n == 0:
            raise ValueError(f"{path.name} ended at byte {offset + got}, before the data its header describes")
        got += n


def _reserve(device: torch.device, nbytes: int) -> None:
    """One device allocation of the weights' size, freed at once: torch's caching allocator keeps the
    segment and splits it for the tensors read next (one cudaMalloc instead of one per tensor, as
    transformers' caching_allocator_warmup does). Skipped when the device has not that much free."""
    free, _ = torch.cuda.mem_get_info(device)
    if nbytes < free - (1 << 30):
        torch.empty(nbytes, dtype=torch.uint8, device=device)


_META = threading.local()  # .active: parameters registered by this thread go to the meta device
_HOOK_LOCK = threading.Lock()
_HOOK: list = []  # [handle, users]: one global registration hook, shared by every thread that builds


def _to_meta(module: nn.Module, name: str, param: nn.Parameter | None):
    if param is None or not getattr(_META, "active", False) or type(param) is not nn.Parameter:
        return None
    if param.device.type == "meta":
        return None
    return nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)


@contextlib.contextmanager
def params_on_meta() -> Iterator[None]:
    """While open, every nn.Parameter this thread registers is moved to the meta device (buffers stay
    where they are made). Other threads building modules meanwhile are untouched. The hook is
    installed once for all users and removed when the last one leaves."""
    from torch.nn.modules.module import register_module_parameter_registration_hook

    with _HOOK_LOCK:
        if not _HOOK:
            _HOOK[:] = [register_module_parameter_registration_hook(_to_meta), 0]
        _HOOK[1] += 1
    before = getattr(_META, "active", False)
    _META.active = True
    try:
        yield
    finally:
        _META.active = before
        with _HOOK_LOCK:
            _HOOK[1] -= 1
            if _HOOK[1] == 0:
                _HOOK[0].remove()
                _HOOK.clear()


def _direct_class(config):
    """The causal-LM class for `config`, when this path can build it; None otherwise."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    if any(getattr(config, k, None) for k in ("auto_map", "quantization_config", "fusion_config")):
        return None  # remote code, quantized weights, fused modules: from_pretrained's own business
    cls = MODEL_FOR_CAUSAL_LM_MAPPING.get(type(config), None)
    if cls is None or getattr(cls, "_keep_in_fp32_modules", None) or getattr(cls, "_keep_in_fp32_modules_strict", None):
        return None
    return cls


def model_from_weights(config, state: dict[str, torch.Tensor], dtype: torch.dtype, device: torch.device):
    """The model of `config` holding `state` as its parameters, on `device` in `dtype` (see the
    module doc); None when `state` is not exactly the model's parameters by name and shape (the
    caller falls back to from_pretrained). `state` is consumed."""
    cls = _direct_class(config)
    if cls is None:
        return None
    with BUILDING, params_on_meta():
        model = cls._from_config(config, dtype=dtype)
    expected = model.state_dict(keep_vars=True)
    tied = _tied_names(model)
    if not set(state) <= set(expected) or set(expected) - set(state) - tied:
        return None
    if any(tuple(state[k].shape) != tuple(expected[k].shape) for k in state):
        return None
    for k, t in state.items():  # CPU views of the file are always copied; device tensors only to cast
        state[k] = t.to(expected[k].dtype, copy=t.device.type == "cpu")
    model.load_state_dict(state, strict=False, assign=True)
    state.clear()
    model.tie_weights()
    model.to(device)
    if any(t.device.type == "meta" for t in (*model.parameters(), *model.buffers())):
        return None
    return model.eval()


def _tied_names(model: nn.Module) -> set[str]:
    """State-dict names that share their tensor with an earlier name (a tied LM head)."""
    seen: dict[int, str] = {}
    tied = set()
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            tied.add(name)
        else:
            seen[id(p)] = name
    return tied
