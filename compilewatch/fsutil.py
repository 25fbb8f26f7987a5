"""Filesystem helpers that never leave half-written files: write to a temp file beside the target,
fsync, then rename over it (atomic on POSIX within one filesystem).

This is the one place a failed write becomes a message: a full disk (ENOSPC, EDQUOT), an I/O error
(EIO), a read-only filesystem, a folder we may not write, a target that is a directory all raise
`WriteFailed` (exit 2: one line naming the file and the reason; the temp file is removed and the
target is as it was). `check_writable` asks the same question before long work starts (a run whose
report could never be written should not run for hours first)."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import stat
import tempfile
from pathlib import Path
from typing import Any, Iterator

from compilewatch.errors import WriteFailed
from compilewatch.serialize import to_jsonable


def _read_umask() -> int:
    mask = os.umask(0)  # the only portable way to read it; done once, at import (before any threads)
    os.umask(mask)
    return mask


# mkstemp creates files 0600; a finished file gets the mode a plain open() would have given it, so
# other users (a serving engine, a teammate reading a lock file) can read what we write.
FILE_MODE = 0o666 & ~_read_umask()


# errnos that mean "the write itself failed" when they come out of the caller's writing code (an
# OSError about something else, e.g. reading a source file, passes through unchanged)
_WRITE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.EROFS, errno.EFBIG}


def write_failed(target: Path, e: OSError) -> WriteFailed:
    """The WriteFailed for writing `target` that failed with `e`."""
    reason = e.strerror or type(e).__name__
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        hint = "free some space (or write elsewhere) and retry"
    elif e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        hint = "write it somewhere you may write"
    else:
        hint = "check the disk and the path, then retry"
    err = WriteFailed(f"cannot write {target}: {reason}; nothing was written ({target} is as it was)", hint=hint)
    err.errno, err.strerror, err.filename = e.errno, e.strerror, str(target)
    return err


def nearest_existing(path: str | os.PathLike[str]) -> Path | None:
    """`path` if it exists (a dangling link counts), else its nearest ancestor that does (None: none does):
    where creating `path` would start, and what stops it when that is not a directory."""
    path = Path(path)
    return next((p for p in (path, *path.parents) if os.path.lexists(p)), None)


def _parent_not_a_dir(target: Path) -> WriteFailed | None:
    """WriteFailed when the nearest existing ancestor of `target` is not a directory (`FILE/x.json`)."""
    anc = nearest_existing(target.parent)
    if anc is not None and not anc.is_dir():
        return WriteFailed(f"cannot write {target}: {anc} is not a directory", hint="give a path in a folder")
    return None


def _temp_beside(target: Path, suffix: str) -> Path:
    """A new empty temp file in `target`'s folder (created if need be), or WriteFailed: `target` is a
    directory, a device, FIFO or socket (the rename would replace it, not write to it: `-o /dev/null` as
    root made /dev/null a regular file), an ancestor is not a directory, or the folder cannot be created or
    written."""
    if target.is_dir():
        raise WriteFailed(f"cannot write {target}: it is a directory", hint="give a file name")
    try:
        mode = os.lstat(target).st_mode  # the name itself: a link is replaced, never what it points at
    except OSError:
        mode = None
    if mode is not None and (stat.S_ISCHR(mode) or stat.S_ISBLK(mode) or stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode)):
        from compilewatch.inputs import file_kind

        raise WriteFailed(f"cannot write {target}: it is {file_kind(mode)}, which a write here would replace "
                          "(the file is written beside it and renamed over it); nothing was written",
                          hint="give a regular file name (or print to stdout and redirect it)")
    if (bad := _parent_not_a_dir(target)) is not None:
        raise bad
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=suffix, dir=target.parent)
        os.close(fd)
    except OSError as e:
        raise write_failed(target, e) from None
    return Path(tmp)


def same_file(a: str | os.PathLike[str], b: str | os.PathLike[str]) -> bool:
    """Whether `a` and `b` name one file: the same path once symlinks are resolved or, both existing,
    the same inode (a hard link). Writing the one would overwrite the other."""
    try:
        if os.path.exists(a) and os.path.exists(b):
            return os.path.samefile(a, b)
    except OSError:
        pass
    return os.path.realpath(a) == os.path.realpath(b)


def check_writable(target: str | os.PathLike[str]) -> Path:
    """WriteFailed now if `target` could not be written later: it is a directory, or
    its folder cannot be created or written (tested by creating and removing a temp file there)."""
    target = Path(target)
    tmp = _temp_beside(target, ".check")
    try:
        tmp.unlink()
    except OSError as e:
        raise write_failed(target, e) from None
    return target


@contextlib.contextmanager
def atomic_path(target: str | os.PathLike[str], *, suffix: str = "") -> Iterator[Path]:
    """Yield a temporary path beside `target`; on success it is renamed onto `target`.

    On any exception the temporary file (or directory) is removed and `target` is untouched; an
    OSError of the write itself (see the module docstring) becomes WriteFailed.
    """
    target = Path(target)
    tmp_path = _temp_beside(target, suffix + ".tmp")
    try:
        try:
            yield tmp_path
        except WriteFailed:
            raise
        except OSError as e:
            if e.errno in _WRITE_ERRNOS:
                raise write_failed(target, e) from None
            raise
        try:
            if tmp_path.is_file():
                with open(tmp_path, "rb") as fh:
                    os.fsync(fh.fileno())
                os.chmod(tmp_path, FILE_MODE)
            os.replace(tmp_path, target)
        except OSError as e:
            raise write_failed(target, e) from None
    except BaseException:
        with contextlib.suppress(OSError):
            if tmp_path.is_dir() and not tmp_path.is_symlink():
                import shutil

                shutil.rmtree(tmp_path, ignore_errors=True)
            else:
                tmp_path.unlink()
        raise


def atomic_write_bytes(target: str | os.PathLike[str], data: bytes) -> Path:
    with atomic_path(target) as tmp:
        tmp.write_bytes(data)
    return Path(target)


def atomic_write_text(target: str | os.PathLike[str], text: str) -> Path:
    return atomic_write_bytes(target, text.encode("utf-8"))


def atomic_write_json(target: str | os.PathLike[str], data: Any, *, indent: int | None = 2) -> Path:
    return atomic_write_text(target, json.dumps(to_jsonable(data), indent=indent, sort_keys=False) + "\n")
