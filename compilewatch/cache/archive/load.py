"""`cache load`: an archive (the layout: `reader`) or a backup dir back into place, atomically.

A training process can also preload an archive's Mega-Cache with `torch.compiler.load_cache_artifacts`
(`load_mega_cache`) wherever its cache dir is.

Atomic. `load` checks the header (system key, torch
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
import hashlib
import os
import shlex
import shutil
import tarfile
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from compilewatch.cache.archive import check, reader
from compilewatch.cache.archive.reader import (HEADER, MANIFEST, MEGA, PREFIX, MemberHash, _Reader, _umask,
                                                cache_rel, compatibility, read_header)
from compilewatch.cache.content import fingerprint as fp_mod
from compilewatch.cache.content.fingerprint import FileEntry, Fingerprint, ProgressFn
from compilewatch.cache.local import busy, layout, swap
from compilewatch.cache.local.lock import cache_lock
from compilewatch.cache.local.relocate import rebase_triton_paths
from compilewatch.cache.trust import backups, paths, picklescan, provenance
from compilewatch.errors import BadInput
from compilewatch.inputs import loads_json, one_line, open_untrusted

_COPY = 4 << 20


DISK_MARGIN = 64 << 20  # free space kept beyond the manifest's total (filesystem overhead)


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

    verdict = reader.check_provenance(archive, trust=trust).require()
    with _Reader(Path(archive)) as r:
        for m in r.members():
            if m.name == MEGA:
                data = r.read(m, reader.MAX_MEGA)
                verdict.check_member(MEGA, hashlib.sha256(data).hexdigest())
                artifacts = check.deserialize_quietly(CacheArtifactManager, data)
                if artifacts is None:  # not a Mega-Cache this torch parses (`cache verify` names it)
                    return None
                for kind, items in artifacts.items():
                    for a in items:
                        where = paths.mega_key_refused(kind, getattr(a, "key", None))
                        if where is not None:  # a path: refused whatever --trust says, as a member name is
                            raise BadInput(f"{archive}: {MEGA}: {one_line(where, 300)}", hint="a damaged or crafted archive: "
                                           "nothing was written; ask its maker for a new one")
                        scan = picklescan.scan_artifact(kind, getattr(a, "content", None))
                        if not scan.ok and not trust:
                            raise untrusted(archive, f"{MEGA}: {kind} {getattr(a, 'key', '?')}", scan)
                info = CacheArtifactManager.populate_caches(artifacts)
                return {k: len(v) for k, v in info.artifacts.items()}
    return None


# --- load -----------------------------------------------------------------------------------------
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
        rel = cache_rel(m.name)
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
        h = MemberHash()  # SHA-256 for the signature, xxh3-128 for the manifest (what `cache verify` compares)
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
            verdict.check_member(m.name, h.hexdigest())
        got[rel] = (n, h.xxh3_hex(), int(m.mtime * 1e9) if isinstance(m.mtime, (int, float)) else 0)
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
    layout.refuse_symlink(target, "load")
    if target.exists() and not target.is_dir():
        raise BadInput(f"{target} exists and is not a directory; nothing was changed")
    if target.is_dir() and not layout.looks_like_cache(target) and not force:
        raise layout.not_a_cache(target, can_force=True)


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


@contextlib.contextmanager
def _parents_made(folder: Path):
    """Make `folder` and the folders above it that are missing; when the block fails, remove those
    it made again (each only while empty), so a refusal that says "nothing was changed" holds."""
    made = []
    p = folder
    while not os.path.lexists(p) and p.parent != p:
        made.append(p)
        p = p.parent
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:  # a file where a folder must go, no permission
        for d in made:
            with contextlib.suppress(OSError):
                d.rmdir()
        raise BadInput(f"cannot make {folder} to hold the cache: {e.strerror or e}; nothing was changed",
                       hint="choose another place with --dir") from None
    try:
        yield
    except BaseException:
        for d in made:  # deepest first
            try:
                d.rmdir()
            except OSError:  # something was put there meanwhile (or it is gone): leave it
                break
        raise


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
    t0 = time.perf_counter()
    source = Path(os.path.abspath(os.path.expanduser(source)))
    if source.is_dir():
        return restore_dir(source, path, force=force, trust=trust, t0=t0)
    loc = layout.locate(path)
    target = loc.path
    _check_target(target, force)
    header = read_header(source)
    from compilewatch.fsutil import nearest_existing

    free = shutil.disk_usage(nearest_existing(target.parent) or target.anchor).free  # nothing made before the verdict
    verdict, manifest_bytes = reader.inspect_archive(source, trust=trust, stop_after=free)
    verdict.require()  # first: who made it
    problems = compatibility(header.system_key, header.torch_version, archive_info=header.system_info)
    if problems and not force:
        raise BadInput(f"{source} was saved for another system: " + "; ".join(problems),
                       hint="pass --force to load it anyway (the entries will not hit on this machine); nothing was changed")
    manifest = _manifest_of(source, manifest_bytes)
    space = _SpaceBudget(source, Path(nearest_existing(target.parent) or target.anchor),
                         [e.size for e in manifest.entries or ()])
    with _parents_made(target.parent):  # removed again, when still empty, if the load fails from here on
        return _load_checked(source, target, header, problems, verdict, manifest, space, trust, progress, t0)


def _load_checked(source: Path, target: Path, header, problems, verdict: provenance.Provenance,
                  manifest: Fingerprint, space: "_SpaceBudget", trust: bool, progress: ProgressFn | None,
                  t0: float) -> LoadResult:
    """`load` once the archive was judged: extract beside `target` (whose parent exists), check, swap in."""
    from compilewatch import torchinfo

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


def _restore_pruned(source: Path, target: Path, *, trust: bool, t0: float) -> LoadResult:
    """Entries `cache prune` moved out of `target` into `source`, moved back (renames, under the cache
    lock, never over a file the cache has again: those stay in `source`, said in a warning). `source`
    is removed once empty. The same gates as any dir: who made it (`backups.judge`), every pickle
    scanned."""
    from compilewatch import torchinfo

    if not target.is_dir():
        raise BadInput(f"{source} holds entries pruned from {target}, which does not exist now; nothing was changed",
                       hint=f"restore into an existing cache with `compilewatch cache load {shlex.quote(str(source))} --dir DIR`")
    verdict = backups.judge(source, trust=trust)
    verdict.require()
    files = [f.rel for f in layout.walk(source).files]
    trusted_pickles = _scan_pickles(source, source, files, trust, prefix="")
    moved, kept, size = 0, [], 0
    with cache_lock(target), busy.not_compiling(target):
        for rel in files:
            src, dst = source / rel, target / rel
            if os.path.lexists(dst):
                kept.append(rel)
                continue
            dst.parent.mkdir(parents=True, exist_ok=True)
            size += os.lstat(src).st_size
            os.rename(src, dst)
            moved += 1
        rewritten = rebase_triton_paths(target, target)
    if not kept:
        shutil.rmtree(source, ignore_errors=True)  # only emptied folders are left in it
    warnings = (f"{len(kept)} file(s) stayed in {source}: the cache has them again (e.g. {kept[0]})",) if kept else ()
    return LoadResult(
        source=str(source), path=str(target), backup=None, files=moved, bytes=size, content_hash="",
        archive_system_key="", system_key=torchinfo.system_key(), mismatches=(), forced=False,
        paths_rewritten=rewritten, duration_s=time.perf_counter() - t0,
        warnings=warnings + ((provenance.CODE_WARNING,) if verdict.trusted_by_flag else ()),
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
    rec = backups.recorded(source) if built_here is None else None
    if rec is not None and rec.get("kind") == "pruned":
        return _restore_pruned(source, target, trust=trust, t0=t0)
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
    # a dir that will be refused is read without the stat index, which would add .compilewatch/ to it:
    # its ctime (and with it a recorded backup's identity) stays as it was
    fp = fp_mod.fingerprint(source, use_index=verdict.allowed)
    problems = compatibility(fp.system_key, fp.torch_version, fp.entry_system_keys, fp.entry_torch_hashes)
    if problems and not force:
        raise BadInput(f"{source} holds entries for another system: " + "; ".join(problems),
                       hint="pass --force to restore it anyway; nothing was changed")
    verdict.require()  # who made it: a backup made here, or foreign (accepted only with trust)
    from compilewatch.fsutil import nearest_existing

    where = nearest_existing(target.parent) or target.anchor
    if os.stat(source).st_dev != os.stat(where, follow_symlinks=False).st_dev:
        raise BadInput(f"{source} is on another filesystem than {target}: it cannot be renamed into place; "
                       "nothing was changed",
                       hint=f"save it with `compilewatch cache save X.tar.gz --dir {shlex.quote(str(source))}` and load that")
    trusted_pickles = () if built_here is not None else \
        _scan_pickles(source, source, [f.rel for f in layout.walk(source).files], trust, prefix="")
    with _parents_made(target.parent), cache_lock(target), busy.not_compiling(target):
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
