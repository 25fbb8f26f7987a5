"""Checkpoints written beside training: snapshot into reused host buffers, then write in a thread.

    saver = Saver(run_dir, cfg.checkpoint, export_dtype, report)
    plan = saver.plan(drafter, step, total_steps)  # the run's checkpoint disk use from `step` on
    saver.preflight(plan)                       # before training: stops (BadInput) if one checkpoint cannot fit
    saver.save(step, drafter, optimizer, ...)   # at a checkpoint step: blocks only for the snapshot
    saver.poll()                                # every step: reports saves that finished (or failed)
    saver.finish()                              # at the end: waits; CheckFailed if the final save failed

The snapshot copies the drafter's fp32 weights and AdamW's state into host buffers allocated at the
first save and reused by every later one (pinned on CUDA, so the copies run at PCIe speed and are
waited for once; on CUDA they are allocated beside training after the first step, `Saver.reserve`),
then a background thread casts the export, serializes, fsyncs, records the
manifest, publishes the directory and applies retention (dflash.checkpoint.store, .retention). The
loop loses only the snapshot's time, plus the previous write's remainder when a save is due while
that write still runs (it is waited for, never dropped). Extra memory: host = one copy of the fp32
weights and both AdamW moments (12 bytes per parameter: 12.6 GB for the 8B recipe's 1.05 B-parameter
drafter), plus the export cast while it is written (2 bytes per parameter); GPU = none.

Failure policy (a full disk, EIO, a run directory that vanished): no traceback, and the previous
checkpoint stays intact. A periodic save that fails (or that would not fit: the free space is
checked before each save) is reported as skipped with its reason and the newest checkpoint on disk;
training goes on and the next interval tries again. When the run's last save fails, `finish` raises
CheckFailed (exit 1) naming the newest checkpoint and the exact resume command. Failures other than
a write's (OSError; RuntimeError from torch's zip writer, SafetensorError from safetensors': both
report ENOSPC that way) are bugs: re-raised in the loop's thread.

Why not `torch.distributed.checkpoint.async_save`: the trainer's state is replicated (rank 0 writes
it whole, the other ranks hold the same bits), so DCP's per-rank sharding buys nothing here, and
DCP's `.metadata` is a pickle: checkpoints cross machines and are loaded with `weights_only=True`
(`dflash eval`, `--resume`, serving engines reading model.safetensors), which DCP's loader cannot
offer. Its mechanism (stage into pinned memory, write in a thread) is what this module does, on the
existing format.
"""

from __future__ import annotations

import copy
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from compilewatch import BadInput, CheckFailed, one_line
from dflash.checkpoint import diskspace, retention
from dflash.checkpoint import store as ckpt

Report = Callable[[str, dict[str, Any]], None]


def _write_errors() -> tuple[type[BaseException], ...]:
    """What a failed write raises: OSError; torch's zip writer reports a short write as RuntimeError
    ("unexpected pos"); safetensors' Rust writer as SafetensorError ("No space left on device")."""
    from safetensors import SafetensorError

    return (OSError, RuntimeError, SafetensorError)


_WRITE_ERRORS = _write_errors()


def newest_on_disk(run_dir: Path) -> Path | None:
    """The newest complete checkpoint, for messages and estimates while training: None when there is
    none, or when what `latest` names is damaged (that is for --resume to report, not a reason to
    stop a running save)."""
    try:
        return ckpt.latest_checkpoint(run_dir) if Path(run_dir).is_dir() else None
    except BadInput:
        full = ckpt.complete_checkpoints(run_dir)
        return full[-1] if full else None


class HostBuffers:
    """One host tensor per key, allocated once (pinned when the source is on CUDA) and reused."""

    def __init__(self) -> None:
        self._bufs: dict[Any, torch.Tensor] = {}

    def _buffer(self, key: Any, t: torch.Tensor) -> torch.Tensor:
        buf = self._bufs.get(key)
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
            buf = self._bufs[key] = torch.empty(t.shape, dtype=t.dtype, device="cpu",
                                                pin_memory=t.device.type == "cuda")
        return buf

    def copy(self, key: Any, t: torch.Tensor) -> torch.Tensor:
        t = t.detach()
        buf = self._buffer(key, t)
        buf.copy_(t, non_blocking=t.device.type == "cuda")
        return buf

    def reserve(self, tensors: dict[Any, torch.Tensor]) -> None:
        """Allocate (not fill) the buffers for these tensors: pinning 12.6 GB takes seconds, better
        spent beside training than inside the first save."""
        for key, t in tensors.items():
            self._buffer(key, t)

    @property
    def bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._bufs.values())


@dataclass
class Snapshot:
    step: int
    model: dict[str, torch.Tensor]  # host copies of the fp32 weights
    state: dict[str, Any]  # Trainer.state_dict()'s format, tensors on the host
    spec: Any
    config_toml: str
    final: bool
    blocked_s: float = 0.0  # training time this save cost the loop (wait for the previous + snapshot)
    data: dict[str, Any] | None = None  # the training data's record (dflash.checkpoint.data_check)


def _tensors(drafter: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[Any, torch.Tensor]:
    """Every tensor a snapshot copies, by its buffer key (the same keys `snapshot` uses)."""
    out: dict[Any, torch.Tensor] = {("model", k): v for k, v in drafter.state_dict().items()}
    for i, st in optimizer.state_dict()["state"].items():
        out.update({("opt", i, k): v for k, v in st.items() if isinstance(v, torch.Tensor)})
    return out


def snapshot(buffers: HostBuffers, step: int, drafter: torch.nn.Module, optimizer: torch.optim.Optimizer,
             total_steps: int, config_toml: str, final: bool) -> Snapshot:
    """Copy the drafter's weights and the optimizer's state into `buffers` and wait for the copies."""
    model = {k: buffers.copy(("model", k), v) for k, v in drafter.state_dict().items()}
    opt = optimizer.state_dict()  # keys as in _tensors
    state = {i: {k: buffers.copy(("opt", i, k), v) if isinstance(v, torch.Tensor) else v for k, v in s.items()}
             for i, s in opt["state"].items()}
    devices = {p.device for p in drafter.parameters() if p.device.type == "cuda"}
    for d in devices:
        torch.cuda.synchronize(d)
    spec = drafter.spec
    full = {"step": step, "model": model, "optimizer": {"state": state, "param_groups": copy.deepcopy(opt["param_groups"])},
            "spec": asdict(spec), "total_steps": total_steps}
    return Snapshot(step, model, full, spec, config_toml, final)


@dataclass
class Outcome:
    step: int
    final: bool
    path: str | None = None  # the published checkpoint, when it was written
    error: str | None = None  # why it was not (one line)
    bug: BaseException | None = None  # a failure that is not the disk's: re-raised by poll/finish
    blocked_s: float = 0.0
    write_s: float = 0.0
    bytes: int = 0
    removed: tuple[str, ...] = ()
    stripped: tuple[str, ...] = ()
    notes: list[str] = field(default_factory=list)


class Saver:
    """The checkpoints of one run directory (see the module docstring)."""

    def __init__(self, run_dir: Path, cfg: Any, export_dtype: torch.dtype, report: Report) -> None:
        self.run_dir, self.cfg, self.export_dtype, self.report = Path(run_dir), cfg, export_dtype, report
        self.buffers = HostBuffers()
        self._reserving: threading.Thread | None = None
        self._thread: threading.Thread | None = None
        self._ended = threading.Event()  # set by the write in `_thread` when it ends (`wait`)
        self._done: list[Outcome] = []
        self._lock = threading.Lock()
        self.last: Outcome | None = None  # the latest save that ended (written, failed or skipped)
        self.saved: list[str] = []
        self.blocked_s: list[float] = []
        # a resumed run's step: checkpoints above it that this run did not write are another timeline's
        # (`latest` rewound by hand to an older one): retention neither counts nor removes them
        self.resumed_step: int | None = None
        self._written: set[str] = set()  # checkpoint names this Saver published (the writer thread's)

    # ------------------------------------------------------------ before training
    def plan(self, drafter: torch.nn.Module, step: int, total_steps: int) -> diskspace.DiskPlan:
        """This run's checkpoint disk use from `step` on (dflash.checkpoint.diskspace): estimated from
        the drafter's size until a checkpoint is on disk, then measured from the newest one."""
        c = self.cfg
        n = sum(p.numel() for p in drafter.parameters())
        return diskspace.plan(self.run_dir, n, self.export_dtype.itemsize, step=step, total_steps=total_steps,
                              every=c.every, keep_last=c.keep_last, export_every=c.export_every,
                              newest=newest_on_disk(self.run_dir))

    def preflight(self, p: diskspace.DiskPlan) -> None:
        """BadInput with the numbers when not even one checkpoint fits on the run's filesystem."""
        short = diskspace.shortfall(p)
        if short is not None:
            raise BadInput(f"not enough disk for a checkpoint in {str(self.run_dir)!r}: {short}; this run writes "
                           f"{p.saves} checkpoint(s) and peaks at {diskspace.gb(p.peak_bytes)} with "
                           f"checkpoint.keep_last={self.cfg.keep_last}",
                           hint="free space there, choose another --out, or save less (checkpoint.keep_last, "
                                "checkpoint.export_every)")

    def reserve(self, drafter: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """On CUDA, allocate the pinned host buffers in a background thread now (after the first step,
        when AdamW's state exists), so that the first save only copies. The next save waits for it."""
        on_gpu = any(p.device.type == "cuda" for p in drafter.parameters())
        if not (on_gpu and self.cfg.background) or self._reserving is not None:
            return
        tensors = {k: v.detach() for k, v in _tensors(drafter, optimizer).items()}  # shapes only are read
        self._reserving = threading.Thread(target=self.buffers.reserve, args=(tensors,), name="dflash-pin", daemon=True)
        self._reserving.start()

    def settle(self) -> float:
        """Wait for the pinned-buffer reservation, if one is running: seconds waited. Work timed for
        the user (a periodic eval, whose plain baseline is reused all run long) is not timed while
        gigabytes are pinned beside it: pinning goes through the CUDA driver, which launches and
        graph captures also need, so it can slow them."""
        if self._reserving is None or not self._reserving.is_alive():
            return 0.0
        t0 = time.perf_counter()
        self._reserving.join()
        return time.perf_counter() - t0

    # ------------------------------------------------------------ a save
    def save(self, step: int, drafter: torch.nn.Module, optimizer: torch.optim.Optimizer, total_steps: int,
             config_toml: str, *, final: bool, plan: Callable[[], diskspace.DiskPlan] | None = None,
             data: dict[str, Any] | None = None) -> str:
        """Snapshot now, write in the background (or inline with `checkpoint.background = false`).
        Returns the checkpoint's path (published when the write ends). `plan`: the disk plan to
        check first (default `self.plan` at `step`). `data`: what the run trains on, for the manifest."""
        t0 = time.perf_counter()
        if self._reserving is not None:
            self._reserving.join()
        self.wait()
        self.poll()
        target = str(self.run_dir / "checkpoints" / f"step_{step:06d}")
        short = diskspace.shortfall(plan() if plan is not None else self.plan(drafter, step, total_steps))
        if short is not None:
            self._finished(Outcome(step, final, error=f"not enough disk: {short}", blocked_s=time.perf_counter() - t0))
            self.poll()
            return target
        snap = snapshot(self.buffers, step, drafter, optimizer, total_steps, config_toml, final)
        snap.blocked_s = time.perf_counter() - t0
        snap.data = data
        out = Outcome(step, final, blocked_s=snap.blocked_s)
        if self.cfg.background:
            self._ended = threading.Event()
            self._thread = threading.Thread(target=self._write, args=(snap, out, self._ended),
                                            name="dflash-checkpoint")
            self._thread.start()
        else:
            self._write(snap, out)
            out.blocked_s = time.perf_counter() - t0
            self.poll()
        return target

    def _write(self, snap: Snapshot, out: Outcome, ended: threading.Event | None = None) -> None:
        try:
            self._write_one(snap, out)
        finally:
            if ended is not None:
                ended.set()

    def _write_one(self, snap: Snapshot, out: Outcome) -> None:
        t0 = time.perf_counter()
        try:
            path = ckpt.save_checkpoint(self.run_dir, snap.step, snap.model, snap.spec, self.export_dtype,
                                        snap.state, snap.config_toml, data=snap.data)
            out.path, out.bytes = str(path), diskspace.dir_bytes(path)
            out.write_s = time.perf_counter() - t0
            self._written.add(Path(path).name)
            try:
                pruned = retention.prune(self.run_dir, self.cfg.keep_last, self.cfg.export_every,
                                         spare=self._other_timeline())
                out.removed, out.stripped = pruned.removed, pruned.stripped
            except OSError as e:
                out.notes.append(f"retention stopped: {one_line(e, 200)} (the next save tries again)")
        except _WRITE_ERRORS as e:
            out.error = one_line(f"{type(e).__name__}: {e}", 300)
            out.write_s = time.perf_counter() - t0
        except BaseException as e:  # noqa: BLE001 - not the disk's fault: a bug, re-raised in the loop's thread
            out.error, out.bug = one_line(f"{type(e).__name__}: {e}", 300), e
        self._finished(out)

    def _other_timeline(self) -> set[str]:
        """Complete checkpoints past the step this run resumed from that it did not write itself: left to
        their owner (a rewound run must not lose its own older checkpoints to keep those)."""
        if self.resumed_step is None:
            return set()
        return {ck.name for ck in ckpt.complete_checkpoints(self.run_dir)
                if int(ck.name.split("_")[1]) > self.resumed_step and ck.name not in self._written}

    def _finished(self, out: Outcome) -> None:
        with self._lock:
            self._done.append(out)

    # ------------------------------------------------------------ reporting
    def poll(self) -> None:
        """Report the saves that ended since the last call (from the calling thread)."""
        with self._lock:
            done, self._done = self._done, []
        for out in done:
            self.last = out
            self.blocked_s.append(out.blocked_s)
            if out.bug is not None:
                raise out.bug
            if out.path is not None:
                self.saved.append(out.path)
                self.report("checkpoint", {"step": out.step, "path": out.path, "blocked_s": round(out.blocked_s, 4),
                                           "write_s": round(out.write_s, 3), "bytes": out.bytes,
                                           "removed": list(out.removed), "stripped": list(out.stripped),
                                           "notes": out.notes, "final": out.final})
            else:
                newest = newest_on_disk(self.run_dir)
                self.report("checkpoint-skipped", {
                    "step": out.step, "reason": out.error, "final": out.final, "blocked_s": round(out.blocked_s, 4),
                    "newest": str(newest) if newest is not None else None,
                    "then": "the run stops" if out.final else f"training goes on; the next save is at step "
                                                              f"{out.step + self.cfg.every - out.step % self.cfg.every}"})

    def wait(self) -> None:
        """Wait for the write in progress (if any); its outcome is reported by the next poll."""
        if self._thread is not None:
            # the write's own event first: on Python 3.11 a KeyboardInterrupt inside Thread.join marks the
            # thread ended while it still runs (bpo-45274's handling), and a second join returns at once.
            # A thread that ends without setting it (one `save` did not start) ends the wait too.
            while not self._ended.wait(timeout=1.0):
                if not self._thread.is_alive():
                    break
            self._thread.join()
            self._thread = None

    @property
    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def finish(self, steps_done: int) -> None:
        """Wait for the last write and report it; CheckFailed (exit 1) when the run's last save failed."""
        self.wait()
        self.poll()
        out = self.last
        if out is None or out.path is not None or out.step != steps_done:
            return  # written, or an earlier save failed and a later state was saved
        newest = newest_on_disk(self.run_dir)
        lost = steps_done - (int(newest.name.split("_")[1]) if newest is not None else 0)
        where = (f"the newest checkpoint is {newest} ({lost} step(s) behind)" if newest is not None
                 else "no checkpoint of this run is on disk")
        raise CheckFailed(f"the final checkpoint (step {out.step}) could not be written: {out.error}; {where}",
                          hint=f"free space on the run directory's filesystem (or fix it), then continue with "
                               f"`dflash train --out {self.run_dir} --resume`")

    def close(self) -> None:
        """Wait for a write in progress without raising its failure (the run is ending for another reason). A Ctrl-C
        during the wait does not cut it: the write is waited for to its end, then the interrupt is raised
        (a process that left here with the write running would exit under it: the checkpoint half-staged,
        or the process aborted in the writer's C++ code)."""
        stopped = None
        while self._thread is not None:
            try:
                self.wait()
            except KeyboardInterrupt as e:
                stopped = e
        if stopped is not None:
            raise stopped
