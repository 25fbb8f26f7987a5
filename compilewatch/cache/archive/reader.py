"""What a cache archive is, and its one-pass reads.

Archive layout (a tar stream, compressed by suffix: `.tar.zst` zstd, `.tar.gz`/`.tgz` gzip, `.tar`
none; zstd needs Python >= 3.14's `compression.zstd` or the `zstandard` package):

1. `compilewatch-archive.json`: header read first: system key + system info, torch version and build
   hash, an environment summary, the source path, the compression.
2. `cache/<relative path>`: every file of the cache (mtimes kept; the stat-index sidecar and
   writers' temp files left out, and `precompiled_headers/` unless `headers=True`).
3. `mega_cache.bin` (when torch offers it): the fxgraph and aotautograd entries in torch's own
   Mega-Cache format (`torch.compiler.save_cache_artifacts`).
4. `manifest.json`: the fingerprint of what was written (each file's size and xxh3-128), last,
   because it describes the bytes actually read (a training job may add entries meanwhile).
5. `signature.json`: the signed statement (`trust.provenance`).

Here: the header and manifest readers (each member capped in size before it is read into memory),
the compatibility check against this machine, and `inspect_archive`, the one pass that hashes every
member and gives the provenance verdict (`check_provenance`), handing members to a scan as they
stream by. `MemberHash` is how a member's bytes are hashed, by that pass and by `cache load`'s
extraction alike: SHA-256 for the signature, xxh3-128 for the manifest.
"""

from __future__ import annotations

import gzip
import hashlib
import os
import tarfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import xxhash

from compilewatch.cache.archive import tarsafe
from compilewatch.cache.content import fingerprint as fp_mod
from compilewatch.cache.content import stamps
from compilewatch.cache.content.fingerprint import Fingerprint
from compilewatch.cache.trust import provenance
from compilewatch.errors import BadInput
from compilewatch.inputs import loads_json, one_line
from compilewatch.jsonshape import build

FORMAT = 1


HEADER = "compilewatch-archive.json"


MANIFEST = "manifest.json"


MEGA = "mega_cache.bin"


PREFIX = "cache/"


SUFFIXES = {".tar.zst": "zstd", ".tzst": "zstd", ".tar.gz": "gzip", ".tgz": "gzip", ".tar": "none"}


_GZIP_MAGIC = b"\x1f\x8b"


_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"


MAX_HEADER = 16 << 20  # the header is a few KB; anything this large is not one


MAX_MANIFEST = 512 << 20  # ~150 bytes per file: millions of files


# The work an untrusted archive can make us do is bounded by its size on disk: its tar stream may
# inflate to MAX_RATIO times the bytes the file takes (its allocated blocks: a sparse file's holes,
# which read as zeros, count as nothing), and to MIN_INFLATE whatever its size. Real caches compress
# 3-6x (a CPU compile's 24 files: 4.3x overall, 6.0x its most compressible member, a .so); gzip reaches
# 1032x on zeros (a 0.5 MB file of 512 MiB took `cache verify` 1.3 s: ~2.4 s per GiB inflated, and a
# pickle member's scan ~0.7 s per MB of opcodes), zstd 30,000x and more.
MAX_RATIO = 64


MIN_INFLATE = 64 << 20


def _disk_bytes(st: os.stat_result) -> int:
    """The bytes a file takes on disk: its size, or less where it is sparse (holes take nothing). No
    blocks at all is taken as unknown (some FUSE mounts say 0 for every file): a sparse archive has
    at least its first header's block."""
    blocks = getattr(st, "st_blocks", None)
    return min(st.st_size, blocks * 512) if blocks else st.st_size


def inflate_limit(st: os.stat_result) -> int:
    """How many bytes the archive whose stat is `st` may inflate to (MAX_RATIO, MIN_INFLATE)."""
    return max(MIN_INFLATE, MAX_RATIO * _disk_bytes(st))


def _on_disk(archive: Path) -> int:
    try:
        return _disk_bytes(os.stat(archive))
    except OSError:
        return 0


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"


@dataclass(frozen=True, slots=True)
class ArchiveHeader:
    format: int
    created_at: str
    source_path: str
    system_key: str
    system_info: dict[str, Any]
    torch_version: str
    torch_hash: str | None
    compression: str
    env: dict[str, Any]


def cache_rel(name: str) -> str | None:
    """The cache-relative path of member `name`, or None when `load` would never write it: not under
    `cache/`, absolute, with an empty, `.` or `..` component, or compilewatch's own sidecar."""
    from compilewatch.cache.local import layout

    if not name.startswith(PREFIX):
        return None
    rel = name[len(PREFIX):]
    parts = rel.split("/")
    if not rel or rel.startswith("/") or any(p in ("", ".", "..") for p in parts) or parts[0] == layout.SIDECAR:
        return None
    return rel


# --- compression ----------------------------------------------------------------------------------
def compression_for(archive: Path) -> str:
    name = archive.name.lower()
    for suffix, comp in SUFFIXES.items():
        if name.endswith(suffix):
            return comp
    raise BadInput(f"unknown archive type {archive.name!r}",
                   hint="name it *.tar.zst (zstd), *.tar.gz / *.tgz (gzip) or *.tar (uncompressed)")


LEVELS = {"gzip": (1, 9), "zstd": (1, 22)}  # the compression levels `cache save --level` takes, by compression


def check_level(comp: str, level: int | None, archive: Path) -> None:
    """BadInput unless `level` is None or a level `comp` takes (an uncompressed .tar takes none)."""
    if level is None:
        return
    if comp not in LEVELS:
        raise BadInput(f"--level {level}: {archive.name!r} is an uncompressed archive, which has no level",
                       hint="name it *.tar.gz or *.tar.zst to compress it, or leave --level out")
    lo, hi = LEVELS[comp]
    if isinstance(level, bool) or not isinstance(level, int) or not lo <= level <= hi:
        raise BadInput(f"--level {level!r}: {comp} levels are {lo}-{hi}", hint="leave --level out for 3")


def _zstd_module():
    try:
        from compression import zstd  # type: ignore[import-not-found]  # Python >= 3.14

        return "stdlib", zstd
    except ImportError:
        pass
    try:
        import zstandard  # type: ignore[import-not-found]

        return "zstandard", zstandard
    except ImportError:
        return None, None


def _compressed_writer(raw: BinaryIO, comp: str, level: int | None) -> BinaryIO:
    if comp == "gzip":
        return gzip.GzipFile(fileobj=raw, mode="wb", compresslevel=level or 3, mtime=0)  # type: ignore[return-value]
    if comp == "zstd":
        kind, mod = _zstd_module()
        if kind == "stdlib":
            return mod.ZstdFile(raw, "w", level=level or 3)
        if kind == "zstandard":
            return mod.ZstdCompressor(level=level or 3, threads=-1).stream_writer(raw, closefd=False)
        raise BadInput("zstd archives need Python >= 3.14 or the zstandard package",
                       hint="name the archive *.tar.gz for gzip, or `pip install zstandard`")
    return raw


def _compressed_reader(raw: BinaryIO, source: Path) -> BinaryIO:
    magic = raw.read(4)
    raw.seek(0)
    if magic[:2] == _GZIP_MAGIC:
        return gzip.GzipFile(fileobj=raw, mode="rb")  # type: ignore[return-value]
    if magic == _ZSTD_MAGIC:
        kind, mod = _zstd_module()
        if kind == "stdlib":
            return mod.ZstdFile(raw, "r")
        if kind == "zstandard":
            return mod.ZstdDecompressor().stream_reader(raw, closefd=False)
        raise BadInput(f"{source} is zstd-compressed; reading it needs Python >= 3.14 or the zstandard package")
    return raw


def _umask() -> int:
    """The process umask, read without changing it (Linux), else the usual 0o022."""
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    return 0o022


# --- read -----------------------------------------------------------------------------------------
class _Reader:
    """Sequential access to an archive's members, with every failure turned into BadInput."""

    def __init__(self, archive: Path) -> None:
        if not archive.exists():
            raise BadInput(f"archive {archive} does not exist")
        if not archive.is_file():
            raise BadInput(f"{archive} is not a file")
        self.archive = archive
        self.raw = open(archive, "rb")
        try:
            limit = inflate_limit(os.fstat(self.raw.fileno()))
            self.stream = tarsafe.GuardedStream(_compressed_reader(self.raw, archive), limit)
            self.tar = tarfile.open(fileobj=self.stream, mode="r|")  # type: ignore[call-overload]
        except (tarfile.TarError, OSError, EOFError, ValueError) as e:
            self.close()
            raise self.corrupt(e) from None
        except BaseException:
            self.close()
            raise

    def corrupt(self, e: BaseException | str) -> BadInput:
        return _corrupt(self.archive, e)

    def members(self):
        try:
            for m in self.tar:
                problem = tarsafe.check_member(m)
                if problem is not None:
                    raise self.corrupt(problem)
                yield m
        except (tarfile.TarError, OSError, EOFError, ValueError) as e:
            raise self.corrupt(e) from None

    def unfinished(self, members: int, last: str | None, missing: str) -> BadInput | None:
        """BadInput when the tar stream did not end at its end-of-archive marker (`GuardedStream.end`):
        cut short, or a block that is not a header; `tarfile` just stops there, so the members after
        the cut (`missing`: "its signature", ...) look absent rather than lost. None when it ended well."""
        end = self.stream.end
        if end == "marker":
            return None
        where = f"after member {members} ({one_line(last, 120)})" if last else "before its first member"
        if end == "damaged":
            what = (f"{self.archive} is damaged: at byte {self.stream.end_at} of its tar stream, {where}, comes a "
                    f"block that is not a tar header; nothing after it can be read, {missing} included: a damaged "
                    "archive (a corrupted copy or download?), not an unsigned one")
        else:
            what = (f"{self.archive} was cut short: its tar stream ends {where}, without the end-of-archive marker "
                    f"every finished archive has, and without {missing}: a damaged archive (an interrupted copy or "
                    "download?), not an unsigned one")
        return BadInput(what,
                        hint="copy it again from where it was made; nothing was changed")

    def read(self, m: tarfile.TarInfo, limit: int) -> bytes:
        if m.size > limit:
            raise self.corrupt(f"member {one_line(m.name, 120)} is {m.size} bytes, more than {limit} for what it is")
        try:
            fh = self.tar.extractfile(m)
            return fh.read() if fh else b""
        except (tarfile.TarError, OSError, EOFError, ValueError) as e:
            raise self.corrupt(e) from None

    def close(self) -> None:
        for obj in (getattr(self, "tar", None), getattr(self, "stream", None), self.raw):
            try:
                if obj is not None:
                    obj.close()
            except Exception:  # noqa: BLE001 - closing a corrupt stream may raise again
                pass

    def __enter__(self) -> "_Reader":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _parse_header(reader: _Reader, data: bytes) -> ArchiveHeader:
    try:
        d = loads_json(data, f"{reader.archive}:{HEADER}")
        if not isinstance(d, dict):
            raise BadInput("the header is not a JSON object")
        if d.get("format") != FORMAT:
            raise reader.corrupt(f"unsupported archive format {one_line(repr(d.get('format')), 40)}, expected {FORMAT}")
        return build(ArchiveHeader, d, HEADER)
    except BadInput as e:
        if e.message.startswith(str(reader.archive)):
            raise
        raise reader.corrupt(f"bad header: {e.message}") from None


def read_header(archive: str | os.PathLike[str]) -> ArchiveHeader:
    """The header of `archive` (reads only the first member)."""
    with _Reader(Path(archive)) as r:
        for m in r.members():
            if m.name != HEADER:
                break
            return _parse_header(r, r.read(m, MAX_HEADER))
    raise BadInput(f"{archive} is not a compilewatch cache archive (no {HEADER} first)",
                   hint="make archives with `compilewatch cache save`")


def read_manifest(archive: str | os.PathLike[str], *, stop_after: int | None = None) -> Fingerprint:
    """The manifest (fingerprint with every file) of `archive`; reads the whole stream, writes nothing.

    `stop_after`: BadInput as soon as the members seen so far add up to more bytes (a stream that
    would not fit anyway is not decompressed to its end)."""
    read_header(archive)  # a clear error for files that are not archives
    seen = 0
    with _Reader(Path(archive)) as r:
        for m in r.members():
            if m.name == MANIFEST:
                return _parse_manifest(r.archive, r.read(m, MAX_MANIFEST))
            seen += max(m.size, 0)
            if stop_after is not None and seen > stop_after:
                raise BadInput(f"{archive} holds more than {stop_after} bytes before its manifest, more than "
                               "the disk beside the cache has free; nothing was changed")
    raise BadInput(f"{archive} has no {MANIFEST}: it was cut short", hint="save it again")


def read_manifest_checked(archive: str | os.PathLike[str]) -> tuple[Fingerprint, provenance.Provenance]:
    """`read_manifest`, and from the same pass the archive's provenance (every member hashed against
    what was signed): for a foreign archive the manifest is only what its maker claims (`cache diff`)."""
    verdict, data = inspect_archive(archive)
    if data is None:
        raise BadInput(f"{archive} has no {MANIFEST}: it was cut short", hint="save it again")
    return _parse_manifest(Path(archive), data), verdict


def _corrupt(archive: Path, e: BaseException | str) -> BadInput:
    if isinstance(e, tarsafe.Inflated):
        return BadInput(f"{archive} inflates to more than {_mib(e.limit)} ({MAX_RATIO} times the "
                        f"{_mib(_on_disk(archive))} it takes on disk, and at least {_mib(MIN_INFLATE)}): a compression "
                        "bomb, or not a cache archive (real caches compress 3-6x); stopped reading it",
                        hint="nothing was changed. If you made it yourself, save it again as an uncompressed *.tar, "
                             "which this bound does not refuse")
    why = e if isinstance(e, str) else str(e) if isinstance(e, tarsafe.UnsafeTar) else f"{type(e).__name__}: {e}"
    return BadInput(f"{archive} is not a readable compilewatch cache archive ({one_line(why, 400)})",
                    hint="it may be truncated or corrupt; nothing was changed")


def _parse_manifest(archive: Path, data: bytes) -> Fingerprint:
    data_ = loads_json(data, f"{archive}:{MANIFEST}")
    if not isinstance(data_, dict):
        raise _corrupt(archive, f"{MANIFEST} is not a JSON object")
    fp = fp_mod.from_json(data_, source=f"{archive}:{MANIFEST}")
    if fp.entries is None:
        raise _corrupt(archive, f"{MANIFEST} lists no files")
    return fp


def describe_system(info: dict[str, Any] | None) -> str:
    """'NVIDIA H200, CUDA 13.0' from a `CacheBase.get_system()` dict; 'no GPU' for the CPU-only key."""
    if not info or not info.get("device"):
        return "no GPU"
    version = info.get("version") or {}
    rt = f"CUDA {version['cuda']}" if version.get("cuda") else f"HIP {version['hip']}" if version.get("hip") else ""
    return ", ".join(x for x in (str(info["device"].get("name")), rt) if x)


def compatibility(archive_key: str, archive_torch: str, entry_keys: dict[str, int] | None = None,
                  entry_torch: dict[str, int] | None = None,
                  archive_info: dict[str, Any] | None = None) -> tuple[str, ...]:
    """Why an archive or backup from (system key, torch version) would not hit here; () if it would."""
    from compilewatch import torchinfo

    torch = torchinfo.torch_module()
    here_key, here_torch = torchinfo.system_key(), str(torch.__version__)
    problems = []
    if archive_key != here_key:
        there = f" ({describe_system(archive_info)})" if archive_info is not None else ""
        problems.append(f"system key differs: archive {archive_key[:16]}…{there}, this machine {here_key[:16]}… "
                        f"({describe_system(torchinfo.system_info())}): GPU model, CUDA version or triton "
                        "differ, so every entry would miss")
    if archive_torch != here_torch:
        problems.append(f"torch version differs: archive {archive_torch}, this machine {here_torch} "
                        "(the FX-graph key hashes torch's version and source: every entry would miss)")
    if entry_keys:
        stamped = {k: n for k, n in entry_keys.items() if k != "unknown"}
        if stamped and here_key not in stamped:
            problems.append(f"no entry was built for this machine's system key ({sum(stamped.values())} stamped "
                            "entries, all for other keys)")
    here_hash = stamps.current_torch_hash()
    if entry_torch and here_hash:
        stamped = {k: n for k, n in entry_torch.items() if k != "unknown"}
        if stamped and here_hash not in stamped:
            problems.append(f"no entry was built by this torch build ({sum(stamped.values())} stamped entries, "
                            "all from other torch versions or sources)")
    return tuple(problems)


MAX_SIGNATURE = 1 << 30  # a statement names every member (~120 bytes each): millions of files


IN_MEMORY = 256 << 20  # members up to this size reach `on_member` as bytes; larger ones as a MemberStream


MAX_MEGA = 1 << 30  # a Mega-Cache parsed in memory (verify's scan, load_mega_cache): larger ones are not parsed


def check_provenance(archive: str | os.PathLike[str], *, trust: bool = False) -> provenance.Provenance:
    """The provenance verdict of `archive` (module docstring); reads and hashes every member, runs
    nothing. BadInput only for a file that is not a readable archive. `trust`: the caller accepts a
    foreign archive as code (`Provenance.allowed`)."""
    return inspect_archive(archive, trust=trust)[0]


def inspect_archive(archive: str | os.PathLike[str], *, trust: bool = False, stop_after: int | None = None,
                    on_member=None, digests: dict[str, tuple[int, str]] | None = None):
    """One pass over `archive`: (Provenance, manifest bytes or None). `stop_after`: BadInput once the
    members seen add up to more bytes. `on_member(name, data)` gets each member as read (for `verify_archive`'s
    scan): its bytes, or for a cache file over IN_MEMORY bytes a MemberStream to read it from while it
    is hashed (what the callback leaves unread is hashed after it returns). `digests`: filled with each
    member's (bytes read, xxh3-128 hex), the size and `hash` its manifest entry must have
    (`MemberHash`: what `cache load` compares); the signature member is left out. A member that
    appears twice is BadInput, as for `cache load`, which reads the archive with this pass first."""
    path = Path(archive)
    read_header(path)  # a clear error for files that are not archives
    seen: dict[str, tuple[int, str]] = {}
    sig = manifest = None
    total = count = 0
    last = None
    with _Reader(path) as r:
        for m in r.members():
            count, last = count + 1, m.name
            if m.name in seen or (m.name == provenance.SIGNATURE and sig is not None):
                raise r.corrupt(f"member {one_line(m.name, 200)} appears twice")  # which copy counts is ambiguous
            if m.name == provenance.SIGNATURE:
                sig = r.read(m, MAX_SIGNATURE)
                continue
            total += max(m.size, 0)
            if stop_after is not None and total > stop_after:
                raise BadInput(f"{archive} holds more than {stop_after} bytes, more than the disk beside the cache "
                               "has free; nothing was changed")
            if not m.isreg():  # compilewatch archives hold regular files only; a link's target is never read
                raise r.corrupt(f"member {one_line(repr(m.name), 200)} is {_KINDS.get(m.type, 'not a regular file')} "
                                "(compilewatch archives hold regular files only)")
            cap = {HEADER: MAX_HEADER, MANIFEST: MAX_MANIFEST}.get(m.name)
            if cap is not None and m.size > cap:
                raise r.corrupt(f"member {m.name} is {m.size} bytes, more than {cap} for what it is")
            h = MemberHash(xxh3=digests is not None)
            # the Mega-Cache is kept only for a scan, and only up to MAX_MEGA (a small compressed archive
            # can declare one of any size: kept whole, it would be read into memory before any verdict)
            keep = m.name in (HEADER, MANIFEST) or (on_member is not None and (
                m.size <= MAX_MEGA if m.name == MEGA else m.size <= IN_MEMORY))
            chunks: list[bytes] = []
            n = 0
            try:
                fh = r.tar.extractfile(m)
            except Exception as e:  # noqa: BLE001 - tarfile errors on a damaged stream
                raise _in_member(r, m.name, e) from None
            if fh is not None and on_member is not None and not keep:  # a large cache file: read as it streams
                stream = MemberStream(fh, h, m.size)
                try:
                    on_member(m.name, stream)
                except Exception:
                    if stream.error is None:
                        raise
                    raise _in_member(r, m.name, stream.error) from None  # the archive's stream failed under the scan
                seen[m.name] = (stream.drain(), h.hexdigest())
                if stream.error is not None:
                    raise _in_member(r, m.name, stream.error) from None
                if digests is not None:
                    digests[m.name] = (stream.n, h.xxh3_hex())
                continue
            try:
                while fh is not None:
                    chunk = fh.read(4 << 20)
                    if not chunk:
                        break
                    h.update(chunk)
                    n += len(chunk)
                    if keep:
                        chunks.append(chunk)
            except Exception as e:  # noqa: BLE001 - tarfile/decompressor errors on a damaged stream
                raise _in_member(r, m.name, e) from None
            seen[m.name] = (n, h.hexdigest())
            if digests is not None:
                digests[m.name] = (n, h.xxh3_hex())
            data = b"".join(chunks) if keep else None
            chunks.clear()  # one copy of a large member in memory while on_member parses it, not two
            if m.name == MANIFEST:
                manifest = data
            if on_member is not None:
                on_member(m.name, data)
        if sig is None:  # the signature comes last: a cut (or a damaged block) loses it first
            cut = r.unfinished(count, last, "its signature" if manifest is not None else "its manifest and signature")
            if cut is not None:
                raise cut
    return provenance.judge(path, seen, sig, trust), manifest


def _in_member(r: _Reader, name: str, e: BaseException) -> BadInput:
    """`r.corrupt(e)` for an error reading member `name`'s bytes (an archive cut or damaged inside it),
    naming the member; a bound's own message (`tarsafe.Inflated`, `UnsafeTar`) as it is."""
    if isinstance(e, (tarsafe.Inflated, tarsafe.UnsafeTar)):
        return r.corrupt(e)
    return r.corrupt(f"{type(e).__name__}: {e}, in member {one_line(name, 200)}")


_KINDS = {tarfile.SYMTYPE: "a symbolic link", tarfile.LNKTYPE: "a hard link", tarfile.DIRTYPE: "a directory",
          tarfile.FIFOTYPE: "a FIFO", tarfile.CHRTYPE: "a character device", tarfile.BLKTYPE: "a block device"}


class MemberHash:
    """The hashes of one archive member's bytes, fed as they stream by (`update`): SHA-256 (`hexdigest`,
    what the signature lists: `provenance`) and, with `xxh3`, xxh3-128 (`xxh3_hex`, the manifest entry's
    `hash`: the fingerprint's leaf). `cache load`'s extraction and `inspect_archive` (for `cache verify`)
    both hash with it, so what verify compares with the manifest is what load compares."""

    __slots__ = ("sha", "xxh")

    def __init__(self, *, xxh3: bool = True) -> None:
        self.sha = hashlib.sha256()
        self.xxh = xxhash.xxh3_128() if xxh3 else None

    def update(self, data: bytes) -> None:
        self.sha.update(data)
        if self.xxh is not None:
            self.xxh.update(data)

    def hexdigest(self) -> str:
        """SHA-256, hex."""
        return self.sha.hexdigest()

    def xxh3_hex(self) -> str:
        """xxh3-128, hex (as a manifest entry's `hash`)."""
        if self.xxh is None:
            raise ValueError("MemberHash made without xxh3")
        return self.xxh.hexdigest()


class MemberStream:
    """An archive member as it is read (`read`, `readline`, `peek`), every byte hashed on the way.
    An error of the archive's stream (a damaged gzip block) is raised to the reader and kept in
    `error`: `inspect_archive` calls the archive corrupt, whatever the reader made of it."""

    def __init__(self, fh, h, size: int) -> None:
        self.fh, self.h, self.size = fh, h, size  # size: what the member's header says
        self.n = 0
        self.error: Exception | None = None
        self._pending = b""

    def _take(self, read, arg: int) -> bytes:
        if self.error is not None:
            raise self.error
        try:
            data = read(arg)
        except Exception as e:  # noqa: BLE001 - tarfile/decompressor errors on a damaged stream
            self.error = e
            raise
        self.h.update(data)
        self.n += len(data)
        return data

    def peek(self, n: int) -> bytes:
        """The next `n` bytes (fewer at the end), left to be read again."""
        if len(self._pending) < n:
            self._pending += self._take(self.fh.read, n - len(self._pending))
        return self._pending[:n]

    def read(self, n: int | None = -1) -> bytes:
        if n is None or n < 0:
            data, self._pending = self._pending + self._take(self.fh.read, -1), b""
            return data
        head, self._pending = self._pending[:n], self._pending[n:]
        return head + self._take(self.fh.read, n - len(head)) if len(head) < n else head

    def readline(self, limit: int | None = -1) -> bytes:
        limit = -1 if limit is None else limit
        head, self._pending = self._pending, b""
        if b"\n" in head or 0 <= limit <= len(head):  # the line ends inside what was peeked
            cut = head.find(b"\n") + 1 or len(head)
            cut = min(cut, limit) if limit >= 0 else cut
            head, self._pending = head[:cut], head[cut:]
            return head
        return head + self._take(self.fh.readline, limit - len(head) if limit >= 0 else -1)

    def drain(self) -> int:
        """Hash what was not read; the member's byte count."""
        if self.error is None:
            try:
                while self.read(4 << 20):
                    pass
            except Exception:  # noqa: BLE001 - kept in self.error
                pass
        return self.n
