"""What the watcher's instruments report, turned into findings: the Detector behind each Watcher.

The Watcher (compilewatch.tracing.watcher) installs the instruments, is the object they call, and keeps
the event log; it hands each call to its Detector, which decides what the call means:
- a trace that ends (tracehooks): a `trace` event (when the watcher records traces), and
  `trace_failed` when a plain make_fx / symbolic_trace raised (inside a dynamo compile,
  `compile_failed` reports it);
- a flag read that finds the FX flag set (fxpatch): `flag_leak` (another thread's trace set it),
  `leak_prevented` (the guard kept it local), `eager_fallback` (dynamo runs the compiled function
  eagerly, silently), or stuck state when no thread is tracing;
- a module call through another thread's class-level `nn.Module.__call__` patch: `module_call_leak`;
- a compile that ends (compile_events): `compile`, `compile_failed` (with the traces that raised
  inside it), and `recompile_after_warm` with torch's guard reasons once the warm-up is declared done;
- a thread that dies with an uncaught exception: `thread_error`;
- the watchdog's tick: a compile or trace open longer than `stall_after` (monotonic clock) is a
  `stall`, with every thread's stack; stuck tracing state seen on two ticks in a row, at the end of
  the last trace, or on a check is a `stuck_state` (put back first when the watcher repairs).

A finding is keyed by (kind, victim thread, setter threads, call): the first one is emitted with its
stacks, later ones are only counted (the watcher's `_first` / `_repeat_of`), so a failing loop pays a
dictionary lookup per repeat. Threads are named by (ident, when the watcher first saw them), since
Python reuses idents.
"""

from __future__ import annotations

import sys
import threading
import time
from collections import deque
from typing import Any, Protocol

from compilewatch.tracing import fxpatch, stacks, tracehooks
from compilewatch.tracing.compile_events import CompileRecorder, CompileWindow
from compilewatch.tracing.stacks import Frame
from compilewatch.tracing.watch_events import WatchEvent

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
            "thread_start": thread_start(threading._active.get(w.thread_id)),  # type: ignore[attr-defined]
            "window_id": w.window_id, "tracer": w.tracer, "target": w.target, "since": w.start,
            "dynamo_compile": _in_dynamo_compile(w.stack), "where": _where(w.stack), "stack": _frames(w.stack)}


def thread_start(t: Any) -> float | None:
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
    return ident, thread_start(threading._active.get(ident))  # type: ignore[attr-defined]


class NamedThread:
    """Stands in for a thread that has ended, so an event can still carry its name and id."""

    def __init__(self, name: str, ident: int, start: float | None = None) -> None:
        self.name, self.ident = name, ident
        if start is not None:
            self._compilewatch_seen = start


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


def _setter_threads(exclude_thread: int) -> tuple[tuple[int, float | None], ...]:
    """Threads (other than `exclude_thread`) inside an outermost Tracer.trace now: cheap, no stacks."""
    return tuple(sorted({_thread_key(w.thread_id) for w in tracehooks.active_windows()
                         if w.thread_id != exclude_thread and w.outer_window is None}, key=str))


def _setters(exclude_thread: int | None = None, only_thread: int | None = None) -> list[dict[str, Any]]:
    out = []
    for w in tracehooks.active_windows():
        if exclude_thread is not None and w.thread_id == exclude_thread:
            continue
        if only_thread is not None and w.thread_id != only_thread:
            continue
        if w.outer_window is None:
            out.append(_window_json(w))
    return out


def _fallback_configured() -> bool:
    import torch._dynamo.config as dcfg

    return not getattr(dcfg, "force_compile_during_fx_trace", False) and not getattr(dcfg, "error_on_nested_fx_trace", True)


class WatcherSide(Protocol):
    """What a Detector uses of its Watcher: the settings, what the install could watch, the event log."""

    stall_after: float
    repair_stuck: bool
    record_traces: bool
    _fx_observed: bool  # fxpatch installed: flag reads, module calls and stuck state are watched
    _flag_per_thread: bool
    _compiles: CompileRecorder
    _dog: threading.Thread | None

    def _emit(self, kind: str, detail: dict[str, Any], thread: Any = None) -> WatchEvent: ...

    def _first(self, key: tuple) -> bool: ...

    def _repeat_of(self, *keys: tuple) -> bool: ...

    def _emit_first(self, key: tuple, kind: str, detail: dict[str, Any]) -> None: ...


class Detector:
    """The findings' state (recent traces, stalls and stuck state already reported, the warm-up's
    counters) and what each instrument's report means; see the module docstring."""

    def __init__(self, watcher: WatcherSide) -> None:
        self.w = watcher
        self.recent: deque[tracehooks.TraceWindow] = deque(maxlen=16)
        self.stalled: set[tuple] = set()
        self.stuck_reported = False
        self.stuck_ticks = 0
        self.warm_snapshot: Any = None  # counters at mark_warm() (then at the last compile after it)

    # --- traces (tracehooks) ----------------------------------------------------------------------
    def on_trace_exit(self, window: tracehooks.TraceWindow) -> None:
        w = self.w
        self.recent.append(window)
        if window.error and window.outer_window is None and not _in_dynamo_compile(window.stack):
            # a plain make_fx / symbolic_trace raised (inside a dynamo compile, compile_failed reports it)
            w._emit("trace_failed", {"tracer": window.tracer, "target": window.target, "window_id": window.window_id,
                                     "where": _where(window.stack), "error": window.error,
                                     "stack": _frames(window.stack)})
        if w.record_traces:
            d = _window_json(window)
            d.update(start=window.start, end=window.end, duration_s=window.duration, compiling=window.compiling,
                     flag_before=window.flag_before, flag_after=window.flag_after, error=window.error,
                     outer_window=window.outer_window)
            d.pop("since", None)
            d.pop("thread", None)
            d.pop("thread_id", None)
            w._emit("trace", d)
        if not tracehooks.active_windows():
            self.check_stuck("trace_exit")

    # --- the FX flag and module calls (fxpatch) -----------------------------------------------------
    def on_flag_read(self, read: fxpatch.FlagRead) -> None:
        if not read.original:  # torch's reader said "not tracing" anyway (e.g. is_compiling() True)
            return
        w = self.w
        me = threading.get_ident()
        call = _compiled_call_name(read.caller)
        if read.thread_is_tracing:
            if call is not None and read.effective and _fallback_configured():
                if w._first(("eager_fallback", me, call)):
                    w._emit("eager_fallback", {"call": call, "cross_thread": False, "setters": [],
                                               "victim_stack": _frames(stacks.current_stack(skip=3))})
            return
        # a per-thread flag read True outside a trace was set by this thread, never by another's trace
        setter_threads = () if w._flag_per_thread else _setter_threads(exclude_thread=me)
        if not setter_threads:  # the flag is set and nobody is tracing: stuck
            self.check_stuck("flag_read")
            return
        victim = _thread_key(me)
        if read.effective and w._repeat_of(("flag_leak", victim, setter_threads, call),
                                           ("eager_fallback", victim, setter_threads, call)):
            return  # seen already for this (setter, victim) pair: counted, nothing else to do
        if not read.effective:
            key = ("leak_prevented", _thread_key(me), setter_threads, call)
            if w._first(key):
                w._emit_first(key, "leak_prevented", {"reader": read.reader, "call": call,
                                                      "setters": _setters(exclude_thread=me)})
            return
        if call is not None:
            import torch._dynamo.config as dcfg

            if getattr(dcfg, "force_compile_during_fx_trace", False):
                return
            if not getattr(dcfg, "error_on_nested_fx_trace", True):
                key = ("eager_fallback", _thread_key(me), setter_threads, call)
                if w._first(key):
                    w._emit_first(key, "eager_fallback", {
                        "call": call, "cross_thread": True, "setters": _setters(exclude_thread=me),
                        "victim_stack": _frames(stacks.current_stack(skip=3))})
                return
            outcome = "RuntimeError: Detected that you are using FX to symbolically trace a dynamo-optimized function"
        else:
            caller = read.caller
            outcome = (f"{read.reader}() returned True in a thread that is not tracing"
                       + (f" (called from {caller.f_code.co_name})" if caller is not None else ""))
        key = ("flag_leak", _thread_key(me), setter_threads, call)
        if w._first(key):
            w._emit_first(key, "flag_leak", {"reader": read.reader, "call": call, "outcome": outcome,
                                             "setters": _setters(exclude_thread=me),
                                             "victim_stack": _frames(stacks.current_stack(skip=3))})

    def on_foreign_module_call(self, call: fxpatch.ForeignModuleCall) -> None:
        w = self.w
        me = threading.get_ident()
        error_type = call.error.split(":", 1)[0] if call.error else None
        key = ("module_call_leak", _thread_key(me), _thread_key(call.owner_thread_id), call.module, error_type)
        if w._first(key):
            w._emit_first(key, "module_call_leak", {
                "module": call.module, "error": call.error, "setters": _setters(only_thread=call.owner_thread_id),
                "victim_stack": _frames(stacks.current_stack(skip=4))})

    # --- compiles (compile_events) -------------------------------------------------------------------
    def on_compile_end(self, cw: CompileWindow) -> None:
        w = self.w
        d = {"compile_id": cw.compile_id, "trigger": cw.trigger, "start": cw.start, "end": cw.end,
             "duration_s": cw.duration, "recompile": cw.is_recompile,
             "function": cw.function, "error": cw.error}
        w._emit("compile", d)
        if cw.error:
            inner = [x.error for x in self.recent if x.error and x.thread_id == cw.thread_id and x.mono_start >= cw.mono_start]
            w._emit("compile_failed", {"compile_id": cw.compile_id, "trigger": cw.trigger, "function": cw.function,
                                       "error": cw.error, "trace_errors": inner[-3:],
                                       "stack": _frames([f for f in stacks.current_stack(skip=3)
                                                         if not f.file.endswith(("callback.py", "contextlib.py"))])})
        if self.warm_snapshot is not None:
            from compilewatch.tracing import counters

            snap = counters.snapshot()
            delta = counters.delta(self.warm_snapshot, snap)
            self.warm_snapshot = snap
            w._emit("recompile_after_warm", {**d, "reasons": list(delta.recompile_reasons)})

    # --- threads that die (threading.excepthook) ----------------------------------------------------
    def on_thread_exception(self, args: Any) -> None:
        """A `thread_error` for a thread's uncaught exception (never raises; the watcher chains the hook)."""
        try:
            if args.exc_type is not SystemExit and args.thread is not self.w._dog:
                import traceback

                frames = stacks.frames_from(args.exc_traceback.tb_frame) if args.exc_traceback else []
                tb = args.exc_traceback
                while tb is not None and tb.tb_next is not None:
                    tb = tb.tb_next
                where = None
                if tb is not None:
                    where = _where(stacks.frames_from(tb.tb_frame))
                self.w._emit("thread_error", {
                    "error": f"{args.exc_type.__name__}: {args.exc_value}"[:2000], "where": where,
                    "traceback": "".join(traceback.format_exception(args.exc_type, args.exc_value,
                                                                    args.exc_traceback))[-8000:],
                    "stack": _frames(frames)}, thread=args.thread or NamedThread("?", 0))
        except Exception as e:  # noqa: BLE001 - the watcher never breaks the program
            tracehooks.note_listener_error("Watcher thread excepthook", e)

    # --- checks: stuck state, stalls ----------------------------------------------------------------
    def check_stuck(self, seen_at: str) -> bool:
        """Report stuck tracing state once (put back first when the watcher repairs); True if stuck."""
        w = self.w
        if not w._fx_observed or fxpatch.thread_local_enabled():
            return False

        def check_and_repair() -> tuple[fxpatch.StuckState, bool]:
            # under tracehooks' lock: no trace can start between the check and the repair
            state = fxpatch.stuck_state()
            if state.stuck and w.repair_stuck:
                fxpatch.repair_state()
                return state, True
            return state, False

        idle, checked = tracehooks.when_idle(check_and_repair)
        if not idle or checked is None:
            return False
        state, repaired = checked
        if not state.stuck:
            self.stuck_reported = False
            return False
        if self.stuck_reported and not repaired:
            return True
        self.stuck_reported = not repaired
        recent = [_window_json(x) | {"end": x.end, "flag_before": x.flag_before, "flag_after": x.flag_after,
                                     "error": x.error} for x in list(self.recent)[-4:]]
        w._emit("stuck_state", {"flag": state.flag, "module_call_patched": state.module_call_patched,
                                "module_getattr_patched": state.module_getattr_patched,
                                "patcher_left": state.patcher_left, "seen_at": seen_at,
                                "recent_windows": recent, "repaired": repaired})
        return True

    def tick(self) -> None:
        """One watchdog wake-up: stalls (a compile or outermost trace open past `stall_after`) and stuck state."""
        w = self.w
        if "torch._dynamo" in sys.modules:
            w._compiles.ensure_installed()  # a user's torch._dynamo.reset() clears compile callbacks
        now = time.monotonic()  # open-for times: a wall-clock change must not fake (or hide) a stall
        open_items: list[tuple[tuple, str, float, float, int, str]] = []  # key, what, since, mono start, thread
        cw = w._compiles.open_window()
        if cw is not None:
            open_items.append((("compile", cw.compile_id, cw.start), f"dynamo compile {cw.compile_id}", cw.start,
                               cw.mono_start, cw.thread_id, cw.thread_name))
        for win in tracehooks.active_windows():
            if win.outer_window is None:
                open_items.append((("trace", win.window_id), f"{win.tracer} tracing {win.target}", win.start,
                                   win.mono_start, win.thread_id, win.thread_name))
        for key, what, since, mono_start, tid, tname in open_items:
            if now - mono_start < w.stall_after or key in self.stalled:
                continue
            self.stalled.add(key)
            all_stacks = stacks.all_thread_stacks()
            in_compile = [name.rsplit(" (", 1)[0] for name, frames in all_stacks.items() if _in_compile(frames)]
            thread = next((t for t in threading.enumerate() if t.ident == tid), None)
            w._emit("stall", {"what": what, "since": since, "open_for_s": now - mono_start,
                              "stall_after_s": w.stall_after, "threads_in_compile": in_compile,
                              "stacks": {k: [str(f) for f in v] for k, v in all_stacks.items()}},
                    thread=thread or NamedThread(tname, tid, _thread_key(tid)[1]))
        if not w._fx_observed or tracehooks.active_windows():
            self.stuck_ticks = 0
        elif fxpatch.stuck_state().stuck:
            self.stuck_ticks += 1
            if self.stuck_ticks >= 2:
                self.check_stuck("watchdog")
        else:
            self.stuck_ticks = 0
