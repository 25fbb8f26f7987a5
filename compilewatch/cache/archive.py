"""Portable cache archives: `save` a cache to one compressed tar, `load` it back, atomically.

Archive layout (a tar stream, compressed by suffix: `.tar.zst` zstd, `.tar.gz`/`.tgz` gzip, `.tar`
none; zstd needs Python >= 3.14's `compression.zstd` or the `zstandard` package):

1. `compilewatch-archive.json`: header read first: system key + system info, torch version and build
   hash, an environment summary, the source path, the compression.
2. `cache/<relative path>`: every file of the cache (mtimes kept; the stat-index sidecar and
   writers' temp files left out, and `precompiled_headers/` unless `headers=True`: LEFT_OUT).
3. `mega_cache.bin` (when torch offers it): the fxgraph and aotautograd entries in torch's own
   Mega-Cache format (`torch.compiler.save_cache_artifacts`), which a training process can preload
   with `torch.compiler.load_cache_artifacts` (`load_mega_cache`) wherever its cache dir is.
4. `manifest.json`: the fingerprint of what was written (each file's size and xxh3-128), last,
   because it describes the bytes actually read (a training job may add entries meanwhile).

Atomic both ways. `save` writes into a temp file beside ARCHIVE and renames it at the end; any
exception (Ctrl-C included) removes the temp file. `load` checks the header (system key, torch
version: refuses on mismatch unless `force`), extracts into a temp dir beside the cache dir,
checks every file against the manifest, points triton's absolute kernel paths at the new location
(`relocate`), then swaps with two renames under the cache lock: the existing cache becomes
`<cache>.backup-<timestamp>` (never deleted), the extracted dir becomes the cache. A failure before
the swap removes the temp dir and leaves the cache as it was.

An archive is code: torch imports the Python and C++ its entries carry and unpickles its entries on
every cache hit. `load` never unpickles; it checks every fxgraph / aotautograd pickle with
`picklescan` and refuses one that names a global torch's caches never use (naming the member and
the global) unless `trust`. That stops a pickle that calls `os.system`; it cannot make a stranger's
archive safe (docs/security.md).

Untrusted sizes. Before writing anything, `load` reads the header and the manifest (a streaming pass
that writes nothing) and checks that the manifest's total plus a margin fits on the target's disk.
Extraction then writes only members the manifest lists, each exactly as large as the manifest says
(a member is refused before a byte of it is written), so a lying archive writes at most the
manifest's total. Header and manifest members are capped in size before they are read into memory.
"""

from __future__ import annotations

import contextlib
import contextvars
import gzip
import hashlib
import io
import json
import os
import platform
import shutil
import socket
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import IO, Any, BinaryIO

import xxhash

from compilewatch.cache import fingerprint as fp_mod
from compilewatch.cache import backups, busy, layout, picklescan, provenance, stamps, swap, tarsafe
from compilewatch.cache.relocate import rebase_triton_paths
from compilewatch.cache.fingerprint import FileEntry, Fingerprint, ProgressFn
from compilewatch.cache.lock import cache_lock
from compilewatch.errors import BadInput
from compilewatch.fsutil import atomic_path
from compilewatch.inputs import loads_json, one_line, open_untrusted
from compilewatch.jsonshape import build
from compilewatch.serialize import to_jsonable

FORMAT = 1
HEADER = "compilewatch-archive.json"
MANIFEST = "manifest.json"
MEGA = "mega_cache.bin"
PREFIX = "cache/"
SUFFIXES = {".tar.zst": "zstd", ".tzst": "zstd", ".tar.gz": "gzip", ".tgz": "gzip", ".tar": "none"}
_GZIP_MAGIC = b"\x1f\x8b"
_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
_COPY = 4 << 20
MAX_HEADER = 16 << 20  # the header is a few KB; anything this large is not one
MAX_MANIFEST = 512 << 20  # ~150 bytes per file: millions of files
DISK_MARGIN = 64 << 20  # free space kept beyond the manifest's total (filesystem overhead)
# sub-caches `save` leaves out unless asked: precompiled_headers/ sits in the cache dir only when it is
# torch's default dir, is hundreds of MB, and only the same host compiler, version and flags can use it
# (torch rebuilds it on the first CPU C++ compile: layout.KINDS)
LEFT_OUT = ("precompiled_headers",)


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


@dataclass(frozen=True, slots=True)
class SaveResult:
    archive: str
    source: str
    files: int
    bytes: int  # uncompressed bytes of cache files
    archive_bytes: int
    content_hash: str
    compression: str
    mega_cache: dict[str, int] | None  # artifact type -> count, None when torch offered none
    duration_s: float
    warnings: tuple[str, ...]
    signed_by: str | None = None  # the key id that signed it (keys.signing_key)
    left_out: dict[str, dict[str, int]] | None = None  # sub-cache -> {"files", "bytes"} not archived (LEFT_OUT)


@dataclass(frozen=True, slots=True)
class LoadResult:
    source: str  # archive file or directory loaded
    path: str  # the cache dir now holding it
    backup: str | None  # where the previous cache went (None: there was none)
    files: int
    bytes: int
    content_hash: str
    archive_system_key: str
    system_key: str
    mismatches: tuple[str, ...]  # compatibility problems accepted with force
    forced: bool
    paths_rewritten: int  # triton .json files pointed at the new path (relocate.rebase_triton_paths)
    duration_s: float
    warnings: tuple[str, ...]
    provenance: provenance.Provenance | None = None  # who made the archive or dir (kind "dir": backups.judge)
    trusted_pickles: tuple[str, ...] = ()  # pickles the scanner refused, loaded because of trust=True


# --- compression ----------------------------------------------------------------------------------
def compression_for(archive: Path) -> str:
    name = archive.name.lower()
    for suffix, comp in SUFFIXES.items():
        if name.endswith(suffix):
            return comp
    raise BadInput(f"unknown archive type {archive.name!r}",
                   hint="name it *.tar.zst (zstd), *.tar.gz / *.tgz (gzip) or *.tar (uncompressed)")


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


# --- environment ----------------------------------------------------------------------------------
def env_summary() -> dict[str, Any]:
    """Facts that decide whether the archive's entries can hit elsewhere (and help a human tell)."""
    from importlib import metadata

    import compilewatch
    from compilewatch import torchinfo

    def version(dist: str) -> str | None:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return None

    prefixes = ("TORCHINDUCTOR_", "TRITON_", "TORCH_COMPILE_", "TORCHDYNAMO_", "CUDA_VISIBLE_DEVICES")
    return {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "machine": platform.machine(),
        "hostname": socket.gethostname(),
        "torch": to_jsonable(torchinfo.torch_build()),
        "triton": version("triton") or version("pytorch-triton"),
        "compilewatch": compilewatch.__version__,
        "env": {k: v for k, v in sorted(os.environ.items()) if k.startswith(prefixes)},
    }


# --- save -----------------------------------------------------------------------------------------
def _tarinfo(name: str, size: int, mtime: float) -> tarfile.TarInfo:
    ti = tarfile.TarInfo(name)
    ti.size, ti.mtime, ti.mode, ti.type = size, mtime, 0o644, tarfile.REGTYPE
    ti.uid = ti.gid = 0
    ti.uname = ti.gname = ""
    return ti


def _add_bytes(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    tar.addfile(_tarinfo(name, len(data), time.time()), io.BytesIO(data))


class _HashingReader:
    """A file object that hashes what tarfile reads from it (xxh3 for the manifest, SHA-256 for the
    signed statement)."""

    def __init__(self, fh: IO[bytes]) -> None:
        self.fh, self.h, self.sha, self.n = fh, xxhash.xxh3_128(), hashlib.sha256(), 0

    def read(self, size: int = -1) -> bytes:
        data = self.fh.read(size)
        self.h.update(data)
        self.sha.update(data)
        self.n += len(data)
        return data


# the Recorder of the save in progress: `_add_file` hashes each member for the signature into it (a
# context variable rather than a parameter, so `_add_file` keeps the signature tests wrap)
_SIGNING: contextvars.ContextVar[provenance.Recorder | None] = contextvars.ContextVar("_SIGNING", default=None)


def _add_file(tar: tarfile.TarFile, root: Path, f: layout.FileStat) -> FileEntry | None:
    """Add one cache file; returns what was written (None: it vanished).

    Everything comes from one open descriptor: torch and triton replace cache files by rename, so an
    open file is a consistent snapshot and the tar header's size always matches the bytes.
    """
    signed = _SIGNING.get()
    try:
        fd = os.open(root / f.rel, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except FileNotFoundError:
        return None
    with os.fdopen(fd, "rb") as fh:
        st = os.fstat(fh.fileno())
        if stamps.needs_content(f.rel):
            data = fh.read()
            tar.addfile(_tarinfo(PREFIX + f.rel, len(data), st.st_mtime), io.BytesIO(data))
            if signed is not None:
                signed.add_bytes(PREFIX + f.rel, data)
            stamp = stamps.stamp_of(f.rel, data)
            return FileEntry(f.rel, len(data), st.st_mtime_ns, xxhash.xxh3_128_hexdigest(data),
                             stamp.system_key, stamp.torch_hash)
        reader = _HashingReader(fh)
        tar.addfile(_tarinfo(PREFIX + f.rel, st.st_size, st.st_mtime), reader)  # type: ignore[arg-type]
        if signed is not None:
            signed.add(PREFIX + f.rel, reader.n, reader.sha.hexdigest())
        stamp = stamps.stamp_of(f.rel, None)
        return FileEntry(f.rel, reader.n, st.st_mtime_ns, reader.h.hexdigest(), stamp.system_key, stamp.torch_hash)


def mega_cache_from_dir(root: Path, entries: list[FileEntry]) -> tuple[bytes, dict[str, int]] | None:
    """The fxgraph and aotautograd entries of `root` in torch's Mega-Cache format, or None.

    Uses torch's CacheArtifactManager (torch >= 2.7) in a fresh recording context, so artifacts this
    process compiled itself are neither included nor disturbed.
    """
    try:
        from torch.compiler._cache import CacheArtifactManager

        import torch._functorch._aot_autograd.autograd_cache  # noqa: F401 - registers "aot_autograd"
        import torch._inductor.codecache  # noqa: F401 - registers "inductor"
    except ImportError:
        return None
    if not hasattr(CacheArtifactManager, "with_fresh_cache"):
        return None
    counts: dict[str, int] = {}
    with CacheArtifactManager.with_fresh_cache():
        for e in entries:
            parts = e.rel.split("/")
            if parts[0] == "fxgraph" and len(parts) == 4:
                kind, key = "inductor", parts[2]
            elif parts[0] == "aotautograd" and len(parts) == 3:
                kind, key = "aot_autograd", parts[1]
            else:
                continue
            try:
                content = (root / e.rel).read_bytes()
            except OSError:
                continue
            CacheArtifactManager.record_artifact(kind, key, content)
            counts[kind] = counts.get(kind, 0) + 1
        if not counts:
            return None
        result = CacheArtifactManager.serialize()
    if result is None:
        return None
    return result[0], counts


def save(archive: str | os.PathLike[str], path: str | os.PathLike[str] | None = None, *,
         mega: bool = True, level: int | None = None, overwrite: bool = False, headers: bool = False,
         progress: ProgressFn | None = None) -> SaveResult:
    """Write the cache at `path` (default: torch's) to `archive`, atomically. See the module docstring.
    The sub-caches in LEFT_OUT (precompiled C++ headers) are not archived unless `headers`; the result
    counts what was left out. `progress(bytes_done, bytes_total)` is called after each file (it must
    not raise)."""
    from compilewatch import torchinfo

    t0 = time.perf_counter()
    archive = Path(os.path.abspath(os.path.expanduser(archive)))
    comp = compression_for(archive)
    if comp == "zstd" and _zstd_module()[0] is None:
        _compressed_writer(io.BytesIO(), comp, level)  # raises the BadInput with the hint
    if archive.exists() and not overwrite:
        raise BadInput(f"{archive} already exists", hint="pass --overwrite to replace it, or choose another name")
    if archive.is_dir():
        raise BadInput(f"{archive} is a directory", hint="give the archive's file name, e.g. cache.tar.gz")
    loc = layout.resolve_existing(path)
    root = loc.path
    if root == archive or root in archive.parents:
        raise BadInput(f"the archive {archive} would be written inside the cache it archives",
                       hint="write it somewhere outside the cache dir")
    torch = torchinfo.torch_module()
    header = ArchiveHeader(
        format=FORMAT, created_at=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        source_path=str(root), system_key=torchinfo.system_key(), system_info=torchinfo.system_info(),
        torch_version=str(torch.__version__), torch_hash=stamps.current_torch_hash(), compression=comp,
        env=env_summary(),
    )
    warnings: list[str] = []
    if not loc.triton_inside:
        warnings.append(f"the triton cache {loc.triton_dir} (TRITON_CACHE_DIR) is outside the inductor dir "
                        "and is not in the archive; inductor re-emits kernels bundled in FX-graph entries")
    with cache_lock(root, shared=True):
        w = layout.walk(root)
        warnings.extend(w.warnings)
        files, left_out = _without_left_out(w.files, () if headers else LEFT_OUT)
        written: list[FileEntry] = []
        mega_counts = None
        signed = provenance.Recorder()

        def add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
            _add_bytes(tar, name, data)
            signed.add_bytes(name, data)

        token = _SIGNING.set(signed)
        with contextlib.ExitStack() as undo, atomic_path(archive) as tmp:
            undo.callback(_SIGNING.reset, token)
            with open(tmp, "wb") as raw:
                stream = _compressed_writer(raw, comp, level)
                try:
                    with tarfile.open(fileobj=stream, mode="w|", format=tarfile.PAX_FORMAT) as tar:
                        add(tar, HEADER, json.dumps(to_jsonable(header), indent=2).encode())
                        total, done = sum(f.size for f in files), 0
                        for f in files:
                            entry = _add_file(tar, root, f)
                            if entry is None:
                                warnings.append(f"{f.rel} vanished while saving (left out)")
                            else:
                                written.append(entry)
                            done += f.size
                            if progress is not None:
                                progress(done, total)
                        if mega:
                            try:
                                built = mega_cache_from_dir(root, written)
                            except Exception as e:  # noqa: BLE001 - torch internals: the archive is still whole
                                built = None
                                warnings.append(f"Mega-Cache left out: {type(e).__name__}: {e}"[:300])
                            if built is not None:
                                add(tar, MEGA, built[0])
                                mega_counts = built[1]
                        manifest = _manifest(root, written, header)
                        add(tar, MANIFEST, json.dumps(to_jsonable(manifest)).encode())
                        _add_bytes(tar, provenance.SIGNATURE, signed.signature_member(header.created_at))
                finally:
                    if stream is not raw:
                        stream.close()
    os.chmod(archive, 0o666 & ~_umask())  # mkstemp made it 0600; an archive is meant to be shared
    return SaveResult(
        archive=str(archive), source=str(root), files=manifest.files, bytes=manifest.bytes,
        archive_bytes=archive.stat().st_size, content_hash=manifest.content_hash, compression=comp,
        mega_cache=mega_counts, duration_s=time.perf_counter() - t0, warnings=tuple(warnings),
        signed_by=signed.key_id, left_out=left_out or None,
    )


def _without_left_out(files: list[layout.FileStat], kinds: tuple[str, ...]
                      ) -> tuple[list[layout.FileStat], dict[str, dict[str, int]]]:
    """`files` without those of the sub-caches `kinds`, and {sub-cache: {"files", "bytes"}} of those."""
    if not kinds:
        return files, {}
    kept, left_out = [], {}
    for f in files:
        sub = layout.subcache_of(f.rel)
        if sub in kinds:
            c = left_out.setdefault(sub, {"files": 0, "bytes": 0})
            c["files"] += 1
            c["bytes"] += f.size
        else:
            kept.append(f)
    return kept, left_out


def _manifest(root: Path, written: list[FileEntry], header: ArchiveHeader) -> Fingerprint:
    from collections import Counter

    per_sub = fp_mod.group(written)
    content_hash, subs = fp_mod.merkle(per_sub)
    stamped = [e for e in written if stamps.needs_content(e.rel) or e.rel.startswith("cache/")]
    return Fingerprint(
        path=str(root), files=len(written), bytes=sum(e.size for e in written), content_hash=content_hash,
        subcaches=subs, system_key=header.system_key, torch_version=header.torch_version,
        entry_system_keys=dict(Counter(e.system_key or "unknown" for e in stamped)),
        entry_torch_hashes=dict(Counter(e.torch_hash or "unknown" for e in stamped if not e.rel.startswith("cache/"))),
        foreign_entries=sum(1 for e in stamped if e.system_key and e.system_key != header.system_key),
        created_at=header.created_at, duration_s=0.0, hashed=len(written), reused=0, in_flight=0, warnings=(),
        entries=tuple(sorted(written, key=lambda e: e.rel)),
    )


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
            self.stream = tarsafe.GuardedStream(_compressed_reader(self.raw, archive))
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
    verdict, data = provenance.inspect_archive(archive)
    if data is None:
        raise BadInput(f"{archive} has no {MANIFEST}: it was cut short", hint="save it again")
    return _parse_manifest(Path(archive), data), verdict


def _corrupt(archive: Path, e: BaseException | str) -> BadInput:
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


def untrusted(archive: str | os.PathLike[str], member: str, scan: picklescan.ScanResult) -> BadInput:
    """The BadInput for a pickle `load` will not hand to torch: which member, which global."""
    why = scan.problem or f"it names {', '.join(one_line(g, 120) for g in scan.refused[:3])}, which torch's caches never use"
    return BadInput(f"{archive}: refused {one_line(member, 200)}: {why}; loading it would run that code",
                    hint="nothing was changed. If you made this archive or fully trust who did, pass --trust "
                         "(docs/security.md)")


def load_mega_cache(archive: str | os.PathLike[str], *, trust: bool = False) -> dict[str, int] | None:
    """Preload `archive`'s Mega-Cache into *this process* (torch.compiler.load_cache_artifacts).

    For trainers whose cache dir differs from the one saved: torch writes the entries into the current
    TORCHINDUCTOR_CACHE_DIR. Returns artifact counts, or None when the archive has no Mega-Cache.
    First the archive's provenance (`provenance.check_provenance`): a foreign archive is BadInput
    unless `trust`. Then what `torch.compiler.load_cache_artifacts` does in its two steps (parse the
    container, which unpickles nothing; populate the caches, which unpickles: torch's inductor artifact
    unpickles its entry to emit the triton bundle), with the Mega-Cache's bytes checked against the
    signed hash and every artifact checked in between (`picklescan.scan_artifact`): one refused is
    BadInput unless `trust`.
    """
    from torch.compiler._cache import CacheArtifactManager

    verdict = provenance.check_provenance(archive, trust=trust).require()
    with _Reader(Path(archive)) as r:
        for m in r.members():
            if m.name == MEGA:
                data = r.read(m, 1 << 40)
                verdict.check_member(MEGA, hashlib.sha256(data).hexdigest())
                artifacts = CacheArtifactManager.deserialize(data)
                if artifacts is None:
                    return None
                for kind, items in artifacts.items():
                    for a in items:
                        scan = picklescan.scan_artifact(kind, getattr(a, "content", None))
                        if not scan.ok and not trust:
                            raise untrusted(archive, f"{MEGA}: {kind} {getattr(a, 'key', '?')}", scan)
                info = CacheArtifactManager.populate_caches(artifacts)
                return {k: len(v) for k, v in info.artifacts.items()}
    return None


# --- load -----------------------------------------------------------------------------------------
def _safe_rel(name: str) -> str | None:
    if not name.startswith(PREFIX):
        return None
    rel = name[len(PREFIX):]
    parts = rel.split("/")
    if not rel or rel.startswith("/") or any(p in ("", ".", "..") for p in parts) or parts[0] == layout.SIDECAR:
        return None
    return rel


def _extract(reader: _Reader, dest: Path, manifest: Fingerprint, progress: ProgressFn | None = None,
             verdict: provenance.Provenance | None = None, space: "_SpaceBudget | None" = None,
             ) -> dict[str, tuple[int, str, int]]:
    """Extract cache files into `dest`; returns rel -> (size, xxh3, mtime) of what was written.

    Only members the manifest lists, each exactly its listed size, each once: nothing else is written
    (a member is refused before any of its bytes reach the disk), so the total is the manifest's.
    `progress` gets (archive bytes read, archive size): the compressed position, known without a scan.
    `verdict`: each member's SHA-256 is checked against what was signed (the archive may have changed
    since it was checked). `space`: charged with every byte as it is written (`_SpaceBudget`).
    """
    want = {e.rel: e.size for e in manifest.entries or ()}
    budget = sum(want.values())
    got: dict[str, tuple[int, str, int]] = {}
    written = 0
    size = reader.archive.stat().st_size
    for m in reader.members():
        if progress is not None:
            progress(min(reader.raw.tell(), size), size)
        if m.name in (HEADER, MEGA, MANIFEST, provenance.SIGNATURE):
            continue
        rel = _safe_rel(m.name)
        if rel is None or not m.isreg():
            raise reader.corrupt(f"unexpected member {one_line(repr(m.name), 200)} (only regular files under "
                                 f"{PREFIX} are allowed)")
        if rel in got:
            raise reader.corrupt(f"member {one_line(rel, 200)} appears twice")
        if rel not in want:
            raise reader.corrupt(f"member {one_line(rel, 200)} is not in the manifest")
        if m.size != want[rel] or written + m.size > budget:
            raise reader.corrupt(f"member {one_line(rel, 200)} is {m.size} bytes, the manifest says {want[rel]}")
        target = dest / rel
        h = xxhash.xxh3_128()
        sha = hashlib.sha256()
        n = 0
        if space is not None:
            space.new_file()
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            src = reader.tar.extractfile(m)
            with open(target, "xb") as out:
                while src is not None and n < m.size:
                    chunk = src.read(min(_COPY, m.size - n))
                    if not chunk:
                        break
                    h.update(chunk)
                    sha.update(chunk)
                    if space is not None:
                        space.charge(len(chunk))
                    out.write(chunk)
                    n += len(chunk)
            os.utime(target, (m.mtime, m.mtime))
        except (tarfile.TarError, EOFError, ValueError) as e:
            raise reader.corrupt(e) from None
        except OSError as e:  # a name too long, a file where a folder must go (`qq` then `qq/child`)
            raise reader.corrupt(f"cannot write member {one_line(rel, 200)}: {e.strerror or e}") from None
        written += n
        if verdict is not None:
            verdict.check_member(m.name, sha.hexdigest())
        got[rel] = (n, h.hexdigest(), int(m.mtime * 1e9) if isinstance(m.mtime, (int, float)) else 0)
    return got


def _check_extracted(reader: _Reader, got: dict[str, tuple[int, str, int]], manifest: Fingerprint) -> str:
    """BadInput unless what was extracted is what the manifest lists; returns the content hash of what
    was extracted (computed here, not the manifest's claim)."""
    want = {e.rel: (e.size, e.hash) for e in manifest.entries or ()}
    missing = sorted(set(want) - set(got))
    extra = sorted(set(got) - set(want))
    bad = sorted(rel for rel in set(want) & set(got) if want[rel] != got[rel][:2])
    if missing or extra or bad:
        sample = [one_line(x, 120) for x in (missing + extra + bad)[:3]]
        raise reader.corrupt(f"{len(missing)} missing, {len(extra)} unexpected, {len(bad)} damaged files "
                             f"(e.g. {', '.join(sample)})")
    rows = [FileEntry(rel, size, mtime, digest) for rel, (size, digest, mtime) in got.items()]
    return fp_mod.merkle(fp_mod.group(rows))[0]


def _scan_pickles(archive: Path, root: Path, got, trust: bool, prefix: str = PREFIX) -> tuple[str, ...]:
    """Scan every file of `got` (relative paths under `root`: what was extracted, or a dir to restore)
    that torch would unpickle (`picklescan.is_pickle_file`): BadInput for the first one refused, unless
    `trust`; returns what was refused and loaded anyway (with `trust`). `prefix`: how a path is named."""
    refused = []
    for rel in sorted(got):
        fd, st = open_untrusted(root / rel, "cache file")  # a file swapped for a FIFO is refused, not waited on
        with os.fdopen(fd, "rb") as fh:
            head = fh.read(1)
            if not picklescan.is_pickle_file(rel, head):
                continue
            fh.seek(0)
            scan = picklescan.scan_file(fh, st.st_size)  # streamed: a large entry is never read in one piece
        if not scan.ok:
            if not trust:
                raise untrusted(archive, prefix + rel, scan)
            refused.append(f"{prefix}{rel}: {scan.problem or ', '.join(scan.refused[:3])}")
    return tuple(refused)


def _swap_in(new: Path, target: Path, *, new_is_temp: bool = True) -> Path | None:
    """Rename `new` onto `target`, moving an existing non-empty `target` to a timestamped backup first
    (journaled: a killed swap is completed or rolled back by the next command, `swap.recover`); the
    backup is recorded as made here (`backups.record`: `cache load BACKUP` trusts it)."""
    backup = swap.swap_in(new, target, new_is_temp=new_is_temp,
                          backup_for=lambda t: layout.timestamped_sibling(t, "backup"))
    if backup is not None:
        backups.record(backup, target)
    return backup


def _check_target(target: Path, force: bool) -> None:
    if target.exists() and not target.is_dir():
        raise BadInput(f"{target} exists and is not a directory; nothing was changed")
    if target.is_dir() and not layout.looks_like_cache(target) and not force:
        raise layout.not_a_cache(target)


class _SpaceBudget:
    """Disk space an extraction may use, counted as bytes are written, not as the manifest claims.

    `need` is what the listed members add up to (each file rounded up to a 4 KiB block, plus a margin);
    it is checked against the free space before anything is written. While extracting, every byte
    written is charged: past `need` (a member larger than listed, more files than listed) or when the
    disk's free space falls below the margin (another writer fills it), `charge` raises BadInput, and
    the load removes what it wrote, leaving the cache as it was.
    """

    _BLOCK = 4096
    _RECHECK = 64 << 20  # look at the real free space again after this many bytes

    def __init__(self, source: Path, where: Path, sizes: "list[int]") -> None:
        self.source, self.where = source, where
        self.need = sum(-(-max(s, 0) // self._BLOCK) * self._BLOCK + self._BLOCK for s in sizes) + DISK_MARGIN
        self.used = 0
        self.since_check = 0
        free = shutil.disk_usage(where).free
        if self.need > free:
            raise BadInput(f"{source} holds {sum(max(s, 0) for s in sizes)} bytes in {len(sizes)} files (counted from "
                           f"its members' listed sizes), {where} has {free} bytes free",
                           hint="free some space or load it elsewhere with --dir; nothing was changed")

    def new_file(self) -> None:
        self.charge(self._BLOCK)

    def charge(self, n: int) -> None:
        self.used += n
        self.since_check += n
        if self.used > self.need:
            raise BadInput(f"{self.source} wrote more than the {self.need} bytes its members were checked for; "
                           "stopped, and removed what was written; nothing was changed")
        if self.since_check >= self._RECHECK:
            self.since_check = 0
            free = shutil.disk_usage(self.where).free
            if free < DISK_MARGIN // 2:
                raise BadInput(f"{self.where} is running out of space while loading {self.source} ({free} bytes free); "
                               "stopped, and removed what was written; nothing was changed",
                               hint="free some space or load it elsewhere with --dir")


def _manifest_of(source: Path, data: bytes | None) -> Fingerprint:
    if data is None:
        raise BadInput(f"{source} has no {MANIFEST}: it was cut short", hint="save it again")
    d = loads_json(data, f"{source}:{MANIFEST}")
    if not isinstance(d, dict):
        raise BadInput(f"{source}: {MANIFEST} is not a JSON object", hint="it may be corrupt; nothing was changed")
    fp = fp_mod.from_json(d, source=f"{source}:{MANIFEST}")
    if fp.entries is None:
        raise BadInput(f"{source}: {MANIFEST} lists no files", hint="it may be corrupt; nothing was changed")
    return fp


def load(source: str | os.PathLike[str], path: str | os.PathLike[str] | None = None, *,
         force: bool = False, trust: bool = False, progress: ProgressFn | None = None) -> LoadResult:
    """Load an archive (or restore a backup dir) into the cache dir `path` (default: torch's).

    First the archive's provenance (`provenance.inspect_archive`): a foreign archive is BadInput unless
    `trust`. Refuses (BadInput) when the archive was made for another system key or torch version, or
    when `path` exists and does not look like an inductor cache, unless `force`; refuses pickles the
    scanner refuses unless `trust`. The previous cache, if any, is moved to
    `<cache>.backup-<timestamp>`. `progress(done, total)` follows the archive's bytes while extracting
    (it must not raise).
    """
    from compilewatch import torchinfo

    t0 = time.perf_counter()
    source = Path(os.path.abspath(os.path.expanduser(source)))
    if source.is_dir():
        return restore_dir(source, path, force=force, trust=trust, t0=t0)
    loc = layout.locate(path)
    target = loc.path
    _check_target(target, force)
    header = read_header(source)
    target.parent.mkdir(parents=True, exist_ok=True)
    verdict, manifest_bytes = provenance.inspect_archive(source, trust=trust,
                                                         stop_after=shutil.disk_usage(target.parent).free)
    verdict.require()  # first: who made it
    problems = compatibility(header.system_key, header.torch_version, archive_info=header.system_info)
    if problems and not force:
        raise BadInput(f"{source} was saved for another system: " + "; ".join(problems),
                       hint="pass --force to load it anyway (the entries will not hit on this machine); nothing was changed")
    manifest = _manifest_of(source, manifest_bytes)
    space = _SpaceBudget(source, target.parent, [e.size for e in manifest.entries or ()])
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.load-", dir=target.parent))
    os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp made it 0700; it becomes the cache dir
    try:
        with _Reader(source) as r:
            got = _extract(r, tmp, manifest, progress, verdict if verdict.verdict != "foreign" else None, space)
            if progress is not None:
                size = source.stat().st_size
                progress(size, size)
            content_hash = _check_extracted(r, got, manifest)
        trusted_pickles = _scan_pickles(source, tmp, got, trust)
        rewritten = rebase_triton_paths(tmp, target)
        with cache_lock(target), busy.not_compiling(target):
            backup = _swap_in(tmp, target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return LoadResult(
        source=str(source), path=str(target), backup=str(backup) if backup else None, files=len(got),
        bytes=sum(v[0] for v in got.values()), content_hash=content_hash, archive_system_key=header.system_key,
        system_key=torchinfo.system_key(), mismatches=problems, forced=bool(problems), paths_rewritten=rewritten,
        duration_s=time.perf_counter() - t0,
        warnings=(provenance.CODE_WARNING,) if verdict.trusted_by_flag else (),
        provenance=verdict, trusted_pickles=trusted_pickles,
    )


def restore_dir(source: Path, path: str | os.PathLike[str] | None = None, *, force: bool = False,
                trust: bool = False, built_here: str | None = None, t0: float | None = None) -> LoadResult:
    """Restore a backup (or any cache) dir by renaming it into place (it must be on the same filesystem).
    A dir is not signed: it is `own` when it is a backup compilewatch recorded making here
    (`backups.judge`), else foreign and restored only with `trust`; every pickle in it is scanned
    first either way (refused unless `trust`). `built_here`: the caller built the dir itself and
    checked what it put there (`cache remote pull`'s staging: links to the live cache plus scanned
    entries), said in these words; no verdict or scan then."""
    from compilewatch import torchinfo

    t0 = time.perf_counter() if t0 is None else t0
    source = Path(os.path.abspath(os.path.expanduser(source)))
    loc = layout.locate(path)
    target = loc.path
    if source == target:
        raise BadInput(f"{source} is already the cache dir")
    if target in source.parents or source in target.parents:
        raise BadInput(f"{source} and the cache dir {target} are nested; nothing was changed",
                       hint="restore a backup that sits beside the cache dir (where `cache clear` puts it)")
    if not layout.cache_evidence(source) or not layout.looks_like_cache(source):
        raise BadInput(f"{source} is not an archive and does not look like an inductor cache "
                       f"({'it is empty' if not os.listdir(source) else 'no inductor structure in it'}); "
                       "nothing was changed", hint="load an archive from `cache save`, or a backup dir from `cache clear`")
    _check_target(target, force)
    if built_here is not None:
        verdict = provenance.Provenance(str(source), "own", built_here, False, None, "this machine", {}, False,
                                        kind="dir")
    else:  # judged before the fingerprint, whose stat index may add .compilewatch/ (the dir's ctime)
        verdict = backups.judge(source, trust=trust)
    fp = fp_mod.fingerprint(source)
    problems = compatibility(fp.system_key, fp.torch_version, fp.entry_system_keys, fp.entry_torch_hashes)
    if problems and not force:
        raise BadInput(f"{source} holds entries for another system: " + "; ".join(problems),
                       hint="pass --force to restore it anyway; nothing was changed")
    verdict.require()  # who made it: a backup made here, or foreign (accepted only with trust)
    target.parent.mkdir(parents=True, exist_ok=True)
    if os.stat(source).st_dev != os.stat(target.parent).st_dev:
        raise BadInput(f"{source} is on another filesystem than {target}: it cannot be renamed into place",
                       hint=f"save it with `compilewatch cache save X.tar.gz --dir {source}` and load that")
    trusted_pickles = () if built_here is not None else \
        _scan_pickles(source, source, [f.rel for f in layout.walk(source).files], trust, prefix="")
    with cache_lock(target), busy.not_compiling(target):
        backup = _swap_in(source, target, new_is_temp=False)
        rewritten = rebase_triton_paths(target, target)
    return LoadResult(
        source=str(source), path=str(target), backup=str(backup) if backup else None, files=fp.files,
        bytes=fp.bytes, content_hash=fp.content_hash, archive_system_key=fp.system_key,
        system_key=torchinfo.system_key(), mismatches=problems, forced=bool(problems), paths_rewritten=rewritten,
        duration_s=time.perf_counter() - t0,
        warnings=fp.warnings + ((provenance.CODE_WARNING,) if verdict.trusted_by_flag else ()),
        provenance=verdict, trusted_pickles=trusted_pickles,
    )
