"""The one progress display for long operations, on stderr (stdout stays data).

On a terminal: rich bars (description, bar, done/total, elapsed, remaining, a free-text info column).
Off a terminal (a pipe, a CI log, torchrun/Slurm output files): no bars, no cursor tricks; a plain
line per task when it starts, then every `interval_s` seconds while it runs, and one when it ends:

    [progress] train 120/288 (41.7%) elapsed 0:00:35 left ~0:00:49 | loss 2.310 ...

`interval_s` defaults to COMPILEWATCH_PROGRESS_INTERVAL (seconds), else 30. Library functions never
print: they take an optional callback, and the commands turn its calls into `update()`s here.
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass, field
from typing import Any

from cli import output

DEFAULT_INTERVAL_S = 30.0


def _interval() -> float:
    try:
        return max(0.0, float(os.environ.get("COMPILEWATCH_PROGRESS_INTERVAL", DEFAULT_INTERVAL_S)))
    except ValueError:
        return DEFAULT_INTERVAL_S


def _clock(s: float) -> str:
    s = int(max(0, s))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


@dataclass
class _Task:
    description: str
    total: float | None
    completed: float = 0
    info: str = ""
    started: float = field(default_factory=time.monotonic)
    last_line: float = 0.0
    rich_id: Any = None
    fmt: Any = None  # how to show done/total (e.g. bytes); default: plain numbers


BAR = 20  # the bar's width on a terminal


class Progress:
    """`with Progress() as p: t = p.add("save", total=n); p.update(t, completed=i, info="...")`."""

    def __init__(self, enabled: bool = True, *, console=None, interval_s: float | None = None) -> None:
        self.console = console or output.err
        self.enabled = enabled
        self.live = enabled and self.console.is_terminal
        self.interval_s = _interval() if interval_s is None else interval_s
        self.tasks: list[_Task] = []
        self._rich = None
        if self.live:
            from rich.progress import (BarColumn, Progress as RichProgress, TextColumn, TimeElapsedColumn,
                                       TimeRemainingColumn)

            # on a narrow terminal the info text (a step's loss, τ, tokens/s) is cut to what is left:
            # the bar, the count, the elapsed time and the ETA keep their width (`_fit`)
            self._rich = RichProgress(
                TextColumn("[bold]{task.description}"), BarColumn(bar_width=BAR), TextColumn("{task.fields[amount]}"),
                TimeElapsedColumn(), TimeRemainingColumn(), TextColumn("{task.fields[info]}"),
                console=self.console, transient=False)

    def __enter__(self) -> Progress:
        if self._rich is not None:
            self._rich.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._rich is not None:
            self._rich.stop()
            return
        for t in self.tasks:  # off a terminal: where each unfinished task stopped
            if t.total is None or t.completed < t.total:
                self._line(t, "stopped at")

    # ------------------------------------------------------------------------------------------
    def add(self, description: str, total: float | None = None, completed: float = 0, info: str = "",
            fmt=None) -> _Task:
        t = _Task(description, total, completed, info, fmt=fmt)
        self.tasks.append(t)
        if self._rich is not None:
            t.rich_id = self._rich.add_task(description, total=total, completed=completed, info=info,
                                            amount=self._done_of(t))
        elif self.enabled:
            self._line(t, "started")
        return t

    def update(self, t: _Task, *, completed: float | None = None, advance: float = 0, total: float | None = None,
               info: str | None = None) -> None:
        if total is not None:
            t.total = total
        if completed is not None:
            t.completed = completed
        t.completed += advance
        if info is not None:
            t.info = info
        if self._rich is not None:
            amount = self._done_of(t)
            self._rich.update(t.rich_id, completed=t.completed, total=t.total, info=self._fit(t, amount),
                              amount=amount)
            return
        if not self.enabled:
            return
        now = time.monotonic()
        finished = t.total is not None and t.completed >= t.total
        if finished or now - t.last_line >= self.interval_s:
            self._line(t, "done" if finished else None)

    def remove(self, t: _Task) -> None:
        if t in self.tasks:
            self.tasks.remove(t)
        if self._rich is not None:
            self._rich.remove_task(t.rich_id)

    def print(self, message: str, **kw) -> None:
        """A line above the bars (or in the log)."""
        if self.enabled:
            self.console.print(message, **kw)

    def _fit(self, t: _Task, amount: str) -> str:
        """`t.info` cut (with …) to the columns the bar's row leaves on this console."""
        used = max(len(x.description) for x in self.tasks) + 1 + BAR + 1 + len(amount) + 1 + 2 * (len("0:00:00") + 1) + 1
        room = self.console.width - used
        if len(t.info) <= room:
            return t.info
        return t.info[:max(room - 1, 0)] + "…" if room > 1 else ""

    # ------------------------------------------------------------------------------------------
    def _amount(self, t: _Task, v: float | None) -> str:
        if v is None:
            return "?"
        return t.fmt(v) if t.fmt else f"{v:,.0f}"

    def _done_of(self, t: _Task) -> str:
        return self._amount(t, t.completed) + (f"/{self._amount(t, t.total)}" if t.total else "")

    def _line(self, t: _Task, state: str | None) -> None:
        t.last_line = time.monotonic()
        elapsed = t.last_line - t.started
        parts = [f"[progress] {t.description}"]
        if state:
            parts.append(state)
        parts.append(self._done_of(t) + (f" ({100.0 * t.completed / t.total:.1f}%)" if t.total else ""))
        parts.append(f"elapsed {_clock(elapsed)}")
        if t.total and 0 < t.completed < t.total:
            parts.append(f"left ~{_clock(elapsed * (t.total - t.completed) / t.completed)}")
        line = " ".join(parts) + (f" | {t.info}" if t.info else "")
        self.console.print(line, markup=False, highlight=False)


LARGE_BYTES = 64 << 20  # byte-counted operations smaller than this show no progress (they take a moment)


@contextlib.contextmanager
def byte_progress(description: str, enabled: bool = True, min_total: int = LARGE_BYTES):
    """A `progress(done, total)` callback for library functions that count bytes (cache fingerprint,
    save, load); a task appears once the total is known to be at least `min_total`."""
    with Progress(enabled=enabled) as p:
        task: list[_Task] = []

        def on_bytes(done: int, total: int) -> None:
            if not task:
                if total < min_total:
                    return
                task.append(p.add(description, total=total, fmt=output.fmt_bytes))
            p.update(task[0], completed=done, total=total)

        yield on_bytes
