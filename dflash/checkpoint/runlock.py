"""One trainer per run directory: `RUN/.lock` holds the owner's pid and host.

The lock file is created with O_CREAT|O_EXCL (atomic: of two trainers starting at once exactly one
creates it) and removed by its owner when the run ends. A lock that is already there is never taken
over silently: when it names a live process (or a process on another host, which cannot be checked
from here) the run stops with who holds it; when it names a dead process on this host (a SIGKILLed
trainer leaves its lock behind) the error says so and what to do.
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


def _read(path: Path) -> dict:
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.loads(fh.read(MAX_LOCK_BYTES))
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


class RunLock:
    """Held while a trainer writes into `run_dir`; `release()` (idempotent) removes the file."""

    def __init__(self, run_dir: str | Path) -> None:
        self.path = Path(run_dir) / LOCK_NAME
        self.held = False

    def acquire(self) -> RunLock:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        me = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        try:
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            raise self._held_error(me["host"]) from None
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as fh:
                json.dump(me, fh)
        except BaseException as e:  # a full disk: the half-written lock is ours (O_EXCL), never left behind
            self.path.unlink(missing_ok=True)
            if isinstance(e, OSError):
                raise BadInput(f"cannot write the run lock {str(self.path)!r}: {e.strerror or e}") from None
            raise
        self.held = True
        return self

    def _held_error(self, host: str) -> BadInput:
        owner = _read(self.path)
        pid, where = owner.get("pid"), owner.get("host")
        run = str(self.path.parent)
        if not isinstance(pid, int) or not where:
            return BadInput(f"{run!r} is locked by {str(self.path)!r}, which does not say who holds it",
                            hint=f"if no trainer is using this run directory, delete {str(self.path)!r} and start again")
        if where == host and not _alive(pid):
            return BadInput(f"{run!r} has a stale lock: process {pid} on this host ({host}) is gone "
                            f"(killed before it could release {str(self.path)!r})",
                            hint=f"no trainer holds this run: delete {str(self.path)!r}, then resume with "
                                 f"`dflash train --out {run} --resume`")
        return BadInput(f"{run!r} is in use by another trainer: pid {pid} on {where} (since {owner.get('started', '?')})",
                        hint="wait for it to finish, or choose another --out; if that process is gone "
                             f"(another host cannot be checked from here), delete {str(self.path)!r}")

    def release(self) -> None:
        if self.held:
            self.held = False
            owner = _read(self.path)
            if owner.get("pid") == os.getpid():  # never remove a lock someone else created
                self.path.unlink(missing_ok=True)

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()
