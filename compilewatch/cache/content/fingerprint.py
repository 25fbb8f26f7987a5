"""Content fingerprint of an inductor cache: a Merkle hash over relative paths and file contents.

- Leaves: xxh3-128 of each file's bytes (xxhash: a fast, well-kept hash; it releases the GIL, so a
  small thread pool hashes on every core).
- Sub-cache nodes: xxh3-128 over the sorted `(relative path, leaf)` pairs of that sub-cache.
- Root (`content_hash`): xxh3-128 over the sorted `(sub-cache, node)` pairs, `locks` left out (torch's
  empty lock files say nothing about content). Two caches with the same root hold the same files.

Re-running on an unchanged cache only stats files: a stat index `(size, mtime_ns, inode) -> hash` is
kept in the sidecar `<cache>/.compilewatch/fingerprint-index.json`. A cached hash is trusted only if
the file's mtime is older than the run that hashed it by at least `RACY_NS` (git's "racily clean"
rule: a file rewritten within the filesystem's timestamp granularity could keep its mtime).

The system key comes only from `torchinfo.system_key()`: it is the key of the machine fingerprinting.
Which key each entry was built for is read from the entries (`stamps`) and summarized in
`entry_system_keys`.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import time
from collections import Counter, defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, Iterable, NamedTuple, Sequence

import xxhash

from compilewatch.cache.content import stamps
from compilewatch.cache.local import layout
from compilewatch.cache.local.layout import FileStat
from compilewatch.errors import BadInput
from compilewatch.fsutil import atomic_write_text

FORMAT = 1
INDEX_NAME = "fingerprint-index.json"
RACY_NS = 2_000_000_000  # trust a cached hash only for files last modified 2 s before it was computed
_READ_WHOLE = 8 << 20  # files up to this size are read in one call
_CHUNK = 4 << 20
_BATCH_FILES = 256
_BATCH_BYTES = 64 << 20

ProgressFn = Callable[[int, int], None]  # (bytes done, bytes total) of a long cache operation; must not raise


@dataclass(frozen=True, slots=True)
class FileEntry:
    rel: str
    size: int
    mtime_ns: int
    hash: str
    system_key: str | None = None  # stamp found inside the entry (fxgraph / aotautograd / cache)
    torch_hash: str | None = None


class _Row(NamedTuple):
    """FileEntry's fields as a tuple: what an incremental run handles per file (cheap to build)."""

    rel: str
    size: int
    mtime_ns: int
    hash: str
    system_key: str | None
    torch_hash: str | None


@dataclass(frozen=True, slots=True)
class SubCacheStats:
    name: str
    files: int
    bytes: int
    content_hash: str
    newest_mtime_ns: int


@dataclass(frozen=True, slots=True)
class Fingerprint:
    """A cache's manifest. `entries` (every file with its hash) only when asked for (`files=True`)."""

    path: str
    files: int
    bytes: int
    content_hash: str
    subcaches: tuple[SubCacheStats, ...]
    system_key: str  # the key of the machine that fingerprinted (torchinfo.system_key())
    torch_version: str
    entry_system_keys: dict[str, int]  # system key stamped in entries -> entry files ("unknown" too)
    entry_torch_hashes: dict[str, int]
    foreign_entries: int  # stamped entries built for another system key: they can never hit here
    created_at: str
    duration_s: float
    hashed: int  # files read and hashed in this run
    reused: int  # files whose hash came from the stat index
    in_flight: int  # temp files of writers in progress, skipped
    warnings: tuple[str, ...]
    entries: tuple[FileEntry, ...] | None = None
    format: int = FORMAT

    def subcache(self, name: str) -> SubCacheStats | None:
        return next((s for s in self.subcaches if s.name == name), None)


def hash_file(path: str, size_hint: int, keep: bool) -> tuple[str, int, bytes | None]:
    """(xxh3-128 hex, bytes read, content if `keep`) of one file."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    try:
        if size_hint <= _READ_WHOLE or keep:
            want = max(size_hint, 0) + 1
            data = os.read(fd, want)
            chunks = [data]
            if len(data) == want:  # the file grew since it was stat'ed: read to the end
                while data:
                    data = os.read(fd, _CHUNK)
                    chunks.append(data)
            content = chunks[0] if len(chunks) == 1 else b"".join(chunks)
            return xxhash.xxh3_128_hexdigest(content), len(content), content if keep else None
        h = xxhash.xxh3_128()
        n = 0
        while True:
            data = os.read(fd, _CHUNK)
            if not data:
                break
            h.update(data)
            n += len(data)
        return h.hexdigest(), n, None
    finally:
        os.close(fd)


def _batches(items: list[FileStat]) -> Iterable[list[FileStat]]:
    batch: list[FileStat] = []
    nbytes = 0
    for f in items:
        batch.append(f)
        nbytes += f.size
        if len(batch) >= _BATCH_FILES or nbytes >= _BATCH_BYTES:
            yield batch
            batch, nbytes = [], 0
    if batch:
        yield batch


def _load_index(root: Path) -> dict:
    try:
        data = json.loads((root / layout.SIDECAR / INDEX_NAME).read_text())
        if data.get("format") == FORMAT and isinstance(data.get("files"), dict):
            return data
    except (OSError, ValueError, AttributeError):
        pass
    return {}


def _save_index(root: Path, started_ns: int, entries: dict[str, list]) -> str | None:
    try:
        (root / layout.SIDECAR).mkdir(exist_ok=True)
        atomic_write_text(root / layout.SIDECAR / INDEX_NAME,
                          json.dumps({"format": FORMAT, "started_ns": started_ns, "files": entries},
                                     separators=(",", ":")))
    except OSError as e:
        return f"stat index not saved ({e.strerror}): the next fingerprint will hash every file again"
    return None


def hash_files(root: Path, files: list[FileStat], workers: int | None = None, progress: ProgressFn | None = None,
                done: int = 0, total: int | None = None) -> tuple[dict[str, FileEntry], list[str]]:
    """Hash `files` (under `root`) on a thread pool; returns rel -> FileEntry and warnings.
    `progress(done + bytes hashed, total)` after each batch (total defaults to these files' bytes)."""
    total = sum(f.size for f in files) if total is None else total
    results: dict[str, FileEntry] = {}
    warnings: list[str] = []
    workers = workers or min(4, os.cpu_count() or 1)

    def run(batch: list[FileStat]) -> list[tuple[FileStat, str, int, stamps.Stamp] | tuple[FileStat, str]]:
        out: list = []
        for f in batch:
            keep = stamps.needs_content(f.rel)
            try:
                digest, n, content = hash_file(os.path.join(root, f.rel), f.size, keep)
            except OSError as e:
                out.append((f, e.strerror or str(e)))
                continue
            out.append((f, digest, n, stamps.stamp_of(f.rel, content)))
        return out

    batches = list(_batches(sorted(files, key=lambda f: -f.size)))
    if workers <= 1 or len(batches) <= 1:
        results_iter = map(run, batches)
    else:
        pool = ThreadPoolExecutor(workers, thread_name_prefix="cw-hash")
        results_iter = pool.map(run, batches)
    try:
        for out in results_iter:
            for item in out:
                if len(item) == 2:
                    f, why = item
                    warnings.append(f"cannot read {f.rel}: {why} (left out)")
                    continue
                f, digest, n, st = item
                size = n
                results[f.rel] = FileEntry(f.rel, size, f.mtime_ns, digest, st.system_key, st.torch_hash)
                if n != f.size:
                    warnings.append(f"{f.rel} changed while being read ({f.size} -> {n} bytes)")
            if progress is not None:
                done += sum(item[0].size for item in out)
                progress(done, total)
    finally:
        if workers > 1 and len(batches) > 1:
            pool.shutdown()
    return results, warnings


def group(entries: Iterable[FileEntry | _Row]) -> dict[str, list]:
    """Entries (FileEntry or _Row) per sub-cache, each list sorted by relative path."""
    per_sub: dict[str, list] = defaultdict(list)
    for e in entries:
        per_sub[layout.subcache_of(e.rel)].append(e)
    for items in per_sub.values():
        items.sort(key=lambda e: e.rel)
    return per_sub


def merkle(per_sub: dict[str, Sequence[FileEntry | _Row]]) -> tuple[str, tuple[SubCacheStats, ...]]:
    """(root hash, per-sub-cache stats with node hashes) over entries grouped by `group`."""
    subs = []
    root = xxhash.xxh3_128()
    for name in sorted(per_sub):
        h = xxhash.xxh3_128()
        items = per_sub[name]
        h.update(b"".join(e.rel.encode("utf-8", "surrogateescape") + b"\0" + e.hash.encode() + b"\n" for e in items))
        node = h.hexdigest()
        subs.append(SubCacheStats(name, len(items), sum(e.size for e in items), "xxh3-128:" + node,
                                  max(e.mtime_ns for e in items)))
        if name != "locks":
            root.update(name.encode() + b"\0" + node.encode() + b"\n")
    return "xxh3-128:" + root.hexdigest(), tuple(subs)


@contextlib.contextmanager
def _gc_paused():
    """Pause the cyclic GC: a walk allocates ~3 objects per file and none form cycles, yet with torch
    imported each full collection costs 0.1-0.3 s (measured on 20,000 files)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def fingerprint(path: str | os.PathLike[str] | None = None, *, files: bool = False, use_index: bool = True,
                workers: int | None = None, progress: ProgressFn | None = None) -> Fingerprint:
    """Fingerprint the cache at `path` (default: torch's inductor cache dir).

    Raises BadInput for a missing dir or one that is not an inductor cache. `progress(bytes done,
    bytes total)` follows the hashing (files whose hash the stat index knows count as done at once).
    """
    from compilewatch import torchinfo

    loc = layout.resolve_existing(path)  # before torch._dynamo is imported: that import creates the dir
    torchinfo.system_key()  # per-process costs (torch import, triton key) before the clock starts
    with _gc_paused():
        return _fingerprint(loc, files, use_index, workers, progress)


def _fingerprint(loc: layout.CacheLocation, files: bool, use_index: bool, workers: int | None,
                 progress: ProgressFn | None = None) -> Fingerprint:
    from compilewatch import torchinfo

    root = loc.path
    t0 = time.perf_counter()
    started_ns = time.time_ns()
    w = layout.walk(root)
    index = _load_index(root) if use_index else {}
    cached = index.get("files", {})
    trusted_before = int(index.get("started_ns", 0)) - RACY_NS
    entries: dict[str, FileEntry | _Row] = {}
    todo: list[FileStat] = []
    for f in w.files:
        c = cached.get(f.rel)
        if (c and len(c) == 6 and c[0] == f.size and c[1] == f.mtime_ns and c[2] == f.ino
                and f.mtime_ns < trusted_before):
            entries[f.rel] = _Row(f.rel, f.size, f.mtime_ns, c[3], c[4], c[5])
        else:
            todo.append(f)
    total = sum(f.size for f in w.files)
    hashed, warnings = hash_files(root, todo, workers, progress, done=total - sum(f.size for f in todo), total=total)
    entries.update(hashed)
    if use_index and (todo or len(cached) != len(entries)):
        by_rel = {f.rel: f for f in w.files}
        new_index = {
            rel: [e.size, e.mtime_ns, by_rel[rel].ino, e.hash, e.system_key, e.torch_hash]
            for rel, e in entries.items() if e.size == by_rel[rel].size
        }
        warn = _save_index(root, started_ns, new_index)
        if warn:
            warnings.append(warn)
    per_sub = group(entries.values())
    root_hash, subs = merkle(per_sub)
    stamped = [e for name in (*stamps.STAMPED_SUBCACHES, "cache") for e in per_sub.get(name, ())]
    sk = Counter(e.system_key or "unknown" for e in stamped)
    th = Counter(e.torch_hash or "unknown" for e in stamped if not e.rel.startswith("cache/"))
    here = torchinfo.system_key()
    return Fingerprint(
        path=str(root), files=len(entries), bytes=sum(s.bytes for s in subs), content_hash=root_hash,
        subcaches=subs, system_key=here, torch_version=torchinfo.torch_version(),
        entry_system_keys=dict(sk), entry_torch_hashes=dict(th),
        foreign_entries=sum(n for k, n in sk.items() if k not in ("unknown", here)),
        created_at=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        duration_s=time.perf_counter() - t0, hashed=len(hashed), reused=len(entries) - len(hashed),
        in_flight=len(w.in_flight), warnings=tuple(w.warnings) + tuple(warnings),
        entries=tuple(FileEntry(*entries[rel]) if isinstance(entries[rel], _Row) else entries[rel]
                      for rel in sorted(entries)) if files else None,
    )


def from_json(data: dict, source: str = "fingerprint") -> Fingerprint:
    """A Fingerprint from its `--json` / manifest form; every field type-checked. BadInput when it is not one."""
    from compilewatch.jsonshape import build

    if not isinstance(data, dict) or "format" not in data or "content_hash" not in data:
        raise BadInput(f"{source} is not a compilewatch fingerprint (no format/content_hash)",
                       hint="make one with `compilewatch cache fingerprint --files --json > fp.json`")
    if data.get("format") != FORMAT:
        raise BadInput(f"{source}: unsupported fingerprint format {str(data.get('format'))[:40]!r} (expected {FORMAT})")
    defaults = {"entry_system_keys": {}, "entry_torch_hashes": {}, "foreign_entries": 0, "warnings": [],
                "entries": None}
    fp = build(Fingerprint, {**defaults, **data}, source)
    if fp.files < 0 or fp.bytes < 0 or any(e.size < 0 for e in fp.entries or ()):
        raise BadInput(f"{source}: negative file counts or sizes")
    return fp
