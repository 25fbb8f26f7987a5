"""One output helper for every command: JSON on stdout with --json, rich for people otherwise.

stdout carries the command's result (a table, a report, or JSON); progress, warnings and hints go to
stderr. Rich drops colour by itself when stdout is not a terminal or NO_COLOR is set.

Off a terminal (a pipe, a CI log, a torchrun/Slurm output file) rich would cut everything to 80
columns: paths end in `…`, table cells wrap. There the consoles are made OFF_TTY_WIDTH wide instead,
so lines come out whole (tables are not expanded: they stay as wide as their content).
"""

from __future__ import annotations

import json
import sys
from typing import Any, Callable

from rich.console import Console

from compilewatch.serialize import to_jsonable

OFF_TTY_WIDTH = 4096


class _Console(Console):
    def on_broken_pipe(self) -> None:
        """Let a closed pipe propagate (rich would exit 1 here): cli/app.py handles it once."""
        self.quiet = True
        raise BrokenPipeError


def make_console(**kw: Any) -> Console:
    """A Console with our defaults: no highlighting, no wrapping of long lines, and off a terminal
    OFF_TTY_WIDTH columns (instead of 80)."""
    c = _Console(soft_wrap=True, highlight=False, **kw)
    if not c.is_terminal:
        c.width = OFF_TTY_WIDTH
    return c


out = make_console()
err = make_console(stderr=True)


def print_json(data: Any) -> None:
    """Write `data` as JSON to stdout (and nothing else)."""
    sys.stdout.write(json.dumps(to_jsonable(data), indent=2) + "\n")
    sys.stdout.flush()


def emit(data: Any, as_json: bool, render: Callable[[Any], None]) -> None:
    """Print `data` as JSON (stdout only) or through `render` for people."""
    if as_json:
        print_json(data)
    else:
        render(data)


def warn(message: str) -> None:
    err.print(f"[yellow]warning:[/] {message}")


def hint(message: str) -> None:
    err.print(f"[dim]hint:[/] {message}")


def fmt_bytes(n: int | float | None) -> str:
    if n is None:
        return "-"
    n = float(n)
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1024 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TB"


def fmt_seconds(s: float | None) -> str:
    if s is None:
        return "-"
    return f"{s * 1000:.1f} ms" if s < 1 else f"{s:.2f} s"
