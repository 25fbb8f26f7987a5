"""The lock compilewatch's cache operations take, so two compilewatch processes never interleave.

`fcntl.flock` on a lock file *beside* the cache dir (`<parent>/.<name>.compilewatch.lock`): beside,
not inside, because load/clear move the cache dir itself. flock locks belong to the open file, so
they also exclude threads of one process that open the file separately, and the kernel drops them
when a process dies (no stale locks). The holder writes its pid and command into the file, which the
error message shows.

Exclusive: load, clear, prune, verify --fix. Shared: save (readers may overlap). fingerprint, ls,
du, diff and plain verify take no lock: they only read, and tolerate files appearing or vanishing.

torch and triton do not take this lock: a training job writing the cache is not blocked (see
docs/cache.md, "While a training job writes the cache").
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import stat
import sys
import time
from pathlib import Path
from typing import Iterator

from compilewatch.errors import BadInput, CompilewatchError

DEFAULT_TIMEOUT_S = 10.0


class CacheLocked(CompilewatchError):
    """Another compilewatch process holds the cache lock (exit code 2: retry when it is done)."""

    exit_code = 2


@contextlib.contextmanager
def cache_lock(cache_dir: str | os.PathLike[str], *, shared: bool = False,
               timeout: float | None = None) -> Iterator[Path | None]:
    """Hold the lock of `cache_dir` for the `with` block; CacheLocked after `timeout` seconds
    (default `DEFAULT_TIMEOUT_S`, read at call time). Yields the lock file, or None for a shared
    lock whose file cannot be created (a read-only parent folder: reading goes ahead unlocked)."""
    timeout = DEFAULT_TIMEOUT_S if timeout is None else timeout
    lock_path = lock_file_for(Path(os.path.abspath(cache_dir)))
    try:
        lock_path.parent.mkdir(parents=True, exist_ok=True)
        # never through a link, never a FIFO or device: the holder truncates and writes the file, and
        # whoever can write beside the cache could otherwise point it at a file of yours
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0), 0o644)
    except OSError as e:
        if e.errno == errno.ELOOP or os.path.islink(lock_path):
            raise BadInput(f"the lock file {lock_path} is a symbolic link; compilewatch does not follow it "
                           "(whoever can write beside the cache could point it at a file of yours)",
                           hint=f"remove it (`rm {lock_path}`) and retry; nothing was changed") from None
        if shared:  # a reader that cannot create the lock file (read-only parent) goes ahead unlocked
            yield None
            return
        raise BadInput(f"cannot create the lock file {lock_path}: {e.strerror}",
                       hint="moving or replacing the cache needs write access to the folder that holds it") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise BadInput(f"the lock file {lock_path} is not a regular file (a FIFO, device or folder someone put there)",
                       hint=f"remove it (`rm {lock_path}`) and retry; nothing was changed")
    try:
        op = (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB
        deadline = time.monotonic() + max(timeout, 0.0)
        while True:
            try:
                fcntl.flock(fd, op)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    holder = _read_holder(fd)
                    raise CacheLocked(
                        f"the cache {cache_dir} is locked by another compilewatch process{holder}",
                        hint=f"wait for it to finish and retry (lock file {lock_path})",
                    ) from None
                time.sleep(0.05)
        if not shared:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"pid {os.getpid()}: {' '.join(sys.argv)[:300]}\n".encode(), 0)
        yield lock_path
    finally:
        os.close(fd)  # closing the descriptor releases the flock


def _read_holder(fd: int) -> str:
    try:
        text = os.pread(fd, 400, 0).decode("utf-8", "replace").strip()
    except OSError:
        return ""
    return f" ({text})" if text else ""


def lock_file_for(path: Path) -> Path:
    """The lock file beside the cache dir (beside, so it survives the dir being swapped or moved)."""
    return path.parent / f".{path.name}.compilewatch.lock"
