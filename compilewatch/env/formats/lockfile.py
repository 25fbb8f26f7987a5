"""A compilewatch lock (`compilewatch lock -o FILE`) as one side of a diff."""

from __future__ import annotations

from packaging.utils import canonicalize_name

from compilewatch.env.formats.model import EnvSpec, Package, normalize_source
from compilewatch.env.lock import parse_lock


def parse_lock_file(text: str, path: str) -> EnvSpec:
    lock = parse_lock(text, path)
    packages = tuple(
        Package(name=canonicalize_name(d.name), version=d.version, source=normalize_source(d.source), editable=d.editable)
        for d in lock.distributions
    )
    return EnvSpec(path=path, format="lock", packages=packages, python=lock.python.version, lock=lock,
                   notes=tuple(f"{path}: {n}" for n in lock.notes))
