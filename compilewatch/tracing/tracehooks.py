"""One patch point on `torch.fx.Tracer.trace`, shared by every instrument (probe, watcher).

`Tracer.trace` is where the FX tracing flag is set and restored (a module global up to torch 2.13, per
thread from 2.14: compilewatch.tracing.torchcompat reads it), and where `nn.Module.__call__` is patched on the
class for the duration of a trace (`_Patcher` and `module_call_wrapper` in `torch/fx/_symbolic_trace.py`,
torch 2.11 to 2.15). make_fx's
`PythonKeyTracer`, AOTAutograd and Inductor all trace through it: subclasses that override `trace`
call `super().trace`, so patching the base class sees every trace window, with `type(self)` naming
the subclass. Nested entries of one tracer object (a subclass's override calling the base) are
recorded once.

Listeners subscribe; the patch is installed while at least one listener is subscribed and the
original function is put back when the last one leaves. A listener that raises never breaks the
user's trace: its error is recorded (`note_listener_error`) and a watcher reports what it recorded
(`listener_errors_since`) as an `instrument_error` event, so instrument failures do not vanish.
"""

from __future__ import annotations

import functools
import itertools
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, TypeVar

from compilewatch.tracing import torchcompat
from compilewatch.tracing.stacks import Frame, current_stack


@dataclass(slots=True)
class TraceWindow:
    """One `Tracer.trace` call: who traced what, from where, and what the global flags were."""

    window_id: int
    thread_id: int
    thread_name: str
    tracer: str  # tracer class, e.g. "PythonKeyTracer"
    target: str  # what was traced: the module's class or the function's qualified name
    start: float  # time.time(): a timestamp, for event times and timelines
    compiling: bool | None  # torch.compiler.is_compiling() on entry (a process global!)
    flag_before: bool | None  # the FX flag on entry, as this thread sees it (None: unknown layout)
    stack: tuple[Frame, ...]  # innermost last
    end: float | None = None
    flag_after: bool | None = None  # the value `finally` restored
    error: str | None = None
    outer_window: int | None = None  # enclosing open window in the same thread, if nested
    mono_start: float = field(default_factory=time.monotonic)  # durations and stalls (immune to clock changes)
    mono_end: float | None = None

    @property
    def duration(self) -> float | None:
        return None if self.mono_end is None else self.mono_end - self.mono_start


class TraceListener(Protocol):
    def on_trace_enter(self, window: TraceWindow) -> None: ...

    def on_trace_exit(self, window: TraceWindow) -> None: ...


T = TypeVar("T")
_lock = threading.RLock()  # also held while a window registers, before the trace sets any state
_listeners: list[TraceListener] = []
_original: Any = None
_active: dict[int, TraceWindow] = {}
_ids = itertools.count(1)
_local = threading.local()
_errors_lock = threading.Lock()
_errors: list[str] = []  # the first _MAX_ERRORS texts; _error_count counts them all
_error_count = 0
_MAX_ERRORS = 100


def _target_name(root: Any) -> str:
    import torch

    if isinstance(root, torch.nn.Module):
        return type(root).__qualname__
    name = getattr(root, "__qualname__", None) or getattr(root, "__name__", None)
    return str(name) if name else type(root).__name__


def _notify(method: str, window: TraceWindow) -> None:
    with _lock:
        listeners = list(_listeners)
    for listener in listeners:
        try:
            getattr(listener, method)(window)
        except Exception as e:  # noqa: BLE001 - instruments must never break the traced program
            note_listener_error(f"{type(listener).__name__}.{method}", e)


def note_listener_error(where: str, e: BaseException) -> None:
    """Record that an instrument's listener (or watchdog, hook) raised; the program went on."""
    global _error_count
    with _errors_lock:
        _error_count += 1
        if len(_errors) < _MAX_ERRORS:
            _errors.append(f"{where}: {type(e).__name__}: {e}"[:2000])


def listener_error_mark() -> int:
    """How many listener errors were recorded so far (pass it to `listener_errors_since`)."""
    with _errors_lock:
        return _error_count


def listener_errors_since(mark: int) -> tuple[int, str | None]:
    """(how many listener errors were recorded after `mark`, the first one's text if it was kept)."""
    with _errors_lock:
        return _error_count - mark, (_errors[mark] if mark < len(_errors) else None)


def _make_patched(original):
    @functools.wraps(original)
    def trace(self, root, *args, **kwargs):
        import torch

        stack_ids: list[tuple[int, int]] = getattr(_local, "open", None) or []
        _local.open = stack_ids
        if stack_ids and stack_ids[-1][0] == id(self):  # a subclass override calling the base
            return original(self, root, *args, **kwargs)
        t = threading.current_thread()
        window = TraceWindow(
            window_id=next(_ids),
            thread_id=t.ident or 0,
            thread_name=t.name,
            tracer=type(self).__name__,
            target=_target_name(root),
            start=time.time(),
            compiling=bool(torch.compiler.is_compiling()),
            flag_before=torchcompat.fx_flag(),
            stack=tuple(current_stack(skip=1)),
            outer_window=stack_ids[-1][1] if stack_ids else None,
        )
        stack_ids.append((id(self), window.window_id))
        try:  # a listener interrupted on entry (Ctrl-C while the guard waits for its lock) still closes the window
            with _lock:
                _active[window.window_id] = window
            _notify("on_trace_enter", window)
            return original(self, root, *args, **kwargs)
        except BaseException as e:
            window.error = f"{type(e).__name__}: {e}"
            raise
        finally:
            window.end, window.mono_end = time.time(), time.monotonic()
            window.flag_after = torchcompat.fx_flag()
            stack_ids.pop()
            with _lock:
                _active.pop(window.window_id, None)
            _notify("on_trace_exit", window)

    trace.__compilewatch_original__ = original  # type: ignore[attr-defined]
    return trace


def subscribe(listener: TraceListener) -> None:
    """Add a listener; installs the patch on `torch.fx.Tracer.trace` if it is the first."""
    global _original
    import torch.fx

    with _lock:
        if listener in _listeners:
            return
        _listeners.append(listener)
        if _original is None:
            _original = torch.fx.Tracer.__dict__["trace"]
            torch.fx.Tracer.trace = _make_patched(_original)


def unsubscribe(listener: TraceListener) -> None:
    """Remove a listener; restores the original `Tracer.trace` when none is left."""
    global _original
    import torch.fx

    with _lock:
        if listener in _listeners:
            _listeners.remove(listener)
        if not _listeners and _original is not None:
            torch.fx.Tracer.trace = _original
            _original = None


def installed() -> bool:
    with _lock:
        return _original is not None


def thread_is_tracing() -> bool:
    """True when the calling thread is inside `Tracer.trace` (needs a subscribed listener)."""
    return bool(getattr(_local, "open", None))


def when_idle(fn: Callable[[], T]) -> tuple[bool, T | None]:
    """Call `fn` only if no trace window is open, atomically with respect to trace entry: a
    `Tracer.trace` that starts meanwhile waits (before it sets any tracing state) until `fn`
    returns. (False, None) without calling `fn` when a window is open. Keep `fn` short and free of
    other instruments' locks."""
    with _lock:
        if _active:
            return False, None
        return True, fn()


def active_windows() -> list[TraceWindow]:
    """Trace windows open right now, in any thread, oldest first."""
    with _lock:
        return sorted(_active.values(), key=lambda w: w.window_id)


@dataclass
class TraceRecorder:
    """A listener that keeps every window it saw (used by probe and tests)."""

    windows: list[TraceWindow] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def on_trace_enter(self, window: TraceWindow) -> None:
        with self._lock:
            self.windows.append(window)

    def on_trace_exit(self, window: TraceWindow) -> None:
        pass

    def __enter__(self) -> "TraceRecorder":
        subscribe(self)
        return self

    def __exit__(self, *exc: object) -> None:
        unsubscribe(self)
