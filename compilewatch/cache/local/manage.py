"""Day-to-day cache management: clear (backup first), prune (least recently used first), ls, du
(`cache diff` is `archive.diff`: it reads archives too).

Nothing here deletes without being told twice: `clear` renames the cache dir to
`<cache>.backup-<timestamp>` and says how to restore it; `prune` moves entries to
`<cache>.pruned-<timestamp>/`; only `backup=False` / `delete=True` together with `yes=True` delete,
and even then the dir is renamed away first, so a half-deleted cache never sits at the live path.

An *entry* is what torch treats as one thing (`layout.entry_of`): an fxgraph or aotautograd key
folder, a triton kernel folder, the files of one generated module. Recency is the newest of the
entry files' mtime and atime (atime moves only where the filesystem records it: relatime updates it
at most daily, noatime never; then prune is "least recently written first").
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from compilewatch.cache.local import busy, layout
from compilewatch.cache.local.lock import cache_lock
from compilewatch.cache.trust import backups
from compilewatch.errors import BadInput

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b?)\s*$", re.IGNORECASE)


_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_size(text: str) -> int:
    """'500MB' -> bytes. K/M/G/T (with optional B or iB) are powers of 1024, like `du -h` prints them."""
    m = _SIZE_RE.match(str(text))
    if not m:
        raise BadInput(f"not a size: {text!r}", hint="write e.g. 500MB, 1.5G, 200M or a number of bytes")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


@dataclass(frozen=True, slots=True)
class Entry:
    subcache: str
    name: str  # relative path of the entry (a folder, a file, or a generated module's stem)
    files: int
    bytes: int
    mtime_ns: int  # newest file mtime
    last_used_ns: int  # newest of mtime and atime


def _entries(files: tuple[layout.FileStat, ...]) -> list[Entry]:
    acc: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0, 0, 0, 0])
    for f in files:
        a = acc[layout.entry_of(f.rel)]
        a[0] += 1
        a[1] += f.size
        a[2] = max(a[2], f.mtime_ns)
        a[3] = max(a[3], f.mtime_ns, f.atime_ns)
    return [Entry(sub, name, *v) for (sub, name), v in acc.items()]


def _entry_paths(root: Path, removed: list[Entry], files: tuple[layout.FileStat, ...]) -> list[str]:
    """The files and folders that make up the `removed` entries (what prune moves): an entry whose
    name is a path (a key folder) moves whole, one that is not (a generated module's stem) moves
    file by file. One pass over `files`, however many entries are removed."""
    wanted = {(e.subcache, e.name) for e in removed}
    by_entry: dict[tuple[str, str], list[str]] = defaultdict(list)
    for f in files:
        k = layout.entry_of(f.rel)
        if k in wanted:
            by_entry[k].append(f.rel)
    out: list[str] = []
    for e in removed:
        if os.path.lexists(root / e.name):
            out.append(e.name)
        else:
            out.extend(by_entry[(e.subcache, e.name)])
    return out


def _dir_id(path: Path) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


# --- ls / du --------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Listing:
    path: str
    entries: tuple[Entry, ...]
    total_entries: int
    total_files: int
    total_bytes: int


def ls(path: str | os.PathLike[str] | None = None, *, subcache: str | None = None,
       sort: Literal["size", "recent", "name"] = "size", limit: int | None = None) -> Listing:
    """Entries of the cache, largest (or most recently used, or by name) first."""
    if subcache is not None and subcache not in layout.SUBCACHES:
        raise BadInput(f"unknown sub-cache {subcache!r}", hint="one of: " + ", ".join(layout.SUBCACHES))
    if sort not in ("size", "recent", "name"):
        raise BadInput(f"unknown sort {sort!r}", hint="one of: size, recent, name")
    if limit is not None and limit < 0:
        raise BadInput(f"--limit must be >= 0, got {limit}")
    loc = layout.resolve_existing(path)
    w = layout.walk(loc.path)
    entries = [e for e in _entries(w.files) if subcache is None or e.subcache == subcache]
    key = {"size": lambda e: (-e.bytes, e.name), "recent": lambda e: (-e.last_used_ns, e.name),
           "name": lambda e: e.name}[sort]
    entries.sort(key=key)
    return Listing(str(loc.path), tuple(entries[:limit] if limit else entries), len(entries),
                   sum(e.files for e in entries), sum(e.bytes for e in entries))


@dataclass(frozen=True, slots=True)
class SubCacheUsage:
    name: str
    entries: int
    files: int
    bytes: int
    description: str


@dataclass(frozen=True, slots=True)
class Usage:
    path: str
    files: int
    bytes: int
    in_flight: int
    subcaches: tuple[SubCacheUsage, ...]
    largest: tuple[Entry, ...]


def du(path: str | os.PathLike[str] | None = None, *, top: int = 10) -> Usage:
    """Bytes per sub-cache and the `top` largest entries."""
    if top < 0:
        raise BadInput(f"--top must be >= 0, got {top}")
    loc = layout.resolve_existing(path)
    w = layout.walk(loc.path)
    entries = _entries(w.files)
    per: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0])
    for e in entries:
        per[e.subcache][0] += 1
        per[e.subcache][1] += e.files
        per[e.subcache][2] += e.bytes
    subs = tuple(sorted((SubCacheUsage(n, *v, layout.SUBCACHES[n]) for n, v in per.items()), key=lambda s: -s.bytes))
    largest = tuple(sorted(entries, key=lambda e: (-e.bytes, e.name))[:top])
    return Usage(str(loc.path), len(w.files), sum(f.size for f in w.files), len(w.in_flight), subs, largest)


# --- clear ----------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class ClearResult:
    path: str
    files: int
    bytes: int
    backup: str | None  # where the cache went (None only when deleted)
    deleted: bool
    restore_command: str | None


def restore_command(backup: Path, cache_dir: Path) -> str:
    return f"compilewatch cache load {shlex.quote(str(backup))} --dir {shlex.quote(str(cache_dir))}"


def clear(path: str | os.PathLike[str] | None = None, *, backup: bool = True, yes: bool = False,
          force: bool = False) -> ClearResult:
    """Move the cache to `<cache>.backup-<timestamp>` (default) or, with backup=False and yes=True, delete it.

    Refuses a dir without inductor's structure (`layout.looks_like_cache`) unless `force`, and
    (CheckFailed, exit 1) while torch is compiling into it (`busy.not_compiling`)."""
    if not backup and not yes:
        raise BadInput("--no-backup deletes the cache for good and needs --yes to confirm; nothing was changed",
                       hint="drop --no-backup to keep a backup you can restore")
    loc = layout.resolve_existing(path, force=force, can_force=True)
    root = loc.path
    layout.refuse_symlink(root, "clear")
    with cache_lock(root):
        w = layout.walk(root)
        nfiles, nbytes = len(w.files), sum(f.size for f in w.files)
        with busy.not_compiling(root, w.in_flight):  # never out from under a live compile
            if backup:
                dest = layout.timestamped_sibling(root, "backup")
                os.rename(root, dest)
                backups.record(dest, root)  # `cache load dest` trusts it as made here
                return ClearResult(str(root), nfiles, nbytes, str(dest), False, restore_command(dest, root))
            doomed = layout.timestamped_sibling(root, "deleting")
            os.rename(root, doomed)  # off the live path first: torch never sees a half-deleted cache
    shutil.rmtree(doomed)
    return ClearResult(str(root), nfiles, nbytes, None, True, None)


# --- prune ----------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class PruneResult:
    path: str
    max_bytes: int
    bytes_before: int
    bytes_after: int
    removed: tuple[Entry, ...]  # least recently used first
    moved_to: str | None  # where the removed entries went (None: dry run or deleted)
    deleted: bool
    dry_run: bool
    restore: str | None = None  # the command that moves the pruned entries back (entries the cache has again stay)


def prune(max_size: int | str, path: str | os.PathLike[str] | None = None, *, dry_run: bool = False,
          delete: bool = False, yes: bool = False, force: bool = False) -> PruneResult:
    """Remove least recently used entries until the cache holds at most `max_size` bytes.

    Removed entries move to `<cache>.pruned-<timestamp>/` unless `delete` (which needs `yes`), recorded
    as made here, so `restore` (`cache load` of that dir) moves them back. Refuses a dir without
    inductor's structure unless `force`.
    """
    max_bytes = parse_size(max_size) if isinstance(max_size, str) else int(max_size)
    if max_bytes < 0:
        raise BadInput(f"--max-size must be >= 0, got {max_size}")
    if delete and not yes and not dry_run:
        raise BadInput("--delete removes entries for good and needs --yes to confirm; nothing was changed")
    loc = layout.resolve_existing(path, force=force, can_force=True)
    root = loc.path
    # Plan without the lock (a walk of a large cache takes a while; readers and torch keep going),
    # then hold the exclusive lock only for the renames. An entry that vanished meanwhile is skipped.
    planned_id = _dir_id(root)
    w = layout.walk(root)
    before = sum(f.size for f in w.files)
    candidates = sorted((e for e in _entries(w.files) if e.subcache != "locks"),
                        key=lambda e: (e.last_used_ns, e.name))
    removed: list[Entry] = []
    total = before
    for e in candidates:
        if total <= max_bytes:
            break
        removed.append(e)
        total -= e.bytes
    moved_to = None
    if removed and not dry_run:
        rels = _entry_paths(root, removed, w.files)
        dest = layout.timestamped_sibling(root, "deleting" if delete else "pruned")
        with cache_lock(root):
            if _dir_id(root) != planned_id:  # loaded, cleared or restored while we planned
                raise BadInput(f"{root} was replaced while prune was planning; nothing was moved",
                               hint="run the prune again")
            layout.move_aside(root, rels, dest)
        if delete:
            shutil.rmtree(dest, ignore_errors=True)
        else:
            moved_to = str(dest)
            backups.record(dest, root, kind="pruned")  # `cache load DEST` moves them back, no --trust
    return PruneResult(str(root), max_bytes, before, total, tuple(removed), moved_to, delete and not dry_run, dry_run,
                       restore_command(Path(moved_to), root) if moved_to else None)
