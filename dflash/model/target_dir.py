"""Where a target comes from, checked without torch or transformers (bad input fails in
milliseconds, before a start imports anything heavy): `embedded:tiny`, or a local Hugging Face
model directory holding config.json (nothing is ever downloaded)."""

from __future__ import annotations

from pathlib import Path

from compilewatch import BadInput
from dflash.config import EMBEDDED_TARGET, TargetConfig


def check_dir(path: Path) -> None:
    """BadInput unless `path` is a directory with a config.json."""
    if not path.is_dir():
        raise BadInput(f"target directory {str(path)!r} does not exist",
                       hint="pass a local Hugging Face model directory (target.path); nothing is downloaded")
    if not (path / "config.json").is_file():
        raise BadInput(f"{str(path)!r} has no config.json: not a Hugging Face model directory",
                       hint="point target.path at the folder holding config.json, tokenizer and weights")


def check_target(cfg: TargetConfig) -> None:
    """BadInput now for a target that cannot load: an unknown embedded name, a missing directory, a
    directory without config.json. What only loading tells (weights, tokenizer) is said by the load."""
    if cfg.path == EMBEDDED_TARGET:
        return
    if cfg.path.startswith("embedded:"):
        raise BadInput(f"unknown embedded target {cfg.path!r}", hint=f"the embedded target is {EMBEDDED_TARGET}")
    check_dir(Path(cfg.path).expanduser())
