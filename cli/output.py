"""One output helper for every command: JSON on stdout with --json, rich for people otherwise.

stdout carries the command's result (a table, a report, or JSON); progress, warnings and hints go to
stderr. Rich drops colour by itself when stdout is not a terminal or NO_COLOR is set.

Off a terminal (a pipe, a CI log, a torchrun/Slurm output file) rich would cut everything to 80
columns: paths end in `…`, table cells wrap. There the consoles are made OFF_TTY_WIDTH wide instead,
so lines come out whole (tables are not expanded: they stay as wide as their content), and without
the trailing spaces rich pads a table's rows with.

Nothing from a file reaches the terminal raw. Results are rendered from `cleaned(data)`: every string
in them (archive member names, cache paths, lock package names, messages quoting files) has its
control characters escaped (`\x1b` for ESC, `\n` for a newline, also C1 controls, line separators
and bidi overrides), so a name can neither send terminal escape sequences nor forge a line. With
`emit(..., escape_markup=True)` (the cache commands, whose renderers interpolate names into markup)
rich markup in strings is escaped too, so a name cannot style the output or break it; renderers that
print data with `markup=False` or escape it themselves (diff-env, probe, run) use the default.
warn/hint/the error map escape controls and markup in their messages.
`--json` needs no extra step: the JSON encoder escapes every control and non-ASCII character
(`\u001b`).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import re
import sys
from pathlib import PurePath
from typing import Any, Callable

from rich.console import Console
from rich.markup import escape as escape_markup

from cli.helpstyle import TidyWriter
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
        # a table is padded to its widest row: without the trailing spaces a log shows each line as
        # long as its content (the stream is looked up at each write, like rich's own default)
        given = kw.get("file")
        stream = (lambda: given) if given is not None else (lambda: sys.stderr) if kw.get("stderr") else (lambda: sys.stdout)
        c.file = TidyWriter(stream, blank_lines=False)
    return c


out = make_console()
err = make_console(stderr=True)


# C0 controls and DEL, C1 controls, Unicode line/paragraph separators, bidi embeddings/overrides/isolates
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\u200e\u200f\u202a-\u202e\u2066-\u2069]")
_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def count(n: int, noun: str, plural: str | None = None) -> str:
    """`1 variable`, `3 variables` (`plural` for nouns that do not take an s)."""
    return f"{n} {noun if n == 1 else plural or noun + 's'}"


def escape_controls(text: str) -> str:
    """`text` with every control character written as an escape (`\x1b`, `\n`, `\u202e`)."""
    return _CONTROL.sub(lambda m: _NAMED.get(m.group(), f"\\x{ord(m.group()):02x}" if ord(m.group()) < 256
                                             else f"\\u{ord(m.group()):04x}"), text)


def clean(text: str) -> str:
    """A string from a file, made safe to print through rich: controls escaped, markup escaped."""
    return escape_markup(escape_controls(text))


def cleaned(data: Any, markup: bool = False) -> Any:
    """A copy of a result with every string in it (dataclass fields, tuples, lists, dict keys and
    values, paths) passed through `escape_controls` (and rich's markup escape with `markup`); other
    values as they are."""
    if isinstance(data, str):
        return clean(data) if markup else escape_controls(data)
    if isinstance(data, PurePath):
        s = str(data)
        c = clean(s) if markup else escape_controls(s)
        return data if c == s else type(data)(c)
    if isinstance(data, tuple) and hasattr(data, "_fields"):
        return type(data)(*(cleaned(x, markup) for x in data))
    if isinstance(data, (list, tuple)):
        return type(data)(cleaned(x, markup) for x in data)
    if isinstance(data, dict):
        return {cleaned(k, markup): cleaned(v, markup) for k, v in data.items()}
    if dataclasses.is_dataclass(data) and not isinstance(data, type):
        new = copy.copy(data)
        for f in dataclasses.fields(data):
            object.__setattr__(new, f.name, cleaned(getattr(data, f.name), markup))
        return new
    return data


def jsonable(data: Any) -> Any:
    return to_jsonable(data)


def print_json(data: Any) -> None:
    """Write `data` as JSON to stdout (and nothing else)."""
    sys.stdout.write(json.dumps(to_jsonable(data), indent=2) + "\n")
    sys.stdout.flush()


def emit(data: Any, as_json: bool, render: Callable[[Any], None], *, escape_markup: bool = False) -> None:
    """Print `data` as JSON (stdout only) or through `render` for people, from `cleaned(data)`."""
    if as_json:
        print_json(data)
    else:
        render(cleaned(data, escape_markup))


def warn(message: str) -> None:
    err.print(f"[yellow]warning:[/] {clean(message)}")


def hint(message: str) -> None:
    err.print(f"[dim]hint:[/] {clean(message)}")


def note(message: str, console: Console | None = None) -> None:
    """A `note:` line (stderr unless `console`): a note quotes paths and files, so its markup is escaped."""
    (console or err).print(f"[dim]note:[/] {clean(message)}", highlight=False)


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
