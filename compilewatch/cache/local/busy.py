"""Is a torch process compiling into this cache dir right now? (Before `clear` or `load` moves it.)

Moving the cache dir while torch compiles into it breaks the compile: torch writes a generated
module or a C++ build into the dir and loads it back from the same path a moment later (seen: 30
of 103 compiles failed under repeated `cache clear`). torch does not take compilewatch's lock; it
takes its own, per kernel: `torch.utils._filelock.FileLock` (the `filelock` package: `flock` on
`<cache>/locks/<key>.lock`) around each C++ compile and load (`codecache._worker_compile_cpp`,
`CppCodeCache`, the CUDA/ROCm `compile`). So `hold_torch_locks` takes every one of those locks,
non-blocking, for as long as the move takes: a compile inside its locked region makes the move
refuse; a compile that wants its lock meanwhile waits (microseconds) for the move to finish.

Between the locked regions torch writes Python modules and FX-graph entries with `write_atomic`:
a temp file named `.<pid>.<tid>.tmp` renamed into place (triton: a `tmp.pid_<pid>_<uuid>/` dir).
`live_writers` names the live processes behind such in-flight names, and the processes of this
user that have a file inside the dir open (psutil). Both together say "compiling now"; a training
process that merely has TORCHINDUCTOR_CACHE_DIR set and is not compiling is not blocked (its next
compile writes into a fresh dir).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import re
from pathlib import Path
from typing import Iterator

_TORCH_TMP = re.compile(r"^\.(\d+)\.\d+\.tmp$")  # torch's write_atomic: .<pid>.<thread id>.tmp
_TRITON_TMP = re.compile(r"^tmp\.pid_(\d+)_")  # triton's cache manager: tmp.pid_<pid>_<uuid>/


@contextlib.contextmanager
def hold_torch_locks(root: str | os.PathLike[str]) -> Iterator[list[str]]:
    """Take torch's per-kernel locks under `root/locks/` (exclusive, non-blocking) for the `with`
    block; yields the lock files another process holds (empty: none, and they are all ours now)."""
    lock_dir = Path(root) / "locks"
    fds: list[int] = []
    held: list[str] = []
    try:
        try:
            names = sorted(n for n in os.listdir(lock_dir) if n.endswith(".lock"))
        except OSError:
            names = []
        for name in names:
            try:
                fd = os.open(lock_dir / name, os.O_RDWR | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOFOLLOW", 0))
            except OSError:
                continue  # vanished, or not ours to lock: torch could not take it either
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                os.close(fd)
                if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                    held.append(name)
                continue
            fds.append(fd)
        yield held
    finally:
        for fd in fds:
            os.close(fd)  # closing releases the flock


def _pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # alive, another user's
    return True


def live_writers(root: str | os.PathLike[str], in_flight: tuple[str, ...] | list[str] = ()) -> list[str]:
    """Live processes writing into `root` now: the pids in torch's and triton's in-flight temp names
    (`in_flight`: paths relative to root, as `layout.walk` lists them), and processes of this user
    with a file under `root` open. One line per process, e.g. "pid 4242 (python): .4242.140.tmp"."""
    root = Path(os.path.abspath(root))
    found: dict[int, str] = {}
    for rel in in_flight:
        name = rel.rsplit("/", 1)[-1]
        m = _TORCH_TMP.match(name) or _TRITON_TMP.match(name)
        if m is not None:
            pid = int(m.group(1))
            if pid != os.getpid() and pid not in found and _pid_alive(pid):
                found[pid] = f"writing {rel}"
    try:
        import psutil
    except ImportError:  # pragma: no cover - a dependency; without it only the names above count
        psutil = None
    if psutil is not None:
        prefix = str(root) + os.sep
        me, uid = os.getpid(), os.getuid()
        for p in psutil.process_iter(["pid", "uids"]):
            try:
                if p.pid == me or p.pid in found or p.info["uids"] is None or p.info["uids"].real != uid:
                    continue
                for f in p.open_files():
                    if f.path.startswith(prefix):
                        found[p.pid] = f"has {os.path.relpath(f.path, root)} open"
                        break
            except (psutil.Error, OSError):
                continue
    out = []
    for pid, what in sorted(found.items()):
        name = ""
        if psutil is not None:
            with contextlib.suppress(Exception):
                name = f" ({psutil.Process(pid).name()})"
        out.append(f"pid {pid}{name} {what}")
    return out


@contextlib.contextmanager
def not_compiling(root: str | os.PathLike[str], in_flight: tuple[str, ...] | list[str] | None = None) -> Iterator[None]:
    """For the `with` block (a move of `root`): hold torch's locks, and raise CheckFailed (exit 1,
    nothing changed) when a process is compiling into `root`. `in_flight`: the walk's in-flight
    names (looked up here when None)."""
    from compilewatch.errors import CheckFailed

    if in_flight is None:
        from compilewatch.cache.local import layout

        in_flight = layout.walk(root).in_flight if os.path.isdir(root) else ()
    with hold_torch_locks(root) as held:
        writers = live_writers(root, in_flight)
        if held or writers:
            shown = writers[:3] + [f"a process holds torch's lock locks/{n}" for n in held[:3 - min(3, len(writers))]]
            raise CheckFailed(f"{root} is in use: torch is compiling into it now ({'; '.join(shown)}); moving it "
                              "would break those compiles, so nothing was changed",
                              hint="wait for the compile to finish (or stop that process), then retry")
        yield
