"""Seed, fetch and clear torch's Redis remote caches: `push`, `pull`, `clear` (with a local backup).

`push` writes FX-graph and AOTAutograd entries exactly as torch does (`remote_keys`), and only what
verifies: a cache dir goes through `cache.verify` (deep: every pickle parsed by `picklescan`) and an
entry with any error or foreign finding stays home; an archive goes through `archive.load` (the
function `cache load` uses, so its header, manifest, pickle and provenance checks apply) into a
temporary dir first; a backup file from `clear` has every value checked again. Existing keys are
left alone unless `overwrite` (torch would not overwrite a hit either). Autotune, bundled-autotune and
PGO entries are not pushed from a cache dir: their local files are keyed differently (the remote key
hashes the triton backend and the kernel's configs, which the files do not record).

`pull` fetches the entries this machine's torch would hit into the local cache through the same
steps as `cache load DIR`: a staging dir beside the cache (hard links of the current files plus the
fetched entries, each pickle checked first: one that names a global torch's caches never use refuses
the whole pull, nothing changed), then `archive.load` swaps it in under the cache lock and moves the
previous cache to `<cache>.backup-<time>`.

`clear` writes every torch entry to a backup file (JSON lines, atomically) before it deletes, and
deletes a key only if its value is still the one backed up (a Lua compare-and-delete on its SHA-1),
so an entry written meanwhile survives. `push BACKUP` restores it.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import shlex
import shutil
import socket
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from urllib.parse import urlsplit

from compilewatch.cache.archive import load as archive_load
from compilewatch.cache.archive import reader
from compilewatch.cache.content import verify as verify_mod
from compilewatch.cache.local import layout
from compilewatch.cache.remote import keyspace as remote_keys
from compilewatch.cache.remote import server as remote
from compilewatch.cache.remote import signatures as sigs
from compilewatch.cache.trust import picklescan
from compilewatch.errors import BadInput, WriteFailed
from compilewatch.fsutil import atomic_path
from compilewatch.inputs import one_line, read_bytes

BACKUP_FORMAT = "compilewatch-remote-backup"
BACKUP_SUFFIX = ".jsonl"
_CAS_DELETE = "if redis.sha1hex(redis.call('GET', KEYS[1]) or '') == ARGV[1] then return redis.call('DEL', KEYS[1]) end return 0"


@dataclass(frozen=True, slots=True)
class Skipped:
    what: str  # a cache-relative path or a Redis key
    reason: str


@dataclass(frozen=True, slots=True)
class PushResult:
    url: str
    source: str
    source_kind: str  # "dir", "archive" or "backup"
    pushed: dict[str, int]  # kind -> entries written
    bytes: int  # value bytes written
    already: int  # keys the server already had (left alone)
    skipped: tuple[Skipped, ...]  # entries that did not verify, with the reason
    duration_s: float
    notes: tuple[str, ...] = ()  # what the entries need to hit
    signed: int = 0  # signatures written (by this machine's key) beside entries written or found identical
    signer: str | None = None  # the key id that signed them


AOT_FLAG_NOTE = ("AOTAutograd entries hit only processes whose TORCHINDUCTOR_AUTOGRAD_REMOTE_CACHE setting is the one "
                 "of the process that wrote them (functorch's config is part of the AOTAutograd key): seed from a cache "
                 "written with it =1, as a job with the remote cache on writes it. FX-graph entries hit either way.")


@dataclass(frozen=True, slots=True)
class PullResult:
    url: str
    path: str
    backup: str | None  # where the previous cache went (None: nothing was swapped)
    pulled: dict[str, int]
    bytes: int
    already_local: int  # entries the local cache already had, byte for byte
    skipped: tuple[Skipped, ...]  # foreign, malformed, oversized, unsigned entries left on the server
    duration_s: float


@dataclass(frozen=True, slots=True)
class RemoteClearResult:
    url: str
    deleted: int  # entries (signature keys not counted: `signatures`)
    bytes: int
    backup: str | None  # None when there was nothing to delete
    changed_meanwhile: int  # keys rewritten between backup and delete: kept
    left_alone: int  # keys that are not torch's
    restore_command: str | None
    signatures: int = 0  # signature keys deleted with their entries (backed up too)


# --- push ---------------------------------------------------------------------------------------------
def _local_entries(root: Path) -> dict[tuple[str, str], layout.FileStat]:
    """(kind, key) -> the newest entry file of each fxgraph / aotautograd key (the remote holds one)."""
    best: dict[tuple[str, str], layout.FileStat] = {}
    for f in layout.walk(root).files:
        parts = f.rel.split("/")
        if parts[0] == "fxgraph" and len(parts) == 4:
            kk = ("fxgraph", parts[2])
        elif parts[0] == "aotautograd" and len(parts) == 3:
            kk = ("aotautograd", parts[1])
        else:
            continue
        if kk not in best or f.mtime_ns > best[kk].mtime_ns:
            best[kk] = f
    return best


def _set(client, key: str, value: bytes, overwrite: bool) -> bool:
    return bool(client.set(key, value, nx=not overwrite))


@dataclass
class _Tally:
    """What a push did: entries written per kind, their bytes, keys the server already had, skipped."""

    pushed: Counter[str] = field(default_factory=Counter)
    nbytes: int = 0
    already: int = 0
    skipped: list[Skipped] = field(default_factory=list)
    signer: sigs.Signer | None = None  # None: restore as it was (a backup), sign nothing
    signed: int = 0

    def send(self, client, key: str, kind: str, value: bytes, overwrite: bool) -> None:
        """Write `value` (NX unless `overwrite`), then its signature: the value first, so a reader
        between the two sees an unsigned entry (a miss), never a signature for other bytes."""
        if _set(client, key, value, overwrite):
            self.pushed[kind] += 1
            self.nbytes += len(value)
            self._sign(client, key, value)
        else:
            self.already += 1
            if self.signer is not None:
                try:  # the server holds these very bytes (a job wrote them unwatched): vouch for them too
                    same = remote.read_capped(client, key, len(value)) == value
                except ValueError:
                    same = False
                if same:
                    self._sign(client, key, value)

    def _sign(self, client, key: str, value: bytes) -> None:
        if self.signer is not None:
            client.set(remote_keys.signature_key(key), self.signer.sign(key, value))
            self.signed += 1


def _push_dir(client, root: Path, overwrite: bool, max_value: int) -> _Tally:
    report = verify_mod.verify(root, deep=True)
    bad = {f.path: f"{f.kind}: {f.detail}" for f in report.findings if f.severity in ("error", "foreign")}
    t = _Tally(signer=sigs.Signer.load(), skipped=[Skipped(p, r) for p, r in sorted(bad.items()) if layout.subcache_of(p) in remote_keys.PUSHABLE])
    for (kind, key), f in sorted(_local_entries(root).items()):
        if f.rel in bad:
            continue
        try:
            rkey = remote_keys.redis_key(kind, key)
        except ValueError as e:
            t.skipped.append(Skipped(f.rel, str(e)))
            continue
        if f.size > max_value:
            t.skipped.append(Skipped(f.rel, f"{f.size} bytes, over the {max_value} byte cap"))
            continue
        try:  # bounded and non-blocking: the file may have grown or been swapped since the walk
            content = read_bytes(root / f.rel, limit=max_value, what="cache file")
        except BadInput as e:
            t.skipped.append(Skipped(f.rel, f"unreadable: {e.message}"))
            continue
        scan = picklescan.scan(content)  # again: the file may have changed since verify read it
        if not scan.ok:
            t.skipped.append(Skipped(f.rel, scan.problem or f"names {', '.join(scan.refused[:3])}"))
            continue
        t.send(client, rkey, kind, remote_keys.encode_pickled(content), overwrite)
    return t


def _push_backup(client, path: Path, overwrite: bool, max_value: int) -> _Tally:
    """Restore a `clear` backup as it was: each value checked again, and the signature it had restored
    only if it still verifies for that value (a restore signs nothing anew: it vouches for nothing)."""
    t = _Tally()
    values: dict[str, bytes] = {}
    signatures: dict[str, bytes] = {}
    for key, value in read_backup(path, max_value=max_value):
        parsed = remote_keys.parse_key(key)
        if parsed.kind == remote_keys.SIGNATURE:
            signatures[parsed.key or ""] = value
            continue
        if parsed.kind not in remote_keys.KINDS:
            t.skipped.append(Skipped(key, "not a key torch writes"))
            continue
        e = remote.check_value(key, parsed.kind, value, deep=True)
        if e.problem:
            t.skipped.append(Skipped(key, f"{e.problem}: {e.detail}"))
            continue
        values[key] = value
        t.send(client, key, parsed.kind, value, overwrite)
    for key, sig in signatures.items():
        value = values.get(key)
        if value is None or sigs.Trust.structurally_valid(key, value, sig) is not None:
            continue
        client.set(remote_keys.signature_key(key), sig)
        t.signed += 1
    return t


def push(source: str | os.PathLike[str], url: str | None = None, *, overwrite: bool = False,
         max_value: int = remote.MAX_VALUE, timeout: float = remote.DEADLINE_S) -> PushResult:
    """Seed the remote cache at `url` (default: torch's) from a cache dir, an archive or a `clear` backup."""
    t0 = time.perf_counter()
    src = Path(os.path.abspath(os.path.expanduser(source)))
    try:
        exists = src.exists()
    except OSError as e:  # a name too long, a loop of links: not a traceback
        raise BadInput(f"cannot use {one_line(str(src), 200)}: {e.strerror}", hint="give a cache dir, an archive from "
                       "`cache save`, or a backup file from `cache remote clear`") from None
    if not exists:
        raise BadInput(f"{src} does not exist", hint="give a cache dir, an archive from `cache save`, or a backup "
                       "file from `cache remote clear`")
    if src.is_dir():
        kind = "dir"
        layout.resolve_existing(src)  # BadInput unless it looks like an inductor cache
    elif src.name.endswith(BACKUP_SUFFIX):
        kind = "backup"
    else:
        kind = "archive"
        reader.compression_for(src)  # BadInput for a file that is none of the three
    client = remote.connect(url, deadline=timeout)
    try:
        with remote.failing_server(url, "push", "what was written before the failure stays; run push again "
                                   "when the server is back"):
            if kind == "dir":
                t = _push_dir(client, src, overwrite, max_value)
            elif kind == "backup":
                t = _push_backup(client, src, overwrite, max_value)
            else:
                tmp = Path(tempfile.mkdtemp(prefix="compilewatch-push-"))
                try:
                    archive_load.load(src, tmp / "cache")  # every check `cache load` makes, provenance included
                    t = _push_dir(client, tmp / "cache", overwrite, max_value)
                finally:
                    shutil.rmtree(tmp, ignore_errors=True)
    finally:
        client.close()
    notes = (AOT_FLAG_NOTE,) if t.pushed.get("aotautograd") and kind != "backup" else ()
    return PushResult(remote.config(url).url, str(src), kind, dict(t.pushed), t.nbytes, t.already, tuple(t.skipped),
                      time.perf_counter() - t0, notes, t.signed, t.signer.key_id if t.signer else None)


def _url(url: str | None) -> str:
    return remote._raw_url(url, os.environ)[0]


# --- pull ---------------------------------------------------------------------------------------------
def _entry_name(content: bytes) -> str:
    """The file name torch gives an entry (`codecache.sha256_hash`: base32 of SHA-256, 51 characters,
    lower case); torch reads every file of a key's folder, so the name only avoids collisions."""
    return base64.b32encode(hashlib.sha256(content).digest())[:51].decode().lower()


def _local_rel(kind: str, key: str, content: bytes) -> str:
    remote_keys.redis_key(kind, key)  # ValueError unless `key` has the shape torch gives it (no path tricks)
    name = _entry_name(content)
    return f"fxgraph/{key[1:3]}/{key}/{name}" if kind == "fxgraph" else f"aotautograd/{key}/{name}"


def _same_file_exists(folder: Path, content: bytes) -> bool:
    try:
        names = os.listdir(folder)
    except OSError:
        return False
    for n in names:
        p = folder / n
        try:
            if p.stat().st_size == len(content) and p.read_bytes() == content:
                return True
        except OSError:
            continue
    return False


def _link_tree(src: Path, dest: Path) -> None:
    """Hard links of every file of `src` in `dest` (same filesystem: the staging dir sits beside it)."""
    for f in layout.walk(src).files:
        target = dest / f.rel
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(src / f.rel, target)
        except OSError:
            shutil.copy2(src / f.rel, target)


def pull(url: str | None = None, path: str | os.PathLike[str] | None = None, *, all_systems: bool = False,
         force: bool = False, max_value: int = remote.MAX_VALUE, allow_unsigned: bool = False,
         timeout: float = remote.DEADLINE_S) -> PullResult:
    """Fetch the remote cache's FX-graph and AOTAutograd entries into the local cache `path` (default:
    torch's). Only entries stamped for this machine's system key and torch build (or unstamped) unless
    `all_systems`, and only entries signed by this machine's or a trusted key unless `allow_unsigned`
    (then unsigned and foreign-signed ones too; a signature that does not verify never)."""
    t0 = time.perf_counter()
    try:
        loc = layout.locate(path)
        target = loc.path
        layout.refuse_symlink(target, "pull")
        if target.exists() and not target.is_dir():
            raise BadInput(f"{target} exists and is not a directory; nothing was changed")
        if target.is_dir() and not layout.looks_like_cache(target) and not force:
            raise layout.not_a_cache(target, can_force=True)
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:  # a name too long, a parent that is a file: said, not a traceback
        raise _local_error(path, e) from None
    client = remote.connect(url, deadline=timeout)
    sk, th, _ = remote.here()
    try:
        staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.load-", dir=target.parent))
    except OSError as e:
        client.close()
        raise _local_error(target.parent, e) from None
    pulled: Counter[str] = Counter()
    skipped: list[Skipped] = []
    nbytes = already = 0
    backup = None
    try:
        try:
            if target.is_dir():
                _link_tree(target, staging)
            with remote.failing_server(url, "pull", "nothing was changed; pull again when the server is back"):
                nbytes, already = _fetch(client, url, staging, pulled, skipped, sk, th, all_systems, max_value,
                                         allow_unsigned)
        except OSError as e:  # the staging dir beside the cache: disk full, read-only, a name too long
            raise _local_error(staging, e) from None
        finally:
            client.close()
        if pulled:
            result = archive_load.restore_dir(  # `cache load DIR`: swap + backup
                staging, target, force=force or all_systems,
                built_here="a staging dir cache remote pull built here (the local cache linked, each fetched pickle scanned)")
            backup = result.backup
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return PullResult(remote.config(url).url, str(target), backup, dict(pulled), nbytes, already, tuple(skipped),
                      time.perf_counter() - t0)


def _local_error(where, e: OSError) -> BadInput:
    return BadInput(f"cannot write {one_line(str(where), 200)}: {e.strerror or e}; nothing was changed",
                    hint="give --dir a writable cache dir on a filesystem with room for the fetched entries")


def _fetch(client, url: str | None, staging: Path, pulled: Counter[str], skipped: list[Skipped], sk: str,
           th: str | None, all_systems: bool, max_value: int, allow_unsigned: bool = False) -> tuple[int, int]:
    """Write the remote entries this machine would hit into `staging`; (bytes, entries already there)."""
    nbytes = already = 0
    trust = sigs.Trust()
    for e in remote.entries(client, kinds=remote_keys.PUSHABLE, deep=True, keep=True, max_value=max_value,
                            trust=trust):
        if e.problem in ("untrusted", "unloadable"):
            raise BadInput(f"{remote.config(url).url}: refused {one_line(e.key, 200)}: {e.detail}",
                           hint="nothing was changed. `compilewatch cache remote verify` lists every such "
                                "entry; someone who could write to this server put it there (docs/security.md)")
        if e.problem:
            skipped.append(Skipped(e.key, f"{e.problem}: {e.detail}"))
            continue
        if e.signature not in sigs.ADMITTED and (e.signature == "bad-signature" or not allow_unsigned):
            skipped.append(Skipped(e.key, f"{e.signature}: {e.signature_detail}"
                                   + ("" if e.signature == "bad-signature" else " (--allow-unsigned fetches it)")))
            continue
        if remote.would_hit(e, sk, th) is False and not all_systems:
            skipped.append(Skipped(e.key, "built for another system key or torch build: it never hits here"))
            continue
        parsed = remote_keys.parse_key(e.key)
        assert e.content is not None and parsed.key is not None
        try:
            rel = _local_rel(e.kind, parsed.key, e.content)
        except ValueError as err:
            skipped.append(Skipped(e.key, str(err)))
            continue
        dest = staging / rel
        if _same_file_exists(dest.parent, e.content):
            already += 1
            continue
        dest.parent.mkdir(parents=True, exist_ok=True)
        with open(dest, "xb") as fh:
            fh.write(e.content)
        pulled[e.kind] += 1
        nbytes += len(e.content)
    return nbytes, already


# --- clear and its backup ------------------------------------------------------------------------------
def default_backup_path(url: str | None = None) -> Path:
    parts = urlsplit(_url(url))
    db = (parts.path or "/0").strip("/") or "0"
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    return Path.cwd() / f"redis-{parts.hostname or 'localhost'}-{parts.port or 6379}-{db}.backup-{stamp}{BACKUP_SUFFIX}"


def read_backup(path: Path, *, max_value: int = remote.MAX_VALUE):
    """(key, value) pairs of a backup file, each line read with a cap; BadInput for anything else."""
    line_cap = max_value * 4 // 3 + 4096
    try:
        fh = open(path, "rb")
    except OSError as e:
        raise BadInput(f"cannot read {path}: {e.strerror}") from None
    with fh:
        header = fh.readline(65536)
        try:
            h = remote_keys.decode_value(header)
        except ValueError:
            h = None
        if not isinstance(h, dict) or h.get("format") != BACKUP_FORMAT:
            raise BadInput(f"{path} is not a backup from `compilewatch cache remote clear`",
                           hint="push a cache dir or an archive from `cache save` instead")
        for n, line in enumerate(iter(lambda: fh.readline(line_cap + 1), b""), start=2):
            if len(line) > line_cap:
                raise BadInput(f"{path}:{n}: a line over {line_cap} bytes (the value cap is {max_value})",
                               hint="raise --max-value if you trust this file")
            try:
                row = remote_keys.decode_value(line)  # bounded: a crafted line is not a RecursionError
                key, value = row["key"], base64.b64decode(row["value"], validate=True)
            except (ValueError, KeyError, TypeError):
                raise BadInput(f"{path}:{n}: not a backup row") from None
            if not isinstance(key, str):
                raise BadInput(f"{path}:{n}: not a backup row")
            yield key, value


def _write_backup(client, dest: Path, safe: str, keys: list[remote.KeyInfo],
                  max_value: int) -> tuple[dict[str, str], int]:
    """Every key's value into the backup file `dest`, atomically (BadInput when it exists); (SHA-1 per key, bytes)."""
    if dest.exists():
        raise BadInput(f"{dest} already exists; nothing was deleted", hint="choose another --backup file")
    digests: dict[str, str] = {}
    nbytes = 0
    with atomic_path(dest) as tmp:
        with open(tmp, "w", encoding="ascii") as out:
            out.write(json.dumps({"format": BACKUP_FORMAT, "version": 1, "url": safe, "host": socket.gethostname(),
                                  "created_at": datetime.now(timezone.utc).isoformat(timespec="seconds")}) + "\n")
            for ki in keys:
                value = remote.read_capped(client, ki.key, max_value)
                if value is None:
                    continue
                out.write(json.dumps({"key": ki.key, "value": base64.b64encode(value).decode("ascii")}) + "\n")
                digests[ki.key] = hashlib.sha1(value).hexdigest()
                nbytes += len(value)
    return digests, nbytes


def clear(url: str | None = None, *, backup: str | os.PathLike[str] | None = None,
          max_value: int = remote.MAX_VALUE, timeout: float = remote.DEADLINE_S) -> RemoteClearResult:
    """Back up every torch entry (and its signature) of the remote cache to a file, then delete what was
    backed up."""
    client = remote.connect(url, deadline=timeout)
    safe = remote.config(url).url
    try:
        with remote.failing_server(url, "clear", "entries are deleted only after the backup file is complete; "
                                   "what was deleted is in it"):
            return _clear(client, url, safe, backup, max_value)
    finally:
        client.close()


def _clear(client, url: str | None, safe: str, backup: str | os.PathLike[str] | None,
           max_value: int) -> RemoteClearResult:
    keys: list[remote.KeyInfo] = []
    left = 0
    for ki in remote.scan(client):
        if ki.kind in remote_keys.KINDS or ki.kind in ("pt2-unknown", remote_keys.SIGNATURE):
            keys.append(ki)
        else:
            left += 1
    over = [k for k in keys if (k.size or 0) > max_value]
    if over:
        raise BadInput(f"{len(over)} entries are larger than the {max_value} byte cap (e.g. "
                       f"{one_line(over[0].key, 120)}, {over[0].size} bytes): they could not be backed up; "
                       "nothing was deleted", hint="raise --max-value")
    if not keys:
        return RemoteClearResult(safe, 0, 0, None, 0, left, None)
    dest = Path(os.path.abspath(os.path.expanduser(backup))) if backup else default_backup_path(url)
    try:
        digests, nbytes = _write_backup(client, dest, safe, keys, max_value)
    except WriteFailed:  # atomic_path's own message (a full disk, a read-only folder)
        raise
    except OSError as e:  # a name too long, a parent that is a file, a full disk: nothing deleted yet
        raise BadInput(f"cannot write the backup {one_line(str(dest), 200)}: {e.strerror or e}; nothing was deleted",
                       hint="choose another --backup file") from None
    except ValueError as e:  # a value that grew past the cap between SCAN and the read
        raise BadInput(f"an entry grew meanwhile: {e}; nothing was deleted", hint="raise --max-value, or run it "
                       "again when the writers are done") from None
    cas = client.register_script(_CAS_DELETE)
    deleted = changed = nsig = 0
    for key, digest in digests.items():
        is_sig = remote_keys.parse_key(key).kind == remote_keys.SIGNATURE
        if cas(keys=[key], args=[digest]):
            if is_sig:
                nsig += 1
            else:
                deleted += 1
        elif not is_sig:
            changed += 1
    return RemoteClearResult(safe, deleted, nbytes, str(dest), changed, left,
                             f"compilewatch cache remote push {shlex.quote(str(dest))}" + ("" if url is None else f" {safe}"), nsig)
