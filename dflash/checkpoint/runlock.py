"""One trainer per run directory: `RUN/.lock` holds the owner's pid, host and process start time.

The lock file is created with O_CREAT|O_EXCL (atomic: of two trainers starting at once exactly one
creates it) and removed by its owner when the run ends. A lock that is already there:
- names a live process on this host (same pid *and* the same process start time), or a process on
  another host (which cannot be checked from here): the run stops with who holds it;
- names a process on this host that is gone, or whose pid now belongs to a younger process (pid
  reuse: the start times differ): a SIGKILLed trainer left it behind. It is taken over with a note
  (`RunLock.took_over`): renamed aside atomically, checked to still be the stale lock judged (else
  put back: another trainer just took it), removed, and the O_EXCL create is tried again.
A `.lock` that is not a regular file (a FIFO, a directory, a socket) is BadInput naming it, at once:
it is opened non-blocking and its type checked on the descriptor (`compilewatch.open_untrusted`).
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

from compilewatch import BadInput

LOCK_NAME = ".lock"
MAX_LOCK_BYTES = 4096  # a lock file is a few dozen bytes; never read more


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def process_start(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (/proc/PID/stat field 22), or None when it
    is gone or this is not Linux. With the boot id, it tells a pid's owner from a reuse of that pid."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            raw = fh.read(4096)
        return int(raw[raw.rindex(b")") + 2:].split()[19])  # fields after "(comm)": state is field 3
    except (OSError, ValueError, IndexError):
        return None


def boot_id() -> str | None:
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as fh:
            return fh.read(64).strip() or None
    except OSError:
        return None


def _read(path: Path) -> dict:
    """What the lock file says ({} when it is gone or not a JSON object). A lock that is not a regular
    file (a FIFO, a directory, a socket) is BadInput naming it: it is opened non-blocking and its type
    checked on the descriptor, so a FIFO nobody writes to never hangs the trainer."""
    from compilewatch import open_untrusted

    try:
        fd, _st = open_untrusted(path, "the run lock")
    except BadInput as e:
        if not os.path.lexists(path):
            return {}  # removed meanwhile (its owner released it)
        raise BadInput(e.message, hint=f"{LOCK_NAME} is written only by dflash; if no trainer is using this run "
                                       f"directory, remove {str(path)!r} and start again") from None
    try:
        with os.fdopen(fd, "rb", closefd=False) as fh:
            data = json.loads(fh.read(MAX_LOCK_BYTES).decode("utf-8"))
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}
    finally:
        os.close(fd)


def _stale(owner: dict, host: str) -> str | None:
    """Why a lock on this host is stale (its process is gone, or its pid was reused), or None."""
    pid = owner.get("pid")
    if owner.get("host") != host or not isinstance(pid, int) or isinstance(pid, bool):
        return None
    if owner.get("boot") and boot_id() and owner["boot"] != boot_id():
        return f"process {pid} ran before this host rebooted"
    if not _alive(pid):
        return f"process {pid} on this host is gone"
    started = owner.get("proc_start")
    if isinstance(started, int) and process_start(pid) not in (None, started):
        return f"pid {pid} now belongs to another process (started later than the lock's owner)"
    return None


class RunLock:
    """Held while a trainer writes into `run_dir`; `release()` (idempotent) removes the file."""

    def __init__(self, run_dir: str | Path) -> None:
        self.path = Path(run_dir) / LOCK_NAME
        self.held = False
        self.took_over: str | None = None  # a note when a stale lock was taken over

    def acquire(self) -> RunLock:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        me = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
              "proc_start": process_start(os.getpid()), "boot": boot_id()}
        for _ in range(3):
            try:
                self._create(me)
            except FileExistsError:
                owner = _read(self.path)
                why = _stale(owner, me["host"])
                if why is None or not self._remove_stale(owner):
                    raise self._held_error(me["host"]) from None
                self.took_over = (f"took over the stale lock {str(self.path)!r}: {why} (a killed trainer left it; "
                                  f"it was started {owner.get('started', '?')})")
                continue
            self.held = True
            return self
        raise self._held_error(me["host"])

    def _create(self, me: dict) -> None:
        """Create the lock with its contents in one step: written to a private file, then hard-linked
        to `.lock` (atomic, fails if it exists), so a kill never leaves an empty lock that names no
        one. Filesystems without hard links: O_CREAT|O_EXCL, then the write. A write that fails (a
        full disk) leaves no lock behind: BadInput."""
        tmp = self.path.with_name(f"{LOCK_NAME}.new-{os.getpid()}")
        try:
            try:
                with open(tmp, "w", encoding="utf-8") as fh:
                    json.dump(me, fh)
            except OSError as e:
                raise BadInput(f"cannot write the run lock {str(self.path)!r}: {e.strerror or e}") from None
            try:
                os.link(tmp, self.path)
                return
            except FileExistsError:
                raise
            except OSError:  # no hard links here
                pass
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)  # FileExistsError: held
            try:
                with os.fdopen(fd, "w", encoding="utf-8") as fh:
                    json.dump(me, fh)
            except BaseException as e:  # the half-written lock is ours (O_EXCL), never left behind
                self.path.unlink(missing_ok=True)
                if isinstance(e, OSError):
                    raise BadInput(f"cannot write the run lock {str(self.path)!r}: {e.strerror or e}") from None
                raise
        finally:
            tmp.unlink(missing_ok=True)

    def _remove_stale(self, judged: dict) -> bool:
        """Move the lock judged stale aside, and remove it if it is still that lock (True); when another
        trainer replaced it in between, put theirs back (False: it is held)."""
        aside = self.path.with_name(f"{LOCK_NAME}.stale-{os.getpid()}")
        try:
            os.rename(self.path, aside)
        except FileNotFoundError:
            return True  # someone else removed it: try to create ours
        if _read(aside) == judged:
            aside.unlink(missing_ok=True)
            return True
        try:
            os.link(aside, self.path)  # fails if a third trainer created one meanwhile: theirs stays
        except OSError:
            pass
        aside.unlink(missing_ok=True)
        return False

    def _held_error(self, host: str) -> BadInput:
        owner = _read(self.path)
        pid, where = owner.get("pid"), owner.get("host")
        run = str(self.path.parent)
        if not isinstance(pid, int) or not where:
            return BadInput(f"{run!r} is locked by {str(self.path)!r}, which does not say who holds it",
                            hint=f"if no trainer is using this run directory, delete {str(self.path)!r} and start again")
        return BadInput(f"{run!r} is in use by another trainer: pid {pid} on {where} (since {owner.get('started', '?')})",
                        hint="wait for it to finish, or choose another --out; if that process is gone "
                             f"(another host cannot be checked from here), delete {str(self.path)!r}")

    def release(self) -> None:
        if self.held:
            self.held = False
            try:
                owner = _read(self.path)
            except BadInput:  # something else replaced our lock: it is not ours to remove
                return
            if owner.get("pid") == os.getpid():  # never remove a lock someone else created
                self.path.unlink(missing_ok=True)

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()
