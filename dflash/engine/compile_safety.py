"""The engine's compile-safety seams, each one function over compilewatch's public API.

| seam | compilewatch API |
|---|---|
| `prewarm_replicas` | `compilewatch.prewarm(devices, fn)`: a warm pass, then a verify pass under `fail_on_recompile` |
| `CompileBarrier` | `compilewatch.CompileGuard`: installed before prewarm (thread-local FX flag where torch allows), `freeze()` after it |
| `watching` | `compilewatch.watch(...)` during the worker phase; its summary goes into the engine's report |
| `device_sampler` | per engine device from torch (`mem_get_info`, `memory_allocated`, `utilization`), plus `compilewatch.sample_gpus()` |

Why prewarm runs per replica and not once per device: a compiled callable's cache is per function
and guards on what it sees; warming every replica (in this thread, one after another) covers both
per-device and per-instance compile state, and the verify pass proves nothing compiles again.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping, Sequence


# --------------------------------------------------------------------------- prewarm
@dataclass(frozen=True, slots=True)
class PrewarmResult:
    ok: bool
    devices: tuple[str, ...]  # unique devices (target devices with a warm, then drafter devices), in the order warmed
    replicas: int
    wall_s: float
    via: str  # what warmed: "compilewatch.devices.warm"
    error: str | None  # first failure, "Type: message"
    verdicts: tuple[str, ...]
    report: Any = None  # compilewatch.WarmReport


def _unique(devices: Sequence[str]) -> list[str]:
    out: list[str] = []
    for d in devices:
        if d not in out:
            out.append(d)
    return out


def prewarm_replicas(replicas: Sequence[Any], warm: Callable[[Any], None], *,
                     targets: Mapping[str, Callable[[], None]] | None = None,
                     progress: Callable[[Any], None] | None = None) -> PrewarmResult:
    """Run `warm(replica)` for every replica in this thread, grouped by device, one device after
    another; then once more with compiling forbidden (nothing may compile the second time).
    `warm` must run forward and backward at every shape training will use, and not step the
    optimizer. `targets` (per target device) warms what produces the batches there, e.g. a compiled
    target forward at every shape; it runs first on its device. Gradients are cleared afterwards.
    Never raises for `warm`'s own errors."""
    targets = dict(targets or {})
    devices = _unique([*targets, *(r.device for r in replicas)])

    def run_device(device: str) -> None:
        if device in targets:
            targets[device]()
        for r in replicas:
            if r.device == device:
                warm(r)
                r.model.zero_grad(set_to_none=True)

    t0 = time.perf_counter()
    with _room_for_every_replica(len(replicas) + len(targets)):
        return _prewarm(replicas, devices, run_device, t0, progress)


@contextlib.contextmanager
def _room_for_every_replica(n: int) -> Iterator[None]:
    """Dynamo keeps at most `recompile_limit` (default 8) variants per code object, then silently
    runs it eagerly. Guards include the device, and every compiled wrapper (per replica, per compiled
    layer: they share `nn.Module._call_impl`) adds its own: shapes x devices x wrappers passes 8
    quickly (4 buckets x 3 replicas = 12). Raise the limits while prewarm compiles, in this thread;
    later cache lookups in worker threads do not check them."""
    import torch._dynamo.config as dc

    names = [("recompile_limit", "cache_size_limit", 64), ("accumulated_recompile_limit", "accumulated_cache_size_limit", 256)]
    patch = {}
    for new_name, old_name, per_replica in names:
        name = new_name if hasattr(dc, new_name) else old_name
        if hasattr(dc, name):
            patch[name] = max(getattr(dc, name), per_replica * n)
    with dc.patch(**patch):
        yield


def _prewarm(replicas: Sequence[Any], devices: list[str], run_device: Callable[[str], None], t0: float,
             progress: Callable[[Any], None] | None) -> PrewarmResult:
    from compilewatch import prewarm

    rep = prewarm(devices, run_device, verify=True, strict=True, progress=progress, name="dflash drafter step")
    for r in replicas:
        r.model.zero_grad(set_to_none=True)
    err = next((x.error or (x.recompile.message if x.recompile else None)
                for x in (*rep.warm, *rep.verify) if not x.ok), None)
    return PrewarmResult(rep.ok, tuple(devices), len(replicas), time.perf_counter() - t0, "compilewatch.devices.warm", err,
                         tuple(rep.verdicts), rep)


# --------------------------------------------------------------------------- freeze
class CompileBarrier:
    """Installed before prewarm, frozen after it, closed when the workers are done: a
    `compilewatch.CompileGuard` (which also makes the FX flag per thread where the installed torch
    allows it). After `freeze()` any compile, in any thread, raises GuardError naming the function
    and the guard failure, instead of racing with other threads' compiled calls."""

    def __init__(self, enabled: bool) -> None:
        self.kind = "off"
        self._guard: Any = None
        if enabled:
            from compilewatch import CompileGuard

            self._guard = CompileGuard().install()
            self.kind = "compilewatch.tracing.guard" + (" + thread-local FX flag" if self._guard.thread_local else "")

    def freeze(self) -> None:
        if self._guard is not None:
            self._guard.freeze()

    def close(self) -> None:
        if self._guard is not None:
            self._guard.close()
            self._guard = None

    def __enter__(self) -> "CompileBarrier":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_BLOCKED = ("GuardError", "stance is 'fail_on_recompile'")


def is_blocked_compile(error: str) -> bool:
    """Did this error come from the barrier refusing a compile after freeze?"""
    return any(m in error for m in _BLOCKED)


# --------------------------------------------------------------------------- watch
@contextlib.contextmanager
def watching(enabled: bool, *, stall_after: float, report: str | None = None) -> Iterator[Any]:
    """The compilewatch watcher around the worker phase (None when off)."""
    if not enabled:
        yield None
        return
    import compilewatch

    with compilewatch.watch(report, stall_after=stall_after) as w:
        yield w


def watch_summary(w: Any) -> Any:
    return None if w is None else w.summary()


# --------------------------------------------------------------------------- sample
@dataclass(frozen=True, slots=True)
class DeviceSample:
    device: str
    memory_used_bytes: int | None  # GPU: in use on the device by every process; CPU: this process's RSS
    memory_total_bytes: int | None
    allocated_bytes: int | None  # this process's tensors on the device (torch's allocator; None on CPU)
    utilization_pct: float | None  # GPU busy % over the last sample period (NVML); CPU: this process's CPU %


@dataclass(frozen=True, slots=True)
class Samples:
    devices: tuple[DeviceSample, ...]  # the engine's devices, as torch numbers them
    gpus: tuple[Any, ...] = ()  # every GPU on the node (compilewatch.sample_gpus(), NVML order), when available


def _device_samples(devices: Sequence[str]) -> tuple[DeviceSample, ...]:
    import torch

    out = []
    for d in _unique(devices):
        if d.startswith("cuda"):
            try:
                free, total = torch.cuda.mem_get_info(d)
                used: int | None = total - free
            except Exception:  # noqa: BLE001 - a broken device still gets a row
                used = total = None
            try:
                alloc: int | None = int(torch.cuda.memory_allocated(d))
            except Exception:  # noqa: BLE001
                alloc = None
            try:
                util: float | None = float(torch.cuda.utilization(d))  # NVML, mapped through CUDA_VISIBLE_DEVICES
            except Exception:  # noqa: BLE001 - needs NVML
                util = None
            out.append(DeviceSample(d, used, total, alloc, util))
        else:
            try:
                import psutil

                p = psutil.Process()
                out.append(DeviceSample(d, p.memory_info().rss, psutil.virtual_memory().total, None,
                                        p.cpu_percent(None)))
            except Exception:  # noqa: BLE001
                out.append(DeviceSample(d, None, None, None, None))
    return tuple(out)


def device_sampler() -> Callable[[Sequence[str]], Samples]:
    """A callable: the engine's devices -> Samples (per engine device, plus every GPU on the node)."""
    from compilewatch import sample_gpus

    def sample(devices: Sequence[str]) -> Samples:
        node: tuple[Any, ...] = ()
        if any(d.startswith("cuda") for d in devices):
            try:
                node = tuple(sample_gpus())
            except Exception:  # noqa: BLE001 - best effort
                node = ()
        return Samples(_device_samples(devices), node)
    return sample
