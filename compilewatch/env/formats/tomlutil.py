"""TOML reading for the lock formats: tomllib (tomli before Python 3.11), errors with file and line."""

from __future__ import annotations

import re
import sys
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

from compilewatch.env.formats.model import bad_line

_AT_LINE = re.compile(r"\(at line (\d+), column (\d+)\)")


def load_toml(text: str, path: str) -> dict[str, Any]:
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        msg = str(e)
        m = _AT_LINE.search(msg)
        line = int(m.group(1)) if m else getattr(e, "lineno", None)
        raise bad_line(path, line, f"invalid TOML: {_AT_LINE.sub('', msg).strip()}") from None
