"""uv's `uv.lock` (TOML, read with tomllib).

A name may appear several times (`torch 2.7.1` from PyPI for macOS, `2.7.1+cpu` and `2.7.1+cu128`
from PyTorch's indexes for Linux): every `[[package]]` becomes its own Package, keyed by name +
version + source, and the diff compares the set of versions a name has.
"""

from __future__ import annotations

from packaging.utils import canonicalize_name

from compilewatch.env.formats.model import EnvSpec, Package, bad_line, git_source, line_of, normalize_source
from compilewatch.env.formats.tomlutil import load_toml

PYPI = "https://pypi.org/simple"


def parse_uv_lock(text: str, path: str) -> EnvSpec:
    data = load_toml(text, path)
    if "version" not in data or not isinstance(data.get("package", []), list):
        raise bad_line(path, 1, "not a uv.lock: expected a top-level `version` and [[package]] tables",
                       hint="pass --format to say what the file is")
    packages = []
    search_from = 1
    for i, entry in enumerate(data.get("package", [])):
        line = line_of(text, "[[package]]", search_from)
        search_from = (line or search_from) + 1
        if not isinstance(entry, dict) or not isinstance(entry.get("name"), str):
            raise bad_line(path, line, f"[[package]] #{i + 1} has no name")
        source = entry.get("source", {})
        if not isinstance(source, dict):
            raise bad_line(path, line, f"package {entry['name']!r}: `source` must be a table")
        version = entry.get("version")
        if version is not None and not isinstance(version, str):
            raise bad_line(path, line, f"package {entry['name']!r}: `version` must be a string")
        packages.append(Package(
            name=canonicalize_name(entry["name"]),
            version=version,
            source=_source(source),
            editable="editable" in source,
        ))
    notes = []
    if data.get("requires-python"):
        notes.append(f"{path}: uv.lock records requires-python {data['requires-python']}, not a Python version")
    return EnvSpec(path=path, format="uv.lock", packages=tuple(packages), notes=tuple(notes))


def _source(source: dict) -> str | None:
    """uv's source table -> one string; PyPI (the default index) is None, like a plain pip install."""
    if "registry" in source:
        return None if str(source["registry"]).rstrip("/") == PYPI else str(source["registry"])
    if "git" in source:
        return git_source(str(source["git"]))
    for kind in ("url", "path", "directory", "editable", "virtual"):
        if kind in source:
            return normalize_source(str(source[kind]))
    return None
