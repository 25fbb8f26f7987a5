"""What every environment format is read into: a list of packages plus the facts the format knows."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from compilewatch.errors import BadInput
from compilewatch.inputs import one_line

if TYPE_CHECKING:
    from compilewatch.env.lock import EnvLock


@dataclass(frozen=True, slots=True)
class Package:
    name: str  # canonical (PEP 503) name: "flash-attn", "torch"
    version: str | None  # exact version when the format pins one ("2.11.0+cu128"); None otherwise
    spec: str | None = None  # an unpinned specifier (">=1.26") when there is no exact version
    source: str | None = None  # where it comes from when not a plain index: VCS/file URL, path, index URL
    editable: bool = False
    marker: str | None = None  # environment marker ("sys_platform == 'linux'"), when the format has one
    build: str | None = None  # conda build string ("py3.12_cuda12.4_cudnn9.1.0_0")

    @property
    def kind(self) -> str:
        """Where it comes from: "index", "vcs" (git+/hg+/svn+/bzr+), "url" or "local" (a path)."""
        if not self.source:
            return "index"
        if self.source.startswith(("git+", "hg+", "svn+", "bzr+")):
            return "vcs"
        return "url" if "://" in self.source else "local"

    def label(self) -> str:
        """How the package's version is shown: "v2.11.0+cu128", ">=1.26", or the source."""
        if self.version:
            return f"v{self.version}"
        if self.source and self.name == f"{self.kind}:{self.source}":  # no package name: the source is the name
            return f"({'editable ' if self.editable else ''}{self.kind})"
        if self.spec:
            return self.spec
        return self.source or "(any version)"


@dataclass(frozen=True, slots=True)
class EnvSpec:
    """One side of a diff: an environment as a file describes it."""

    path: str
    format: str  # one of compilewatch.env.formats.FORMATS
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
    """A BadInput that names the file and line: `requirements.txt:12: not a requirement: ...`.

    `what` often quotes the file: it is cut to one line of bounded length (a crafted file must not
    turn into a megabyte error message)."""
    where = f"{path}:{line}" if line else path
    return BadInput(f"{where}: {one_line(what, 400)}", hint=hint)


def line_of(text: str, needle: str, start: int = 1) -> int | None:
    """1-based number of the first line at or after `start` that contains `needle`."""
    for i, line in enumerate(text.splitlines()[start - 1:], start):
        if needle in line:
            return i
    return None


def normalize_source(source: str | None) -> str | None:
    """One spelling per origin, whatever the format wrote, so equal origins compare equal.

    VCS: `git+URL@commit` (uv.lock's `URL?rev=..#commit` included); local files and directories: the
    path (`file:///w/x.whl`, `path:/w/x.whl` -> `/w/x.whl`; `./pkg`, `editable:pkg` -> `pkg`); the URL
    fragment (`#sha256=...`, `#egg=...`) dropped; anything else unchanged.
    """
    if not source:
        return None
    s = source.strip()
    for prefix in ("path:", "directory:", "editable:", "virtual:"):
        if s.startswith(prefix):
            s = s[len(prefix):]
            break
    if s.startswith("file://") and "+" not in s.split("://")[0]:
        s = s[len("file://"):]
    if s.startswith(("git+", "hg+", "svn+", "bzr+")):
        return s.split("#")[0]
    s = s.split("#")[0]
    while s.startswith("./"):
        s = s[2:]
    return s.rstrip("/") or "."


def git_source(url: str) -> str:
    """uv.lock's `git = "URL?rev=v1#<commit>"` -> `git+URL@<commit>`."""
    base, _, commit = url.partition("#")
    base = base.split("?")[0]
    return f"git+{base}@{commit}" if commit else f"git+{base}"
