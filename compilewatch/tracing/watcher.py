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
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from collections import deque
from typing import Any, Callable, Iterator

from compilewatch.tracing import fxpatch, stacks, torchcompat, tracehooks
from compilewatch.tracing.compile_events import CompileRecorder, CompileWindow
from compilewatch.tracing.stacks import Frame
from compilewatch.tracing.watch_events import EventLog, WatchEvent, WatchSummary, summarize

# frames that mean "this thread is inside compile machinery"
_COMPILE_FILES = ("torch/_dynamo/convert_frame.py", "torch/_dynamo/output_graph.py", "torch/_inductor/compile_fx.py",
                  "torch/_functorch/aot_autograd.py", "torch/_functorch/_aot_autograd/", "torch/fx/_symbolic_trace.py",
                  "torch/fx/experimental/proxy_tensor.py", "torch/_inductor/codecache.py")


def _frames(frames: list[Frame] | tuple[Frame, ...], relevant: bool = True) -> list[str]:
    picked = stacks.relevant(list(frames)) if relevant else list(frames)
    return [str(f) for f in picked]


def _where(frames: list[Frame] | tuple[Frame, ...]) -> str | None:
    """The innermost user frame (what the user's code was doing), else the innermost frame."""
    user = [f for f in frames if stacks.is_user_short_path(f.file)]
    return str(user[-1]) if user else (str(frames[-1]) if frames else None)


def _window_json(w: tracehooks.TraceWindow) -> dict[str, Any]:
    return {"thread": w.thread_name, "thread_id": w.thread_id,
            "thread_start": _thread_start(threading._active.get(w.thread_id)),  # type: ignore[attr-defined]
            "window_id": w.window_id, "tracer": w.tracer, "target": w.target, "since": w.start,
            "dynamo_compile": _in_dynamo_compile(w.stack), "where": _where(w.stack), "stack": _frames(w.stack)}


def _thread_start(t: Any) -> float | None:
    """When the watcher first saw thread object `t` (kept on the object; Python records no start
    time). Tells apart two threads that got the same reused ident."""
    if t is None:
        return None
    seen = getattr(t, "_compilewatch_seen", None)
    if seen is None:
        seen = time.time()
        try:
            t._compilewatch_seen = seen
        except AttributeError:  # a thread object that takes no attributes
            return None
    return seen


def _thread_key(ident: int) -> tuple[int, float | None]:
    """A Python thread's identity: its ident (reused by later threads) and when the watcher first saw it."""
    return ident, _thread_start(threading._active.get(ident))  # type: ignore[attr-defined]


def _in_dynamo_compile(frames: list[Frame] | tuple[Frame, ...]) -> bool:
    """The trace runs inside a dynamo compile (AOTAutograd / Inductor), not a plain make_fx / symbolic_trace."""
    return any(f.file == "torch/_dynamo/convert_frame.py" for f in frames)


def _in_compile(frames: list[Frame]) -> bool:
    return any(f.file.startswith(_COMPILE_FILES) for f in frames)


def _compiled_call_name(frame: Any) -> str | None:
    """Name the function a dynamo `compile_wrapper` frame was about to run."""
    if frame is None or frame.f_code.co_name != "compile_wrapper":
        return None
    fn = frame.f_locals.get("fn")
    code = getattr(fn, "__code__", None)
    name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or type(fn).__name__
    if code is None:
        return name
    key = (code, name)
    text = _call_names.get(key)
    if text is None:  # paths are shortened once per function: a failing loop repeats this per call
        text = _call_names[key] = f"{name} ({stacks.short_path(code.co_filename)}:{code.co_firstlineno})"
    return text


_call_names: dict[tuple[Any, str], str] = {}


class Watcher:
    """Install with `install()` (or `with`), remove with `close()`; see the module docstring."""

    def __init__(self, report: str | os.PathLike[str] | None = None, *, stall_after: float = 300.0,
                 repair: bool = False, on_event: Callable[[WatchEvent], None] | None = None,
                 timeline: str | os.PathLike[str] | None = None, record_traces: bool = True) -> None:
        if stall_after <= 0:
            from compilewatch.errors import BadInput

            raise BadInput(f"stall_after must be > 0 seconds, got {stall_after}")
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
        self._warm_snapshot = None
        self._seen: dict[tuple, WatchEvent | None] = {}  # rate limit: one event per (kind, victim, setter threads, ...)
        self._stalled: set[tuple] = set()
        self._stuck_reported = False
        self._stuck_ticks = 0
        self._recent: deque[tracehooks.TraceWindow] = deque(maxlen=16)
        self.repeats: dict[tuple, int] = {}
        self.repeat_total = 0  # detections that repeated a first event (counted, not re-reported)
        self._fx_observed = False  # fxpatch installed (flag reads, module calls, stuck state watched)
        self._flag_per_thread = False
        self._errors_mark = 0  # tracehooks' listener-error count when installed

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
            self._check_stuck("close")
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

        self._warm_snapshot = counters.snapshot()
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
        return self._check_stuck("check")

    def repair(self) -> fxpatch.StuckState:
        before = fxpatch.repair_state()
        self._emit("repair", {"was": before})
        self._stuck_reported = False
        return before

    # --- event plumbing -------------------------------------------------------------------------
    def _emit(self, kind: str, detail: dict[str, Any], thread: threading.Thread | None = None) -> WatchEvent:
        t = thread or threading.current_thread()
        with self._lock:
            self._seq += 1
            ev = WatchEvent(kind=kind, time=time.time(), pid=os.getpid(), thread=t.name, thread_id=t.ident or 0,
                            seq=self._seq, detail=detail, thread_start=_thread_start(t))
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
                           thread=_NamedThread(ev.thread, ev.thread_id, ev.thread_start))
        self.repeats.clear()

    def _on_thread_exception(self, args: Any) -> None:
        try:
            if args.exc_type is not SystemExit and args.thread is not self._dog:
                import traceback

                frames = stacks.frames_from(args.exc_traceback.tb_frame) if args.exc_traceback else []
                tb = args.exc_traceback
                while tb is not None and tb.tb_next is not None:
                    tb = tb.tb_next
                where = None
                if tb is not None:
                    where = _where(stacks.frames_from(tb.tb_frame))
                self._emit("thread_error", {
                    "error": f"{args.exc_type.__name__}: {args.exc_value}"[:2000], "where": where,
                    "traceback": "".join(traceback.format_exception(args.exc_type, args.exc_value,
                                                                    args.exc_traceback))[-8000:],
                    "stack": _frames(frames)}, thread=args.thread or _NamedThread("?", 0))
        except Exception as e:  # noqa: BLE001 - the watcher never breaks the program
            tracehooks.note_listener_error("Watcher thread excepthook", e)
        self._prev_excepthook(args)

    @staticmethod
    def _setter_threads(exclude_thread: int) -> tuple[tuple[int, float | None], ...]:
        """Threads (other than `exclude_thread`) inside an outermost Tracer.trace now: cheap, no stacks."""
        return tuple(sorted({_thread_key(w.thread_id) for w in tracehooks.active_windows()
                             if w.thread_id != exclude_thread and w.outer_window is None}, key=str))

    def _setters(self, exclude_thread: int | None = None, only_thread: int | None = None) -> list[dict[str, Any]]:
        out = []
        for w in tracehooks.active_windows():
            if exclude_thread is not None and w.thread_id == exclude_thread:
                continue
            if only_thread is not None and w.thread_id != only_thread:
                continue
            if w.outer_window is None:
                out.append(_window_json(w))
        return out

    # --- tracehooks listener --------------------------------------------------------------------
    def on_trace_enter(self, window: tracehooks.TraceWindow) -> None:
        pass

    def on_trace_exit(self, window: tracehooks.TraceWindow) -> None:
        self._recent.append(window)
        if window.error and window.outer_window is None and not _in_dynamo_compile(window.stack):
            # a plain make_fx / symbolic_trace raised (inside a dynamo compile, compile_failed reports it)
            self._emit("trace_failed", {"tracer": window.tracer, "target": window.target, "window_id": window.window_id,
                                        "where": _where(window.stack), "error": window.error,
                                        "stack": _frames(window.stack)})
        if self.record_traces:
            d = _window_json(window)
            d.update(start=window.start, end=window.end, duration_s=window.duration, compiling=window.compiling,
                     flag_before=window.flag_before, flag_after=window.flag_after, error=window.error,
                     outer_window=window.outer_window)
            d.pop("since", None)
            d.pop("thread", None)
            d.pop("thread_id", None)
            self._emit("trace", d)
        if not tracehooks.active_windows():
            self._check_stuck("trace_exit")

    # --- fxpatch observer -----------------------------------------------------------------------
    def on_flag_read(self, read: fxpatch.FlagRead) -> None:
        if not read.original:  # torch's reader said "not tracing" anyway (e.g. is_compiling() True)
            return
        me = threading.get_ident()
        call = _compiled_call_name(read.caller)
        if read.thread_is_tracing:
            if call is not None and read.effective and self._fallback_configured():
                if self._first(("eager_fallback", me, call)):
                    self._emit("eager_fallback", {"call": call, "cross_thread": False, "setters": [],
                                                  "victim_stack": _frames(stacks.current_stack(skip=2))})
            return
        # a per-thread flag read True outside a trace was set by this thread, never by another's trace
        setter_threads = () if self._flag_per_thread else self._setter_threads(exclude_thread=me)
        if not setter_threads:  # the flag is set and nobody is tracing: stuck
            self._check_stuck("flag_read")
            return
        victim = _thread_key(me)
        if read.effective and self._repeat_of(("flag_leak", victim, setter_threads, call),
                                              ("eager_fallback", victim, setter_threads, call)):
            return  # seen already for this (setter, victim) pair: counted, nothing else to do
        if not read.effective:
            key = ("leak_prevented", _thread_key(me), setter_threads, call)
            if self._first(key):
                self._emit_first(key, "leak_prevented", {"reader": read.reader, "call": call,
                                                         "setters": self._setters(exclude_thread=me)})
            return
        if call is not None:
            import torch._dynamo.config as dcfg

            if getattr(dcfg, "force_compile_during_fx_trace", False):
                return
            if not getattr(dcfg, "error_on_nested_fx_trace", True):
                key = ("eager_fallback", _thread_key(me), setter_threads, call)
                if self._first(key):
                    self._emit_first(key, "eager_fallback", {
                        "call": call, "cross_thread": True, "setters": self._setters(exclude_thread=me),
                        "victim_stack": _frames(stacks.current_stack(skip=2))})
                return
            outcome = "RuntimeError: Detected that you are using FX to symbolically trace a dynamo-optimized function"
        else:
            caller = read.caller
            outcome = (f"{read.reader}() returned True in a thread that is not tracing"
                       + (f" (called from {caller.f_code.co_name})" if caller is not None else ""))
        key = ("flag_leak", _thread_key(me), setter_threads, call)
        if self._first(key):
            self._emit_first(key, "flag_leak", {"reader": read.reader, "call": call, "outcome": outcome,
                                                "setters": self._setters(exclude_thread=me),
                                                "victim_stack": _frames(stacks.current_stack(skip=2))})

    @staticmethod
    def _fallback_configured() -> bool:
        import torch._dynamo.config as dcfg

        return not getattr(dcfg, "force_compile_during_fx_trace", False) and not getattr(dcfg, "error_on_nested_fx_trace", True)

    def on_foreign_module_call(self, call: fxpatch.ForeignModuleCall) -> None:
        me = threading.get_ident()
        error_type = call.error.split(":", 1)[0] if call.error else None
        key = ("module_call_leak", _thread_key(me), _thread_key(call.owner_thread_id), call.module, error_type)
        if self._first(key):
            self._emit_first(key, "module_call_leak", {
                "module": call.module, "error": call.error, "setters": self._setters(only_thread=call.owner_thread_id),
                "victim_stack": _frames(stacks.current_stack(skip=3))})

    # --- compile listener -----------------------------------------------------------------------
    def on_compile_start(self, w: CompileWindow) -> None:
        pass

    def on_compile_end(self, w: CompileWindow) -> None:
        d = {"compile_id": w.compile_id, "trigger": w.trigger, "start": w.start, "end": w.end,
             "duration_s": w.duration, "recompile": w.is_recompile,
             "function": w.function, "error": w.error}
        self._emit("compile", d)
        if w.error:
            inner = [x.error for x in self._recent if x.error and x.thread_id == w.thread_id and x.mono_start >= w.mono_start]
            self._emit("compile_failed", {"compile_id": w.compile_id, "trigger": w.trigger, "function": w.function,
                                          "error": w.error, "trace_errors": inner[-3:],
                                          "stack": _frames([f for f in stacks.current_stack(skip=2)
                                                            if not f.file.endswith(("callback.py", "contextlib.py"))])})
        if self._warm_snapshot is not None:
            from compilewatch.tracing import counters

            snap = counters.snapshot()
            delta = counters.delta(self._warm_snapshot, snap)
            self._warm_snapshot = snap
            self._emit("recompile_after_warm", {**d, "reasons": list(delta.recompile_reasons)})

    # --- checks ---------------------------------------------------------------------------------
    def _check_stuck(self, seen_at: str) -> bool:
        if not self._fx_observed or fxpatch.thread_local_enabled():
            return False

        def check_and_repair() -> tuple[fxpatch.StuckState, bool]:
            # under tracehooks' lock: no trace can start between the check and the repair
            state = fxpatch.stuck_state()
            if state.stuck and self.repair_stuck:
                fxpatch.repair_state()
                return state, True
            return state, False

        idle, checked = tracehooks.when_idle(check_and_repair)
        if not idle or checked is None:
            return False
        state, repaired = checked
        if not state.stuck:
            self._stuck_reported = False
            return False
        if self._stuck_reported and not repaired:
            return True
        self._stuck_reported = not repaired
        recent = [_window_json(w) | {"end": w.end, "flag_before": w.flag_before, "flag_after": w.flag_after,
                                     "error": w.error} for w in list(self._recent)[-4:]]
        self._emit("stuck_state", {"flag": state.flag, "module_call_patched": state.module_call_patched,
                                   "module_getattr_patched": state.module_getattr_patched,
                                   "patcher_left": state.patcher_left, "seen_at": seen_at,
                                   "recent_windows": recent, "repaired": repaired})
        return True

    def _watchdog(self) -> None:
        period = min(0.5, self.stall_after / 4)
        while not self._stop.wait(period):
            try:
                self._tick()
            except Exception as e:  # noqa: BLE001 - the watchdog must survive anything
                tracehooks.note_listener_error("Watcher watchdog", e)

    def _tick(self) -> None:
        if "torch._dynamo" in sys.modules:
            self._compiles.ensure_installed()  # a user's torch._dynamo.reset() clears compile callbacks
        now = time.monotonic()  # open-for times: a wall-clock change must not fake (or hide) a stall
        open_items: list[tuple[tuple, str, float, float, int, str]] = []  # key, what, since, mono start, thread
        cw = self._compiles.open_window()
        if cw is not None:
            open_items.append((("compile", cw.compile_id, cw.start), f"dynamo compile {cw.compile_id}", cw.start,
                               cw.mono_start, cw.thread_id, cw.thread_name))
        for w in tracehooks.active_windows():
            if w.outer_window is None:
                open_items.append((("trace", w.window_id), f"{w.tracer} tracing {w.target}", w.start, w.mono_start,
                                   w.thread_id, w.thread_name))
        for key, what, since, mono_start, tid, tname in open_items:
            if now - mono_start < self.stall_after or key in self._stalled:
                continue
            self._stalled.add(key)
            all_stacks = stacks.all_thread_stacks()
            in_compile = [name.rsplit(" (", 1)[0] for name, frames in all_stacks.items() if _in_compile(frames)]
            thread = next((t for t in threading.enumerate() if t.ident == tid), None)
            self._emit("stall", {"what": what, "since": since, "open_for_s": now - mono_start,
                                 "stall_after_s": self.stall_after, "threads_in_compile": in_compile,
                                 "stacks": {k: [str(f) for f in v] for k, v in all_stacks.items()}},
                       thread=thread or _NamedThread(tname, tid, _thread_key(tid)[1]))
        if not self._fx_observed or tracehooks.active_windows():
            self._stuck_ticks = 0
        elif fxpatch.stuck_state().stuck:
            self._stuck_ticks += 1
            if self._stuck_ticks >= 2:
                self._check_stuck("watchdog")
        else:
            self._stuck_ticks = 0


_active_watchers: list[Watcher] = []


def notify_all(kind: str, detail: dict[str, Any]) -> None:
    """Emit an event from another instrument (the guard) into every installed watcher."""
    for w in list(_active_watchers):
        w._emit(kind, detail)


class _NamedThread:
    """Stands in for a thread that has ended, so an event can still carry its name and id."""

    def __init__(self, name: str, ident: int, start: float | None = None) -> None:
        self.name, self.ident = name, ident
        if start is not None:
            self._compilewatch_seen = start


def watch(report: str | os.PathLike[str] | None = None, *, stall_after: float = 300.0, repair: bool = False,
          on_event: Callable[[WatchEvent], None] | None = None,
          timeline: str | os.PathLike[str] | None = None) -> Watcher:
    """Install a Watcher now and return it (use as a context manager, or call `.close()`)."""
    return Watcher(report, stall_after=stall_after, repair=repair, on_event=on_event, timeline=timeline).install()
