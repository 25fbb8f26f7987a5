"""The cross-thread watcher: sees the FX-flag race while a real program runs.

    with compilewatch.watch(report="watch.jsonl", stall_after=120) as w:
        warm_up()
        w.mark_warm()
        train()
    print(w.summary().verdicts)

What it listens to (each through the one module that owns that patch point):
- tracehooks: every `Tracer.trace` window (thread, tracer class, target, stack);
- fxpatch: every read of the FX flag that finds it set, and every module call a thread makes through
  another thread's class-level `nn.Module.__call__` patch. Where torch keeps the flag per thread
  (2.14+), a flag read can only see the reading thread's own trace, so no flag leak is reported there;
  the class-level patch and CURRENT_PATCHER are still shared and still watched. On a torch whose
  layout compilewatch.tracing.torchcompat does not recognise, fxpatch installs nothing: the `start` event
  lists it under `unwatched` and the summary is not ok;
- compile_events: dynamo compile windows (for stalls and compiles after `mark_warm()`);
- a watchdog thread that wakes every `min(0.5, stall_after / 4)` s: a compile or trace open longer
  than `stall_after` is reported with every thread's stack; stuck tracing state is checked too.
- compile failures (the exception in flight when dynamo's end callback runs), traces that raise
  outside dynamo, and threads that die with an uncaught exception (`threading.excepthook`, chained).

Each finding is a failure (an exception or harm was seen) or a risk (nothing failed), see
watch_events.severity(); the summary ranks failures first and names known torch failures
(compilewatch.tracing.patterns). A finding that repeats for the same (setter thread, victim thread) pair is
reported once with its stacks and then only counted (`repeat` events at close), so a failing loop
pays a dictionary lookup per repeat, not a stack capture.

Events go to `report` (JSONL, schema in watch_events) as they happen; `close()` writes an `end`
event with the summary. The watcher never changes what the program does, except `repair=True`,
which puts stuck tracing state back when it is found.

Two jobs, two modules. This one installs and removes the instruments (all or nothing), is the object
they call, runs the watchdog thread, and keeps the event log with its rate limit (`_emit`, `_first`,
`repeat` events); what each call means (which finding, with which stacks, when a stall or stuck state
is reported) is decided by the watcher's Detector, compilewatch.tracing.watch_detect.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from typing import Any, Callable, Iterator

from compilewatch.tracing import fxpatch, torchcompat, tracehooks
from compilewatch.tracing.compile_events import CompileRecorder, CompileWindow
from compilewatch.tracing.watch_detect import Detector, NamedThread, thread_start
from compilewatch.tracing.watch_events import EventLog, WatchEvent, WatchSummary, summarize


class Watcher:
    """Install with `install()` (or `with`), remove with `close()`; see the module docstring."""

    def __init__(self, report: str | os.PathLike[str] | None = None, *, stall_after: float = 300.0,
                 repair: bool = False, on_event: Callable[[WatchEvent], None] | None = None,
                 timeline: str | os.PathLike[str] | None = None, record_traces: bool = True) -> None:
        from compilewatch.errors import BadInput
        from compilewatch.fsutil import same_file

        if not stall_after > 0:  # nan too: it would turn stall detection off
            raise BadInput(f"stall_after must be > 0 seconds, got {stall_after}")
        if report is not None and timeline is not None and same_file(report, timeline):
            raise BadInput(f"report and timeline are the same file ({report}): the timeline would overwrite the report",
                           hint="give each its own file, e.g. report='watch.jsonl', timeline='watch.json'")
        self.stall_after = float(stall_after)
        self.repair_stuck = repair
        self.on_event = on_event
        self.timeline = timeline
        self.record_traces = record_traces
        self._log = EventLog(report)
        self._seq = 0
        self._lock = threading.RLock()
        self._compiles = CompileRecorder()
        self._stop = threading.Event()
        self._dog: threading.Thread | None = None
        self._installed = False
        self._closed = False
        self._seen: dict[tuple, WatchEvent | None] = {}  # rate limit: one event per (kind, victim, setter threads, ...)
        self.repeats: dict[tuple, int] = {}
        self.repeat_total = 0  # detections that repeated a first event (counted, not re-reported)
        self._fx_observed = False  # fxpatch installed (flag reads, module calls, stuck state watched)
        self._flag_per_thread = False
        self._errors_mark = 0  # tracehooks' listener-error count when installed
        self._detect = Detector(self)  # what the instruments' reports mean: findings, stalls, stuck state

    # --- lifecycle ---------------------------------------------------------------------------
    def install(self) -> "Watcher":
        if self._installed:
            return self
        import torch

        from compilewatch.errors import CompilewatchError

        self._errors_mark = tracehooks.listener_error_mark()
        unwatched = []
        try:  # all or nothing: a failed install leaves nothing patched
            fxpatch.add_observer(self)
            self._fx_observed = True
            self._flag_per_thread = torchcompat.fx_flag_layout().per_thread
        except CompilewatchError as e:
            unwatched.append({"what": "FX flag reads, module calls through another thread's nn.Module patch, stuck "
                                      "tracing state", "why": e.message})
        self._emit("start", {"argv": list(sys.argv), "torch": torch.__version__, "python": sys.version.split()[0],
                             "stall_after_s": self.stall_after, "repair": self.repair_stuck,
                             "thread_local_flag": fxpatch.thread_local_enabled(),
                             "fx_flag": torchcompat.fx_flag_layout().kind, "unwatched": unwatched})
        tracehooks.subscribe(self)
        self._compiles.listeners.append(self)
        self._prev_excepthook = threading.excepthook
        threading.excepthook = self._on_thread_exception
        from compilewatch.tracing.importhook import after_import

        after_import("torch._dynamo", self._install_compile_callbacks)
        from compilewatch.explain.record import on_watch_start  # issue 38: every cache lookup's key parts

        on_watch_start(self, after_import)
        self._dog = threading.Thread(target=self._watchdog, name="compilewatch-watchdog", daemon=True)
        self._dog.start()
        self._installed = True
        _active_watchers.append(self)
        return self

    def _install_compile_callbacks(self) -> None:
        if not self._closed:
            self._compiles.install()

    def close(self) -> WatchSummary:
        """Stop watching, write the `end` event (and the timeline, if asked); returns the summary."""
        with self._lock:
            if self._closed:
                return self.summary()
            self._closed = True
        if self in _active_watchers:
            _active_watchers.remove(self)
        if self._installed:
            self._stop.set()
            if self._dog is not None and self._dog is not threading.current_thread():
                self._dog.join(timeout=5)
            self._detect.check_stuck("close")
            tracehooks.unsubscribe(self)
            if self._fx_observed:
                fxpatch.remove_observer(self)
                self._fx_observed = False
            from compilewatch.tracing.importhook import cancel

            cancel("torch._dynamo", self._install_compile_callbacks)
            if "torch._dynamo" in sys.modules:
                self._compiles.uninstall()
            self._compiles.listeners.remove(self)
            if threading.excepthook == self._on_thread_exception:
                threading.excepthook = self._prev_excepthook
            self._emit_repeats()
            from compilewatch.explain.record import on_watch_close  # issue 38: the `cache_lookups` event

            on_watch_close(self)
            self._emit_remote_cache()
            n, first = tracehooks.listener_errors_since(self._errors_mark)
            if n:  # compilewatch's own listeners failed: what it watched may be incomplete
                self._emit("instrument_error", {"count": n, "first": first})
        summary = self.summary()
        self._emit("end", {"summary": summary, "repeats": self.repeat_total})
        self._log.close()
        if self.timeline is not None:
            from compilewatch.tracing.timeline import write_timeline

            write_timeline(self.events, self.timeline)
        return summary

    def _emit_remote_cache(self) -> None:
        """torch's remote caches in this process: hits/misses per kind, and a finding when they are on
        but the server does not answer (torch itself stays silent then). Only where inductor ran (it
        imports torch._inductor.remote_cache): nothing is imported at exit otherwise."""
        if "torch._inductor.remote_cache" not in sys.modules:
            return
        try:
            from compilewatch import remote_usage

            u = remote_usage.usage()
        except Exception as e:  # noqa: BLE001 - reporting must never break the program's exit
            tracehooks.note_listener_error("remote cache report", e)
            return
        if u is None:
            return
        detail = {"url": u.url, "source": u.source, "enabled": list(u.enabled), "reachable": u.reachable,
                  "why": u.why, "counts": u.counts}
        if u.down:
            self._emit("remote_cache_down", {**detail, "message": remote_usage.down_message(u)})
        else:
            self._emit("remote_cache", detail)

    def __enter__(self) -> "Watcher":
        return self.install()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- public ---------------------------------------------------------------------------------
    @property
    def events(self) -> list[WatchEvent]:
        return list(self._log.events)

    @property
    def report_path(self):
        return self._log.path

    def summary(self) -> WatchSummary:
        return summarize(self._log.events)

    def mark_warm(self) -> None:
        """Declare the warm-up done: every compile from now on is reported with its guard reasons."""
        from compilewatch.tracing import counters

        self._detect.warm_snapshot = counters.snapshot()
        self._emit("warm", {"compiles_so_far": len(self._compiles.windows)})

    @contextlib.contextmanager
    def span(self, name: str, cat: str = "span", **args: Any) -> Iterator[None]:
        """Record a named slice of this thread's time (a timeline shows it on the thread's track):
        e.g. `with w.span("warm cuda:1", cat="warm"):` or a worker's step / wait."""
        start, t0 = time.time(), time.monotonic()
        error = None
        try:
            yield
        except BaseException as e:
            error = f"{type(e).__name__}: {e}"
            raise
        finally:
            end, duration = time.time(), time.monotonic() - t0
            self._emit("span", {"name": name, "cat": cat, "start": start, "end": end, "duration_s": duration,
                                "error": error, **args})

    def check(self) -> bool:
        """Check for stuck tracing state now (no trace may be running); True if something is stuck."""
        return self._detect.check_stuck("check")

    def repair(self) -> fxpatch.StuckState:
        before = fxpatch.repair_state()
        self._emit("repair", {"was": before})
        self._detect.stuck_reported = False
        return before

    # --- event plumbing -------------------------------------------------------------------------
    def _emit(self, kind: str, detail: dict[str, Any], thread: threading.Thread | None = None) -> WatchEvent:
        t = thread or threading.current_thread()
        with self._lock:
            self._seq += 1
            ev = WatchEvent(kind=kind, time=time.time(), pid=os.getpid(), thread=t.name, thread_id=t.ident or 0,
                            seq=self._seq, detail=detail, thread_start=thread_start(t))
        self._log.append(ev)
        if self.on_event is not None:
            try:
                self.on_event(ev)
            except Exception as e:  # noqa: BLE001
                tracehooks.note_listener_error("Watcher.on_event", e)
        return ev

    def _first(self, key: tuple) -> bool:
        """True the first time `key` is seen (then emit with `_emit_first`); later: only counted, so
        a detection that repeats in a hot loop costs a dict lookup, not a stack capture."""
        with self._lock:
            if key in self._seen:
                self.repeats[key] = self.repeats.get(key, 0) + 1
                return False
            self._seen[key] = None
            return True

    def _repeat_of(self, *keys: tuple) -> bool:
        """Count a repeat of whichever of `keys` was reported already; False if none was."""
        with self._lock:
            for key in keys:
                if key in self._seen:
                    self.repeats[key] = self.repeats.get(key, 0) + 1
                    return True
        return False

    def _emit_first(self, key: tuple, kind: str, detail: dict[str, Any]) -> None:
        ev = self._emit(kind, detail)
        with self._lock:
            self._seen[key] = ev

    def _emit_repeats(self) -> None:
        """One `repeat` event per finding that recurred: how often after its first event."""
        for key, n in list(self.repeats.items()):
            self.repeat_total += n
            ev = self._seen.get(key)
            if ev is not None and n:
                self._emit("repeat", {"of_seq": ev.seq, "of_pid": ev.pid, "of_kind": ev.kind, "count": n},
                           thread=NamedThread(ev.thread, ev.thread_id, ev.thread_start))
        self.repeats.clear()

    # --- the instruments' callbacks: they call the Watcher, its Detector decides what each means ---
    def on_trace_enter(self, window: tracehooks.TraceWindow) -> None:
        pass

    def on_trace_exit(self, window: tracehooks.TraceWindow) -> None:
        self._detect.on_trace_exit(window)

    def on_flag_read(self, read: fxpatch.FlagRead) -> None:
        self._detect.on_flag_read(read)

    def on_foreign_module_call(self, call: fxpatch.ForeignModuleCall) -> None:
        self._detect.on_foreign_module_call(call)

    def on_compile_start(self, w: CompileWindow) -> None:
        pass

    def on_compile_end(self, w: CompileWindow) -> None:
        self._detect.on_compile_end(w)

    def _on_thread_exception(self, args: Any) -> None:
        self._detect.on_thread_exception(args)
        self._prev_excepthook(args)

    # --- the watchdog -----------------------------------------------------------------------------
    def _watchdog(self) -> None:
        period = min(0.5, self.stall_after / 4)
        while not self._stop.wait(period):
            try:
                self._tick()
            except Exception as e:  # noqa: BLE001 - the watchdog must survive anything
                tracehooks.note_listener_error("Watcher watchdog", e)

    def _tick(self) -> None:
        self._detect.tick()


_active_watchers: list[Watcher] = []


def notify_all(kind: str, detail: dict[str, Any]) -> None:
    """Emit an event from another instrument (the guard) into every installed watcher."""
    for w in list(_active_watchers):
        w._emit(kind, detail)


def watch(report: str | os.PathLike[str] | None = None, *, stall_after: float = 300.0, repair: bool = False,
          on_event: Callable[[WatchEvent], None] | None = None,
          timeline: str | os.PathLike[str] | None = None) -> Watcher:
    """Install a Watcher now and return it (use as a context manager, or call `.close()`)."""
    return Watcher(report, stall_after=stall_after, repair=repair, on_event=on_event, timeline=timeline).install()
