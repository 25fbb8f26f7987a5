"""PEP 751 `pylock.toml`, validated and read by packaging.pylock (packaging >= 26.4)."""

from __future__ import annotations

import re

from packaging.pylock import Pylock, PylockUnsupportedVersionError, PylockValidationError
from packaging.utils import canonicalize_name

from compilewatch.env.formats.model import EnvSpec, Package, bad_line, line_of, normalize_source
from compilewatch.env.formats.tomlutil import load_toml
from compilewatch.env.formats.uvlock import PYPI

_PACKAGE_INDEX = re.compile(r"^packages\[(\d+)\]")


def parse_pylock(text: str, path: str) -> EnvSpec:
    data = load_toml(text, path)
    try:
        lock = Pylock.from_dict(data)
    except PylockUnsupportedVersionError as e:
        raise bad_line(path, line_of(text, "lock-version"), f"unsupported pylock: {e}") from None
    except PylockValidationError as e:
        raise bad_line(path, _line_of_context(text, getattr(e, "context", None) or ""),
                       f"invalid pylock.toml: {e}", hint="PEP 751 describes the format") from None
    packages = []
    for p in lock.packages:
        source, editable = _source(p)
        packages.append(Package(
            name=canonicalize_name(p.name),
            version=str(p.version) if p.version is not None else None,
            source=source,
            editable=editable,
            marker=str(p.marker) if p.marker is not None else None,
        ))
    notes = []
    if lock.requires_python:
        notes.append(f"{path}: pylock records requires-python {lock.requires_python}, not a Python version")
    return EnvSpec(path=path, format="pylock", packages=tuple(packages), notes=tuple(notes))


def _source(p) -> tuple[str | None, bool]:
    if p.vcs is not None:
        where = p.vcs.url or p.vcs.path
        return f"{p.vcs.type}+{where}@{p.vcs.commit_id}", False
    if p.directory is not None:
        return normalize_source(p.directory.path), bool(p.directory.editable)
    if p.archive is not None:
        return normalize_source(p.archive.url or p.archive.path), False
    if p.index and p.index.rstrip("/") != PYPI:
        return p.index, False
    return None, False


def _line_of_context(text: str, context: str) -> int | None:
    """'packages[3].name' -> the line of the 4th [[packages]] table (or of the key, if top-level)."""
    m = _PACKAGE_INDEX.match(context)
    if not m:
        key = context.split(".")[0].split("[")[0]
        return line_of(text, key) if key else None
    line = 0
    for _ in range(int(m.group(1)) + 1):
        found = line_of(text, "[[packages]]", line + 1)
        if found is None:
            return None
        line = found
    return line
