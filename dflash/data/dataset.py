"""Chat data -> token ids, loss masks, length-bucketed batches and per-epoch anchors.

Input: JSONL, one conversation per line, either `{"messages": [{"role", "content"}, ...]}` or ShareGPT
`{"conversations": [{"from": "human"|"gpt"|"system", "value"}, ...]}`. Each conversation is rendered
through the target tokenizer's chat template once; the loss mask covers what the target generates
for each assistant turn, end-of-turn token included (dflash/data/chat_mask.py). Sequences are truncated
to `max_length`. Every record that is not trained on (an unreadable line, a line or conversation over
the size limit (`data.max_record_chars`: never parsed or tokenized), no assistant turn, one that starts
with the assistant, a conversation the template refuses, no anchor position left) is counted by
reason in `DataStats`, with its first examples; `data.strict` turns any of them into bad input.

`tokenize_record` is the one tokenizing step: the in-memory path (`build_dataset`, `data.cache_dir =
"off"`) and the memory-mapped cache (dflash/data/cache.py, built in worker processes) both call it,
and `ChatDataset` batches either (it needs the sequences' lengths for the plan and reads only the
samples of each batch it makes).

Anchors: every epoch, each sequence gets `num_anchors` positions sampled without replacement from its
loss-masked positions in [0, S-B] (fewer if it has fewer; the rest are padding marked invalid). The
sampling generator is seeded by (seed, epoch, sample index), so epochs, batches and a resumed run all
see the same anchors without saving any RNG state.

Batches: shuffled per epoch (seeded), then packed (`data.pack`, the default: conversations back to
back in rows, only valid blocks; dflash/data/packing.py), or grouped by length within windows, padded
on the right to the next bucket length (few shapes = few recompiles), incomplete last batch dropped.
"""

from __future__ import annotations

import codecs
import json
import os
import random
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, Iterable, Iterator, Sequence

import numpy as np
import torch

from compilewatch import BadInput
from dflash.data.chat_mask import ChatMaskError, tokenize_conversation
from dflash.config import EMBEDDED_DATA, DataConfig

SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "system": "system", "chatgpt": "assistant", "bing": "assistant", "bard": "assistant"}
SORT_WINDOW = 32  # batches per length-sorting window: less padding, still shuffled
EXAMPLES_PER_REASON = 3  # skipped records kept as examples for each reason
UNREADABLE = "unreadable JSONL line"
OVERSIZED_LINE = "JSONL line over the size limit (data.max_record_chars)"
OVERSIZED_RECORD = "conversation over data.max_record_chars characters"
ASSISTANT_FIRST = "conversation starts with an assistant turn"
NO_ANCHOR = "no anchor position (too short, or no assistant token in [0, S-B])"


@dataclass
class Sample:
    input_ids: torch.Tensor  # (S,) long
    loss_mask: torch.Tensor  # (S,) bool: assistant tokens


@dataclass
class DataStats:
    records: int = 0
    kept: int = 0
    truncated: int = 0
    dropped: dict[str, int] = field(default_factory=dict)  # skip reason -> records
    examples: dict[str, list[str]] = field(default_factory=dict)  # skip reason -> its first examples
    tokens: int = 0
    loss_tokens: int = 0
    warnings: list[str] = field(default_factory=list)
    unknown_tokens: int = 0  # trained tokens that are the tokenizer's unknown token: text it does not cover

    def drop(self, reason: str, example: str = "") -> None:
        self.dropped[reason] = self.dropped.get(reason, 0) + 1
        shown = self.examples.setdefault(reason, [])
        if example and len(shown) < EXAMPLES_PER_REASON:
            shown.append(example)

    @property
    def skipped(self) -> int:
        return sum(self.dropped.values())

    def merge(self, other: DataStats) -> None:
        """Add `other`'s counts (a later shard of the same records): equal to counting both in order."""
        self.records += other.records
        self.kept += other.kept
        self.truncated += other.truncated
        self.tokens += other.tokens
        self.loss_tokens += other.loss_tokens
        self.unknown_tokens += other.unknown_tokens
        for reason, n in other.dropped.items():
            self.dropped[reason] = self.dropped.get(reason, 0) + n
            shown = self.examples.setdefault(reason, [])
            shown += other.examples.get(reason, [])[: EXAMPLES_PER_REASON - len(shown)]
        self.warnings += other.warnings

    def summary(self) -> str:
        """'N skipped (reason: n, ...)' for messages; '' when nothing was skipped."""
        if not self.dropped:
            return ""
        return f"{self.skipped} skipped (" + "; ".join(f"{k}: {v}" for k, v in self.dropped.items()) + ")"


@dataclass
class Batch:
    """One micro-batch: right-padded sequences and their anchors for this epoch."""

    input_ids: torch.Tensor  # (B, S) long, S = bucket length
    loss_mask: torch.Tensor  # (B, S) bool
    lengths: torch.Tensor  # (B,) valid lengths
    anchors: torch.Tensor  # (B, N) long, sorted; padding anchors are 0
    anchor_valid: torch.Tensor  # (B, N) bool

    def to(self, device) -> Batch:
        return Batch(**{k: getattr(self, k).to(device, non_blocking=True) for k in self.__dataclass_fields__})

    @property
    def tokens(self) -> int:
        return int(self.lengths.sum())


# ---------------------------------------------------------------- records
def _text(value: Any, field: str, turn: int) -> str:
    """A turn's role or text, which must be a JSON string: str() would train on 'None', '5' or a
    list's Python repr (OpenAI-style content parts) as if the conversation said it."""
    if not isinstance(value, str):
        got = "null" if value is None else {bool: "a boolean", int: "a number", float: "a number", list: "a list",
                                            dict: "an object"}.get(type(value), type(value).__name__)
        raise ValueError(f'turn {turn}: "{field}" must be a string, got {got}')
    try:  # a lone surrogate ("\ud800" in the JSON) is no text: the tokenizer and the cache's manifest refuse it
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f'turn {turn}: "{field}" holds a lone UTF-16 surrogate ({value[e.start]!r} at character '
                         f'{e.start}), which is not valid Unicode') from None
    return value


TOOL_FIELDS = ("tool_calls", "function_call")  # OpenAI assistant turns that call a tool


def _no_tool_call(m: dict, turn: int) -> None:
    """A turn that calls a tool: normalize_record keeps role and content only, so its call would be
    dropped from the rendering and the answer trained without it (not what the target generates)."""
    for key in TOOL_FIELDS:
        if m.get(key):
            raise ValueError(f'turn {turn}: "{key}" is not supported (the call would be dropped and the turn '
                             "trained without it); remove the conversation or render the call into \"content\"")


OPENAI_ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})


def _role(role: str) -> str:
    """A `messages` role as the chat templates and the trained-token mask spell it: "Assistant" or " USER" is
    that role (it was no assistant turn, so a record mixing cases was trained in part, without a word);
    another role stays as written (the template decides what to do with it)."""
    low = role.strip().lower()
    return low if low in OPENAI_ROLES else role


def normalize_record(rec: Any) -> list[dict[str, str]]:
    """A record's turns as [{"role", "content"}]; ValueError says what was wrong."""
    if not isinstance(rec, dict):
        raise ValueError("a line must be a JSON object")
    if "messages" in rec:
        msgs = rec["messages"]
        if not isinstance(msgs, list) or not all(isinstance(m, dict) and "role" in m and "content" in m for m in msgs):
            raise ValueError('"messages" must be a list of {"role", "content"} objects')
        for i, m in enumerate(msgs, 1):
            _no_tool_call(m, i)
        return [{"role": _role(_text(m["role"], "role", i)), "content": _text(m["content"], "content", i)}
                for i, m in enumerate(msgs, 1)]
    if "conversations" in rec:
        conv = rec["conversations"]
        if not isinstance(conv, list) or not all(isinstance(m, dict) and "from" in m and "value" in m for m in conv):
            raise ValueError('"conversations" must be a list of {"from", "value"} objects')
        out = []
        for i, m in enumerate(conv, 1):
            role = SHAREGPT_ROLES.get(_text(m["from"], "from", i).lower())
            if role is None:
                raise ValueError(f"unknown ShareGPT speaker {m['from']!r}")
            out.append({"role": role, "content": _text(m["value"], "value", i)})
        return out
    raise ValueError('expected a "messages" or a "conversations" key')


def capped_lines(fh: BinaryIO, limit: int) -> Iterator[tuple[int, bytes | None]]:
    """(line number, bytes) for each line of a binary file, None for a line longer than `limit` bytes:
    it is read past in chunks of at most `limit` bytes, never held whole (one 100 GB line costs
    `limit` bytes of memory)."""
    n = 0
    while True:
        raw = fh.readline(limit + 1)
        if not raw:
            return
        n += 1
        if len(raw) > limit and not raw.endswith(b"\n"):
            while raw and not raw.endswith(b"\n"):  # the rest of this line, dropped as it is read
                raw = fh.readline(limit + 1)
            yield n, None
        else:
            yield n, raw


def record_chars(conv: list[dict[str, str]]) -> int:
    return sum(len(m["content"]) + len(m["role"]) for m in conv)


def _skip_warning(name: str, n: int, reason: str, detail: str) -> str:
    return f"{name}:{n}: skipped ({reason}: {detail})"


def warning_reason(warning: str) -> str:
    """The skip reason of a read_jsonl warning (an oversized line or record, else UNREADABLE)."""
    for reason in (OVERSIZED_LINE, OVERSIZED_RECORD):
        if f": skipped ({reason}: " in warning:
            return reason
    return UNREADABLE


SHARDS_HINT = "a directory of shards is not read: give one JSONL file (cat DIR/*.jsonl > all.jsonl)"
COMPRESSED = ((b"\x1f\x8b", "gzip", "gunzip -k"), (b"\x28\xb5\x2f\xfd", "zstd", "zstd -d"),
              (b"BZh", "bzip2", "bunzip2 -k"), (b"\xfd7zXZ\x00", "xz", "unxz -k"), (b"PK\x03\x04", "zip", "unzip"))


def _not_compressed(p: Path, head: bytes) -> None:
    """BadInput for a compressed file (its magic bytes): read as text, every line of it would be an
    unreadable line, and the message would say nothing of why."""
    for magic, kind, command in COMPRESSED:
        if head.startswith(magic):
            raise BadInput(f"dataset {str(p)!r} is {kind}-compressed, not JSON Lines",
                           hint=f"decompress it first ({command} {shlex.quote(str(p))}) and pass the .jsonl file")


def read_jsonl(path: str | Path, max_chars: int | None = None,
               max_line_bytes: int | None = None) -> tuple[list[list[dict[str, str]]], list[str]]:
    """All conversations in a JSONL file, plus warnings for the lines that were skipped: unreadable
    ones, lines over `max_line_bytes` (never parsed) and conversations over `max_chars` characters
    (never tokenized). Limits: DataConfig.record_chars() / line_bytes() (None: that default's for
    the default max_length)."""
    from dflash.config import DataConfig

    defaults = DataConfig()
    max_chars = defaults.record_chars() if max_chars is None else max_chars
    max_line_bytes = defaults.line_bytes() if max_line_bytes is None else max_line_bytes
    p = Path(path).expanduser()
    if not p.is_file():  # stat only: a FIFO or a directory is refused here, never opened
        raise BadInput(f"dataset {str(p)!r} does not exist" if not p.exists() else f"dataset {str(p)!r} is not a file",
                       hint=SHARDS_HINT if p.is_dir() else
                       'give a JSONL file with one {"messages": [...]} or {"conversations": [...]} per line')
    convs, warnings = [], []
    with open(p, "rb") as fh:  # bytes: a line that is not UTF-8 is skipped like any other bad line
        _not_compressed(p, fh.read(8))
        fh.seek(0)
        for n, raw in capped_lines(fh, max_line_bytes):
            if raw is None:
                warnings.append(_skip_warning(p.name, n, OVERSIZED_LINE, f"more than {max_line_bytes} bytes"))
                continue
            if n == 1 and raw.startswith(codecs.BOM_UTF8):  # a UTF-8 BOM (Windows editors): not part of the JSON
                raw = raw[len(codecs.BOM_UTF8):]
            if not raw.strip():
                continue
            try:
                conv = normalize_record(json.loads(raw.decode("utf-8")))
            except (ValueError, TypeError, KeyError, AttributeError, RecursionError) as e:  # JSON, UTF-8, shape
                warnings.append(f"{p.name}:{n}: skipped ({type(e).__name__}: {str(e)[:160]})")
                continue
            if record_chars(conv) > max_chars:
                warnings.append(_skip_warning(p.name, n, OVERSIZED_RECORD,
                                              f"{record_chars(conv)} characters, the limit is {max_chars}"))
                continue
            convs.append(conv)
    return convs, warnings


def embedded_prompts(n: int, seed: int) -> list[list[dict[str, str]]]:
    """Single-turn prompts of random words from the tiny vocabulary (answers come from the target)."""
    from dflash.model.target import tiny_words

    words = tiny_words()
    rng = random.Random(seed)
    return [[{"role": "user", "content": " ".join(rng.choice(words) for _ in range(rng.randint(6, 20)))}]
            for _ in range(n)]


EMBEDDED_TRAIN = 384  # conversations in the embedded training set
EMBEDDED_EVAL_SEED = 99991  # held-out embedded prompts come from another seed


def hold_out_eval(cfg: DataConfig, convs: list, n_eval: int):
    """The training conversations and the eval prompts (a dflash.data.holdout.Split): the prompts are the
    last distinct ones of the data, and every conversation that begins with one of them is held out of
    training, by content, when the dataset has more than twice as many (else they are training prompts
    too: `held_out_note` says so). The embedded dataset's eval prompts come from another seed: never
    trained on."""
    from dflash.data.holdout import Split, last_prompts, split

    if cfg.path == EMBEDDED_DATA:
        prompts = embedded_prompts(n_eval, seed=EMBEDDED_EVAL_SEED) if n_eval else []
        return Split(convs, prompts, len(prompts), 0)
    return split(convs, last_prompts(convs, n_eval) if n_eval else [])


def held_out_note(n_eval_prompts: int, held_out: int | None, conversations: int) -> str | None:
    """A note when the eval prompts are also training prompts (τ measured on them is optimistic)."""
    if not n_eval_prompts or held_out is None or held_out >= n_eval_prompts:
        return None
    return (f"the {n_eval_prompts} eval prompts are training prompts too: the data has {conversations} "
            f"conversation(s), and prompts are held out of training only when it has more than "
            f"{2 * n_eval_prompts}; τ measured on them is optimistic (pass --data with more records, or eval "
            "prompts of your own to `dflash eval --data`)")


def check_data_path(cfg: DataConfig) -> None:
    """BadInput now when `cfg.path` is not a readable regular file (or an embedded dataset): checked
    before anything expensive (loading an 8B target takes minutes)."""
    if cfg.path.startswith("embedded:"):
        if cfg.path != EMBEDDED_DATA:
            raise BadInput(f"unknown embedded dataset {cfg.path!r}", hint=f"the embedded dataset is {EMBEDDED_DATA}")
        return
    from compilewatch import open_untrusted

    if Path(cfg.path).expanduser().is_dir():
        raise BadInput(f"training data {cfg.path!r} is a directory, not a file", hint=SHARDS_HINT)
    try:
        fd, _ = open_untrusted(Path(cfg.path).expanduser(), "training data")
    except BadInput as e:  # missing, unreadable: say what to pass (the qwen3_8b recipe names data/train.jsonl)
        raise BadInput(e.message, hint=e.hint or "pass --data FILE: chat JSONL, one {\"messages\": [...]} or "
                       "{\"conversations\": [...]} object a line (a relative path is read from the directory "
                       "you run in)") from None
    try:
        head = os.read(fd, 8)
    finally:
        os.close(fd)
    _not_compressed(Path(cfg.path).expanduser(), head)


def load_conversations(cfg: DataConfig) -> tuple[list[list[dict[str, str]]], list[str]]:
    if cfg.path == EMBEDDED_DATA:
        return embedded_prompts(EMBEDDED_TRAIN, seed=7), []
    if cfg.path.startswith("embedded:"):
        raise BadInput(f"unknown embedded dataset {cfg.path!r}", hint=f"the embedded dataset is {EMBEDDED_DATA}")
    return read_jsonl(cfg.path, cfg.record_chars(), cfg.line_bytes())


def eval_prompts(cfg: DataConfig, n: int) -> list[list[dict[str, str]]]:
    """Prompts for `dflash eval`: held-out embedded prompts, or the last n distinct prompts of the data
    (dflash.data.holdout: the ones training held out)."""
    from dflash.data.holdout import last_prompts

    if cfg.path == EMBEDDED_DATA:
        return embedded_prompts(n, seed=EMBEDDED_EVAL_SEED)
    convs, _ = read_jsonl(cfg.path, cfg.record_chars(), cfg.line_bytes())
    return last_prompts(convs, n)


# ---------------------------------------------------------------- tokenization
def render_ids(tokenizer, messages: list[dict[str, str]], add_generation_prompt: bool) -> list[int]:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def tokenize_record(tokenizer, conv: list[dict[str, str]], n: int, max_length: int, block_size: int,
                    stats: DataStats, max_chars: int | None = None) -> tuple[list[int], list[int]] | None:
    """Record number `n` (1-based) -> (ids, loss mask), truncated to `max_length`; None when it is
    skipped (counted in `stats` by reason). The one tokenizing step of the in-memory path and of the
    cache builder (dflash.data.cache), so both give the same tokens and masks. Never tokenized: a
    record over `max_chars` characters (default 64 x max_length: read_jsonl skips them already;
    this guards every other source), and one whose first turn after the system prompt is the
    assistant's (an answer to nothing: most often a file whose roles are shifted or swapped, where
    every "assistant" turn is really the user's; Llama, Gemma and Mistral templates refuse these
    anyway, so skipping them makes no template train what the others drop)."""
    stats.records += 1
    limit = 64 * max_length if max_chars is None else max_chars
    if record_chars(conv) > limit:
        stats.drop(OVERSIZED_RECORD, f"record {n} ({record_chars(conv)} characters, the limit is {limit})")
        return None
    if not any(m["role"] == "assistant" for m in conv):
        roles = list(dict.fromkeys(m["role"] for m in conv))  # answers under a role of their own ("model") named
        stats.drop("no assistant turn", _example(n, conv, "" if set(roles) <= {"user", "system"}
                                                 else "roles " + ", ".join(roles)))
        return None
    if next(m["role"] for m in conv if m["role"] != "system") == "assistant":
        stats.drop(ASSISTANT_FIRST, _example(n, conv))
        return None
    try:
        ids, mask = tokenize_conversation(tokenizer, conv)
    except ChatMaskError as e:
        stats.drop(e.reason, _example(n, conv, str(e)))
        return None
    if len(ids) > max_length:
        ids, mask = ids[:max_length], mask[:max_length]
        stats.truncated += 1
    if len(ids) < block_size or not any(mask[: len(ids) - block_size + 1]):
        stats.drop(NO_ANCHOR, _example(n, conv, f"{len(ids)} tokens"))
        return None
    stats.kept += 1
    stats.tokens += len(ids)
    stats.loss_tokens += sum(mask)
    unk = getattr(tokenizer, "unk_token_id", None)
    if unk is not None and unk in ids:  # a C scan first: most tokenizers never produce it
        stats.unknown_tokens += sum(1 for t, m in zip(ids, mask) if m and t == unk)
    return ids, mask


def tokenize_all(tokenizer, convs: Iterable[list[dict[str, str]]], cfg: DataConfig, block_size: int,
                 stats: DataStats) -> list[Sample]:
    samples = []
    for n, conv in enumerate(convs, 1):
        out = tokenize_record(tokenizer, conv, n, cfg.max_length, block_size, stats, cfg.record_chars())
        if out is not None:
            samples.append(Sample(torch.tensor(out[0], dtype=torch.long), torch.tensor(out[1], dtype=torch.bool)))
    return samples


def _example(n: int, conv: list[dict[str, str]], detail: str = "") -> str:
    first = next((m["content"] for m in conv if m["role"] == "user"), conv[0]["content"] if conv else "")
    snippet = " ".join(first.split())[:60]
    return f"record {n} ({snippet!r}{', ' + detail[:120] if detail else ''})"


# ---------------------------------------------------------------- anchors and batches
def _mix(*xs: int) -> int:
    h = 1469598103934665603
    for x in xs:
        h = ((h ^ (x & 0xFFFFFFFFFFFFFFFF)) * 1099511628211) & 0x7FFFFFFFFFFFFFFF
    return h


def sample_anchors(loss_mask: torch.Tensor, num_anchors: int, block_size: int,
                   generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(N,) sorted anchors drawn without replacement from loss-masked positions in [0, S-B], and (N,) valid."""
    s = loss_mask.shape[0]
    # max(0, ...): a sequence shorter than a block has no candidate (a negative stop would slice from the end)
    cand = torch.nonzero(loss_mask[: max(0, s - block_size + 1)], as_tuple=False).flatten()
    if cand.numel() > num_anchors:
        cand = cand[torch.randperm(cand.numel(), generator=generator)[:num_anchors]]
    cand, _ = torch.sort(cand)
    anchors = torch.zeros(num_anchors, dtype=torch.long)
    valid = torch.zeros(num_anchors, dtype=torch.bool)
    anchors[: cand.numel()] = cand
    valid[: cand.numel()] = True
    return anchors, valid


def bucket_length(n: int, buckets: tuple[int, ...]) -> int:
    for b in buckets:
        if n <= b:
            return b
    return buckets[-1]


class ChatDataset:
    """Tokenized samples plus the per-epoch batch plan. `samples` is a list of Samples (in memory) or
    any sequence of them, e.g. dflash.data.cache.MappedSamples over a memory-mapped cache: the plan
    needs only `lengths`, and a batch reads only its own samples."""

    def __init__(self, samples: Sequence[Sample], cfg: DataConfig, block_size: int, seed: int, stats: DataStats,
                 lengths: Sequence[int] | None = None) -> None:
        self.samples, self.cfg, self.block_size, self.seed, self.stats = samples, cfg, block_size, seed, stats
        self.buckets = cfg.bucket_lengths()
        if lengths is None:
            lengths = getattr(samples, "lengths", None)
        if lengths is None:
            lengths = [s.input_ids.numel() for s in samples]
        self.lengths = np.asarray(lengths, dtype=np.int64)
        self.packed = cfg.pack
        self._blocks: np.ndarray | None = None  # packed: each sample's blocks (its valid anchors)
        self._packs_per_epoch: int | None = None
        self._plan: tuple[int, list] | None = None  # (epoch, its plan): step_batches' last epoch
        self.block_budget = cfg.batch_size * cfg.num_anchors  # padded: the block slots of a micro-batch
        self.identity: dict[str, Any] | None = None  # what checkpoints record of the data (dflash.data.prepare)
        if self.packed:
            self.block_budget = self.packed_block_budget()

    def steps_per_epoch(self, grad_accum: int) -> int:
        """Optimizer steps an epoch holds at `grad_accum` micro-batches a step."""
        return max(1, self.batches_per_epoch() // grad_accum)

    def step_batches(self, step: int, grad_accum: int) -> list:
        """The micro-batches of optimizer step `step` (0-based): deterministic in (seed, step)."""
        epoch, within = divmod(step, self.steps_per_epoch(grad_accum))
        if self._plan is None or self._plan[0] != epoch:
            self._plan = (epoch, self.epoch_plan(epoch))
        return [self.make_batch(ix, epoch) for ix in self._plan[1][within * grad_accum: (within + 1) * grad_accum]]

    def warm_batches(self) -> list:
        """One micro-batch per shape training uses (packed: `warm_packed_batches`; padded: one per bucket
        length), from the first sample: for compile warm-up (the Trainer's, each engine replica's, and
        the drafter's while the target loads, dflash.training.warmup)."""
        cfg = self.cfg
        if self.packed:
            from dflash.data.packing import warm_packed_batches

            return warm_packed_batches(self.samples[0], cfg.batch_size, cfg.max_length, self.block_budget)
        out = []
        s = self.samples[0]
        bs, na = cfg.batch_size, cfg.num_anchors
        for seq in self.buckets:
            n = min(seq, s.input_ids.numel())
            ids = torch.zeros(1, seq, dtype=torch.long)
            ids[0, :n] = s.input_ids[:n]
            lm = torch.zeros(1, seq, dtype=torch.bool)
            lm[0, :n] = s.loss_mask[:n]
            out.append(Batch(input_ids=ids.repeat(bs, 1), loss_mask=lm.repeat(bs, 1), lengths=torch.full((bs,), n),
                             anchors=torch.zeros(bs, na, dtype=torch.long),
                             anchor_valid=torch.ones(bs, na, dtype=torch.bool)))
        return out

    def packed_block_budget(self) -> int:
        """The blocks of a packed micro-batch: `data.pack_blocks`, else the data's blocks per token times
        the micro-batch's tokens, in multiples of 8 x data.pack_chunks ("auto": 8 x 4) (a flex tile of 128 queries at
        block size 16, per chunk), between batch_size x num_anchors and 4 x that."""
        cfg = self.cfg
        if cfg.pack_blocks is not None:
            return cfg.pack_blocks
        quantum = 8 * cfg.chunk_quantum()
        base = -(-cfg.batch_size * cfg.num_anchors // quantum) * quantum
        if not len(self.samples):
            return base
        density = float(self.sample_blocks().sum()) / max(1.0, float(self.lengths.sum()))
        want = -(-int(density * cfg.batch_size * cfg.max_length) // quantum) * quantum
        return int(min(4 * base, max(base, want)))

    def __len__(self) -> int:
        return len(self.samples)

    def batches_per_epoch(self) -> int:
        """Micro-batches per epoch: the same in every epoch (the schedule and resume count on it).
        Packed: as many as epoch 0's plan has (dflash.data.packing)."""
        if self.packed:
            if self._packs_per_epoch is None:
                self._packs_per_epoch = len(self._pack_epoch(0))
            return self._packs_per_epoch
        n, bs = len(self.samples), self.cfg.batch_size
        return max(1, n // bs) if n >= bs else 1

    def sample_blocks(self) -> np.ndarray:
        """(n,) the blocks each sample gets: min(num_anchors, its anchor candidates)."""
        if self._blocks is None:
            from dflash.data.packing import candidate_counts

            self._blocks = np.minimum(candidate_counts(self.samples, self.block_size), self.cfg.num_anchors)
        return self._blocks

    def _pack_epoch(self, epoch: int) -> list:
        from dflash.data.packing import pack

        g = torch.Generator().manual_seed(_mix(self.seed, epoch, 17))
        order = torch.randperm(len(self.samples), generator=g).tolist()
        return pack(order, self.lengths, self.sample_blocks(), self.cfg.batch_size, self.cfg.max_length,
                    self.block_budget)

    def epoch_plan(self, epoch: int) -> list:
        """Sample indices of every batch of `epoch`, deterministic in (seed, epoch); packed: its Packs,
        `batches_per_epoch()` of them (an epoch that packs into fewer starts over from its first pack,
        one that packs into more drops its last: packing differs a little from epoch to epoch)."""
        if self.packed:
            packs, k = self._pack_epoch(epoch), self.batches_per_epoch()
            return [packs[i % len(packs)] for i in range(k)]
        g = torch.Generator().manual_seed(_mix(self.seed, epoch, 17))
        order = torch.randperm(len(self.samples), generator=g).tolist()
        bs = self.cfg.batch_size
        window = bs * SORT_WINDOW
        batches = []
        order_a = np.asarray(order, dtype=np.int64)
        for w in range(0, len(order), window):
            chunk = order_a[w: w + window]
            chunk = chunk[np.argsort(-self.lengths[chunk], kind="stable")].tolist()  # longest first, stable
            batches += [chunk[i: i + bs] for i in range(0, len(chunk), bs)]
        if len(self.samples) >= bs:
            batches = [b for b in batches if len(b) == bs]
        perm = torch.randperm(len(batches), generator=g).tolist()
        return [batches[i] for i in perm][: self.batches_per_epoch()]

    def anchors_of(self, index: int, sample: Sample, epoch: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Sample `index`'s anchors in `epoch` (seeded by both): the same padded or packed."""
        g = torch.Generator().manual_seed(_mix(self.seed, epoch, index, 31))
        return sample_anchors(sample.loss_mask, self.cfg.num_anchors, self.block_size, g)

    def make_batch(self, indices, epoch: int):
        """The micro-batch of a plan entry: a Batch (padded rows), or a PackedBatch for a Pack."""
        if self.packed:
            from dflash.data.packing import make_packed_batch

            return make_packed_batch(self.samples, indices, lambda i, s: self.anchors_of(i, s, epoch),
                                     self.cfg.batch_size, self.cfg.max_length, self.block_budget)
        items = [self.samples[i] for i in indices]
        longest = max(s.input_ids.numel() for s in items)
        seq = bucket_length(longest, self.buckets)
        n = len(items)
        ids = torch.zeros(n, seq, dtype=torch.long)
        lmask = torch.zeros(n, seq, dtype=torch.bool)
        lengths = torch.zeros(n, dtype=torch.long)
        anchors = torch.zeros(n, self.cfg.num_anchors, dtype=torch.long)
        valid = torch.zeros(n, self.cfg.num_anchors, dtype=torch.bool)
        for r, (i, s) in enumerate(zip(indices, items)):
            L = s.input_ids.numel()
            ids[r, :L], lmask[r, :L], lengths[r] = s.input_ids, s.loss_mask, L
            anchors[r], valid[r] = self.anchors_of(i, s, epoch)
        return Batch(input_ids=ids, loss_mask=lmask, lengths=lengths, anchors=anchors, anchor_valid=valid)


def build_dataset(convs: list[list[dict[str, str]]], tokenizer, cfg: DataConfig, block_size: int, seed: int,
                  warnings: list[str] | None = None) -> ChatDataset:
    """Tokenize conversations; BadInput when nothing usable is left, or when `cfg.strict` and any record
    was skipped (no checkpoint is written then). `warnings`: the lines read_jsonl skipped."""
    stats = stats_with_warnings(warnings)
    samples = tokenize_all(tokenizer, convs, cfg, block_size, stats)
    check_usable(stats, cfg)
    return ChatDataset(samples, cfg, block_size, seed, stats)


def stats_with_warnings(warnings: list[str] | None) -> DataStats:
    """Fresh stats that already count the lines read_jsonl skipped."""
    stats = DataStats(warnings=list(warnings or []))
    for w in stats.warnings:
        stats.drop(warning_reason(w), w)
    return stats


def _json_array(path: str) -> bool:
    """Whether the file's first non-blank byte (after a BOM) is '[': a JSON array, read 4 KiB at most."""
    try:
        with open(Path(path).expanduser(), "rb") as fh:
            head = fh.read(4096)
    except OSError:
        return False
    return head.removeprefix(codecs.BOM_UTF8).lstrip().startswith(b"[")


def check_usable(stats: DataStats, cfg: DataConfig) -> None:
    """BadInput when nothing usable is left, or when `cfg.strict` and any record was skipped (the same
    check for freshly tokenized and cached data)."""
    if cfg.strict and stats.dropped:
        shown = "; ".join(f"{k}: {v} (e.g. {stats.examples[k][0]})" if stats.examples.get(k) else f"{k}: {v}"
                          for k, v in stats.dropped.items())
        raise BadInput(f"data.strict: {stats.skipped} of {stats.records + len(stats.warnings)} records would be "
                       f"skipped: {shown}", hint="fix or remove those records, or train without --strict")
    if not stats.kept and cfg.path == EMBEDDED_DATA and not cfg.regenerate:
        raise BadInput(f"{EMBEDDED_DATA} holds prompts only", hint="set data.regenerate=true so the target answers them")
    if not stats.kept:
        why = stats.summary() or "no records"
        first = next((shown[0] for shown in stats.examples.values() if shown), None)
        if first:  # what was wrong with a record, not only its reason's name
            why += f"; e.g. {first}"
        hint = "each line needs an assistant turn of at least drafter.block_size tokens"
        if set(stats.dropped) == {"no assistant turn"}:  # answers under another role ("model", "bot", ...)
            hint = ('each line needs an answer: a turn with "role": "assistant" ("messages") or "from": "gpt" '
                    '("conversations"); rename the role your answers have')
        if set(stats.dropped) <= {UNREADABLE}:  # nothing parsed as a chat: the format is what to fix
            hint = ('each line must be one JSON object: {"messages": [{"role": "user", "content": "..."}, '
                    '{"role": "assistant", "content": "..."}]} or {"conversations": [{"from": "human", '
                    '"value": "..."}, {"from": "gpt", "value": "..."}]}')
            if stats.dropped and _json_array(cfg.path):  # ShareGPT dumps are often one JSON array (.json)
                hint = ("the file is one JSON array, not JSON Lines: write one conversation per line, e.g. "
                        "python -c 'import json,sys; [print(json.dumps(r)) for r in json.load(open(sys.argv[1]))]' "
                        "IN.json > OUT.jsonl; " + hint)
        if stats.dropped.get(NO_ANCHOR):  # the turns may be long enough and cut off by the length cap
            hint += (f", within the first data.max_length ({cfg.max_length}) tokens of the conversation: raise "
                     "data.max_length if the prompts fill them")
        raise BadInput(f"the dataset {cfg.path!r} has no usable conversation ({stats.records} read; {why})", hint=hint)
