"""Swapping a new tree in as the cache dir, with an intent journal so a killed swap is repaired.

`cache load` (and restoring a backup dir) ends with two renames: the live cache dir becomes
`<cache>.backup-<timestamp>`, then the new tree becomes the cache dir. A process killed between
them (SIGKILL, an OOM kill, a power cut) leaves no cache dir at all: the old one in the backup, the
new one in a staging dir. So before the first rename `swap_in` writes (atomically, fsynced) a
journal beside the cache, `.<name>.compilewatch.swap.json`, naming the three paths; it removes the
journal after the second rename.

`recover(target)` reads a journal left behind and finishes what it says, under the cache lock
(the dead process held it; the kernel released it): the new tree is complete when the journal is
written (extracted and checked before), so a missing cache dir with the new tree present is
completed (the new tree renamed into place); with the new tree gone too, the backup is renamed
back (rolled back). A journal whose swap never started (the cache dir and the new tree both
still there) is dropped, and a staging dir that was a temp dir of `load` is removed. Every cache
command reaches it through `layout.locate`; `compilewatch run` and `warm` call it for torch's
cache dir. It costs one stat when there is no journal.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import shutil
from pathlib import Path

from compilewatch.errors import CompilewatchError

JOURNAL_SUFFIX = ".compilewatch.swap.json"
_recovered: list[str] = []  # what recover() did in this process (the CLI reports it)


def journal_for(target: Path) -> Path:
    return target.parent / f".{target.name}{JOURNAL_SUFFIX}"


def _write_journal(target: Path, new: Path, backup: Path | None, new_is_temp: bool) -> Path:
    from compilewatch.fsutil import atomic_write_text

    j = journal_for(target)
    atomic_write_text(j, json.dumps({"target": str(target), "new": str(new), "backup": str(backup) if backup else None,
                                     "new_is_temp": new_is_temp, "pid": os.getpid()}))
    _fsync_dir(target.parent)
    return j


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def swap_in(new: Path, target: Path, *, new_is_temp: bool, backup_for) -> Path | None:
    """Rename `new` onto `target`, moving an existing non-empty `target` to `backup_for(target)`
    first; journaled (see the module docstring). Call it holding the cache lock."""
    backup = None
    if target.exists():
        if target.is_dir() and not os.listdir(target):
            target.rmdir()
        else:
            backup = backup_for(target)
    journal = _write_journal(target, new, backup, new_is_temp)
    if backup is not None:
        os.rename(target, backup)
    try:
        os.rename(new, target)
    except BaseException as e:
        try:
            if backup is not None:
                try:
                    os.rename(backup, target)
                except OSError:  # something recreated the dir between the two renames (a running job)
                    raise CompilewatchError(
                        f"{target} was recreated by another process while it was being replaced; the previous "
                        f"cache is safe at {backup}",
                        hint="stop the process writing the cache, then `compilewatch cache load "
                             f"{shlex.quote(str(backup))} --dir {shlex.quote(str(target))}`",
                    ) from e
        finally:
            with contextlib.suppress(OSError):
                journal.unlink()
        raise
    with contextlib.suppress(OSError):
        journal.unlink()
    _fsync_dir(target.parent)
    return backup


def recover(target: str | os.PathLike[str]) -> str | None:
    """Finish or roll back a swap a killed process left at `target`; returns what was done (None:
    nothing to do, or another live process holds the lock and is still swapping)."""
    target = Path(target)
    j = journal_for(target)
    if not os.path.lexists(j):
        return None
    from compilewatch.cache.local.lock import CacheLocked, cache_lock

    try:
        with cache_lock(target, timeout=0.0):
            return _recover_locked(target, j)
    except CacheLocked:
        return None  # the swap is live: its owner finishes it
    except CompilewatchError:
        return None  # no lock file can be made here: leave it for a command that can


def _recover_locked(target: Path, j: Path) -> str | None:
    try:
        d = json.loads(j.read_text()[:1 << 16])
        new, backup = Path(d["new"]), (Path(d["backup"]) if d.get("backup") else None)
        new_is_temp = bool(d.get("new_is_temp"))
        if Path(d["target"]) != target:
            raise ValueError("journal names another cache dir")
    except (OSError, ValueError, KeyError, TypeError):
        with contextlib.suppress(OSError):
            j.unlink()
        return None
    # only paths beside the cache, as swap_in makes them
    if new.parent != target.parent or (backup is not None and backup.parent != target.parent):
        with contextlib.suppress(OSError):
            j.unlink()
        return None
    done: str | None
    if target.exists():
        if new.exists():  # killed before the first rename: nothing was swapped
            if new_is_temp:
                shutil.rmtree(new, ignore_errors=True)
            done = None
        else:
            done = None  # both renames happened; only the journal was left
    elif new.exists():
        os.rename(new, target)
        done = (f"completed an interrupted swap of {target}: the new cache is in place"
                + (f", the previous one is at {backup}" if backup is not None and backup.exists() else ""))
    elif backup is not None and backup.exists():
        os.rename(backup, target)
        done = f"rolled back an interrupted swap of {target}: the previous cache is back in place"
    else:
        done = None
    with contextlib.suppress(OSError):
        j.unlink()
    _fsync_dir(target.parent)
    if done:
        _recovered.append(done)
    return done


def take_recovered() -> list[str]:
    """What `recover` did in this process since the last call (for the CLI to say)."""
    out = list(_recovered)
    _recovered.clear()
    return out
