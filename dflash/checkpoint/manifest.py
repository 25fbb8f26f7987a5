"""Placeholder until issue 31's manifest.py (helper dflashfaults) lands on main: same signatures;
records file sizes only. Replaced wholesale by that file on merge."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable

MANIFEST = "manifest.json"


def record(directory: Path, names: Iterable[str]) -> dict[str, Any]:
    from compilewatch import atomic_write_json

    files = {n: {"bytes": (Path(directory) / n).stat().st_size} for n in names if n != MANIFEST}
    manifest = {"format": "dflash-checkpoint-manifest", "version": 1, "files": files}
    atomic_write_json(Path(directory) / MANIFEST, manifest)
    return manifest


def check(directory: Path, names: Iterable[str] | None = None) -> str | None:
    return None
