"""`probe`: run a target under instrumentation and report what compile machinery it touched.

Two modes:
- `probe(target)`: one run in the calling thread with Tracer.trace entries, dynamo compile windows,
  counter deltas (compiles, recompiles with guard reasons, graph breaks, FX-graph/AOTAutograd cache
  hits and misses) and wall time.
- `probe_threads(target, n)`: the cross-thread race on demand: N threads start the target together from a
  cold state, a watchdog marks threads that never finish as hung and dumps every stack, and the FX
  flag is checked afterwards. `run_threads` is the reusable part (any list of callables).
"""

from __future__ import annotations

import contextlib
import os
import re
import tempfile
import threading
import time
import traceback
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Literal

from compilewatch.tracing import counters as _counters
from compilewatch.tracing import fxpatch, stacks, torchcompat
from compilewatch import torchinfo
from compilewatch.tracing.compile_events import CompileRecorder, CompileWindow, error_text
from compilewatch.devices.spec import parse_devices
from compilewatch.tracing.stacks import Frame
from compilewatch.tracing.targets import Target, resolve
from compilewatch.tracing.tracehooks import TraceRecorder, TraceWindow


@dataclass(frozen=True, slots=True)
class TraceEntry:
    """One Tracer.trace call as the probe reports it."""

    thread: str
    tracer: str
    target: str
    compiling: bool | None  # torch.compiler.is_compiling() on entry
    flag_before: bool | None  # the FX flag on entry, as the tracing thread saw it (None: unknown layout)
    duration_s: float | None
    error: str | None
    nested: bool
    stack: tuple[Frame, ...]  # the user-relevant frames (user code, then torch's entry)

    @staticmethod
    def from_window(w: TraceWindow) -> "TraceEntry":
        return TraceEntry(
            thread=w.thread_name, tracer=w.tracer, target=w.target, compiling=w.compiling,
            flag_before=w.flag_before, duration_s=w.duration, error=w.error,
            nested=w.outer_window is not None, stack=tuple(stacks.relevant(list(w.stack))),
        )


@dataclass(frozen=True, slots=True)
class CompileEntry:
    thread: str
    compile_id: str
    trigger: str
    recompile: bool
    duration_s: float | None
    function: str | None = None  # "name (file:line)" of the compiled frame
    error: str | None = None  # "Type: message" when this compile raised

    @staticmethod
    def from_window(w: CompileWindow) -> "CompileEntry":
        return CompileEntry(w.thread_name, w.compile_id, w.trigger, w.is_recompile,
                            w.duration, w.function, w.error)


@dataclass(frozen=True, slots=True)
class ProbeReport:
    target: str
    device: str
    backend: str
    torch_version: str
    wall_s: float
    ok: bool
    error: str | None
    traces: tuple[TraceEntry, ...]
    traces_per_thread: dict[str, int]
    traces_per_tracer: dict[str, int]
    compiles: tuple[CompileEntry, ...]
    counters: _counters.CompileCounters
    fx_flag_after: bool | None  # this thread's FX flag after the run (None: this torch's layout is unknown)
    cache_dir: str
    verdicts: tuple[str, ...]
    stuck_after: bool = False  # tracing state (flag, nn.Module patch, CURRENT_PATCHER) left set after the run
    race: torchcompat.RaceFacts | None = None  # what this torch fixed upstream and what it did not


Outcome = Literal["ok", "error", "hang"]


@dataclass(frozen=True, slots=True)
class ThreadOutcome:
    index: int
    name: str
    device: str
    outcome: Outcome
    error: str | None = None  # "Type: message" of the exception (or of the first error the function returned)
    error_traceback: str | None = None
    wall_s: float | None = None
    returned_errors: tuple[str, ...] = ()  # errors the function returned instead of raising (kept its own)


@dataclass(frozen=True, slots=True)
class ThreadsReport:
    target: str
    devices: tuple[str, ...]
    backend: str
    torch_version: str
    threads: tuple[ThreadOutcome, ...]
    timeout_s: float
    wall_s: float
    fx_flag_stuck: bool  # tracing state left set after every thread finished (flag, Module patch, CURRENT_PATCHER)
    traces: tuple[TraceEntry, ...]  # every Tracer.trace entry, as in ProbeReport
    traces_per_thread: dict[str, int]
    counters: _counters.CompileCounters  # frames_ok of frames_total: how many dynamo frame compiles succeeded
    compiles: tuple[CompileEntry, ...]
    compile_failures: tuple[CompileEntry, ...]  # compiles that raised (even when the function swallowed it)
    stacks: dict[str, tuple[Frame, ...]]  # every thread's stack, dumped when something hung
    cache_dir: str
    verdicts: tuple[str, ...]
    race: torchcompat.RaceFacts | None = None  # what this torch fixed upstream and what it did not

    @property
    def failed(self) -> bool:
        return self.fx_flag_stuck or bool(self.compile_failures) or any(t.outcome != "ok" for t in self.threads)


@contextlib.contextmanager
def cache_dir_env(path: str | None) -> Iterator[str]:
    """Point TORCHINDUCTOR_CACHE_DIR at `path` for the duration (None: leave as is)."""
    if path is None:
        yield str(torchinfo.inductor_cache_dir())
        return
    old = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = path
    try:
        yield path
    finally:
        if old is None:
            os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
        else:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = old


@contextlib.contextmanager
def fresh_cache_dir(enabled: bool) -> Iterator[str]:
    if not enabled:
        with cache_dir_env(None) as d:
            yield d
        return
    with tempfile.TemporaryDirectory(prefix="compilewatch-probe-") as tmp:
        with cache_dir_env(tmp) as d:
            yield d


def _trace_effect(race: torchcompat.RaceFacts) -> str:
    """What one Tracer.trace entry does to other threads on this torch."""
    parts = []
    if race.fx_flag == "global":
        parts.append("holds the module-global FX flag")
    if race.module_patch_on_class:
        parts.append("patches nn.Module.__call__ for every thread")
    if not parts:
        return "keeps its tracing state to its own thread on this torch"
    return " and ".join(parts)


def _verdicts_single(target: str, traces: list[TraceEntry], c: _counters.CompileCounters, error: str | None,
                     fx_flag_after: bool | None, stuck: fxpatch.StuckState,
                     race: torchcompat.RaceFacts) -> list[str]:
    out: list[str] = []
    if not traces:
        out.append(f"{target} does not trace: 0 Tracer.trace entries, so it cannot set the FX tracing flag by itself.")
    else:
        tracers = Counter(t.tracer for t in traces)
        out.append(f"{target} entered Tracer.trace {len(traces)} times ({', '.join(f'{k} x{v}' for k, v in tracers.items())}): "
                   f"each entry {_trace_effect(race)}.")
    if c.frames_total:
        out.append(f"dynamo compiled {c.frames_total} frame(s); recompiles: {c.recompiles}; graph breaks: {c.graph_breaks}.")
    if c.fxgraph_cache_hit or c.fxgraph_cache_miss or c.autograd_cache_hit or c.autograd_cache_miss:
        out.append(f"inductor FX-graph cache {c.fxgraph_cache_hit} hit / {c.fxgraph_cache_miss} miss; "
                   f"AOTAutograd cache {c.autograd_cache_hit} hit / {c.autograd_cache_miss} miss.")
    if fx_flag_after:
        out.append("the FX tracing flag is still True after the target returned: every later compiled call will fail.")
    elif fx_flag_after is None:
        out.append(f"the FX tracing flag could not be read on this torch ({race.fx_flag_why}): whether the target left "
                   "it stuck is not known, so the probe does not report ok.")
    if stuck.module_call_patched or stuck.module_getattr_patched or stuck.patcher_left:
        out.append("nn.Module.__call__/__getattr__ or CURRENT_PATCHER were left patched after the target returned: "
                   "later module calls go through a dead tracer.")
    if error:
        out.append(f"the target raised {error.splitlines()[0]}")
    out.append(race_verdict(race))
    return out


def race_verdict(race: torchcompat.RaceFacts) -> str:
    """One line: what this torch fixed upstream about the thread race and what it did not."""
    return f"torch {race.torch_version}: {race.headline}"


def probe(target: str | Target, *, device: str = "cpu", backend: str = "inductor", reset: bool = True,
          fresh_cache: bool = False) -> ProbeReport:
    """Run `target` once in this thread under instrumentation; never raises for the target's errors."""
    tgt = resolve(target, backend) if isinstance(target, str) else target
    dev = parse_devices(device)[0]
    if reset:
        _counters.reset_dynamo()
    with fresh_cache_dir(fresh_cache) as cache_dir:
        before = _counters.snapshot()
        error = None
        with TraceRecorder() as rec, CompileRecorder() as comp:
            t0 = time.perf_counter()
            try:
                tgt.fn(dev)
            except Exception as e:  # noqa: BLE001 - the target's failure is part of the report
                error = error_text(e)
            wall = time.perf_counter() - t0
        delta = _counters.delta(before)
    traces = [TraceEntry.from_window(w) for w in rec.windows]
    flag = torchcompat.fx_flag()
    stuck = fxpatch.stuck_state()
    race = torchcompat.race_facts()
    compiles = [CompileEntry.from_window(w) for w in comp.windows]
    failed = [c for c in compiles if c.error]
    return ProbeReport(
        target=tgt.name, device=dev, backend=backend, torch_version=_torch_version(), wall_s=wall,
        ok=error is None and flag is False and not stuck.stuck and not failed, error=error, traces=tuple(traces),
        traces_per_thread=dict(Counter(t.thread for t in traces)),
        traces_per_tracer=dict(Counter(t.tracer for t in traces)),
        compiles=tuple(compiles), counters=delta,
        fx_flag_after=flag, cache_dir=cache_dir,
        verdicts=tuple(_failure_lines(failed, error, "the target")
                       + _verdicts_single(tgt.name, traces, delta, None, flag, stuck, race)),
        stuck_after=stuck.stuck, race=race,
    )


def _torch_version() -> str:
    import torch

    return torch.__version__


@dataclass
class _Slot:
    outcome: Outcome = "hang"
    error: str | None = None
    tb: str | None = None
    wall: float | None = None
    returned: tuple[str, ...] = ()


_ERROR_TEXT = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Failed|Interrupt)\b")


def returned_errors(value: Any, _depth: int = 0) -> list[str]:
    """Errors a function returned instead of raising: exception objects, or "SomeError: ..." strings,
    alone or inside lists, tuples, sets and dict values (3 levels deep, 100 at most)."""
    if isinstance(value, BaseException):
        return [error_text(value)]
    if isinstance(value, str):
        return [value[:2000]] if _ERROR_TEXT.match(value) else []
    if _depth >= 3:
        return []
    items = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple, set)) else ()
    out: list[str] = []
    for item in items:
        out += returned_errors(item, _depth + 1)
        if len(out) >= 100:
            break
    return out[:100]


def run_threads(fns: list[Callable[[], Any]], *, timeout: float, names: list[str] | None = None,
                devices: list[str] | None = None) -> tuple[list[ThreadOutcome], dict[str, tuple[Frame, ...]]]:
    """Start every callable in its own daemon thread at the same instant (a Barrier) and collect
    outcomes. A thread still running `timeout` seconds after the start is reported as `hang`, and
    then every thread's stack is returned (otherwise the stack dict is empty). Hung threads are left
    running as daemons: they cannot be killed from Python.
    """
    n = len(fns)
    names = names or [f"probe-{i}" for i in range(n)]
    devices = devices or ["-"] * n
    slots = [_Slot() for _ in range(n)]
    barrier = threading.Barrier(n)
    done = [threading.Event() for _ in range(n)]

    def body(i: int) -> None:
        try:
            barrier.wait()
            t0 = time.perf_counter()
            try:
                returned = returned_errors(fns[i]())
                if returned:
                    slots[i].outcome, slots[i].error = "error", f"returned {len(returned)} error(s): {returned[0]}"
                    slots[i].returned = tuple(returned)
                else:
                    slots[i].outcome = "ok"
            except BaseException as e:  # noqa: BLE001 - reported as the thread's outcome
                slots[i].outcome, slots[i].error, slots[i].tb = "error", error_text(e), traceback.format_exc()
            slots[i].wall = time.perf_counter() - t0
        finally:
            done[i].set()

    threads = [threading.Thread(target=body, args=(i,), name=names[i], daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout
    for ev in done:
        ev.wait(max(0.0, deadline - time.monotonic()))
    hung = [i for i in range(n) if not done[i].is_set()]
    dumped = {k: tuple(v) for k, v in stacks.all_thread_stacks().items()} if hung else {}
    outcomes = [ThreadOutcome(i, names[i], devices[i], "hang" if i in hung else slots[i].outcome,
                              slots[i].error, slots[i].tb, slots[i].wall, slots[i].returned) for i in range(n)]
    return outcomes, dumped


def probe_threads(target: str | Target, n: int, *, devices: str | list[str] = "cpu", backend: str = "inductor",
                  timeout: float = 300.0, fresh_cache: bool = True) -> ThreadsReport:
    """The cross-thread race on demand: reset dynamo, point inductor at a fresh cache dir (unless
    `fresh_cache=False`), start `n` threads on the target together, watch them with a watchdog."""
    from compilewatch.errors import BadInput

    if n < 1:
        raise BadInput(f"--threads must be at least 1, got {n}")
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout < float("inf"):
        # 0 or less once made every thread a "hang" finding before it could start
        raise BadInput(f"--timeout must be a number of seconds > 0, got {timeout!r}",
                       hint="leave --timeout out for 300 s")
    tgt = resolve(target, backend) if isinstance(target, str) else target
    devs = parse_devices(devices)
    per_thread = [devs[i % len(devs)] for i in range(n)]
    _counters.reset_dynamo()
    # The cache dir env var must outlive hung threads, so it is not restored until they are done.
    tmp = tempfile.mkdtemp(prefix="compilewatch-threads-") if fresh_cache else None
    with cache_dir_env(tmp) as cache_dir:
        before = _counters.snapshot()
        t0 = time.perf_counter()
        with TraceRecorder() as rec, CompileRecorder() as comp:
            fns = [(lambda d=d: tgt.fn(d)) for d in per_thread]
            outcomes, dumped = run_threads(fns, timeout=timeout, names=[f"worker-{i}" for i in range(n)],
                                           devices=per_thread)
        wall = time.perf_counter() - t0
        delta = _counters.delta(before)
    hung = any(o.outcome == "hang" for o in outcomes)
    stuck = not hung and fxpatch.stuck_state().stuck
    per_thread_traces = dict(Counter(w.thread_name for w in rec.windows))
    compiles = tuple(CompileEntry.from_window(w) for w in comp.windows)
    plain_traces = any(not any(f.file == "torch/_dynamo/convert_frame.py" for f in w.stack) for w in rec.windows)
    race = torchcompat.race_facts()
    verdicts = _verdicts_threads(tgt.name, outcomes, stuck, timeout, race, compiles, delta, plain_traces)
    if tmp is not None and not hung:
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)  # our own temp dir, never a user's cache
    return ThreadsReport(
        target=tgt.name, devices=tuple(per_thread), backend=backend, torch_version=_torch_version(),
        threads=tuple(outcomes), timeout_s=timeout, wall_s=wall, fx_flag_stuck=stuck,
        traces=tuple(TraceEntry.from_window(w) for w in rec.windows), traces_per_thread=per_thread_traces,
        counters=delta, compiles=compiles, compile_failures=tuple(c for c in compiles if c.error), stacks=dumped,
        cache_dir=cache_dir, verdicts=tuple(verdicts), race=race,
    )


def _known(message: str | None) -> str:
    """' — known torch failure NAME (not a thread race): cause' for a known pattern, else ''."""
    from compilewatch.tracing import patterns

    p = patterns.match(message)
    if p is None:
        return ""
    return f" — known torch failure '{p.name}'{'' if p.race else ' (not a thread race)'}: {p.cause}"


def _failure_lines(compile_failures: list[CompileEntry], error: str | None, who: str) -> list[str]:
    """What failed, first: the exception, then every compile that raised (thread, function, message)."""
    from compilewatch.tracing.watch_events import headline

    out = []
    if error:
        out.append(f"failure: {who} raised {headline(error)}{_known(error)}")
    for c in compile_failures:
        out.append(f"failure: compile {c.compile_id} of {c.function or 'a frame'} in thread {c.thread} raised "
                   f"{headline(c.error)}{_known(c.error)}")
    return out


def _fixes(messages: list[str], plain_traces: bool) -> list[str]:
    """The fix for each known pattern seen; the nested-FX error's fix depends on who traced."""
    from compilewatch.tracing import patterns

    out: list[str] = []
    for m in messages:
        p = patterns.match(m)
        if p is None:
            continue
        if p.name == "nested_fx_trace":
            out.append(patterns.THREAD_LOCAL_FIX if plain_traces else patterns.WARM_FREEZE_FIX)
        else:
            out.append(p.fix)
    return list(dict.fromkeys(out))


def _verdicts_threads(name: str, outcomes: list[ThreadOutcome], stuck: bool, timeout: float,
                      race: torchcompat.RaceFacts, compiles: tuple[CompileEntry, ...] = (),
                      c: _counters.CompileCounters | None = None, plain_traces: bool = False) -> list[str]:
    from compilewatch.tracing import patterns
    from compilewatch.tracing.watch_events import headline

    out = []
    errs = [o for o in outcomes if o.outcome == "error"]
    hangs = [o for o in outcomes if o.outcome == "hang"]
    failed_compiles = [x for x in compiles if x.error]
    for o in errs:  # exceptions first: raised, then returned
        if o.returned_errors:
            kinds = Counter(headline(e) for e in o.returned_errors)
            out.append(f"failure: {o.name} ({o.device}) returned {len(o.returned_errors)} error(s): "
                       + "; ".join(f"{k}" + (f" x{v}" if v > 1 else "") for k, v in kinds.items())
                       + _known(o.returned_errors[0]))
        else:
            out.append(f"failure: {o.name} ({o.device}) raised {headline(o.error)}{_known(o.error)}")
    out += _failure_lines(failed_compiles, None, name)
    messages = [e for o in errs for e in (o.returned_errors or (o.error,)) if e] + [x.error for x in failed_compiles if x.error]
    if any("symbolically trace a dynamo-optimized function" in m for m in messages):
        out.append("that is the cross-thread FX-flag race: another thread's trace held the module-global "
                   "FX tracing flag while the failing thread called a compiled function."
                   if race.fx_flag == "global" else
                   "this torch keeps the FX flag per thread, so that error came from the failing thread's own trace "
                   "(a compiled call inside symbolic_trace/make_fx), not from another thread.")
    if any("is not installed as a submodule" in m or "CURRENT_PATCHER" in m for m in messages):
        out.append("that is the class-level patch race: another thread's Tracer.trace had nn.Module.__call__/"
                   "__getattr__ (and CURRENT_PATCHER) patched for every thread while the failing thread ran modules.")
    for o in hangs:
        out.append(f"failure: {o.name} ({o.device}) did not finish within {timeout:g} s: hang (all stacks dumped)"
                   f" — {patterns.by_name('compile_hang').cause}")
    if stuck:
        out.append("failure: tracing state (the FX flag, nn.Module.__call__ or CURRENT_PATCHER) was left set after all "
                   "threads finished (overlapping traces restored it in the wrong order): later compiled or module "
                   "calls in this process will fail.")
    if c is not None and c.frames_total:
        out.append(f"dynamo frames compiled ok: {c.frames_ok} of {c.frames_total}"
                   + (f" ({c.frames_total - c.frames_ok} failed or fell back)" if c.frames_ok < c.frames_total else "") + ".")
    if not errs and not hangs and not stuck and not failed_compiles:
        out.insert(0, f"all {len(outcomes)} threads finished {name} without error.")
        out.append(race_verdict(race))
        return out
    fixes = _fixes(messages, plain_traces)
    if hangs:
        fixes.append(patterns.by_name("compile_hang").fix)
    if stuck:
        fixes.append(patterns.by_name("stuck_flag").fix)
    if not fixes:
        fixes.append("run the target once in one thread (`compilewatch probe TARGET`) to see whether threads matter; "
                     "if only the threaded run fails: " + patterns.WARM_FREEZE_FIX)
    out += [f"fix: {f}" for f in dict.fromkeys(fixes)]
    out.append(race_verdict(race))
    return out
