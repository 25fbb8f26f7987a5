"""Help text as rich should wrap it: a docstring's own line breaks removed inside prose paragraphs.

typer's rich markup mode keeps every single newline of a docstring, so a paragraph written at 100
columns in the source prints as a full line followed by a stub at 80 or 120 columns. `reflow` joins
the lines of each prose paragraph into one line and leaves rich to wrap it at the terminal's width.

What stays as written:
- an indented paragraph (examples, shell commands, continuation lines ending in `\\`),
- a paragraph that starts with typer's `\\b` no-rewrap marker,
- list items: a line starting with `- `, `* ` or `N. ` starts a new line; its continuation lines
  (indented or not) are joined onto it;
- indented lines inside a prose paragraph (examples right under "Examples:").

`CompilewatchGroup` (cli/app.py) applies it once to every group, command and parameter help, so no
docstring needs hand re-flowing.
"""

from __future__ import annotations

import inspect
import re

_KEEP_INDENT = "[dim][/dim]"  # rich markup that renders as nothing: a non-indented line for cleandoc
_BULLET = re.compile(r"^(?:[-*•]|\d+[.)])\s")


def reflow(text: str | None) -> str | None:
    """`text` with the single line breaks inside its prose paragraphs replaced by spaces."""
    if not text:
        return text
    head, ff, tail = inspect.cleandoc(text).partition("\f")  # click: nothing after \f is shown
    body = head.rstrip("\n")
    out = [_reflow_paragraph(p) for p in re.split(r"\n[ \t]*\n", body.strip("\n"))]
    rest = "\n\n".join(out[1:]).split("\n")
    if len(rest) > 1 and all(line[:1] in (" ", "\t") for line in rest[1:] if line.strip()):
        # typer runs inspect.cleandoc on the text after the first paragraph, which strips the common
        # indentation of its lines 2+: "Examples:" followed only by indented examples would lose
        # their indent. An empty markup line (renders as a blank line) keeps them as written.
        out[1:] = ["\n".join([rest[0], _KEEP_INDENT, *rest[1:]])]
    return "\n\n".join(out) + head[len(body):] + ff + tail


def _reflow_paragraph(p: str) -> str:
    lines = p.split("\n")
    if p.startswith("\b") or lines[0][:1] in (" ", "\t"):
        return p
    items: list[str] = []
    kinds: list[str] = []  # "prose", "bullet" or "code" per item
    for line in lines:
        stripped = line.strip()
        indented = line[:1] in (" ", "\t")
        if _BULLET.match(stripped) and not indented:
            items.append(stripped)
            kinds.append("bullet")
        elif indented and kinds and kinds[-1] == "bullet":
            items[-1] += " " + stripped  # a list item's continuation
        elif indented:
            items.append(line.rstrip())  # an example under a prose line ("Examples:"): as written
            kinds.append("code")
        elif kinds and kinds[-1] != "code":
            items[-1] += " " + stripped
        else:
            items.append(stripped)
            kinds.append("prose")
    return "\n".join(items)


def reflow_command(cmd) -> None:
    """Reflow a click command's help, short help and its parameters' help, in place."""
    cmd.help = reflow(cmd.help)
    if getattr(cmd, "short_help", None):
        cmd.short_help = reflow(cmd.short_help)
    for param in getattr(cmd, "params", ()):
        if getattr(param, "help", None):
            param.help = reflow(param.help)
