"""`cache save`: a cache dir to one compressed, signed tar (the layout: `reader`).

Atomic: `save` writes into a temp file beside ARCHIVE and renames it at the end; any exception
(Ctrl-C included) removes the temp file. Every member is hashed with SHA-256 as it is written, and
the signed statement naming them is written last (`trust.provenance.Recorder`).
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
import io
import json
import os
import platform
import socket
import sys
import tarfile
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import IO, Any

import xxhash

from compilewatch.cache.archive.reader import (
    FORMAT,
    HEADER,
    MANIFEST,
    MEGA,
    PREFIX,
    ArchiveHeader,
    _compressed_writer,
    _umask,
    _zstd_module,
    check_level,
    compression_for,
)
from compilewatch.cache.content import fingerprint as fp_mod
from compilewatch.cache.content import stamps
from compilewatch.cache.content.fingerprint import FileEntry, Fingerprint, ProgressFn
from compilewatch.cache.local import layout
from compilewatch.cache.local.lock import cache_lock
from compilewatch.cache.trust import provenance
from compilewatch.errors import BadInput
from compilewatch.fsutil import atomic_path
from compilewatch.serialize import to_jsonable

# sub-caches `save` leaves out unless asked: precompiled_headers/ sits in the cache dir only when it is
# torch's default dir, is hundreds of MB, and only the same host compiler, version and flags can use it
# (torch rebuilds it on the first CPU C++ compile: layout.KINDS)
LEFT_OUT = ("precompiled_headers",)


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
    signed_by: str | None = None  # the key id that signed it (keys.signing_key; which key, in words: keys.describe_own)
    left_out: dict[str, dict[str, int]] | None = None  # sub-cache -> {"files", "bytes"} not archived (LEFT_OUT)


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
        import torch._functorch._aot_autograd.autograd_cache  # noqa: F401 - registers "aot_autograd"
        import torch._inductor.codecache  # noqa: F401 - registers "inductor"
        from torch.compiler._cache import CacheArtifactManager
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
    check_level(comp, level, archive)
    if comp == "zstd" and _zstd_module()[0] is None:
        _compressed_writer(io.BytesIO(), comp, level)  # raises the BadInput with the hint
    if archive.exists() and not overwrite:
        raise BadInput(f"{archive} already exists", hint="pass --overwrite to replace it, or choose another name")
    if archive.is_dir():
        raise BadInput(f"{archive} is a directory", hint="give the archive's file name, e.g. cache.tar.gz")
    loc = layout.resolve_existing(path)
    root = loc.path
    layout.refuse_inside(root, archive, "archive")
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
