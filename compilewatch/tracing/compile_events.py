"""Dynamo compile windows, from torch's own compile callbacks (`torch._dynamo.callback`).

Dynamo compiles are serialized by a global lock, so start/end callbacks delimit one compile at a
time; the thread that runs the start callback is the compiling thread. Nested compiles (a lazy
backward inside a forward compile) collapse into the outer window, as torch reports them.
"""

from __future__ import annotations

import sys
import threading
import time
from dataclasses import dataclass, field


@dataclass(slots=True)
class CompileWindow:
    compile_id: str  # dynamo's "frame/recompile" id; a second number > 0 means a recompile
    trigger: str  # DYNAMO, LAZY_BACKWARD, ...
    thread_id: int
    thread_name: str
    start: float  # time.time(): a timestamp, for event times and timelines
    end: float | None = None
    function: str | None = None  # "name (file:line)" of the frame dynamo compiles, when found
    error: str | None = None  # "Type: message" when the compile raised (torch runs the end callback in `finally`)
    _exc_at_start: object = field(default=None, repr=False)  # an exception already being handled at start
    mono_start: float = field(default_factory=time.monotonic)  # durations and stalls (immune to clock changes)
    mono_end: float | None = None

    @property
    def duration(self) -> float | None:
        return None if self.mono_end is None else self.mono_end - self.mono_start

    @property
    def is_recompile(self) -> bool:
        part = self.compile_id.split("/")[-1] if "/" in self.compile_id else "0"
        digits = "".join(ch for ch in part if ch.isdigit())
        return bool(digits) and int(digits) > 0


def error_text(e: BaseException, *, bare: bool = False) -> str:
    """"Type: message" of an exception (`bare`: the message alone, for one whose message names the
    error already), cut at 2000 characters: what every report keeps of an error."""
    text = str(e) if bare else f"{type(e).__name__}: {e}".strip()
    return text if len(text) <= 2000 else text[:2000] + " ..."


def _compiled_function(frame) -> str | None:
    """Name the code object dynamo's `_compile` is compiling (a local named `code`), from the stack."""
    depth = 0
    while frame is not None and depth < 40:
        if frame.f_code.co_name == "_compile" and frame.f_code.co_filename.endswith("convert_frame.py"):
            code = frame.f_locals.get("code")
            if code is not None and hasattr(code, "co_filename"):
                from compilewatch.tracing.stacks import short_path

                return f"{code.co_name} ({short_path(code.co_filename)}:{code.co_firstlineno})"
            return None
        frame, depth = frame.f_back, depth + 1
    return None


@dataclass
class CompileRecorder:
    """Records compile windows while installed (context manager or install/uninstall)."""

    windows: list[CompileWindow] = field(default_factory=list)
    _open: CompileWindow | None = field(default=None, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _installed: bool = field(default=False, repr=False)
    # objects with on_compile_start(window) / on_compile_end(window), called in the compiling thread
    listeners: list = field(default_factory=list, repr=False)

    def _start(self, args=None) -> None:
        t = threading.current_thread()
        w = CompileWindow(
            compile_id=str(getattr(args, "compile_id", "?")),
            trigger=getattr(getattr(args, "callback_trigger", None), "name", "DYNAMO"),
            thread_id=t.ident or 0,
            thread_name=t.name,
            start=time.time(),
            function=_compiled_function(sys._getframe(1)),
            _exc_at_start=sys.exc_info()[1],
        )
        with self._lock:
            self._open = w
            self.windows.append(w)
        self._notify("on_compile_start", w)

    def _end(self, args=None) -> None:
        with self._lock:
            w, self._open = self._open, None
            if w is not None:
                w.end, w.mono_end = time.time(), time.monotonic()
                # the end callback runs in install_callbacks' `finally`: an exception in flight is the
                # compile's own failure (one that was already being handled at the start is not)
                exc = sys.exc_info()[1]
                if exc is not None and exc is not w._exc_at_start:
                    w.error = error_text(exc)
                w._exc_at_start = None
        if w is not None:
            self._notify("on_compile_end", w)

    def _notify(self, method: str, w: CompileWindow) -> None:
        for listener in list(self.listeners):
            try:
                getattr(listener, method)(w)
            except Exception as e:  # noqa: BLE001 - an instrument never breaks a compile
                from compilewatch.tracing import tracehooks

                tracehooks.note_listener_error(f"{type(listener).__name__}.{method}", e)

    def open_window(self) -> CompileWindow | None:
        with self._lock:
            return self._open

    def install(self) -> None:
        from torch._dynamo.callback import callback_handler

        if not self._installed:
            callback_handler.register_start_callback(self._start)
            callback_handler.register_end_callback(self._end)
            self._installed = True

    def uninstall(self) -> None:
        from torch._dynamo.callback import callback_handler

        if self._installed:
            # torch._dynamo.reset() clears every callback: ours may be gone already
            if self._start in callback_handler.start_callbacks:
                callback_handler.remove_start_callback(self._start)
            if self._end in callback_handler.end_callbacks:
                callback_handler.remove_end_callback(self._end)
            self._installed = False

    def ensure_installed(self) -> bool:
        """Re-register after a torch._dynamo.reset() cleared the callbacks; True if it had to."""
        from torch._dynamo.callback import callback_handler

        if not self._installed:
            return False
        missing = self._start not in callback_handler.start_callbacks
        if missing:
            callback_handler.register_start_callback(self._start)
        if self._end not in callback_handler.end_callbacks:
            callback_handler.register_end_callback(self._end)
            missing = True
        return missing

    def __enter__(self) -> "CompileRecorder":
        self.install()
        return self

    def __exit__(self, *exc: object) -> None:
        self.uninstall()
