"""Checks of the values a user gives a command directly, as flags (not through the config, whose
fields dflash.config checks): a bad one is a BadInput (exit 2) that names the flag, says what it must
be and what leaving it out does, before anything is loaded."""

from __future__ import annotations

import math

from compilewatch import BadInput


def check_count(n: int | None, flag: str, what: str, *, hint: str | None = None) -> None:
    """BadInput unless `n` is None (left out) or an int >= 1; `what` says what it counts."""
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
        raise BadInput(f"{flag} is {n!r}: it must be >= 1 ({what})", hint=hint)


def check_temperature(t: float) -> None:
    """BadInput unless `t` is a finite number in [0, 100] (0: greedy)."""
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or not 0 <= t <= 100:
        raise BadInput(f"--temperature is {t!r}: it must be in [0, 100] (0: greedy)")


def check_num_prompts(n: int | None) -> None:
    from dflash.config import MAX_EVAL_PROMPTS

    check_count(n, "-n/--prompts", "the number of prompts to decode",
                hint="leave -n out for the config's eval.num_prompts")
    if n is not None and n > MAX_EVAL_PROMPTS:
        raise BadInput(f"-n/--prompts is {n}: at most {MAX_EVAL_PROMPTS} prompts are decoded",
                       hint="leave -n out for the config's eval.num_prompts")


def check_max_new_tokens(n: int | None) -> None:
    check_count(n, "--max-new-tokens", "the tokens generated per prompt",
                hint="leave it out for the config's eval.max_new_tokens")
