"""What every environment format is read into: a list of packages plus the facts the format knows."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from compilewatch.errors import BadInput

if TYPE_CHECKING:
    from compilewatch.envlock import EnvLock


@dataclass(frozen=True, slots=True)
class Package:
    name: str  # canonical (PEP 503) name: "flash-attn", "torch"
    version: str | None  # exact version when the format pins one ("2.11.0+cu128"); None otherwise
    spec: str | None = None  # an unpinned specifier (">=1.26") when there is no exact version
    source: str | None = None  # where it comes from when not a plain index: VCS/file URL, path, index URL
    editable: bool = False
    marker: str | None = None  # environment marker ("sys_platform == 'linux'"), when the format has one
    build: str | None = None  # conda build string ("py3.12_cuda12.4_cudnn9.1.0_0")

    def label(self) -> str:
        """How the package's version is shown: "v2.11.0+cu128", ">=1.26", or the source."""
        if self.version:
            return f"v{self.version}"
        if self.spec:
            return self.spec
        return self.source or "(any version)"


@dataclass(frozen=True, slots=True)
class EnvSpec:
    """One side of a diff: an environment as a file describes it."""

    path: str
    format: str  # one of compilewatch.envformats.FORMATS
    packages: tuple[Package, ...]
    python: str | None = None  # the Python version when the format records one ("3.12.3", "3.12")
    lock: "EnvLock | None" = None  # the full snapshot when the file is a compilewatch lock
    notes: tuple[str, ...] = field(default=())  # what the reader skipped or could not know

    def by_name(self) -> dict[str, tuple[Package, ...]]:
        out: dict[str, list[Package]] = {}
        for p in self.packages:
            out.setdefault(p.name, []).append(p)
        return {k: tuple(v) for k, v in out.items()}


def bad_line(path: str, line: int | None, what: str, *, hint: str | None = None) -> BadInput:
    """A BadInput that names the file and line: `requirements.txt:12: not a requirement: ...`."""
    where = f"{path}:{line}" if line else path
    return BadInput(f"{where}: {what}", hint=hint)


def line_of(text: str, needle: str, start: int = 1) -> int | None:
    """1-based number of the first line at or after `start` that contains `needle`."""
    for i, line in enumerate(text.splitlines()[start - 1:], start):
        if needle in line:
            return i
    return None
