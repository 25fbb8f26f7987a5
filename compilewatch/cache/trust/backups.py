"""The backup dirs compilewatch made on this machine: how `cache load DIR` decides to trust a directory.

An archive says who made it with a signature (`provenance`); a directory cannot: anyone can put a
dir that looks like a cache beside yours. So compilewatch keeps a record of every backup dir it
makes itself (`cache clear`, and the previous cache that `cache load` / `cache remote pull` move
aside): one JSON line per backup in `backups.jsonl` in its config dir (`keys.config_dir()`, the
user's own folder that holds the signing key), with the dir's path, device, inode, change time
(ctime, set by the rename that made the backup) and owner, the cache it came from and when. Nothing
is written into the backup itself.

`judge(dir, trust=...)` gives a directory a `provenance.Provenance` (kind "dir"):

- `own`: a backup this record names: the same path, device, inode and ctime (a dir copied, a new
  dir put at that path even if it gets the inode back, or one whose top level changed since, is not
  it), owned by this user, and nothing in it owned by another user or writable by everyone (so nobody
  else changed it since, and nobody else can once it is the cache again).
- `foreign`: any other dir (an unrecorded dir, a copy, someone else's cache); restored only with
  `trust=True`, as code from a stranger.

The record is believed only where nobody else can change it (`modes.check`: the record file, the
config dir and every folder above them owned by the user or root and not writable by group or
others; a root-owned sticky dir such as /tmp excepted). Otherwise a dir it names is `foreign`, the
reason naming the path and the fix, and no new line is written there.

Either way, `archive.load` scans every pickle in the dir before the rename (the second line), as it
does for an archive. A record that cannot be written (a read-only config dir, or one others can
change) does not fail the backup; restoring that backup then needs --trust, and the refusal says why.
"""

from __future__ import annotations

import json
import os
import stat
from datetime import datetime, timezone
from pathlib import Path

from compilewatch.cache.trust import keys, modes
from compilewatch.cache.trust.provenance import Provenance
from compilewatch.errors import BadInput

RECORD = "backups.jsonl"
MAX_RECORD = 4 << 20  # ~250 bytes a backup: thousands of them
COMPACT_AT = 1 << 20  # past this, rewrite the record keeping only backups that still exist
_OTHERS_SHOWN = 3


def record_path() -> Path:
    return keys.config_dir() / RECORD


def _record_problem() -> modes.Problem | None:
    return modes.check(record_path(), "backups record", base=keys.config_dir())


def record(backup: str | os.PathLike[str], source: str | os.PathLike[str], *, kind: str = "backup") -> bool:
    """Record `backup` (a dir compilewatch just moved `source` to) as made here. `kind`: "backup" (the
    whole cache: `cache load` swaps it back) or "pruned" (entries prune moved out of `source`: `cache
    load` moves them back in). False when the record could not be written (the backup itself is fine;
    restoring it then needs --trust)."""
    backup = Path(backup)
    try:
        st = os.lstat(backup)
        line = json.dumps({"path": str(backup), "dev": st.st_dev, "ino": st.st_ino, "ctime_ns": st.st_ctime_ns,
                           "uid": st.st_uid, "from": str(source), "kind": kind,
                           "made_at": datetime.now(timezone.utc).isoformat(timespec="seconds")}) + "\n"
        path = record_path()
        modes.ensure_dir(path.parent)  # BadInput for a config dir others can change: nothing written there
        if _record_problem() is not None:
            return False  # a record others can change is not believed: adding to it would say nothing
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o600)
        try:
            os.write(fd, line.encode())  # one short append: whole even beside another process's
            size = os.fstat(fd).st_size
        finally:
            os.close(fd)
        if size > COMPACT_AT:
            _compact(path)
        return True
    except (OSError, BadInput):
        return False


def _entries(path: Path) -> list[dict]:
    from compilewatch.inputs import read_bytes

    if not os.path.lexists(path):
        return []
    out = []
    for raw in read_bytes(path, limit=MAX_RECORD, what="backup record").splitlines():
        try:
            e = json.loads(raw)
        except ValueError:
            continue  # a torn line: that one backup is not recorded
        if (isinstance(e, dict) and isinstance(e.get("path"), str)
                and all(isinstance(e.get(k), int) and not isinstance(e.get(k), bool) for k in ("dev", "ino", "ctime_ns", "uid"))):
            out.append(e)
    return out


def _same_dir(e: dict, st: os.stat_result) -> bool:
    return (e["dev"], e["ino"], e["ctime_ns"], e["uid"]) == (st.st_dev, st.st_ino, st.st_ctime_ns, st.st_uid)


def _compact(path: Path) -> None:
    keep = []
    for e in _entries(path):
        try:
            if _same_dir(e, os.lstat(e["path"])):
                keep.append(e)
        except OSError:
            continue
    keys.write_private(path, "".join(json.dumps(e) + "\n" for e in keep).encode())


def recorded(directory: str | os.PathLike[str]) -> dict | None:
    """The record of `directory` as a backup compilewatch made here, or None."""
    directory = Path(directory)
    try:
        st = os.lstat(directory)
    except OSError:
        return None
    for e in reversed(_entries(record_path())):
        if e["path"] == str(directory) and _same_dir(e, st):
            return e
    return None


def others_can_change(directory: Path) -> list[str]:
    """Paths under `directory` (itself included) owned by another user or writable by everyone."""
    uid = os.getuid() if hasattr(os, "getuid") else None
    found: list[str] = []
    stack = [directory]
    while stack and len(found) < _OTHERS_SHOWN:
        d = stack.pop()
        try:
            st = os.lstat(d)
            it = os.scandir(d)
        except OSError:
            continue
        if (uid is not None and st.st_uid != uid) or st.st_mode & stat.S_IWOTH:
            found.append(str(d))
        with it:
            for e in it:
                try:
                    s = e.stat(follow_symlinks=False)
                except OSError:
                    continue
                if stat.S_ISDIR(s.st_mode):
                    stack.append(Path(e.path))
                elif (uid is not None and s.st_uid != uid) or (s.st_mode & stat.S_IWOTH and not stat.S_ISLNK(s.st_mode)):
                    found.append(e.path)
                    if len(found) >= _OTHERS_SHOWN:
                        break
    return found


def judge(directory: str | os.PathLike[str], *, trust: bool = False) -> Provenance:
    """The provenance verdict of a dir `cache load` would restore (module docstring). Reads no file
    content; `trust`: the caller accepts a foreign dir as code."""
    directory = Path(directory)

    def foreign(reason: str) -> Provenance:
        return Provenance(str(directory), "foreign", reason, False, None, None, {}, trust, kind="dir")

    bad = _record_problem()
    if bad is not None and bad.kind in ("type", "access"):
        return foreign(f"the record of backups compilewatch made ({record_path()}) cannot be read: {bad.sentence}")
    try:
        rec = recorded(directory)
    except BadInput as e:
        return foreign(f"the record of backups compilewatch made ({record_path()}) cannot be read: {e.message}")
    if rec is not None and bad is not None:
        return foreign(f"the record of backups compilewatch made names it, but others can change that record: "
                       f"{bad.sentence}")
    if rec is None and bad is not None:
        return foreign(f"it is not recorded as a backup compilewatch made on this machine, and nothing is recorded "
                       f"while others can change the record: {bad.sentence}")
    if rec is None:
        return foreign("it is not a backup compilewatch made on this machine (none is recorded at this path "
                       f"with this inode and change time in {record_path()})")
    others = others_can_change(directory)
    if others:
        return foreign(f"it was a backup compilewatch made here, but others can change it: "
                       f"{', '.join(others)} {'is' if len(others) == 1 else 'are'} owned by another user or "
                       "writable by everyone")
    made = {"created_at": rec["made_at"]} if isinstance(rec.get("made_at"), str) else {}
    src = rec["from"] if isinstance(rec.get("from"), str) else None
    what = (f"entries compilewatch pruned from {src or 'a cache'} on this machine" if rec.get("kind") == "pruned"
            else f"a backup{f' of {src}' if src else ''} compilewatch made on this machine")
    return Provenance(str(directory), "own", what, False, None, "this machine", made, False, kind="dir")
