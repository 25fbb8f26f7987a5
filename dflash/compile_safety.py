"""The engine's compile-safety seams, each behind one function: prewarm, freeze, watch, sample.

The engine calls only these four; each uses compilewatch's public API when the installed
compilewatch has it, and a minimal stand-in otherwise (so the engine and its tests run while the
pieces land one by one):

| seam | compilewatch API | stand-in |
|---|---|---|
| `prewarm_replicas` | `compilewatch.warm.prewarm(devices, fn)` (warm pass, then a verify pass under `fail_on_recompile`) | the same two passes as a plain loop |
| `frozen` | `compilewatch.guard.freeze()` | `torch.compiler.set_stance("fail_on_recompile")` (a process-wide stance: any dynamo compile in any thread raises) |
| `watching` | `compilewatch.watch(...)` | none (the report says the watcher was not available) |
| `device_sampler` | `compilewatch.gpus` | `torch.cuda.mem_get_info` / `torch.cuda.utilization`, psutil on CPU |

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
@contextlib.contextmanager
def frozen(enabled: bool = True) -> Iterator[str]:
    """While inside: compiling is forbidden in every thread (a compile raises a clear error instead
    of racing with other threads' compiled calls). Yields what enforces it."""
    if not enabled:
        yield "off"
        return
    guard = _optional("compilewatch.guard")
    if guard is not None and hasattr(guard, "freeze"):
        token = guard.freeze()
        try:
            yield "compilewatch.guard"
        finally:
            for name in ("unfreeze", "thaw"):
                if hasattr(guard, name):
                    getattr(guard, name)(token) if token is not None else getattr(guard, name)()
                    break
        return
    import torch

    with torch.compiler.set_stance("fail_on_recompile"):
        yield "set_stance(fail_on_recompile)"


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
    memory_used_bytes: int | None  # device memory in use (all processes on a GPU; this process's RSS on CPU)
    memory_total_bytes: int | None
    utilization_pct: float | None  # GPU busy %, or this process's CPU %


def _torch_sample(devices: Sequence[str]) -> list[DeviceSample]:
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
                util: float | None = float(torch.cuda.utilization(d))
            except Exception:  # noqa: BLE001 - needs NVML
                util = None
            out.append(DeviceSample(d, used, total, util))
        else:
            try:
                import psutil

                p = psutil.Process()
                out.append(DeviceSample(d, p.memory_info().rss, psutil.virtual_memory().total, p.cpu_percent(None)))
            except Exception:  # noqa: BLE001
                out.append(DeviceSample(d, None, None, None))
    return out


def device_sampler() -> Callable[[Sequence[str]], list[Any]]:
    """A callable: devices -> one sample per device (memory in use, utilization)."""
    gpus = _optional("compilewatch.gpus")
    if gpus is not None and hasattr(gpus, "sample"):
        return lambda devices: list(gpus.sample(_unique(devices)))
    return _torch_sample
