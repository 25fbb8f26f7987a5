"""The config of a resumed run: the run's own saved config, plus explicit overrides."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from compilewatch import BadInput
from dflash.config import Config, apply_overrides, load_toml


def build_config_for_resume(run_dir: str | Path, overrides: dict[str, Any]) -> Config:
    """A resumed run uses its own saved config (plus explicit overrides, e.g. a longer max_steps)."""
    path = Path(run_dir) / "config.toml"
    if not path.is_file():
        raise BadInput(f"--resume: {str(path)!r} not found", hint="point --out at the run directory to continue")
    cfg = load_toml(path, overrides)
    return apply_overrides(cfg, {"checkpoint.out_dir": str(run_dir)})
