"""The held-out eval prompts of a dataset, split by content.

An eval prompt is a conversation's turns before its first assistant turn, when the last of them is the
user's: what the periodic and end-of-run evals decode from. The prompts are the last distinct ones of
the data (the same prompt twice is one prompt); when the data has more than twice as many
conversations, every conversation that begins with one of them is held out of training, not just the
record it was taken from. A conversation repeated in the file (a concatenation of shards that overlap,
a retry that appended its records again) used to stay in training while its last copy was held out:
the drafter trained on the very prompts (and, with regenerated answers, the very answers) its τ was
measured on. `split` says how many such copies it held out too; `duplicates` how many repeats the
training conversations still hold (each copy is trained on: counted, not removed).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Sequence


def prompt_of(conv: Sequence[dict[str, str]]) -> list[dict[str, str]] | None:
    """The turns an eval decodes from (before the first assistant turn, ending with the user's), or None."""
    turns = []
    for m in conv:
        if m["role"] == "assistant":
            break
        turns.append(m)
    return turns if turns and turns[-1]["role"] == "user" else None


def content_key(turns: Any) -> str:
    """What two turn lists share exactly when they are the same content."""
    return json.dumps(turns, ensure_ascii=False, sort_keys=True)


def last_prompts(convs: Sequence[Sequence[dict[str, str]]], n: int) -> list[list[dict[str, str]]]:
    """The prompts of the last `n` conversations that have one, each distinct (last record first)."""
    out: list[list[dict[str, str]]] = []
    seen: set[str] = set()
    for conv in reversed(convs):
        if len(out) >= n:
            break
        turns = prompt_of(conv)
        if turns is None or (key := content_key(turns)) in seen:
            continue
        seen.add(key)
        out.append(turns)
    return out


@dataclass(frozen=True)
class Split:
    train: list  # the conversations trained on
    prompts: list  # the eval prompts
    held_out: int  # how many of the prompts no training conversation begins with (0 or len(prompts))
    repeats_held_out: int  # conversations held out beyond one per prompt: repeats of a held-out prompt


def split(convs: list, prompts: list) -> Split:
    """Hold `prompts` out of `convs` by content when there are more than twice as many conversations
    (else they stay training prompts too: dflash.data.dataset.held_out_note says so)."""
    if not prompts or len(convs) <= 2 * len(prompts):
        return Split(convs, prompts, 0, 0)
    keys = {content_key(p) for p in prompts}
    train = [c for c in convs if (p := prompt_of(c)) is None or content_key(p) not in keys]
    return Split(train, prompts, len(prompts), len(convs) - len(train) - len(prompts))


def duplicates(convs: Sequence[Any]) -> tuple[int, int]:
    """(conversations that occur more than once, extra copies of them) among `convs` (counted by a 128-bit
    digest of each: a million conversations hold ~100 MB here, not their text)."""
    import xxhash

    counts: dict[bytes, int] = {}
    for c in convs:
        key = xxhash.xxh3_128_digest(content_key(c).encode("utf-8", "surrogatepass"))
        counts[key] = counts.get(key, 0) + 1
    repeated = [n for n in counts.values() if n > 1]
    return len(repeated), sum(repeated) - len(repeated)


def duplicate_notes(repeats_held_out: int | None, repeated: int | None, extra: int | None) -> list[str]:
    """What the console says about repeated records (None: a cache built before they were counted)."""
    out = []
    if repeats_held_out:
        out.append(f"{repeats_held_out} more conversation(s) begin with a held-out eval prompt (the data repeats "
                   "them): held out of training too, so no eval prompt is trained on")
    if repeated:
        out.append(f"the training data repeats {repeated} conversation(s) ({extra} extra copies): each copy is "
                   "trained on (deduplicate the file to train on each once)")
    return out


def held_out_size(cfg: Any) -> int:
    """How many eval prompts a run of `cfg` (a dflash Config) takes from its data: the end-of-run eval's,
    else the periodic eval's, else none (held out of training only when the data has more than twice as
    many conversations: `split`)."""
    return cfg.eval.num_prompts if cfg.eval.at_end else cfg.eval.every_prompts if cfg.eval.every else 0
