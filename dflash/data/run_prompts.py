"""The prompts `dflash eval RUN` and `dflash check` decode from a run's own data, and what to say about them.

`dflash train` holds its eval prompts out of training (dflash.data.holdout); an eval asked for more prompts
than the run held out (`dflash eval RUN -n 64`, the next step `dflash train` prints) decodes the data's last
prompts, the rest of which the drafter trained on: τ on those is optimistic, which the note says.
"""

from __future__ import annotations

import os
from typing import Any

from dflash.data.dataset import EMBEDDED_EVAL_SEED, embedded_prompts, read_jsonl
from dflash.data.holdout import held_out_size, last_prompts


def run_eval_prompts(cfg: Any, n: int) -> tuple[list[list[dict[str, str]]], str | None]:
    """The `n` prompts `dflash eval RUN` and `dflash check` decode from a run's own data (`cfg`: the run's
    config): its last distinct prompts, as training took them, and a note when they are not all what the
    run held out of training: the data has fewer than `n`, or some of them were trained on (τ measured on
    those is optimistic). The embedded data's eval prompts come from their own seed: never trained on."""
    from dflash.config import EMBEDDED_DATA

    if cfg.data.path == EMBEDDED_DATA:
        return embedded_prompts(n, seed=EMBEDDED_EVAL_SEED), None
    if not os.path.lexists(os.path.expanduser(cfg.data.path)):
        from compilewatch import BadInput

        raise BadInput(f"the run's training data {cfg.data.path!r} is gone: its eval prompts are read from it",
                       hint="put the file back, or pass --data FILE (chat JSONL) to decode prompts of your own")
    convs, _ = read_jsonl(cfg.data.path, cfg.data.record_chars(), cfg.data.line_bytes())
    prompts = last_prompts(convs, n)
    size = held_out_size(cfg)
    held = min(size if size and len(convs) > 2 * size else 0, len(prompts))
    parts = []
    if prompts and len(prompts) < n:
        parts.append(f"the run's data has {len(prompts)} distinct prompt(s): decoding {len(prompts)}, not {n}")
    trained = len(prompts) - held
    if prompts and trained:
        setting = "eval.num_prompts" if cfg.eval.at_end else "eval.every_prompts"
        which = (f"the run held out only its last {held} ({setting})" if held
                 else "the run held out none of its data's prompts (too few conversations, or no eval)")
        fix = f"-n {held} decodes only the held-out ones; " if held else ""
        count = f"all {len(prompts)}" if trained == len(prompts) else f"{trained} of these {len(prompts)}"
        parts.append(f"{count} prompt(s) were trained on: {which}, so τ measured on them is optimistic "
                     f"({fix}--data FILE decodes prompts of your own)")
    return prompts, "; ".join(parts) or None


PROMPTS_HINT = ('pass --data a chat JSONL file, one {"messages": [...]} or {"conversations": [...]} object a line, '
                "whose turns before the first assistant turn end with a user turn")


def file_prompts(data: Any, n: int) -> list[list[dict[str, str]]]:
    """The last `n` distinct prompts of the chat JSONL `data.path` (`--data FILE` of `dflash eval` and
    `dflash check`); BadInput saying why there is none: every line unreadable (with the first line's
    reason: an Alpaca file, a JSON array, ...), or no conversation that starts with a user turn."""
    from compilewatch import BadInput
    from dflash.data.dataset import eval_prompts

    if data.path.startswith("embedded:"):
        return eval_prompts(data, n)
    convs, warnings = read_jsonl(data.path, data.record_chars(), data.line_bytes())
    prompts = last_prompts(convs, n)
    if prompts:
        return prompts
    if convs:
        why = f"none of its {len(convs)} conversation(s) has a user turn before its first assistant turn"
    elif warnings:
        why = f"none of its {len(warnings)} line(s) is a chat record: e.g. {warnings[0]}"
    else:
        why = "it holds no records"
    raise BadInput(f"no prompts found in {data.path!r}: {why}", hint=PROMPTS_HINT)
