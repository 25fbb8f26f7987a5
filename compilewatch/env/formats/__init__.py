"""Read environment descriptions of every kind into one model (`EnvSpec`), detecting the format.

Formats: `lock` (compilewatch's own), `requirements` (pip freeze / requirements.txt), `uv.lock`,
`pylock` (PEP 751 pylock.toml), `conda-yaml` (environment.yml), `conda-explicit`
(`conda list --explicit`). Unreadable input raises BadInput naming the file and line.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Callable

from compilewatch.env.formats.conda import parse_conda_explicit, parse_environment_yml
from compilewatch.env.formats.lockfile import parse_lock_file
from compilewatch.env.formats.model import EnvSpec, Package, bad_line
from compilewatch.env.formats.pylock import parse_pylock
from compilewatch.env.formats.requirements import parse_requirements
from compilewatch.env.formats.uvlock import parse_uv_lock
from compilewatch.errors import BadInput
from compilewatch.inputs import one_line, read_text

PARSERS: dict[str, Callable[[str, str], EnvSpec]] = {
    "lock": parse_lock_file,
    "requirements": parse_requirements,
    "uv.lock": parse_uv_lock,
    "pylock": parse_pylock,
    "conda-yaml": parse_environment_yml,
    "conda-explicit": parse_conda_explicit,
}
FORMATS = tuple(PARSERS)
ALIASES = {"freeze": "requirements", "pip": "requirements", "txt": "requirements", "uv": "uv.lock",
           "pylock.toml": "pylock", "conda": "conda-yaml", "environment.yml": "conda-yaml",
           "yaml": "conda-yaml", "explicit": "conda-explicit", "json": "lock"}
_PYLOCK_NAME = re.compile(r"^pylock\.([^.]+\.)?toml$")


def normalize_format(name: str) -> str:
    fmt = ALIASES.get(name.lower(), name.lower())
    if fmt not in PARSERS:
        raise BadInput(f"unknown format {one_line(repr(name), 80)}", hint=f"one of: {', '.join(FORMATS)}")
    return fmt


def detect_format(path: str | os.PathLike[str], text: str) -> str:
    """The format of a file, from its name first, then its content (all of it: a uv.lock's first
    `[[package]]` can sit far down a file; the patterns are anchored per line, so this is linear)."""
    name = Path(path).name.lower()
    head = text.lstrip()
    if name.endswith(".json") or head.startswith("{"):
        return "lock"
    if name == "uv.lock" or (name.endswith(".lock") and "[[package]]" in head):
        return "uv.lock"
    if _PYLOCK_NAME.match(name) or re.search(r"^lock-version\s*=", head, re.M):
        return "pylock"
    if re.search(r"^@EXPLICIT\s*$", head, re.M):
        return "conda-explicit"
    if name.endswith((".yml", ".yaml")) or re.search(r"^dependencies\s*:", head, re.M):
        return "conda-yaml"
    if re.search(r"^\[\[package\]\]", head, re.M):
        return "uv.lock"
    return "requirements"


def load_env(path: str | os.PathLike[str], fmt: str | None = None) -> EnvSpec:
    """Read `path` as `fmt` (detected when None) into an EnvSpec."""
    p = Path(path)
    text = read_text(p, what="lock or requirements file")
    fmt = normalize_format(fmt) if fmt else detect_format(p, text)
    try:
        return PARSERS[fmt](text, str(p))
    except RecursionError:  # TOML / YAML nested deeper than Python's recursion limit
        raise BadInput(f"{p}: nested too deeply to read as {fmt}") from None


__all__ = ["EnvSpec", "Package", "FORMATS", "PARSERS", "bad_line", "detect_format", "load_env",
           "normalize_format"]
