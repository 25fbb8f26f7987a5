"""Where a run's start goes: each phase (imports, cuda, weights, target, data, drafter, resume state,
trainer, first step: dflash.training.build says what each is) timed and reported as an event, so the
CLI shows the user where the seconds before training went.

    phases = Phases(on_event)
    with phases.phase("target"):   # -> on_event("phase-done", {"name": "target", "seconds": 14.8, "at": 19.7})
        ...

`at` is seconds since this process started (Linux: /proc; elsewhere since this module was imported),
so the events line up with a log stamped from process start. A phase that runs in a thread beside
others (`Background`, or a span timed elsewhere: `Phases.record`) is reported when it is joined, with
`beside`: the phases it overlapped, so the seconds of overlapped phases are not read as a sum.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from typing import Any, Callable, Iterator

Event = Callable[[str, dict[str, Any]], None]
_IMPORTED = time.monotonic()


def seconds_since_process_start() -> float:
    """Seconds since this process started: /proc/uptime minus the process's start time (clock ticks
    since boot, /proc/self/stat field 22); off Linux, since this module was imported."""
    try:
        with open("/proc/self/stat", "rb") as fh:
            raw = fh.read(4096)
        ticks = int(raw[raw.rindex(b")") + 2:].split()[19])
        with open("/proc/uptime", "rb") as fh:
            uptime = float(fh.read(64).split()[0])
        return max(0.0, uptime - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return time.monotonic() - _IMPORTED


class Phases:
    """Times named phases; each one that ends is reported as a "phase-done" event (see module doc)."""

    def __init__(self, on_event: Event) -> None:
        self.on_event = on_event
        self.done: dict[str, float] = {}
        self.spans: dict[str, tuple[float, float]] = {}  # perf_counter (start, end) of each `phase`

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        t0 = time.perf_counter()
        yield
        t1 = time.perf_counter()
        self.spans[name] = (t0, t1)
        self.mark(name, t1 - t0)

    def record(self, name: str, span: tuple[float, float]) -> None:
        """Report phase `name` that ran in another thread over `span` (perf_counter start, end): its
        seconds, when it ended (since process start) and `beside`: the phases recorded so far that
        overlapped it."""
        t0, t1 = span
        beside = [n for n, (a, b) in self.spans.items() if a < t1 and b > t0 and n != name]
        self.spans[name] = span
        at = seconds_since_process_start() - max(0.0, time.perf_counter() - t1)
        self.mark(name, t1 - t0, beside=beside, at=at)

    def mark(self, name: str, seconds: float, *, beside: list[str] | None = None, at: float | None = None) -> None:
        """Report phase `name` done; `beside`: the phases it ran concurrently with (a Background
        phase), `at`: when it ended (default now)."""
        self.done[name] = seconds
        data = {"name": name, "seconds": round(seconds, 3),
                "at": round(seconds_since_process_start() if at is None else at, 2)}
        if beside:
            data["beside"] = list(beside)
        self.on_event("phase-done", data)


class Background:
    """One start phase run in a thread while the main thread runs others (issue 28: the start's reads
    overlap). `join()` returns its result, or raises the very exception it raised (its type, message
    and traceback: the same error the sequential start gives); the phase is reported then, from the
    joining thread, with the phases that ran beside it ("beside": the CLI says so).

        bg = Background(phases, "resume state", read)   # starts now
        ...                                             # other phases
        state = bg.join()                               # -> "phase-done" {"name": "resume state", "beside": [...]}
    """

    def __init__(self, phases: Phases, name: str, fn: Callable[[], Any]) -> None:
        self.phases, self.name = phases, name
        self._result: Any = None
        self._error: BaseException | None = None
        self._span = (time.perf_counter(), 0.0)
        self._thread = threading.Thread(target=self._run, args=(fn,), name=f"dflash-start-{name}", daemon=True)
        self._thread.start()

    def _run(self, fn: Callable[[], Any]) -> None:
        try:
            self._result = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the joining thread, which raises it
            self._error = e
        finally:
            self._span = (self._span[0], time.perf_counter())

    def join(self) -> Any:
        """Wait for the phase; its result, or its exception raised here. Reported once it succeeded."""
        self._thread.join()
        if self._error is not None:
            error, self._error = self._error, None
            raise error
        self.phases.record(self.name, self._span)
        return self._result

    def wait_quietly(self) -> None:
        """Wait for the thread without raising or reporting (the start failed elsewhere: what the phase
        read is dropped, but nothing it touches is released under it)."""
        self._thread.join()
