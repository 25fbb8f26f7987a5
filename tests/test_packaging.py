"""pyproject: each dependency listed once, and the wheel carries every file the packages hold."""

from __future__ import annotations

import fnmatch
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
PACKAGES = ("compilewatch", "dflash", "cli")


def test_each_dependency_is_listed_once():
    reqs = [Requirement(r) for r in PYPROJECT["project"]["dependencies"]]
    keys = [(r.name.lower(), str(r.marker)) for r in reqs]
    assert len(keys) == len(set(keys)), sorted(k for k in keys if keys.count(k) > 1)


def test_package_data_matches_what_the_packages_hold():
    """Every non-Python file in a package is shipped by a package-data pattern, and every pattern
    matches a file (the embedded tiny target, tokenizer and data are code: there are none today)."""
    patterns = PYPROJECT["tool"]["setuptools"].get("package-data", {})
    for pkg, globs in patterns.items():
        for g in globs:
            assert any(fnmatch.fnmatch(p.relative_to(ROOT / pkg).as_posix(), g) for p in (ROOT / pkg).rglob("*")
                       if p.is_file()), f"package-data {pkg}: {g!r} matches no file"
    for pkg in PACKAGES:
        for p in (ROOT / pkg).rglob("*"):
            if not p.is_file() or p.suffix in (".py", ".pyc") or "__pycache__" in p.parts:
                continue
            rel = p.relative_to(ROOT / pkg).as_posix()
            assert any(fnmatch.fnmatch(rel, g) for g in patterns.get(pkg, ())), f"{pkg}/{rel} is not in the wheel"
