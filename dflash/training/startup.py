"""Where a run's start goes: each phase (target, data, drafter, resume state, first step) timed and
reported as an event, so the CLI shows the user where the seconds before training went.

    phases = Phases(on_event)
    with phases.phase("target"):   # -> on_event("phase-done", {"name": "target", "seconds": 14.8, "at": 19.7})
        ...

`at` is seconds since this process started (Linux: /proc; elsewhere since this module was imported),
so the events line up with a log stamped from process start.
"""

from __future__ import annotations

import contextlib
import os
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

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        t0 = time.perf_counter()
        yield
        self.mark(name, time.perf_counter() - t0)

    def mark(self, name: str, seconds: float) -> None:
        self.done[name] = seconds
        self.on_event("phase-done", {"name": name, "seconds": round(seconds, 3),
                                     "at": round(seconds_since_process_start(), 2)})
