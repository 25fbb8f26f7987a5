"""One line of `dflash check`: what was checked, what was found, what to do."""

from __future__ import annotations

from dataclasses import dataclass

LEVELS = ("ok", "warn", "fail")  # fail: the export will not serve as trained (exit 1); warn: worth knowing


@dataclass(frozen=True)
class Finding:
    level: str  # ok | warn | fail
    check: str  # what was checked ("taps", "chat template", "serving: RoPE theta", ...)
    found: str  # what was found
    todo: str = ""  # what to do about it ("" when nothing)
