"""Building a Trainer from a Config: every component, each start phase timed, all input checked
before the run directory is created (bad input leaves nothing behind).

    trainer = Trainer.from_config(cfg, resume=True)   # -> build_trainer(Trainer, cfg, resume=True)

Order: the run directory (dflash.checkpoint.rundir: what it must hold, its lock, leftovers), the
device and attention backend, the target (dflash.model.target), the training data
(dflash.data.prepare), on --resume the checkpoint's verified training state (read in a thread
beside the target and the data: both are disk-bound, and on a large run the checkpoint is ~12 GB
beside a ~16 GB target), then the drafter (dflash.model.build) and the Trainer, which loads that state. Every failure once the lock is held
releases it. The phases (target, data, resume state, drafter; the first step is marked by the loop)
are reported as events (dflash.training.startup).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, TypeVar

import torch

from dflash.checkpoint.rundir import OwnedRunDir, check_resume_state, default_run_dir, load_resume_state, resume_point
from dflash.config import Config
from dflash.data.dataset import check_data_path
from dflash.data.prepare import load_training_data
from dflash.model.build import build_drafter, drafter_spec
from dflash.model.mask import detect_backend
from dflash.model.target import load_target, resolve_device
from dflash.training.metrics import check_tensorboard
from dflash.training.startup import Background, Phases

Event = Callable[[str, dict[str, Any]], None]
T = TypeVar("T")  # the Trainer class (dflash.training.trainer), which imports this module


def build_trainer(cfg: Config, cls: type[T], *, resume: bool = False, on_event: Event | None = None,
                  lock: bool = True, device: str | None = None, target_device: str | None = None,
                  overlap: bool = True) -> T:
    """`cls.from_config`'s body (see Trainer.from_config for the arguments): `cls` is the Trainer
    class, passed in so this module does not import the loop it builds. `overlap`: on --resume, read
    the checkpoint (manifest checksums, the memory-mapped training state) in a thread while the
    target and the data load, joined before the drafter is built (False: one after the other, as
    the "resume state" phase after "data"; the same state, the same errors)."""
    on_event = on_event or (lambda kind, data: None)
    run_dir = Path(cfg.checkpoint.out_dir) if cfg.checkpoint.out_dir else default_run_dir(cfg)
    start = resume_point(run_dir, resume)
    device = resolve_device(device or cfg.topology.trainer_device)
    detect_backend(device, cfg.train.attention)  # bad backend/device pairs fail before any work
    check_tensorboard(cfg.metrics)
    check_data_path(cfg.data)  # a missing data file is said before the target loads (minutes at 8B)
    owned = OwnedRunDir.take(run_dir, lock)
    threads_before = torch.get_num_threads()
    if device.type == "cpu" and cfg.train.cpu_threads:
        torch.set_num_threads(cfg.train.cpu_threads)  # restored by close()
    phases = Phases(on_event)
    reading = None
    try:
        notes = owned.clean()
        if start is not None and overlap:
            reading = Background(phases, "resume state", lambda: load_resume_state(start))
        on_event("phase", {"name": "target", "source": cfg.target.path})
        with phases.phase("target"):
            home = resolve_device(target_device) if target_device is not None else device
            full_target = load_target(cfg.target, cfg.drafter.num_layers, home)
            target = full_target if target_device is None else full_target.embed_head_on(device)
        notes += list(full_target.notes)
        if target_device is not None:
            notes.append(f"target on {home} (a target worker's device); {device} holds its embedding and LM head")
        with phases.phase("data"):
            dataset, eval_convs, data_notes = load_training_data(cfg, full_target, on_event)
        notes += data_notes
        spec = drafter_spec(cfg, target)
        state = None
        if start is not None:
            if reading is not None:
                resumed, reading = reading.join(), None  # its error, if it failed, is raised here
            else:
                with phases.phase("resume state"):
                    resumed = load_resume_state(start)
            check_resume_state(start, resumed, spec, target.hidden_size, target.num_layers, target.layer_ids)
            notes += [resumed.unverified] if resumed.unverified else []
            state = resumed.state
        with phases.phase("drafter"):  # on resume: no init at all, the checkpoint's weights are loaded into it
            drafter = build_drafter(cfg, spec, device, init=state is None)
            trainer = cls(cfg, target, dataset, drafter, run_dir, eval_convs=eval_convs, notes=notes,
                          on_event=on_event, full_target=full_target)
            trainer._threads_before = threads_before
            if state is not None:
                # checked against the drafter and optimizer before anything changes
                trainer.load_state_dict(state, where=resumed.where)
                trainer.notes.append(f"resumed from {start} at step {trainer.step}")
    except BaseException:  # every failure once the lock is held: release it (the next --resume must work)
        if reading is not None:
            reading.wait_quietly()  # the checkpoint's reads end before the lock is released
        torch.set_num_threads(threads_before)
        owned.release_after_failure()
        raise
    trainer._lock = owned.lock
    trainer.resumed_from = start
    trainer.phases = phases
    return trainer
