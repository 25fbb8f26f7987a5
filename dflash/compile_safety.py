"""The engine's compile-safety seams, each behind one function: prewarm, freeze, watch, sample.

The engine calls only these four; each uses compilewatch's public API when the installed
compilewatch has it, and a minimal stand-in otherwise (so the engine and its tests run while the
pieces land one by one):

| seam | compilewatch API | stand-in |
|---|---|---|
| `prewarm_replicas` | `compilewatch.warm.prewarm(devices, fn)` (warm pass, then a verify pass under `fail_on_recompile`) | the same two passes as a plain loop |
| `CompileBarrier` | `compilewatch.guard.CompileGuard`: installed before prewarm, `freeze()` after it | `torch.compiler.set_stance("fail_on_recompile")` at freeze (process-wide: any dynamo compile in any thread raises) |
| `watching` | `compilewatch.watch(...)` | none (the report says the watcher was not available) |
| `device_sampler` | per engine device from torch (`mem_get_info`, `memory_allocated`, `utilization`), plus `compilewatch.gpus.sample()` for every GPU on the node | the per-device part only |

Why prewarm runs per replica and not once per device: a compiled callable's cache is per function
and guards on what it sees; warming every replica (in this thread, one after another) covers both
per-device and per-instance compile state, and the verify pass proves nothing compiles again.
"""

from __future__ import annotations

import contextlib
import importlib
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence


def _optional(module: str) -> Any | None:
    try:
        return importlib.import_module(module)
    except ImportError:
        return None


# --------------------------------------------------------------------------- prewarm
@dataclass(frozen=True, slots=True)
class PrewarmResult:
    ok: bool
    devices: tuple[str, ...]  # unique drafter devices, in the order they were warmed
    replicas: int
    wall_s: float
    via: str  # "compilewatch.warm" or "loop"
    error: str | None  # first failure, "Type: message"
    verdicts: tuple[str, ...]
    report: Any = None  # compilewatch.warm.WarmReport when via == "compilewatch.warm"


def _unique(devices: Sequence[str]) -> list[str]:
    out: list[str] = []
    for d in devices:
        if d not in out:
            out.append(d)
    return out


def prewarm_replicas(replicas: Sequence[Any], warm: Callable[[Any], None], *,
                     progress: Callable[[Any], None] | None = None) -> PrewarmResult:
    """Run `warm(replica)` for every replica in this thread, grouped by device, one device after
    another; then once more with compiling forbidden (nothing may compile the second time).
    `warm` must run forward and backward at every shape training will use, and not step the
    optimizer. Gradients are cleared afterwards. Never raises for `warm`'s own errors."""
    devices = _unique([r.device for r in replicas])

    def run_device(device: str) -> None:
        for r in replicas:
            if r.device == device:
                warm(r)
                r.model.zero_grad(set_to_none=True)

    t0 = time.perf_counter()
    with _room_for_every_replica(len(replicas)):
        return _prewarm(replicas, devices, run_device, t0, progress)


@contextlib.contextmanager
def _room_for_every_replica(n: int) -> Iterator[None]:
    """Dynamo keeps at most `recompile_limit` (default 8) variants per function, then silently runs
    it eagerly. Guards include the device, so shapes x devices can exceed 8 (4 buckets x 3 drafter
    devices = 12): raise the limit while prewarm compiles (in this thread). Later lookups in worker
    threads do not check the limit."""
    import torch._dynamo.config as dc

    name = "recompile_limit" if hasattr(dc, "recompile_limit") else "cache_size_limit"
    current = getattr(dc, name)
    with dc.patch(**{name: max(current, 8 * n)}):
        yield


def _prewarm(replicas: Sequence[Any], devices: list[str], run_device: Callable[[str], None], t0: float,
             progress: Callable[[Any], None] | None) -> PrewarmResult:
    warm_mod = _optional("compilewatch.warm")
    if warm_mod is not None and hasattr(warm_mod, "prewarm"):
        rep = warm_mod.prewarm(devices, run_device, verify=True, strict=True, progress=progress,
                               name="dflash drafter step")
        for r in replicas:
            r.model.zero_grad(set_to_none=True)
        err = next((x.error or (x.recompile.message if x.recompile else None)
                    for x in (*rep.warm, *rep.verify) if not x.ok), None)
        return PrewarmResult(rep.ok, tuple(devices), len(replicas), time.perf_counter() - t0, "compilewatch.warm",
                             err, tuple(rep.verdicts), rep)
    return _loop_prewarm(replicas, devices, run_device, t0)


def _loop_prewarm(replicas: Sequence[Any], devices: list[str], run_device: Callable[[str], None],
                  t0: float) -> PrewarmResult:
    import torch

    phase = "warm"
    try:
        for d in devices:
            run_device(d)
        phase = "verify"
        with torch.compiler.set_stance("fail_on_recompile"):
            for d in devices:
                run_device(d)
    except Exception as e:  # noqa: BLE001 - reported, the engine does not start workers
        text = f"{type(e).__name__}: {e}".strip()
        for r in replicas:
            r.model.zero_grad(set_to_none=True)
        verdict = (f"something compiled again in the verify pass: {text.splitlines()[0]}" if phase == "verify"
                   else f"warm failed: {text.splitlines()[0]}")
        return PrewarmResult(False, tuple(devices), len(replicas), time.perf_counter() - t0, "loop", text[:2000],
                             (verdict,))
    return PrewarmResult(True, tuple(devices), len(replicas), time.perf_counter() - t0, "loop", None,
                         (f"warmed {len(replicas)} replica(s) on {len(devices)} device(s) one after another; "
                          "the verify pass compiled nothing.",))


# --------------------------------------------------------------------------- freeze
class CompileBarrier:
    """Installed before prewarm, frozen after it, closed when the workers are done.

    With compilewatch.guard: a `CompileGuard` (which also makes the FX flag per thread where the
    installed torch allows it); `freeze()` makes any later compile, in any thread, raise GuardError
    naming the function and the guard failure. Stand-in: `freeze()` sets the process-wide stance
    `fail_on_recompile` (a dynamo compile in any thread raises; no thread-local flag)."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.kind = "off"
        self._guard: Any = None
        self._stance: Any = None
        if not enabled:
            return
        guard_mod = _optional("compilewatch.guard")
        if guard_mod is not None and hasattr(guard_mod, "CompileGuard"):
            self._guard = guard_mod.CompileGuard().install()
            tl = " + thread-local FX flag" if getattr(self._guard, "thread_local", False) else ""
            self.kind = f"compilewatch.guard{tl}"
        else:
            self.kind = "set_stance(fail_on_recompile)"

    def freeze(self) -> None:
        if self._guard is not None:
            self._guard.freeze()
        elif self.enabled and self._stance is None:
            import torch

            self._stance = torch.compiler.set_stance("fail_on_recompile")
            self._stance.__enter__()

    def close(self) -> None:
        if self._guard is not None:
            self._guard.close()
            self._guard = None
        if self._stance is not None:
            self._stance.__exit__(None, None, None)
            self._stance = None

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
    """The compilewatch watcher around the worker phase (None when off or not available)."""
    cw = _optional("compilewatch")
    fn = getattr(cw, "watch", None) if cw is not None else None
    if fn is None:
        mod = _optional("compilewatch.watch")
        fn = getattr(mod, "watch", None) if mod is not None else None
    if not enabled or fn is None:
        yield None
        return
    with fn(report, stall_after=stall_after) as w:
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
    gpus: tuple[Any, ...] = ()  # every GPU on the node (compilewatch.gpus.sample(), NVML order), when available


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
    """A callable: the engine's devices -> Samples (per engine device, plus the node's GPUs)."""
    gpus = _optional("compilewatch.gpus")
    node = getattr(gpus, "sample", None) if gpus is not None else None

    def sample(devices: Sequence[str]) -> Samples:
        node_samples: tuple[Any, ...] = ()
        if node is not None and any(d.startswith("cuda") for d in devices):
            try:
                node_samples = tuple(node())
            except Exception:  # noqa: BLE001 - best effort
                node_samples = ()
        return Samples(_device_samples(devices), node_samples)
    return sample
