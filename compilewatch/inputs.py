"""Reading files that come from elsewhere: bounded size, clear errors, one-line messages.

Every file a user hands us (lock files, requirements, reports, configs, manifests) is untrusted: it
may be huge (`/dev/zero`), binary, deeply nested, or crafted to make an error message megabytes long.
These helpers turn each of those into a `BadInput` with a message a person can read:

- `read_bytes` / `read_text`: read at most `limit` bytes (one byte more tells "too large"), so an
  endless device or a multi-GB file stops early; a missing file, a directory or non-UTF-8 bytes are
  BadInput naming the file. The file is opened with O_NONBLOCK and its type checked on the open
  descriptor: a regular file is read; a FIFO, pipe (`<(pip freeze)`) or character device is read
  while data keeps coming, and BadInput once nothing arrived for `PIPE_WAIT_S`; a named FIFO nobody
  writes to is BadInput at once (it never blocks); a block device or socket is refused.
- `loads_json`: json.loads, with nesting deeper than Python's recursion limit and integers longer
  than Python's digit limit (both raise something other than JSONDecodeError) reported as bad input.
- `one_line`: what we quote from a file in a message: one line, at most `width` characters.
"""

from __future__ import annotations

import json
import os
import select
import stat
from pathlib import Path
from typing import Any

from compilewatch.errors import BadInput

TEXT_LIMIT = 64 << 20  # lock files, requirements, reports: the largest real ones are a few MB
MESSAGE_WIDTH = 300
PIPE_WAIT_S = 30.0  # how long a pipe or FIFO may stay silent before we stop waiting for it


def one_line(text: object, width: int = MESSAGE_WIDTH) -> str:
    """`text` as one line of at most `width` characters (an ellipsis says it was cut)."""
    s = " ".join(str(text).split())
    return s if len(s) <= width else s[: width - 1] + "…"


def _size_words(n: int) -> str:
    for unit in ("bytes", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n} {unit}" if unit == "bytes" else f"{n:.0f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return str(n)


def read_bytes(path: str | os.PathLike[str], *, limit: int = TEXT_LIMIT, what: str = "file") -> bytes:
    """The bytes of `path`, BadInput past `limit` bytes (read stops at limit + 1: /dev/zero is safe).
    Never blocks on a FIFO without a writer (see the module docstring)."""
    p = Path(path)
    try:
        fd = os.open(p, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise BadInput(f"{p}: no such file (expected a {what})") from None
    except IsADirectoryError:
        raise BadInput(f"{p}: is a directory, expected a {what}") from None
    except OSError as e:
        raise BadInput(f"{p}: cannot read: {e.strerror or e}") from None
    try:
        mode = os.fstat(fd).st_mode
        if stat.S_ISDIR(mode):
            raise BadInput(f"{p}: is a directory, expected a {what}")
        if stat.S_ISREG(mode):
            size = os.fstat(fd).st_size  # read(limit + 1) would allocate limit + 1 bytes up front
            with os.fdopen(fd, "rb", closefd=False) as fh:
                data = fh.read(min(limit, size) + 1)
                if len(data) > size and len(data) <= limit:  # the file grew while read: read on to the limit
                    data += fh.read(limit + 1 - len(data))
        elif stat.S_ISFIFO(mode) or stat.S_ISCHR(mode):
            data = _read_stream(fd, p, limit, what)
        else:
            kind = "a block device" if stat.S_ISBLK(mode) else "a socket" if stat.S_ISSOCK(mode) else "not a file"
            raise BadInput(f"{p}: is {kind}, expected a {what}")
    except OSError as e:
        raise BadInput(f"{p}: cannot read: {e.strerror or e}") from None
    finally:
        os.close(fd)
    if len(data) > limit:
        raise BadInput(f"{p}: file too large (more than {_size_words(limit)}) for a {what}",
                       hint="is it the right file? nothing was read past the limit")
    return data


def _read_stream(fd: int, p: Path, limit: int, what: str) -> bytes:
    """Up to limit + 1 bytes of a pipe, FIFO or character device opened non-blocking."""
    chunks: list[bytes] = []
    got = 0
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    while got <= limit:
        try:
            chunk = os.read(fd, min(1 << 20, limit + 1 - got))
        except BlockingIOError:  # a writer is there, nothing to read yet
            if not poller.poll(PIPE_WAIT_S * 1000):
                raise BadInput(f"{p}: nothing arrived for {PIPE_WAIT_S:g} s (a pipe or FIFO whose writer is "
                               f"silent), expected a {what}", hint="read from a regular file") from None
            continue
        if not chunk:  # end of data, or a FIFO nobody writes to
            break
        chunks.append(chunk)
        got += len(chunk)
    if not got and stat.S_ISFIFO(os.fstat(fd).st_mode) and not p.as_posix().startswith(("/dev/fd/", "/proc/")):
        raise BadInput(f"{p}: a FIFO nobody writes to (nothing to read), expected a {what}",
                       hint="start the program that writes it first, or give a regular file")
    return b"".join(chunks)


def read_text(path: str | os.PathLike[str], *, limit: int = TEXT_LIMIT, what: str = "file") -> str:
    """`read_bytes` decoded as UTF-8 (a BOM is dropped); BadInput for binary content."""
    data = read_bytes(path, limit=limit, what=what)
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise BadInput(f"{path}: not UTF-8 text (byte {e.start}): expected a {what}") from None


def loads_json(text: str | bytes, where: str) -> Any:
    """json.loads with every way untrusted JSON can fail as BadInput `where:line: ...`."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise BadInput(f"{where}:{e.lineno}: invalid JSON: {e.msg} (column {e.colno})") from None
    except RecursionError:
        raise BadInput(f"{where}: JSON nested too deeply to read") from None
    except UnicodeDecodeError as e:
        raise BadInput(f"{where}: not UTF-8 text (byte {e.start})") from None
    except ValueError as e:  # an integer longer than sys.get_int_max_str_digits()
        raise BadInput(f"{where}: invalid JSON: {one_line(e, 160)}") from None
