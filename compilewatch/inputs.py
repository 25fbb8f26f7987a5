"""Reading files that come from elsewhere: bounded size, clear errors, one-line messages.

Every file a user hands us (lock files, requirements, reports, configs, manifests) is untrusted: it
may be huge (`/dev/zero`), binary, deeply nested, or crafted to make an error message megabytes long.
These helpers turn each of those into a `BadInput` with a message a person can read:

- `open_untrusted`: the one way a file from elsewhere is opened: O_NONBLOCK (opening a FIFO never
  waits for a writer) and its type checked on the open descriptor (no window between a stat and the
  open); a missing file, a directory, a file that cannot be opened or one of the wrong kind is
  BadInput naming it. dflash opens its checkpoint files through it.
- `read_bytes` / `read_text`: read at most `limit` bytes (one byte more tells "too large"), so an
  endless device or a multi-GB file stops early; non-UTF-8 bytes are BadInput naming the file. A
  regular file is read; a FIFO, pipe (`<(pip freeze)`) or character device is read while data keeps
  coming, and BadInput once nothing arrived for `PIPE_WAIT_S`; a named FIFO nobody writes to is
  BadInput at once (it never blocks); a block device or socket is refused.
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


def file_kind(mode: int) -> str:
    """What a stat mode is, in words ("a regular file", "a FIFO", "a socket", ...)."""
    for test, name in ((stat.S_ISREG, "a regular file"), (stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device")):
        if test(mode):
            return name
    return "not a plain file"


def open_untrusted(path: str | os.PathLike[str], what: str = "file", *,
                   streams: bool = False) -> tuple[int, os.stat_result]:
    """An fd open for reading on `path` and its fstat (the caller closes the fd), or BadInput naming
    `what` and the path when it is missing, a directory, cannot be opened, or not a regular file.
    O_NONBLOCK: opening a FIFO returns at once instead of waiting for a writer. `streams=True` also
    accepts a FIFO, pipe or character device (the fd stays non-blocking: `read_bytes` reads those)."""
    p = Path(path)
    try:
        fd = os.open(p, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise BadInput(f"{what} {str(p)!r} is missing (no such file)") from None
    except IsADirectoryError:
        raise BadInput(f"{what} {str(p)!r} is a directory, not a file") from None
    except OSError as e:
        raise BadInput(f"{what} {str(p)!r} cannot be opened: {e.strerror or e}") from None
    try:
        st = os.fstat(fd)
    except OSError as e:
        os.close(fd)
        raise BadInput(f"{what} {str(p)!r} cannot be opened: {e.strerror or e}") from None
    mode = st.st_mode
    if stat.S_ISREG(mode) or streams and (stat.S_ISFIFO(mode) or stat.S_ISCHR(mode)):
        return fd, st
    os.close(fd)
    if stat.S_ISDIR(mode):
        raise BadInput(f"{what} {str(p)!r} is a directory, not a file")
    if streams:
        raise BadInput(f"{what} {str(p)!r} is {file_kind(mode)}, not a file to read")
    raise BadInput(f"{what} {str(p)!r} is not a regular file ({file_kind(mode)})")


def read_bytes(path: str | os.PathLike[str], *, limit: int = TEXT_LIMIT, what: str = "file") -> bytes:
    """The bytes of `path`, BadInput past `limit` bytes (read stops at limit + 1: /dev/zero is safe).
    Never blocks on a FIFO without a writer (see the module docstring)."""
    p = Path(path)
    fd, st = open_untrusted(p, what, streams=True)
    try:
        if stat.S_ISREG(st.st_mode):
            size = st.st_size  # read(limit + 1) would allocate limit + 1 bytes up front
            with os.fdopen(fd, "rb", closefd=False) as fh:
                data = fh.read(min(limit, size) + 1)
                if len(data) > size and len(data) <= limit:  # the file grew while read: read on to the limit
                    data += fh.read(limit + 1 - len(data))
        else:
            data = _read_stream(fd, p, limit, what)
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
