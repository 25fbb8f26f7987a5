"""Sequential prewarm: compile a workload on every device, one device after another, in the calling
thread, then prove a second pass compiles nothing.

Why: tracing state is shared between threads (torch/fx/_symbolic_trace.py, docs/race.md): the FX tracing flag up
to torch 2.13, the class-level nn.Module patch on every torch so far. A thread that compiles while
another thread calls a compiled function or a module breaks the caller (error, stuck state, or
hang on GPU). Compiling
everything first, in one thread, and only then starting worker threads avoids the race.

This is the one warm implementation: `compilewatch warm`, dflash's engine prewarm and programs that
install a `CompileGuard` (prewarm, then `guard.freeze()`) all call `prewarm`.

The workload API (`compilewatch.Workload`): `build()` runs once per process and creates the
compiled callables; `run(device)` does one step on a device (forward and backward where supported).
A mapping `{"step": step_fn, "eval": eval_fn}` warms several entry points per device
(`targets.EntryPoints`); a failure names the entry point.
`prewarm` calls `build()` once, then `run(d)` for each device (warm pass), then `run(d)` again for
each device (verify pass) under `torch.compiler.set_stance("fail_on_recompile")`, which turns any
dynamo compile into an error naming the function and its guard failure. The program must then use
the same compiled callables (the workload object, or the module-level compiled functions a plain
callable uses): a new `torch.compile(...)` wrapper is new state that warm never saw.

Never prints: progress goes to an optional callback, results to a frozen `WarmReport`.
"""

from __future__ import annotations

import contextlib
import re
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Literal

from compilewatch import torchinfo
from compilewatch.devices.spec import parse_devices
from compilewatch.tracing import counters as _counters
from compilewatch.tracing.compile_events import CompileRecorder, error_text
from compilewatch.tracing.targets import EntryPointError, Workload, as_workload
from compilewatch.tracing.tracehooks import TraceRecorder

Phase = Literal["warm", "verify"]


@dataclass(frozen=True, slots=True)
class Recompile:
    """Something that compiled in the verify pass: which function, where, and why."""

    device: str
    function: str  # dynamo's code name ("flex_attention"), or "?" when only counters saw it
    location: str | None  # "file:line" when known
    reasons: tuple[str, ...]  # guard failures ("0/0: tensor 'key' dtype mismatch ...")
    message: str  # first lines of torch's message, or a counter summary


@dataclass(frozen=True, slots=True)
class DeviceRun:
    """One device in one pass."""

    device: str
    phase: Phase
    ok: bool
    wall_s: float
    error: str | None  # the workload's own exception (not a recompile), "Type: message"
    frames_compiled: int  # dynamo frame compiles (counters["frames"]["ok"])
    compile_windows: int  # dynamo compile windows incl. lazy backward compiles
    trace_windows: int  # FX Tracer.trace entries (make_fx, AOTAutograd, inductor: the race's window; docs/race.md)
    counters: _counters.CompileCounters  # FX-graph / AOTAutograd cache hits and misses, reasons
    peak_memory_bytes: int | None  # CUDA: max_memory_allocated; CPU: RSS growth (None without psutil)
    memory_metric: Literal["cuda_max_allocated", "rss_delta", "none"]
    recompile: Recompile | None = None  # verify pass only


@dataclass(frozen=True, slots=True)
class WarmReport:
    workload: str
    devices: tuple[str, ...]
    torch_version: str
    cache_dir: str
    warm: tuple[DeviceRun, ...]
    verify: tuple[DeviceRun, ...]  # empty when verify=False or the warm pass failed
    strict: bool  # verify ran under set_stance("fail_on_recompile")
    wall_s: float
    ok: bool  # every device warmed and (if asked) verified without compiling
    verdicts: tuple[str, ...]

    @property
    def recompiles(self) -> tuple[Recompile, ...]:
        return tuple(r.recompile for r in self.verify if r.recompile is not None)


@dataclass(frozen=True, slots=True)
class WarmEvent:
    """Progress: sent before ("start") and after ("done", with `result`) each device in each pass."""

    phase: Phase
    state: Literal["start", "done"]
    device: str
    index: int  # 0-based position in the device list
    total: int
    result: DeviceRun | None = None


ProgressFn = Callable[[WarmEvent], None]

_RECOMPILE_MSG = "Detected recompile when torch.compile stance is 'fail_on_recompile'"
_FN_RE = re.compile(r"filename: '(?P<file>[^']*)', function name: '(?P<fn>[^']*)', line number: (?P<line>\d+)")


def parse_recompile_error(device: str, message: str) -> Recompile | None:
    """Turn torch's fail_on_recompile RuntimeError text into a Recompile (None if it is not one)."""
    if _RECOMPILE_MSG not in message:
        return None
    m = _FN_RE.search(message)
    reasons = tuple(line.strip()[2:] for line in message.splitlines() if line.strip().startswith("- "))
    first = "\n".join(message.splitlines()[:4])
    if m is None:
        return Recompile(device, "?", None, reasons, first)
    return Recompile(device, m["fn"], f"{m['file']}:{m['line']}", reasons, first)


def _from_counters(device: str, c: _counters.CompileCounters, windows: int) -> Recompile | None:
    if not (c.frames_total or windows or c.recompile_reasons):
        return None
    fns = sorted({r.split(":", 1)[0] for r in c.recompile_reasons}) or ["?"]
    msg = (f"{c.frames_total} dynamo frame compile(s) and {windows} compile window(s) in the verify pass"
           + (f"; guard failures: {len(c.recompile_reasons)}" if c.recompile_reasons else ""))
    reasons = tuple(r.split(": ", 1)[-1] for r in c.recompile_reasons)
    return Recompile(device, ", ".join(fns), None, reasons, msg)


def _explain(workload: Workload, device: str, bare: Recompile) -> Recompile:
    """Run once more without the stance so torch's guard-failure list names the function and reason.
    Single-threaded, so letting it compile here is harmless (it only warms more)."""
    before = _counters.snapshot()
    with CompileRecorder() as rec:
        try:
            workload.run(device)
        except Exception:  # noqa: BLE001 - best effort: keep the bare finding
            return bare
    found = _from_counters(device, _counters.delta(before), len(rec.windows))
    if found is None:
        return bare
    return Recompile(device, found.function, None, found.reasons, bare.message)


def _memory_start(device: str) -> tuple[str, int | None]:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        return "cuda_max_allocated", None
    try:
        import psutil

        return "rss_delta", psutil.Process().memory_info().rss
    except Exception:  # noqa: BLE001 - memory is a nice-to-have
        return "none", None


def _memory_end(device: str, metric: str, rss_before: int | None) -> int | None:
    import torch

    if metric == "cuda_max_allocated":
        torch.cuda.synchronize(device)
        return int(torch.cuda.max_memory_allocated(device))
    if metric == "rss_delta" and rss_before is not None:
        import psutil

        return max(0, psutil.Process().memory_info().rss - rss_before)
    return None


@contextlib.contextmanager
def _stance(strict: bool) -> Iterator[None]:
    if not strict:
        yield
        return
    import torch

    with torch.compiler.set_stance("fail_on_recompile"):
        yield


def _run_one(workload: Workload, device: str, phase: Phase, strict: bool, steps: int) -> DeviceRun:
    metric, rss_before = _memory_start(device)
    before = _counters.snapshot()
    error: str | None = None
    recompile: Recompile | None = None
    with CompileRecorder() as rec, TraceRecorder() as traces:
        t0 = time.perf_counter()
        try:
            with _stance(strict and phase == "verify"):
                for _ in range(steps):
                    workload.run(device)
            if device.startswith("cuda"):
                import torch

                torch.cuda.synchronize(device)
        except (Exception, SystemExit) as e:  # noqa: BLE001 - a failing workload (argparse's exit too) is in the report
            recompile = parse_recompile_error(device, str(e)) if phase == "verify" else None
            if recompile is None:
                error = error_text(e, bare=isinstance(e, EntryPointError))  # it names the entry point and the error
        wall = time.perf_counter() - t0
    delta = _counters.delta(before)
    try:
        peak = _memory_end(device, metric, rss_before)
    except Exception:  # noqa: BLE001 - e.g. the device is broken after an error
        peak = None
    if recompile is not None and recompile.function == "?":
        recompile = _explain(workload, device, recompile)  # older torch: a bare fail_on_recompile message
    elif phase == "verify" and recompile is None and error is None:
        recompile = _from_counters(device, delta, len(rec.windows))
    ok = error is None and recompile is None
    return DeviceRun(device=device, phase=phase, ok=ok, wall_s=wall, error=error, frames_compiled=delta.frames_ok,
                     compile_windows=len(rec.windows),
                     trace_windows=len(traces.windows), counters=delta, peak_memory_bytes=peak,
                     memory_metric=metric, recompile=recompile)  # type: ignore[arg-type]


def _pass(workload: Workload, devices: list[str], phase: Phase, strict: bool, steps: int,
          progress: ProgressFn | None) -> list[DeviceRun]:
    out = []
    for i, d in enumerate(devices):
        if progress:
            progress(WarmEvent(phase, "start", d, i, len(devices)))
        r = _run_one(workload, d, phase, strict, steps)
        out.append(r)
        if progress:
            progress(WarmEvent(phase, "done", d, i, len(devices), r))
    return out


def prewarm(devices: str | list[str], fn: Workload | Callable[..., Any], *, verify: bool = True, strict: bool = True,
            steps: int = 1, progress: ProgressFn | None = None, name: str | None = None,
            verify_only: bool = False) -> WarmReport:
    """Compile `fn` on each device, one after another in this thread; then (verify=True) run it
    once more on every device and require that nothing compiles.

    devices: "5,6,7", ["cuda:0", "cpu"], ... (validated by parse_devices; BadInput if not visible).
    fn: a Workload (`build()` once, `run(device)`), a mapping of entry points name -> fn(device), or
        a plain callable taking the device, which must keep its compiled callables itself (see the
        module docstring).
    strict: verify under `torch.compiler.set_stance("fail_on_recompile")`: a compile becomes an
        error naming the function and guard failure, and nothing is compiled. strict=False lets it
        compile and reports it from torch's counters and guard-failure lists instead.
    steps: workload runs per device in the warm pass (1 is enough unless the workload changes
        shapes on its second call).
    progress: called with a WarmEvent before and after each device; must not raise.
    verify_only: no warm pass, only the verify pass: proves that `fn` runs on code an earlier
        prewarm compiled (e.g. an identical model on a device already warmed: its first run compiles
        nothing). `report.warm` is empty; a recompile is reported as in any verify pass.
    Never raises for the workload's own errors: they are in the report (report.ok is False).
    """
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        from compilewatch.errors import BadInput

        raise BadInput(f"--steps must be >= 1 (workload runs per device in the warm pass), got {steps!r}",
                       hint="leave --steps out for 1")
    devs = parse_devices(devices)
    workload = as_workload(fn, name)
    _repair_cache_swap()
    from compilewatch.remote_usage import verify_remote_reads

    verify_remote_reads()  # torch's remote-cache reads verified before it unpickles them
    t0 = time.perf_counter()
    from compilewatch.errors import CompilewatchError

    try:
        workload.build()
        built = None
    except CompilewatchError:
        raise  # bad input the workload names (a target that cannot be read): exit 2, as before
    except (Exception, SystemExit) as e:  # noqa: BLE001 - the workload's own error: in the report, not raised
        built = _build_failed(devs[0], e, time.perf_counter() - t0)
    if built is not None:
        warm, verify_runs = [built], []
    else:
        warm = [] if verify_only else _pass(workload, devs, "warm", strict, steps, progress)
        verify_runs = (_pass(workload, devs, "verify", strict, 1, progress)
                       if (verify or verify_only) and all(r.ok for r in warm) else [])
    report_wall = time.perf_counter() - t0
    return WarmReport(
        workload=workload.name, devices=tuple(devs), torch_version=_torch_version(),
        cache_dir=str(torchinfo.inductor_cache_dir()), warm=tuple(warm), verify=tuple(verify_runs), strict=strict,
        wall_s=report_wall, ok=all(r.ok for r in warm) and all(r.ok for r in verify_runs),
        verdicts=tuple(_verdicts(warm, verify_runs, verify or verify_only, verify_only)),
    )


def _build_failed(device: str, e: BaseException, wall: float) -> DeviceRun:
    """The warm run that never started: the workload's `build()` raised (reported on the first device)."""
    return DeviceRun(device=device, phase="warm", ok=False, wall_s=wall, error=f"build() failed: {error_text(e)}",
                     frames_compiled=0, compile_windows=0, trace_windows=0, counters=_counters.delta(_counters.snapshot()),
                     peak_memory_bytes=None, memory_metric="none")


def _repair_cache_swap() -> None:
    """A `cache load` killed between its renames leaves no cache dir: complete or roll it back before
    compiling into it (compilewatch.cache.local.swap; one stat when there is nothing to repair)."""
    from compilewatch.cache.local import swap

    try:
        swap.recover(torchinfo.inductor_cache_dir())
    except OSError:  # cannot repair from here: the next cache command says so
        pass


def _torch_version() -> str:
    import torch

    return torch.__version__


def _verdicts(warm: list[DeviceRun], verify: list[DeviceRun], asked: bool, verify_only: bool = False) -> list[str]:
    out: list[str] = []
    if verify_only:
        out.append(f"no warm pass (verify only): {len(verify)} device(s) run on code compiled before.")
    failed = [r for r in warm if not r.ok]
    for r in failed:
        out.append(f"warm failed on {r.device}: {(r.error or '').splitlines()[0]}")
    if failed:
        out.append("nothing was verified: fix the workload first (it must run on every device).")
        return out
    if not verify_only:
        frames = sum(r.frames_compiled for r in warm)
        hits = sum(r.counters.fxgraph_cache_hit + r.counters.autograd_cache_hit for r in warm)
        misses = sum(r.counters.fxgraph_cache_miss + r.counters.autograd_cache_miss for r in warm)
        out.append(f"warmed {len(warm)} device(s) one after another: {frames} dynamo frame compile(s), "
                   f"inductor/AOTAutograd cache {hits} hit / {misses} miss.")
    if not asked:
        out.append("verify pass skipped: a later compile in a worker thread would not have been caught here.")
        return out
    bad = [r for r in verify if not r.ok]
    if not bad:
        out.append(f"verify pass compiled nothing on {len(verify)} device(s): worker threads can start now.")
        return out
    for r in bad:
        if r.recompile:
            rc = r.recompile
            why = "; ".join(rc.reasons) or rc.message.splitlines()[0]
            out.append(f"{rc.function} recompiled on {r.device}" + (f" ({rc.location})" if rc.location else "")
                       + f": {why}")
        elif r.error:
            out.append(f"verify failed on {r.device}: {r.error.splitlines()[0]}")
    out.append("a compile after warm would run while worker threads call compiled code (the FX-flag race): "
               "make the workload use the same shapes/dtypes as the program, or mark the dimension dynamic.")
    return out
