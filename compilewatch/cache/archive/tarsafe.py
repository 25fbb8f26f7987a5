"""Bounds on an untrusted tar stream, checked before (and while) Python's `tarfile` reads it.

`tarfile` trusts what an archive says about itself. Before Python 3.11.10 / 3.12.5 it parses PAX
extended headers with regular expressions that backtrack quadratically on digit runs
(CVE-2024-6232: a 10 KB header takes 0.8 s, 40 KB 14 s), and at every version it reads an extended
header (PAX or GNU long name) whole into memory, however large the header says it is. Member
metadata is taken as given: a PAX `mtime=1e30` or `inf` reaches `os.utime` (OverflowError), a path
of 2,000 components reaches `Path.mkdir(parents=True)` (RecursionError).

Two guards, both linear in the bytes they see:

- `GuardedStream` wraps the (decompressed) byte stream `tarfile` reads from. It follows the 512-byte
  tar header blocks as the bytes pass through, and refuses (`UnsafeTar`, before `tarfile` parses the
  header) an extended header larger than `MAX_EXTENDED_HEADER`, extended headers adding up to more
  than `MAX_EXTENDED_TOTAL`, more than `MAX_MEMBERS` members, a PAX header that is not a sequence
  of well-formed records, one holding a run of more than `MAX_DIGIT_RUN` digits (the input that
  makes the old regular expressions quadratic), and what compilewatch archives never hold: global
  PAX headers, GNU sparse members, two extended headers in a row.
- `check_member` validates the metadata of one parsed member before anything uses it: name length,
  component length and depth, no NUL, size, mtime finite and within the years 1970-9999.

`GuardedStream` also bounds the work: it refuses (`Inflated`) a stream that inflates past a limit
its caller sets (`reader`: a multiple of the archive's size on disk), and it records how the tar
stream ended (`end`): at the end-of-archive marker (a zero block) every finished tar has, at a block
that is not a tar header (`tarfile` stops there without a word), or at the end of the bytes (the
file was cut short; `tarfile` stops there silently too when the cut falls between two members).

compilewatch's own archives (`archive.save`: PAX format, one extended header per member at most,
holding `path` and `mtime`) are far inside every bound.
"""

from __future__ import annotations

import math
import re
import struct
import tarfile
from typing import BinaryIO

BLOCK = 512
MAX_EXTENDED_HEADER = 16 << 10  # one PAX / GNU long-name header; a path is at most 4 KiB (PATH_MAX)
MAX_EXTENDED_TOTAL = 64 << 20  # all of them together (~200 bytes per member in a real archive)
MAX_MEMBERS = 4_000_000  # the manifest cap allows millions of files, not more
MAX_DIGIT_RUN = 20  # a size or mtime needs at most 20 digits; longer runs make tarfile's regex quadratic
MAX_NAME = 4096  # bytes of a member name (Linux PATH_MAX)
MAX_COMPONENT = 255  # bytes of one path component (NAME_MAX)
MAX_DEPTH = 64  # path components; a cache file is 2-5 deep
MAX_MTIME = 253402300799  # 9999-12-31T23:59:59Z: what datetime and os.utime take everywhere

_EXTENDED = {b"x", b"X", b"L", b"K"}  # PAX per-file (X: Solaris), GNU long name / long link
_REFUSED = {b"g": "a global PAX header", b"S": "a GNU sparse member"}
_REGULAR = {b"0", b"\0", b"7"}  # tarfile's REGULAR_TYPES minus sparse: their data follows the header
_SUPPORTED = {b"0", b"\0", b"7", b"1", b"2", b"3", b"4", b"5", b"6", b"L", b"K", b"S", b"x", b"g", b"X"}
_DIGITS = re.compile(rb"[0-9]{%d}" % (MAX_DIGIT_RUN + 1))
_NUMBER_FIELDS = {"size", "mtime", "atime", "ctime", "uid", "gid"}
_SIZE_VALUE = re.compile(rb"[0-9]{1,20}")
_TIME_VALUE = re.compile(rb"-?[0-9]{1,20}(\.[0-9]{1,20})?([eE][-+]?[0-9]{1,3})?")  # str(float), as tarfile writes it


class UnsafeTar(tarfile.TarError):
    """The archive is outside the bounds this module enforces (its message says which)."""


class Inflated(UnsafeTar):
    """The stream inflated past `limit` bytes (GuardedStream's `limit`)."""

    def __init__(self, limit: int) -> None:
        super().__init__(f"it inflates to more than {limit} bytes")
        self.limit = limit


def _block(n: int) -> int:
    return (n + BLOCK - 1) // BLOCK * BLOCK


def _number(field: bytes) -> int | None:
    """A header number field as tarfile reads it (octal, or base-256 when the high bit is set);
    None where tarfile would call the header invalid."""
    if field[0] in (0o200, 0o377):
        n = int.from_bytes(field[1:], "big")
        return n - 256 ** (len(field) - 1) if field[0] == 0o377 else n
    text = field.split(b"\0", 1)[0].strip()
    try:
        return int(text or b"0", 8)
    except ValueError:
        return None


def _checksum_ok(header: bytes) -> bool:
    stored = _number(header[148:156])
    unsigned = 256 + sum(struct.unpack_from("148B8x356B", header))
    signed = 256 + sum(struct.unpack_from("148b8x356b", header))
    return stored in (unsigned, signed)


def parse_pax(data: bytes) -> dict[str, bytes]:
    """The records of a PAX extended header, parsed strictly and in one linear pass.

    Each record is `LENGTH SP KEYWORD=VALUE LF`, LENGTH counting the whole record; anything else is
    UnsafeTar, as is a digit run longer than MAX_DIGIT_RUN anywhere in the header."""
    if _DIGITS.search(data):
        raise UnsafeTar(f"a PAX header holds a run of more than {MAX_DIGIT_RUN} digits")
    records: dict[str, bytes] = {}
    pos, end = 0, len(data)
    while pos < end:
        if data[pos] == 0:  # tarfile stops at the padding too
            if data[pos:].strip(b"\0"):
                raise UnsafeTar("a PAX header has bytes after its padding")
            break
        space = data.find(b" ", pos, min(end, pos + MAX_DIGIT_RUN + 1))
        if space <= pos or not data[pos:space].isdigit():
            raise UnsafeTar("a PAX header record does not start with its length")
        length = int(data[pos:space])
        stop = pos + length
        if length <= space - pos + 3 or stop > end or data[stop - 1] != 0x0A:
            raise UnsafeTar("a PAX header record's length does not match its content")
        eq = data.find(b"=", space + 1, stop)
        if eq <= space + 1:
            raise UnsafeTar("a PAX header record has no keyword")
        keyword = data[space + 1:eq].decode("utf-8", "replace")
        value = data[eq + 1:stop - 1]
        if keyword.startswith("GNU.sparse"):
            raise UnsafeTar("a PAX header describes a GNU sparse file (compilewatch archives hold none)")
        if keyword == "size" and not _SIZE_VALUE.fullmatch(value):
            raise UnsafeTar("a PAX size record is not a decimal number")
        if keyword in ("mtime", "atime", "ctime") and not _TIME_VALUE.fullmatch(value):
            raise UnsafeTar(f"a PAX {keyword} record is not a decimal number of seconds")
        if keyword in ("uid", "gid") and not _SIZE_VALUE.fullmatch(value):
            raise UnsafeTar(f"a PAX {keyword} record is not a decimal number")
        records[keyword] = value
        pos = stop
    return records


class GuardedStream:
    """A read-only file object over `raw` that checks every tar header block passing through it.

    `tarfile.open(fileobj=GuardedStream(raw), mode="r|")` reads sequentially through `read`, so
    every header is seen here before tarfile parses it; a violation raises UnsafeTar from `read`.
    The bookkeeping mirrors tarfile's own (where the next header starts: after the data of regular
    members, whose size a PAX `size` record may replace). Once the stream stops looking like tar
    (a zero block ends the archive, a bad checksum makes tarfile stop), checking stops: tarfile
    reads no further headers either.
    """

    def __init__(self, raw: BinaryIO, limit: int | None = None) -> None:
        self._raw = raw
        self._limit = limit  # bytes the stream may inflate to (None: no bound)
        self._pos = 0  # bytes passed through
        self._next = 0  # stream offset of the next header block
        self._header = bytearray()  # the next header, while it is collected
        self._ext: bytearray | None = None  # an extended header's data, while it is collected
        self._ext_size = 0
        self._ext_type = b""
        self._size_override: int | None = None  # from the PAX header before the next member
        self._after_extended = False
        self.extended_bytes = 0
        self.members = 0
        self._done = False
        # how the tar stream ended: "marker" (a zero block), "damaged" (a block that is not a header,
        # at stream offset `end_at`), None (the bytes ran out first, or reading has not reached the end)
        self.end: str | None = None
        self.end_at = 0

    @property
    def position(self) -> int:
        """Bytes passed through so far (the inflated stream's offset)."""
        return self._pos

    def read(self, size: int = -1) -> bytes:
        data = self._raw.read(size)
        if self._limit is not None and self._pos + len(data) > self._limit:
            raise Inflated(self._limit)
        if data and not self._done:
            self._feed(data)
        else:
            self._pos += len(data)
        return data

    def close(self) -> None:
        close = getattr(self._raw, "close", None)
        if close is not None:
            close()

    def _feed(self, data: bytes) -> None:
        start = self._pos
        self._pos += len(data)
        i, n = 0, len(data)
        while i < n and not self._done:
            if self._ext is not None:
                take = data[i:i + self._ext_size - len(self._ext)]
                self._ext += take
                i += len(take)
                if len(self._ext) == self._ext_size:
                    self._extended_done(bytes(self._ext))
                continue
            i = max(i, self._next - start)
            if i >= n:
                return
            take = data[i:i + BLOCK - len(self._header)]
            self._header += take
            i += len(take)
            if len(self._header) == BLOCK:
                header = bytes(self._header)
                self._header.clear()
                self._on_header(header)

    def _on_header(self, header: bytes) -> None:
        here = self._next
        if not header.strip(b"\0") or not _checksum_ok(header):
            self._done = True  # the end of the archive (or tarfile's own error): nothing more to check
            self.end, self.end_at = ("marker" if not header.strip(b"\0") else "damaged"), here
            return
        kind = header[156:157]
        size = _number(header[124:136])
        if size is None:
            self._done = True
            self.end, self.end_at = "damaged", here
            return
        if size < 0:
            raise UnsafeTar(f"a header at byte {here} gives a negative size")
        if kind in _REFUSED:
            raise UnsafeTar(f"the archive holds {_REFUSED[kind]} (compilewatch archives hold none)")
        if kind in _EXTENDED:
            if self._after_extended:
                raise UnsafeTar(f"two extended headers in a row at byte {here} (compilewatch archives "
                                "write one per member at most)")
            if size > MAX_EXTENDED_HEADER:
                raise UnsafeTar(f"an extended header of {size} bytes at byte {here}, more than "
                                f"{MAX_EXTENDED_HEADER}")
            self.extended_bytes += size
            if self.extended_bytes > MAX_EXTENDED_TOTAL:
                raise UnsafeTar(f"extended headers add up to more than {MAX_EXTENDED_TOTAL} bytes")
            self._after_extended = True
            self._ext, self._ext_size, self._ext_type = bytearray(), size, kind
            self._next = here + BLOCK + _block(size)
            if size == 0:
                self._extended_done(b"")
            return
        self.members += 1
        if self.members > MAX_MEMBERS:
            raise UnsafeTar(f"more than {MAX_MEMBERS} members")
        if self._size_override is not None:
            size = self._size_override
        self._size_override = None
        self._after_extended = False
        v7_dir = kind == b"\0" and header[:100].split(b"\0", 1)[0].endswith(b"/")
        carries_data = (kind in _REGULAR and not v7_dir) or kind not in _SUPPORTED
        self._next = here + BLOCK + (_block(size) if carries_data else 0)

    def _extended_done(self, data: bytes) -> None:
        self._ext = None
        if self._ext_type in (b"x", b"X"):
            size = parse_pax(data).get("size")
            if size is not None:
                self._size_override = int(size)


def check_member(m: tarfile.TarInfo) -> str | None:
    """Why member `m`'s metadata is out of bounds, or None when it is fine to use."""
    name = m.name
    if not isinstance(name, str) or "\0" in name:
        return "a member name holds a NUL byte"
    raw = name.encode("utf-8", "surrogateescape")
    if len(raw) > MAX_NAME:
        return f"a member name of {len(raw)} bytes (at most {MAX_NAME})"
    parts = name.split("/")
    if len(parts) > MAX_DEPTH:
        return f"a member path of {len(parts)} components (at most {MAX_DEPTH})"
    if any(len(p.encode("utf-8", "surrogateescape")) > MAX_COMPONENT for p in parts):
        return f"a member path component longer than {MAX_COMPONENT} bytes"
    if not isinstance(m.size, int) or m.size < 0:
        return "a member size that is not a count of bytes"
    mtime = m.mtime
    if not isinstance(mtime, (int, float)) or isinstance(mtime, bool) or not math.isfinite(mtime) \
            or not 0 <= mtime <= MAX_MTIME:
        return f"a member timestamp out of range ({str(mtime)[:40]}; expected seconds in 1970-9999)"
    return None
