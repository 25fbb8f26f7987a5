"""How every --help looks, one convention for both CLIs (installed once by cli/app.py).

- Arguments in usage lines and the Arguments panel: upper case (no type column: the name says), `NAME` when required, `[NAME]` when
  optional, `NAME...` / `[NAME]...` when they repeat (click's convention; typer 0.29 mixes `{name}`,
  `[name]` and the metavar's own case).
- The option type column names what a value is (`TEXT`, `INTEGER`, `FLOAT`, `PATH`, `a|b|c` for
  choices) and is empty for flags: a flag takes no value, so `<bool>` told the reader nothing.
- Output as a person reads it: no trailing spaces (rich pads every line to the console width), no
  blank first line, never two blank lines in a row (an `Examples:` heading over indented examples
  rendered as two).

typer renders help with private helpers (`typer.core`, `typer.rich_utils`); pyproject.toml pins typer's
minor range, and tests/test_cli_help_style.py walks every command's help so a typer that renders
differently fails a test, not a user.
"""

from __future__ import annotations

import re
from typing import Any

_TYPE_NAMES = {"str": "TEXT", "int": "INTEGER", "float": "FLOAT", "bool": "BOOLEAN", "int range": "INTEGER",
               "float range": "FLOAT", "Path": "PATH", "path": "PATH", "file": "FILE", "directory": "DIR"}
_typer_display_type: Any = None  # typer's own TyperOption.display_type, kept by install()
_TRAILING = re.compile(r"[ \t]+((?:\x1b\[[0-9;]*m)*)$")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def argument_name(param: Any) -> str:
    name = (param.metavar or param.name or "").strip("[]{}").upper()
    return name


def usage_name(param: Any) -> str:
    name = argument_name(param)
    if not param.required:
        name = f"[{name}]"
    return name + ("..." if param.nargs != 1 else "")


def panel_name(param: Any) -> str:
    return argument_name(param) + ("..." if param.nargs != 1 else "")


def option_type(param: Any, ctx: Any = None) -> str | None:
    """What the type column says for an option: None for a flag (or a counter)."""
    if param.metavar is not None:
        return param.metavar
    if getattr(param, "is_flag", False) or getattr(param, "count", False):
        return None
    label = _typer_display_type(param, ctx).strip("<>")  # typer's "<str>", "<list[str]>", "<a|b>"
    inner = re.fullmatch(r"list\[(.*)\]", label)
    label = inner.group(1) if inner else label  # a repeatable option: its help says so
    if "|" in label:
        return label
    return _TYPE_NAMES.get(label, label.upper())


class TidyWriter:
    """A text stream that drops trailing spaces and, with `blank_lines`, leading blank lines and a
    second blank line in a row. `target` is a stream, or a function returning one (read at each
    write: sys.stdout as it is then, which a test runner may have swapped)."""

    def __init__(self, target: Any, *, blank_lines: bool = True) -> None:
        self._target = target
        self._blank_lines = blank_lines
        self._partial = ""
        self._started = False
        self._blanks = 0

    @property
    def target(self) -> Any:
        return self._target() if callable(self._target) else self._target

    def write(self, text: str) -> int:
        data = self._partial + text
        *lines, self._partial = data.split("\n")
        out = []
        for line in lines:
            line = _TRAILING.sub(r"\1", line)
            if self._blank_lines and not _ANSI.sub("", line).strip():
                if not self._started or self._blanks:
                    continue
                self._blanks = 1
            else:
                self._started, self._blanks = True, 0
            out.append(line + "\n")
        if out:
            self.target.write("".join(out))
        return len(text)

    def flush(self) -> None:
        if self._partial:  # a line still being written (`print(..., end="")`): as it is, spaces kept
            self.target.write(self._partial)
            self._partial = ""
            self._started, self._blanks = True, 0
        self.target.flush()

    def __getattr__(self, name: str) -> Any:  # isatty, fileno, encoding: the real stream's
        return getattr(self.target, name)


def install() -> None:
    """Apply the convention to typer's help rendering (idempotent)."""
    import typer.core as core
    import typer.rich_utils as rich_utils

    if getattr(rich_utils, "_compilewatch_style", False):
        return
    core.TyperArgument._usage_display_name = usage_name  # type: ignore[method-assign]
    core.TyperArgument._rich_display_name = panel_name  # type: ignore[method-assign]
    core.TyperArgument.display_name_raw = property(argument_name)  # the Arguments panel's name column
    core.TyperArgument.display_type_rich = lambda self, ctx=None: None  # the name says what it is
    global _typer_display_type
    _typer_display_type = core.TyperOption.display_type
    core.TyperOption.display_type_rich = option_type  # type: ignore[method-assign]
    original = rich_utils._get_rich_console

    def console(stderr: bool = False):  # type: ignore[no-untyped-def]
        c = original(stderr=stderr)
        c.file = TidyWriter(c.file)
        return c

    rich_utils._get_rich_console = console
    rich_utils._compilewatch_style = True
