"""A run directory as the run that owns it opens it: where it is, what it must (not) hold, its lock,
what killed saves left there, and on --resume the newest checkpoint's training state, verified.

    start = resume_point(run_dir, resume)     # BadInput before anything is created
    owned = OwnedRunDir.take(run_dir, lock)   # lock held; owned.notes says what it took over or cleaned
    resumed = load_resume_state(start)        # the reads (.state, .where, .unverified): may run in a thread
    check_resume_state(start, resumed, spec, hidden, layers, layer_ids)   # against this run's drafter
    owned.release_after_failure()             # a build that failed: lock released, nothing left behind

The one place the training side reads the checkpoint room's files (store, manifest, retention,
runlock) when a run starts; the Saver (dflash.checkpoint.writer) writes them while it runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import torch

from compilewatch import BadInput
from dflash.checkpoint import manifest, retention, store
from dflash.checkpoint.runlock import RunLock
from dflash.config import Config
from dflash.model.drafter import DrafterSpec


def default_run_dir(cfg: Config) -> Path:
    """`runs/RECIPE-YYYYmmdd-HHMMSS`: where a run without --out writes."""
    return Path("runs") / f"{cfg.recipe}-{datetime.now().strftime('%Y%m%d-%H%M%S')}"


def resume_point(run_dir: Path, resume: bool) -> Path | None:
    """The checkpoint a run continues (None: a fresh run). BadInput when `run_dir` is not a
    directory, when --resume finds no checkpoint, or when a fresh run would write over checkpoints."""
    if run_dir.exists() and not run_dir.is_dir():
        raise BadInput(f"--out {str(run_dir)!r} exists and is not a directory",
                       hint="--out names the run directory dflash creates; choose another name")
    latest = store.latest_checkpoint(run_dir)
    if resume and latest is None:
        raise BadInput(f"--resume: no checkpoint in {str(run_dir)!r}",
                       hint="point --out at the run directory of the run to continue")
    if not resume and latest is not None:
        raise BadInput(f"{str(run_dir)!r} already holds checkpoints",
                       hint="pass --resume to continue that run, or choose another --out")
    return latest if resume else None


@dataclass
class OwnedRunDir:
    """A run directory this process opened: its lock (None for a torchrun rank other than 0, which
    shares rank 0's) and whether the directory was created by this run."""
    path: Path
    lock: RunLock | None
    created: bool
    notes: list[str] = field(default_factory=list)

    @classmethod
    def take(cls, path: Path, lock: bool) -> OwnedRunDir:
        """Hold the lock (when `lock`), nothing more: call `clean()` next, inside the caller's cleanup."""
        created = not path.exists()
        return cls(path, RunLock(path).acquire() if lock else None, created)

    def clean(self) -> list[str]:
        """The lock holder owns the run dir: what a killed run left (its lock, staging directories) is
        its to remove. Returns the notes that say so."""
        if self.lock is None:
            return []
        notes = [self.lock.took_over] if self.lock.took_over else []
        left = retention.clean_leftovers(self.path)
        if left:
            notes.append(f"removed what killed saves left in {self.path / 'checkpoints'}: {', '.join(left)}")
        return notes

    def release_after_failure(self) -> None:
        """The run never started: release the lock (the next --resume must work) and remove the
        directory when this run created it and left it empty (bad input leaves nothing behind)."""
        if self.lock is not None:
            self.lock.release()
            if self.created and not any(self.path.iterdir()):
                self.path.rmdir()


@dataclass(frozen=True)
class ResumeState:
    state: dict[str, Any]  # Trainer.state_dict's, as saved
    where: str  # its file, for messages
    unverified: str | None  # a note when the checkpoint has no manifest to verify against


def load_resume_state(start: Path, device: torch.device | None = None) -> ResumeState:
    """The reads of a resume, no check against the run: every file of checkpoint `start` that its
    manifest lists (sizes and checksums), then its training state (memory-mapped). What a start can
    do while the target loads (dflash.training.build). BadInput for a damaged checkpoint.
    `device` (a GPU): the state's weights and optimizer moments are copied there too, several tensors at
    once, so the trainer's load is a copy on the device (at 8B, 12.6 GB paged in from the memory map
    here, beside the target's load, instead of after it)."""
    unverified = manifest.check(start)
    state = store.load_training_state(start)
    if device is not None and device.type == "cuda":
        state = staged(state, device)
    return ResumeState(state, str(start / store.STATE_FILE), unverified)


def staged(state: dict[str, Any], device: torch.device, threads: int = 4) -> dict[str, Any]:
    """`state` (Trainer.state_dict's) with the tensors of its model and its optimizer's per-parameter
    moments on `device` (the step counters and everything else as they are); a new dict, same keys."""
    from concurrent.futures import ThreadPoolExecutor

    model = state.get("model")
    opt = state.get("optimizer")
    per_param = opt.get("state") if isinstance(opt, dict) else None
    jobs: list[tuple[dict, Any, torch.Tensor]] = []
    out_model = dict(model) if isinstance(model, dict) else model
    if isinstance(out_model, dict):
        jobs += [(out_model, k, v) for k, v in out_model.items() if isinstance(v, torch.Tensor)]
    out_per_param = None
    if isinstance(per_param, dict):
        out_per_param = {i: (dict(e) if isinstance(e, dict) else e) for i, e in per_param.items()}
        for e in out_per_param.values():
            if isinstance(e, dict):
                jobs += [(e, k, v) for k, v in e.items() if k != "step" and isinstance(v, torch.Tensor)]
    with ThreadPoolExecutor(max(1, threads), thread_name_prefix="resume-stage") as pool:
        moved = list(pool.map(lambda job: job[2].to(device), jobs))
    for (holder, key, _), t in zip(jobs, moved):
        holder[key] = t
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # the copies are done when the thread says so
    out = dict(state)
    if isinstance(out_model, dict):
        out["model"] = out_model
    if out_per_param is not None:
        out["optimizer"] = {**opt, "state": out_per_param}
    return out


def check_resume_state(start: Path, resumed: ResumeState, spec: DrafterSpec, target_hidden: int,
                       target_layers: int, layer_ids: tuple[int, ...]) -> ResumeState:
    """The saved drafter against the target and against this config's drafter `spec` (BadInput). A drafter
    setting edited since the checkpoint (drafter.num_layers in config.toml moves the default taps too) is
    named as that, not as a target that does not match."""
    from dataclasses import fields

    saved = DrafterSpec(**resumed.state["spec"])
    differ = [f.name for f in fields(DrafterSpec) if getattr(saved, f.name) != getattr(spec, f.name)]
    if set(differ) - {"target_layer_ids"} and (saved.hidden_size, saved.num_target_layers, saved.vocab_size) == \
            (target_hidden, target_layers, spec.vocab_size):  # the same target: the config's drafter changed
        diffs = [f"{n} {getattr(saved, n)!r} vs {getattr(spec, n)!r}" for n in differ]
        raise BadInput(f"the drafter in {str(start)!r} differs from this config's drafter (checkpoint vs config): "
                       + "; ".join(diffs)[:600],
                       hint="resume with the drafter the run trained with: the summary's `changed` line names the "
                            "settings edited since the checkpoint; put them back in the run's config.toml (or "
                            "--set them to the values in the checkpoint's train_config.toml)")
    store.check_compatible(saved, target_hidden, target_layers, layer_ids, str(start))
    if saved != spec:
        raise BadInput(f"the drafter in {str(start)!r} differs from this config's drafter",
                       hint="resume with the run's own config (it is in the run directory's config.toml)")
    return resumed


def _aside(path: Path) -> Path:
    """A free `NAME.bak-<time>` beside `path` (`-2`, `-3`, ... when one of that second exists)."""
    import time

    base = path.with_name(f"{path.name}.bak-{time.strftime('%Y%m%d-%H%M%S')}")
    backup, n = base, 1
    while backup.exists() or backup.is_symlink():
        n += 1
        backup = base.with_name(f"{base.name}-{n}")
    return backup


def keep_foreign_files(run_dir: Path, config_toml: str) -> list[str]:
    """Before a fresh run writes `run_dir`'s config.toml and metrics.jsonl: a config.toml there that is not
    `config_toml` (the user's own, in `--out .`, or a run's with other settings) is moved aside to
    `config.toml.bak-<time>`, and so is a metrics.jsonl there unless it is a restart's of this very config
    (a run killed before its first checkpoint: the rows past step 0 are its own, dropped when the log
    opens). A metrics.jsonl of the user's used to lose every row with a "step" past 0. Returns the notes."""
    import os

    notes = []
    config = run_dir / "config.toml"
    if config.is_file():
        with open(config, "rb") as fh:
            if fh.read(len(config_toml.encode()) + 1) == config_toml.encode():
                return []  # this very config: a restart of a run killed before its first checkpoint
        backup = _aside(config)
        os.rename(config, backup)
        notes.append(f"{config} was already there (not this run's config): kept as {backup.name}")
    metrics = run_dir / "metrics.jsonl"
    if metrics.is_file():
        backup = _aside(metrics)
        os.rename(metrics, backup)
        notes.append(f"{metrics} was already there (not this run's log): kept as {backup.name}")
    return notes
