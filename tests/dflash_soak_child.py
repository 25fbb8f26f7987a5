"""The trainer processes of the soak test (tests/test_dflash_soak.py).

They are forked from a multiprocessing forkserver that imported this module once (torch, transformers'
Qwen3, dflash and the CLI; the tiny target built once to load transformers' lazy modules), so each
trial starts in a fraction of a second instead of the seconds a fresh interpreter takes.

Faults, in the child only:
- `kill_io=k`: the k-th file operation (fsync, replace, rename, link, unlink, rmtree) of the process
  (or, `writer_only`, of the background checkpoint writer: inside a save) SIGKILLs the process first:
  a kill at an exact point;
- `fill_at=n` with `fill_dir`: before the n-th save is written, a filler file takes the filesystem's
  free space down to a quarter of a checkpoint (a real full disk, mid-save: ENOSPC from the kernel);
- `enospc_at=n`: from the n-th save on, every fsync raises ENOSPC (the same, injected, where no small
  filesystem can be mounted).
"""

from __future__ import annotations

import errno
import os
import shutil
import signal
import sys
import threading

import torch

import cli.dflash_main  # noqa: F401 - imported once in the forkserver
from dflash.checkpoint import store
from dflash.config import apply_overrides, tiny
from dflash.model.target import build_tiny_target
from dflash.training.trainer import Trainer

build_tiny_target()  # loads transformers' lazy Qwen3 modules in the forkserver, not in every trial


def _kill_at(k: int, writer_only: bool) -> None:
    count = [0]

    def wrap(fn):
        def counted(*a, **kw):
            if not writer_only or threading.current_thread().name == "dflash-checkpoint":
                count[0] += 1
                if count[0] >= k:
                    os.kill(os.getpid(), signal.SIGKILL)
            return fn(*a, **kw)
        return counted

    for mod, name in ((os, "fsync"), (os, "replace"), (os, "rename"), (os, "link"), (os, "unlink"), (shutil, "rmtree")):
        setattr(mod, name, wrap(getattr(mod, name)))


FILL_LIMIT = 256 << 20  # the largest filesystem `fill_at` will fill


def _fill_at(n: int, fill_dir: str) -> None:
    real, calls = store.save_checkpoint, [0]

    def filling(run_dir, step, model, *a, **kw):
        calls[0] += 1
        if calls[0] == n:
            size = sum(v.numel() * v.element_size() for v in model.values())
            disk = shutil.disk_usage(fill_dir)
            if disk.total > FILL_LIMIT:  # the test's own small tmpfs only: never fill a real disk
                raise RuntimeError(f"{fill_dir} is {disk.total} bytes, not the test's small tmpfs: not filled")
            free = disk.free
            with open(os.path.join(fill_dir, "filler"), "wb") as fh:
                fh.truncate(0)
                os.posix_fallocate(fh.fileno(), 0, max(1, free - size))  # leave a fraction of one checkpoint
        return real(run_dir, step, model, *a, **kw)

    store.save_checkpoint = filling


def _enospc_at(n: int) -> None:
    real_save, real_fsync, calls = store.save_checkpoint, os.fsync, [0]

    def counting(*a, **kw):
        calls[0] += 1
        return real_save(*a, **kw)

    def failing(fd):
        if calls[0] >= n:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_fsync(fd)

    store.save_checkpoint, os.fsync = counting, failing


def config(overrides: dict):
    return apply_overrides(tiny(), overrides)


def trial(overrides: dict, started=None, kill_io: int | None = None, writer_only: bool = False) -> None:
    """Train the run (resuming when it has a checkpoint); `started` (an Event) is set at the first step.
    `kill_io`: SIGKILL at that file operation of the process (`writer_only`: of the background
    checkpoint writer's thread: inside a save)."""
    torch.set_num_threads(1)
    if kill_io:
        _kill_at(kill_io, writer_only)
    cfg = config(overrides)
    resume = store.latest_checkpoint(cfg.checkpoint.out_dir) is not None

    def on_event(kind, data):
        if kind == "step" and started is not None:
            started.set()

    t = Trainer.from_config(cfg, resume=resume, on_event=on_event)
    try:
        t.train()
    finally:
        t.close()


def cli_trial(args: list[str], stderr_path: str, fill_at: int | None = None, fill_dir: str | None = None,
              enospc_at: int | None = None) -> None:
    """`dflash train ARGS` in this process (exit code = the CLI's), stderr into `stderr_path`."""
    torch.set_num_threads(1)
    fd = os.open(stderr_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 2)
    sys.stderr = open(2, "w", closefd=False)
    if fill_at:
        _fill_at(fill_at, fill_dir)
    if enospc_at:
        _enospc_at(enospc_at)
    from cli.dflash_main import app

    code = 0
    try:
        app(args=["train", *args], prog_name="dflash")
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    sys.stderr.flush()
    os._exit(code)
