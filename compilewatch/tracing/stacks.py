"""Stack capture that keeps what a user needs: their own frames first, torch's entry point next."""

from __future__ import annotations

import os
import sys
import sysconfig
import threading
import traceback
from dataclasses import dataclass
from types import FrameType

_STDLIB = os.path.realpath(sysconfig.get_paths()["stdlib"])
_THIS_PKG = os.path.realpath(os.path.dirname(os.path.dirname(__file__)))  # compilewatch/
# our own packages: their frames are never "user" frames
_OWN_DIRS = (_THIS_PKG + os.sep, os.path.join(os.path.dirname(_THIS_PKG), "cli") + os.sep)
# ...except the built-in probe/warm targets, which stand in for user code
_TARGETS_FILE = os.path.join(_THIS_PKG, "tracing", "targets.py")


def _own(real: str) -> bool:
    return real.startswith(_OWN_DIRS) and real != _TARGETS_FILE


@dataclass(frozen=True, slots=True)
class Frame:
    file: str
    line: int
    function: str
    code: str | None = None

    def __str__(self) -> str:
        return f"{self.file}:{self.line} in {self.function}" + (f": {self.code}" if self.code else "")


def short_path(path: str) -> str:
    """Shorten site-packages paths to `torch/fx/...`; keep user paths relative to cwd when inside it."""
    for marker in ("site-packages" + os.sep, "dist-packages" + os.sep):
        i = path.rfind(marker)
        if i >= 0:
            return path[i + len(marker):]
    try:
        rel = os.path.relpath(path)
        return rel if not rel.startswith("..") else path
    except ValueError:
        return path


def _is_user(path: str) -> bool:
    real = os.path.realpath(path)
    if _own(real) or real.startswith(_STDLIB):
        return False
    if f"{os.sep}torch{os.sep}" in real or f"{os.sep}typer{os.sep}" in real or f"{os.sep}click{os.sep}" in real:
        return False
    if "site-packages" in real or "dist-packages" in real:
        # third-party libraries count as user code (transformers may be the one calling compile)
        return not any(f"{os.sep}{p}{os.sep}" in real for p in ("_pytest", "pluggy", "rich"))
    return not path.startswith("<")


def frames_from(frame: FrameType | None, limit: int = 60) -> list[Frame]:
    """Innermost-last list of frames starting at `frame`, outside this package."""
    out = []
    for fs in traceback.extract_stack(frame, limit=limit):
        if _own(os.path.realpath(fs.filename)):
            continue
        out.append(Frame(short_path(fs.filename), fs.lineno or 0, fs.name, (fs.line or "").strip() or None))
    return out


def relevant(frames: list[Frame], n_user: int = 4, n_entry: int = 2, n_inner: int = 3) -> list[Frame]:
    """What names a trace or a call: the innermost `n_user` user frames, the first `n_entry` torch
    frames after them (where torch took over), and the innermost `n_inner` frames (what called the
    instrumented function). Order is kept (innermost last), duplicates dropped.
    """
    user_idx = [i for i, f in enumerate(frames) if is_user_short_path(f.file)]
    picked: list[int] = user_idx[-n_user:]
    start = user_idx[-1] + 1 if user_idx else 0
    picked += [i for i in range(start, len(frames)) if frames[i].file.startswith("torch/")][:n_entry]
    picked += list(range(max(0, len(frames) - n_inner), len(frames)))
    return [frames[i] for i in sorted(set(picked))]


def is_user_short_path(short: str) -> bool:
    if short.startswith("torch/") or short.startswith("<"):
        return False
    if short.startswith(("typer/", "click/", "_pytest/", "pluggy/", "rich/")):
        return False
    if short.startswith(("compilewatch/", "cli/")):
        return short.endswith("targets.py")
    if os.path.isabs(short):
        if os.path.realpath(os.path.dirname(short)) == os.path.realpath(os.path.join(sys.prefix, "bin")):
            return False  # console-script launchers (bin/compilewatch, bin/dflash)
        return _is_user(short)
    return True


def current_stack(skip: int = 1) -> list[Frame]:
    f = sys._getframe(skip + 1)
    return frames_from(f)


def all_thread_stacks() -> dict[str, list[Frame]]:
    """Every live thread's current stack, keyed by "name (ident)"."""
    names = {t.ident: t.name for t in threading.enumerate()}
    out = {}
    for ident, frame in sys._current_frames().items():
        out[f"{names.get(ident, '?')} ({ident})"] = frames_from(frame)
    return out
