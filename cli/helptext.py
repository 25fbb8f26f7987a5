"""Help text as rich should wrap it: a docstring's own line breaks removed inside prose paragraphs.

typer's rich markup mode keeps every single newline of a docstring, so a paragraph written at 100
columns in the source prints as a full line followed by a stub at 80 or 120 columns. `reflow` joins
the lines of each prose paragraph into one line and leaves rich to wrap it at the terminal's width.

What stays as written:
- an indented paragraph (examples, shell commands, continuation lines ending in `\\`),
- a paragraph that starts with typer's `\\b` no-rewrap marker,
- list items: a line starting with `- `, `* ` or `N. ` starts a new line; its continuation lines
  (indented or not) are joined onto it.

`CompilewatchGroup` (cli/app.py) applies it once to every group, command and parameter help, so no
docstring needs hand re-flowing.
"""

from __future__ import annotations

import inspect
import re

_BULLET = re.compile(r"^(?:[-*•]|\d+[.)])\s")


def reflow(text: str | None) -> str | None:
    """`text` with the single line breaks inside its prose paragraphs replaced by spaces."""
    if not text:
        return text
    head, ff, tail = inspect.cleandoc(text).partition("\f")  # click: nothing after \f is shown
    body = head.rstrip("\n")
    out = [_reflow_paragraph(p) for p in re.split(r"\n[ \t]*\n", body.strip("\n"))]
    return "\n\n".join(out) + head[len(body):] + ff + tail


def _reflow_paragraph(p: str) -> str:
    lines = p.split("\n")
    if p.startswith("\b") or lines[0][:1] in (" ", "\t"):
        return p
    items: list[str] = []
    for line in lines:
        stripped = line.strip()
        if items and not _BULLET.match(stripped):
            items[-1] += " " + stripped
        else:
            items.append(stripped)
    return "\n".join(items)


def reflow_command(cmd) -> None:
    """Reflow a click command's help, short help and its parameters' help, in place."""
    cmd.help = reflow(cmd.help)
    if getattr(cmd, "short_help", None):
        cmd.short_help = reflow(cmd.short_help)
    for param in getattr(cmd, "params", ()):
        if getattr(param, "help", None):
            param.help = reflow(param.help)
