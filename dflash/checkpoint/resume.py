"""The config of a resumed run: the run's own saved config, plus explicit overrides.

What `--resume` can meet, each with its own answer (exit 2 unless it can go on):
- no directory, or a file there: not a run directory, start one with `dflash train --out DIR`;
- a directory without config.toml: a run killed before it wrote anything (its lock or an empty
  checkpoints/ is there) never started, so there is nothing to resume; anything else is not a run;
- a config.toml that is not a regular file (a link to /dev/zero, a FIFO, a directory): named as what
  it is (compilewatch.open_untrusted), never "not found";
- a run that already finished its schedule (`run_complete`): nothing to do, said at once (exit 0),
  with how to extend it.

A resumed run's config may differ from the one its checkpoint was trained with (`--set` overrides, an
edited config.toml): `changes_since_checkpoint` lists the fields that do, for the summary to state.
The data it trains on is compared with what the checkpoint recorded by dflash.checkpoint.data_check.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from compilewatch import BadInput, open_untrusted
from dflash.config import Config, apply_overrides, load_toml

CONFIG = "config.toml"
_RUN_FILES = (".lock", "checkpoints", "metrics.jsonl", "tensorboard", "latest")  # what a run writes in its dir


def build_config_for_resume(run_dir: str | Path, overrides: dict[str, Any]) -> Config:
    """A resumed run uses its own saved config (plus explicit overrides, e.g. a longer max_steps)."""
    run_dir = Path(run_dir)
    path = run_dir / CONFIG
    if not run_dir.is_dir():
        what = "does not exist" if not run_dir.exists() else "is not a directory"
        raise BadInput(f"--resume: run directory {str(run_dir)!r} {what}",
                       hint=f"start a run there with `dflash train --out {run_dir}` (without --resume)")
    if not os.path.lexists(path):
        saved = _newest_saved_config(run_dir)
        if saved is not None:  # checkpoints were written, so the run started: its config.toml went missing since
            raise BadInput(f"--resume: the run in {str(run_dir)!r} has checkpoints but no {CONFIG}: it was removed "
                           "or not copied with them", hint=f"restore it from the newest checkpoint's copy: "
                                                         f"`cp {saved} {path}`, then --resume again")
        if any(os.path.lexists(run_dir / f) for f in _RUN_FILES):
            raise BadInput(f"--resume: the run in {str(run_dir)!r} never started: it has no {CONFIG} (it was "
                           "stopped before writing anything), so there is nothing to resume",
                           hint=f"start it again with `dflash train --out {run_dir}` and the flags you meant, "
                                "without --resume")
        raise BadInput(f"--resume: {str(run_dir)!r} is not a dflash run directory (no {CONFIG} in it)",
                       hint="pass --out the directory a `dflash train --out DIR` run wrote")
    fd, _ = open_untrusted(path, "run config")  # a link to /dev/zero, a FIFO or a dir: named as such
    os.close(fd)
    try:
        cfg = load_toml(path, overrides)
    except BadInput as e:  # an edit of the run's config.toml that does not read: where to get a good one
        saved = _newest_saved_config(run_dir)
        raise BadInput(e.message, hint=f"fix it in {path}" + (f", or put back the config the newest checkpoint "
                                                            f"trained with: `cp {saved} {path}`" if saved else "")
                       ) from None
    cfg = apply_overrides(cfg, {"checkpoint.out_dir": str(run_dir)})
    if run_complete(cfg, overrides) is None:  # a finished run says so, whatever happened to its data since
        _data_is_there(cfg, run_dir)
    return cfg


def _data_is_there(cfg: Config, run_dir: Path) -> None:
    """BadInput, with what the run trained on and how to go on, when the data file is gone (a bare
    "is missing" said nothing of --data, nor that a copy of the same data resumes exactly)."""
    p = cfg.data.path
    if p.startswith("embedded:") or os.path.lexists(Path(p).expanduser()):
        return
    from dflash.checkpoint.manifest import read_data
    from dflash.checkpoint.store import latest_checkpoint

    try:
        latest = latest_checkpoint(run_dir)
        rec = read_data(latest) if latest is not None else None
    except BadInput:
        rec = None  # the resume proper says what is wrong with the checkpoint
    what = ""
    if rec and latest is not None:
        of = "" if rec["path"] == p else f" of {rec['path']!r}"
        what = f" ({latest.name} recorded {rec['records']} records{of}, xxh3 {rec['digest'].partition(':')[2][:12]})"
    raise BadInput(f"--resume: the training data {p!r} is missing (no such file){what}",
                   hint="put it back at that path, or pass --data FILE: a copy of the same data resumes exactly, "
                        "other data is trained on from the checkpoint's step (the summary says so)")


def _newest_saved_config(run_dir: Path) -> Path | None:
    """The train_config.toml of the run's highest-numbered checkpoint (a regular file), or None."""
    from dflash.checkpoint.store import step_number

    steps = sorted((p for p in (run_dir / "checkpoints").glob("step_*") if step_number(p.name) is not None),
                   key=lambda p: step_number(p.name), reverse=True)
    return next((p / "train_config.toml" for p in steps if (p / "train_config.toml").is_file()), None)


@dataclass(frozen=True, slots=True)
class RunComplete:
    """A run whose latest checkpoint already ends its schedule: `--resume` has nothing left to do."""
    run_dir: str
    step: int  # the latest checkpoint's step
    total_steps: int  # the schedule it trained to (the run's last "start" event in metrics.jsonl)


_TAIL = 1 << 20  # the last start event sits near the end of metrics.jsonl: read at most this much of it


def _last_total_steps(metrics: Path) -> int | None:
    """total_steps of the last "start" event in a run's metrics.jsonl (read from its tail, bounded)."""
    try:
        with open(metrics, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            size = fh.tell()
            fh.seek(max(0, size - _TAIL))
            tail = fh.read(_TAIL)
    except OSError:
        return None
    for line in reversed(tail.split(b"\n")):
        if not line.startswith(b'{"event": "start"'):
            continue
        try:
            total = json.loads(line).get("total_steps")
        except (ValueError, AttributeError):
            return None
        return total if isinstance(total, int) and not isinstance(total, bool) and total > 0 else None
    return None


def run_complete(cfg: Config, overrides: dict[str, Any]) -> RunComplete | None:
    """The run `cfg` resumes (`build_config_for_resume`'s), when it already finished its schedule and
    `overrides` do not extend it (a `train.max_steps` past its step, or a `train.epochs` given, do);
    None when there is training left, or when that cannot be told cheaply (the run then starts as
    usual and finds out). Reads the checkpoint names and the tail of metrics.jsonl only: nothing is
    loaded, so `--resume` on a finished run answers at once."""
    from dflash.checkpoint.store import latest_checkpoint

    run_dir = Path(cfg.checkpoint.out_dir)
    try:
        latest = latest_checkpoint(run_dir)
    except BadInput:
        return None  # a damaged checkpoint: the resume proper says what is wrong
    if latest is None:
        return None
    step = int(latest.name.split("_")[-1])
    if "train.epochs" in overrides:
        return None  # a longer schedule whose length depends on the data
    if "train.max_steps" in overrides and cfg.train.max_steps:
        total = int(cfg.train.max_steps)
    else:
        total = _last_total_steps(run_dir / "metrics.jsonl")
    if total is None or step < total:
        return None
    return RunComplete(str(run_dir), step, total)


def changes_since_checkpoint(cfg: Config) -> list[str]:
    """What `cfg` (a resumed run's: its config.toml plus overrides) sets differently from the config its
    newest checkpoint was trained with (that checkpoint's train_config.toml), as `section.field saved ->
    now`, for the summary to state. Empty when there is no such checkpoint, or when its train_config.toml
    does not read (the resume proper says what is wrong with a damaged checkpoint)."""
    from dataclasses import asdict

    from dflash.checkpoint.store import CONFIG_FILE, latest_checkpoint
    from dflash.config import _flatten

    try:
        latest = latest_checkpoint(Path(cfg.checkpoint.out_dir))
        if latest is None or not (latest / CONFIG_FILE).is_file():
            return []
        saved = load_toml(latest / CONFIG_FILE)
    except BadInput:
        return []
    was, now = _flatten(asdict(saved)), _flatten(asdict(cfg))
    for key in ("target.path", "data.path"):  # a relative path is made absolute when the run starts
        p = now.get(key)
        if isinstance(p, str) and not p.startswith("embedded:") and not Path(p).expanduser().is_absolute():
            now[key] = str(Path(p).expanduser().absolute())
    out = []
    for key in now:
        if key in ("checkpoint.out_dir",) or was.get(key) == now[key]:
            continue
        out.append(f"{key} {_shown(was.get(key))} -> {_shown(now[key])}")
    return out


def _shown(v: Any) -> str:
    from compilewatch import one_line

    return one_line(repr(list(v) if isinstance(v, tuple) else v), 60)
