"""The one TOML reader (uv.lock, pylock.toml, dflash configs): tomllib (tomli before Python 3.11),
errors with file and line, and a bound on what makes tomllib slow.

tomllib's work per dotted key grows with the square of its number of parts (`a.a.a...`: 8,000
parts, 16 KB, take 0.8 s; a 400 KB key would take minutes). Real files use a handful of parts, so
`check_key_depth` refuses, in one linear pass before tomllib runs, a key or table header with more
than MAX_KEY_PARTS parts. The pass skips strings and comments (a version "2.11.0" or a URL holds
dots that are no key's) and counts the dots between two of `= [ ] { } ,` or a line end: within a
value there is at most one (a float, a time), within a key one per part.
"""

from __future__ import annotations

import re
import sys
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

from compilewatch.env.formats.model import bad_line

MAX_KEY_PARTS = 64  # uv.lock and pylock.toml use 1-3, a dflash config 2

_AT_LINE = re.compile(r"\(at line (\d+), column (\d+)\)")
_SPECIAL = re.compile(r"\"\"\"|'''|[\"'#.=\[\]{},\n]")
_BASIC = re.compile(r'(?:[^"\\\n]|\\.)*"')
_LITERAL = re.compile(r"[^'\n]*'")
_ML_BASIC = re.compile(r'(?s)(?:[^"\\]|\\.|"(?!""))*"""')
_ML_LITERAL = re.compile(r"(?s)(?:[^']|'(?!''))*'''")
_RESETS = frozenset("=[]{},\n")


def check_key_depth(text: str, path: str, limit: int = MAX_KEY_PARTS) -> None:
    """BadInput (file:line) for a dotted key or table header of more than `limit` parts; linear."""
    dots = 0
    pos = 0
    n = len(text)
    find = _SPECIAL.search
    while pos < n:
        m = find(text, pos)
        if m is None:
            return
        tok = m.group()
        pos = m.end()
        if tok == ".":
            dots += 1
            if dots >= limit:
                line = text.count("\n", 0, pos) + 1
                raise bad_line(path, line, f"a key with more than {limit} dotted parts",
                               hint="real TOML files use a few; this one is crafted or damaged")
        elif tok in _RESETS:
            dots = 0
        elif tok == "#":
            nl = text.find("\n", pos)
            pos = n if nl == -1 else nl
        else:  # a string: skip to its end (an unterminated one is tomllib's error to report)
            pattern = {'"': _BASIC, "'": _LITERAL, '"""': _ML_BASIC, "'''": _ML_LITERAL}[tok]
            end = pattern.match(text, pos)
            if end is not None:
                pos = end.end()


def load_toml(text: str, path: str) -> dict[str, Any]:
    """`text` parsed as TOML; BadInput `path:line: ...` for invalid or over-deep TOML."""
    check_key_depth(text, path)
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        msg = str(e)
        m = _AT_LINE.search(msg)
        line = int(m.group(1)) if m else getattr(e, "lineno", None)
        raise bad_line(path, line, f"invalid TOML: {_AT_LINE.sub('', msg).strip()}") from None
    except RecursionError:  # arrays or inline tables nested deeper than Python's recursion limit
        raise bad_line(path, None, "TOML nested too deeply to read") from None
