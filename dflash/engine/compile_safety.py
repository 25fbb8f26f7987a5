"""The engine's compile-safety seams, each one function over compilewatch's public API.

| seam | compilewatch API |
|---|---|
| `prewarm_replicas` | `compilewatch.prewarm(devices, fn)`: a warm pass, then a verify pass under `fail_on_recompile` |
| `CompileBarrier` | `compilewatch.CompileGuard`: installed before prewarm (thread-local FX flag where torch allows), `freeze()` after it |
| `watching` | `compilewatch.watch(...)` during the worker phase; its summary goes into the engine's report |
| `device_sampler` | per engine device from torch (`mem_get_info`, `memory_allocated`, `utilization`), plus `compilewatch.sample_gpus()` |

Prewarm compiles once per device and proves reuse for every other replica: a compiled callable's
cache is per code object and its guards decide whether a copy can use it. The first replica on a
device is warmed and verified; each other replica there runs once with compiling forbidden, which is
both its warm-up and the proof that it compiles nothing (issue 28: 3 identical replicas on one H200
had each run a full warm and verify pass, ~26 s each). A replica that would compile is warmed on its
own and reported (`ReplicaWarm.mode == "recompiled"`).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Literal, Mapping, Sequence


# --------------------------------------------------------------------------- prewarm
ReplicaMode = Literal["compiled", "reused", "recompiled"]


@dataclass(frozen=True, slots=True)
class ReplicaWarm:
    """What one replica's prewarm did."""

    index: int
    device: str
    mode: ReplicaMode  # compiled: the first replica on its device (warm pass, then verify); reused: its only
    # pass ran under fail_on_recompile and compiled nothing (the code the first replica compiled);
    # recompiled: that pass found something to compile, so it was warmed and verified like a first one
    seconds: float  # this replica's passes, wall time (the first on a device: with that device's target warm)
    frames_compiled: int  # dynamo frames compiled for it (its warm pass; 0 when reused)
    reason: str | None = None  # recompiled: what the reuse pass found (function and guard failure)


@dataclass(frozen=True, slots=True)
class PrewarmResult:
    ok: bool
    devices: tuple[str, ...]  # unique devices (target devices with a warm, then drafter devices), in the order warmed
    replicas: int
    wall_s: float
    via: str  # what warmed: "compilewatch.devices.warm"
    error: str | None  # first failure, "Type: message"
    verdicts: tuple[str, ...]
    report: Any = None  # compilewatch.WarmReport of the first device's first replica (the one that compiles)
    replica_s: tuple[float, ...] = ()  # seconds per replica in replica order (ReplicaWarm.seconds)
    per_replica: tuple[ReplicaWarm, ...] = ()  # in replica order
    reports: tuple[Any, ...] = ()  # every compilewatch.WarmReport, in the order run

    @property
    def compiled(self) -> int:
        """Replicas that compiled (the first on each device, plus any that could not reuse)."""
        return sum(r.mode != "reused" for r in self.per_replica)


def _unique(devices: Sequence[str]) -> list[str]:
    out: list[str] = []
    for d in devices:
        if d not in out:
            out.append(d)
    return out


def prewarm_replicas(replicas: Sequence[Any], warm: Callable[[Any], None], *,
                     targets: Mapping[str, Callable[[], None]] | None = None,
                     progress: Callable[[Any], None] | None = None) -> PrewarmResult:
    """Prewarm in this thread, one device after another. On each device: its target warm (`targets`,
    e.g. a compiled target forward at every shape) and the first replica's `warm` in a warm pass, then
    both again with compiling forbidden (compilewatch.prewarm). Every other replica on that device runs
    `warm` once, also with compiling forbidden (`verify_only`): identical replicas share compiled code
    (one code object per compiled function, guards that pass for every copy), so that one pass is the
    proof that worker threads will compile nothing, at a step's cost instead of a second warm-and-verify.
    A replica whose pass does need a compile (other shapes, dtypes or code) is then warmed and verified
    on its own, and reported `recompiled` with the reason.
    `warm` must run forward and backward at every shape training will use, and not step the
    optimizer. Gradients are cleared afterwards. Never raises for `warm`'s own errors."""
    targets = dict(targets or {})
    devices = _unique([*targets, *(r.device for r in replicas)])
    t0 = time.perf_counter()
    reports: list[Any] = []
    per: dict[int, ReplicaWarm] = {}
    with _room_for_every_replica(len(replicas) + len(targets)):
        for device in devices:
            mine = [(i, r) for i, r in enumerate(replicas) if r.device == device]
            first = mine[0] if mine else None
            if device in targets or first is not None:
                rep = _prewarm_unit(device, targets.get(device), first[1] if first else None, warm, progress, False)
                reports.append(rep)
                if first is not None:
                    per[first[0]] = ReplicaWarm(first[0], device, "compiled", round(rep.wall_s, 3), _frames(rep))
                if not rep.ok:
                    return _result(replicas, devices, t0, reports, per, rep)
            for i, r in mine[1:]:
                rep = _prewarm_unit(device, None, r, warm, progress, True)
                reports.append(rep)
                if rep.ok:
                    per[i] = ReplicaWarm(i, device, "reused", round(rep.wall_s, 3), 0)
                    continue
                if any(x.error for x in rep.verify):
                    return _result(replicas, devices, t0, reports, per, rep)
                reason = _first_problem(rep)
                again = _prewarm_unit(device, None, r, warm, progress, False)
                reports.append(again)
                per[i] = ReplicaWarm(i, device, "recompiled", round(rep.wall_s + again.wall_s, 3), _frames(again), reason)
                if not again.ok:
                    return _result(replicas, devices, t0, reports, per, again)
    return _result(replicas, devices, t0, reports, per, None)


def _prewarm_unit(device: str, target: Callable[[], None] | None, replica: Any, warm: Callable[[Any], None],
                  progress: Callable[[Any], None] | None, verify_only: bool) -> Any:
    from compilewatch import prewarm

    def run(_device: str) -> None:
        if target is not None:
            target()
        if replica is not None:
            warm(replica)
            replica.model.zero_grad(set_to_none=True)

    name = "dflash drafter step" + (f" (replica on {device}, reusing)" if verify_only else "")
    return prewarm([device], run, verify=True, strict=True, progress=progress, name=name, verify_only=verify_only)


def _frames(rep: Any) -> int:
    return sum(r.frames_compiled for r in rep.warm)


def _first_problem(rep: Any) -> str | None:
    return next((x.error or (f"{x.recompile.function}: " + ("; ".join(x.recompile.reasons) or x.recompile.message)
                             if x.recompile else None)
                 for x in (*rep.warm, *rep.verify) if not x.ok), None)


def _result(replicas: Sequence[Any], devices: list[str], t0: float, reports: list[Any], per: dict[int, ReplicaWarm],
            failed: Any) -> PrewarmResult:
    for r in replicas:
        r.model.zero_grad(set_to_none=True)
    rows = tuple(per[i] for i in sorted(per))
    verdicts = list(failed.verdicts) if failed is not None else []
    if rows:
        verdicts.append("per replica: " + ", ".join(
            f"{w.index} on {w.device} {w.mode} ({w.frames_compiled} dynamo frame(s) compiled, {w.seconds:.2f} s)"
            for w in rows) + ".")
        verdicts += [f"replica {w.index} could not reuse the compiled code: {w.reason}" for w in rows if w.reason]
    runs = [r for rep in reports for r in (*rep.warm, *rep.verify)]
    hits = sum(r.counters.fxgraph_cache_hit + r.counters.autograd_cache_hit for r in runs)
    misses = sum(r.counters.fxgraph_cache_miss + r.counters.autograd_cache_miss for r in runs)
    if failed is None:
        verdicts.append(f"{sum(r.frames_compiled for r in runs)} dynamo frame compile(s) in all, inductor/AOTAutograd "
                        f"cache {hits} hit / {misses} miss.")
        verdicts.append(f"verify passes compiled nothing on {len(devices)} device(s): worker threads can start now.")
    return PrewarmResult(
        ok=failed is None, devices=tuple(devices), replicas=len(replicas), wall_s=time.perf_counter() - t0,
        via="compilewatch.devices.warm", error=_first_problem(failed) if failed is not None else None,
        verdicts=tuple(verdicts), report=reports[0] if reports else None,
        replica_s=tuple(w.seconds for w in rows), per_replica=rows, reports=tuple(reports))


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
