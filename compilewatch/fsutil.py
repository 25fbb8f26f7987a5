"""Filesystem helpers that never leave half-written files: write to a temp file beside the target,
fsync, then rename over it (atomic on POSIX within one filesystem)."""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any, Iterator

from compilewatch.serialize import to_jsonable


def _read_umask() -> int:
    mask = os.umask(0)  # the only portable way to read it; done once, at import (before any threads)
    os.umask(mask)
    return mask


# mkstemp creates files 0600; a finished file gets the mode a plain open() would have given it, so
# other users (a serving engine, a teammate reading a lock file) can read what we write.
FILE_MODE = 0o666 & ~_read_umask()


@contextlib.contextmanager
def atomic_path(target: str | os.PathLike[str], *, suffix: str = "") -> Iterator[Path]:
    """Yield a temporary path beside `target`; on success it is renamed onto `target`.

    On any exception the temporary file (or directory) is removed and `target` is untouched.
    """
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=suffix + ".tmp", dir=target.parent)
    os.close(fd)
    tmp_path = Path(tmp)
    try:
        yield tmp_path
        if tmp_path.is_file():
            with open(tmp_path, "rb") as fh:
                os.fsync(fh.fileno())
            os.chmod(tmp_path, FILE_MODE)
        os.replace(tmp_path, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
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
