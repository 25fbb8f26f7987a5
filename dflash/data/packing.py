"""Packed micro-batches: several conversations back to back in each row, and only their valid blocks.

Why: right-padded batches give every sequence `num_anchors` block slots whether it has that many
anchors or not, and pad every sequence to its bucket length; on chats of mixed lengths most of the
drafter's work and part of the target's is padding. A packed micro-batch has the same budget as a
padded one (`batch_size` rows of `max_length` tokens, `batch_size × num_anchors` blocks) and fills it:

- **Rows.** Conversations are placed into rows of `max_length` tokens (best fit); each keeps its own
  positions (0, 1, ... from its first token), and the target attends within a conversation only
  (document masks: `position_ids` restart at each conversation, which transformers' masking turns into
  a block-diagonal causal mask). Rows that hold nothing are not computed.
- **Blocks.** Each conversation gets exactly the anchors it gets unpacked (same generator seed: sample
  index and epoch), so each block, its labels and its loss are those of the unpacked step; the blocks of
  all rows are laid out in one list of `batch_size × num_anchors` slots, the valid ones first; the
  drafter's mask lets a block see its own conversation's context before its anchor, and its own block.
- **Plan.** Per epoch, the seeded shuffle as before, then a greedy two-budget packer over a look-ahead
  pool: the largest conversation that still fits both the token rows and the block budget goes in, until
  nothing fits. One drafter shape per run (the block budget; the context is always `batch_size` rows)
  and one target shape per number of rows used.

`steps` stay a function of the seed: the plan depends on (seed, epoch) and the lengths and anchor counts
of the data only, so a resumed run repeats an uninterrupted one step for step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch

POOL = 64  # look-ahead conversations the packer chooses from
BALANCE = 2.0  # weight of the budgets' balance in the packer's choice (benchmarks/dflash_mixed.py: 2 fills
# 4 rows x 3,072 tokens to ~96% in both budgets on mixed-length chats; 0, largest first, ~93%)


@dataclass(frozen=True, slots=True)
class Pack:
    """One packed micro-batch's plan: the sample indices of each row, in order."""

    rows: tuple[tuple[int, ...], ...]

    @property
    def samples(self) -> list[int]:
        return [i for row in self.rows for i in row]


@dataclass
class PackedBatch:
    """One packed micro-batch (see the module doc). R rows used of length L; N block slots."""

    input_ids: torch.Tensor  # (R, L) long: conversations back to back, zeros after the last one
    position_ids: torch.Tensor  # (R, L) long: positions within each conversation (padding: its own run)
    loss_mask: torch.Tensor  # (R, L) bool
    lengths: torch.Tensor  # (D,) each conversation's length (its real tokens)
    anchor_row: torch.Tensor  # (N,) long: the row of each block's conversation
    anchor_col: torch.Tensor  # (N,) long: the block's anchor, as a column of that row
    doc_start: torch.Tensor  # (N,) long: where the block's conversation starts in the row
    doc_end: torch.Tensor  # (N,) long: where it ends (exclusive)
    anchor_valid: torch.Tensor  # (N,) bool: a real block (the padding slots come last)
    rows_total: int = 0  # the rows the drafter's context holds (batch_size): taps are zero-padded to it
    runs: torch.Tensor | None = None  # (D'+1,) int32 where each run of positions starts (`run_bounds`); None in a chunk
    longest_run: int = 0  # the longest of those runs
    # the CPU batch this one was moved from (`to`): `chunk` reads its block rows there, so choosing a chunk's
    # window of rows never waits for the GPU. Not an init field: copies (dataclasses.replace) drop it.
    host: PackedBatch | None = field(default=None, init=False, repr=False, compare=False)

    packed = True  # what the training step dispatches on (a padded Batch has no such attribute)

    def to(self, device) -> PackedBatch:
        moved = {k: getattr(self, k).to(device, non_blocking=True) for k in self.__dataclass_fields__
                 if isinstance(getattr(self, k), torch.Tensor)}
        out = PackedBatch(**moved, rows_total=self.rows_total, longest_run=self.longest_run)
        out.host = self.host if self.host is not None else (self if self.input_ids.device.type == "cpu" else None)
        return out

    @property
    def run_bounds(self) -> tuple[torch.Tensor, int] | None:
        """(runs, longest_run): the target's attention runs (varlen) without reading the positions again."""
        return None if self.runs is None else (self.runs, self.longest_run)

    @property
    def tokens(self) -> int:
        return int(self.lengths.sum())

    @property
    def token_slots(self) -> int:
        """Tokens the target computes (rows used × row length)."""
        return int(self.input_ids.numel())

    @property
    def block_slots(self) -> int:
        return int(self.anchor_valid.numel())

    def chunk(self, index: int, chunks: int) -> tuple[PackedBatch, slice]:
        """The drafter's chunk `index` of `chunks`: block slots [index·N/chunks, (index+1)·N/chunks)
        (N divides evenly: the budget is made so) with the rows its blocks read, and which rows of the
        micro-batch (of its taps) those are. Blocks are in row order, so a chunk's blocks mostly sit in
        one or two rows: it reads a window of `chunk_rows(chunks)` rows from its first block's row when
        they hold all of its blocks (a smaller context: less of the fused context to compute, shorter
        keys), else every row. Two drafter shapes a run."""
        n = self.block_slots // chunks
        sl = slice(index * n, (index + 1) * n)
        window = self.chunk_rows(chunks)
        src = self.host if self.host is not None else self  # the window is chosen on the CPU copy when there is one
        real = src.anchor_row[sl][src.anchor_valid[sl]]
        r0 = int(real.min()) if real.numel() else 0
        r1 = int(real.max()) if real.numel() else 0
        if r1 - r0 + 1 > window:  # spread over more rows than the window: the whole context
            r0, window = 0, max(self.rows_total, self.input_ids.shape[0])
        rows = slice(r0, min(r0 + window, self.input_ids.shape[0]))
        part = self._part(index, sl, rows, r0, window)
        if self.host is not None:  # the chunk's CPU copy too: its drafter mask is built there (no GPU sync)
            part.host = self.host._part(index, sl, rows, r0, window)
        return part, rows

    def _part(self, index: int, sl: slice, rows: slice, r0: int, window: int) -> PackedBatch:
        """`chunk`'s batch: block slots `sl`, rows `rows` (the window from row `r0`, `window` rows of context)."""
        row, valid = self.anchor_row[sl], self.anchor_valid[sl]
        shifted = torch.where(valid, row - r0, torch.zeros_like(row))  # padding slots: row 0, they see nothing
        return PackedBatch(input_ids=self.input_ids[rows], position_ids=self.position_ids[rows],
                           loss_mask=self.loss_mask[rows], lengths=self.lengths if index == 0 else self.lengths[:0],
                           anchor_row=shifted, anchor_col=self.anchor_col[sl], doc_start=self.doc_start[sl],
                           doc_end=self.doc_end[sl], anchor_valid=valid, rows_total=window)

    def chunk_rows(self, chunks: int) -> int:
        """Rows a chunk's window holds: its share of the rows plus one (a chunk's blocks start mid-row)."""
        total = max(self.rows_total, self.input_ids.shape[0])
        return min(total, -(-total // chunks) + 1)


def run_bounds(position_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(R, L) positions restarting at 0 for each conversation (a row's padding tail is a run of its own)
    -> (cumulative bounds int32 (D'+1,), the longest run): the flattened rows' runs, which varlen attention
    reads (dflash.model.packed_attention). No run crosses a row boundary: every row starts one."""
    flat = position_ids.reshape(-1)
    starts = torch.nonzero(flat == 0).flatten()
    cu = torch.cat([starts, starts.new_tensor([flat.numel()])]).to(torch.int32)
    return cu, int(cu.diff().max())


def candidate_counts(samples: Sequence, block_size: int) -> np.ndarray:
    """(n,) the anchor candidates of every sample: loss-masked positions in [0, S-B] (what
    `sample_anchors` draws from). A sequence with a `candidate_counts` method (the memory-mapped cache)
    answers it from its arrays without building tensors."""
    fast = getattr(samples, "candidate_counts", None)
    if fast is not None:
        return np.asarray(fast(block_size), dtype=np.int64)
    out = np.zeros(len(samples), dtype=np.int64)
    for i, s in enumerate(samples):
        n = s.loss_mask.numel()
        out[i] = int(s.loss_mask[: max(0, n - block_size + 1)].sum())
    return out


def pack(order: Sequence[int], lengths: np.ndarray, blocks: np.ndarray, rows: int, row_len: int,
         block_budget: int, pool: int = POOL) -> list[Pack]:
    """Pack samples (in `order`) into micro-batches of at most `rows` rows of `row_len` tokens and at
    most `block_budget` blocks. Greedy and deterministic: a micro-batch opens the rows the data's
    density says its blocks' tokens need; from a pool of the next `pool` samples, the one largest in
    both budgets (tokens / capacity + blocks / budget) that fits goes into the row it fits best, until
    none fits; then the next micro-batch opens. Every sample is placed exactly once (each fits an empty
    micro-batch: length <= row_len, blocks <= block_budget)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    blocks = np.asarray(blocks, dtype=np.int64)
    order = list(order)
    if order and (lengths[order].max() > row_len or blocks[order].max() > block_budget):
        raise ValueError("pack: a sample does not fit an empty micro-batch")
    packs: list[Pack] = []
    pending: list[int] = []
    nxt = 0
    size_scale = np.array([1.0 / (rows * row_len), 1.0 / block_budget])
    # Balance the two budgets' rests only where the data can fill both (a budget near the data's blocks
    # per token times the tokens); where one binds well before the other, fill that one.
    density = float(blocks[order].sum()) / max(1.0, float(lengths[order].sum())) if order else 0.0
    ratio = block_budget / max(1e-9, density * rows * row_len)
    balance = BALANCE if 0.8 <= ratio <= 1.25 else 0.0
    while nxt < len(order) or pending:
        free = [row_len] * rows
        row_items: list[list[int]] = [[] for _ in range(rows)]
        budget = block_budget
        while True:
            while len(pending) < pool and nxt < len(order):
                pending.append(order[nxt])
                nxt += 1
            if not pending:
                break
            cand = np.asarray(pending, dtype=np.int64)
            ln, bk = lengths[cand], blocks[cand]
            fits = (ln <= max(free)) & (bk <= budget)
            if not fits.any():
                break
            # Rows already open first: where the blocks bind before the tokens (dense data), a new row
            # opened early would stay part empty, and the target computes all of it.
            open_free = [f for f, items in zip(free, row_items) if items]
            in_open = fits & (ln <= max(open_free, default=-1))
            if in_open.any():
                fits = in_open
            # the largest in both budgets, less a penalty for leaving the two budgets' rests out of
            # balance (tokens left without blocks for them, or blocks without tokens: both go unused)
            size = ln * size_scale[0] + bk * size_scale[1]
            rest_t = (sum(free) - ln) * size_scale[0]
            rest_b = (budget - bk) * size_scale[1]
            score = size - balance * np.abs(rest_b - rest_t)
            score[~fits] = -np.inf
            pick = int(np.argmax(score))  # the first of the best: deterministic
            i = pending.pop(pick)
            # best fit: the fullest row that still has room (an open one when one has)
            r = min((f, k) for k, f in enumerate(free) if f >= lengths[i] and (row_items[k] or not in_open.any()))[1]
            row_items[r].append(i)
            free[r] -= int(lengths[i])
            budget -= int(blocks[i])
        used = [tuple(items) for items in row_items if items]
        used.sort(key=lambda items: -int(lengths[list(items)].sum()))  # fullest row first (stable)
        if used:
            packs.append(Pack(rows=tuple(used)))
    return packs


def make_packed_batch(samples: Sequence, pack_plan: Pack, anchors_of, rows_total: int, row_len: int,
                      block_budget: int) -> PackedBatch:
    """The tensors of one planned micro-batch. `anchors_of(i, sample)` -> (anchors (num_anchors,),
    valid (num_anchors,)) for sample index i: the very anchors the padded batch gives it."""
    R = len(pack_plan.rows)
    ids = torch.zeros(R, row_len, dtype=torch.long)
    pos = torch.zeros(R, row_len, dtype=torch.long)
    lmask = torch.zeros(R, row_len, dtype=torch.bool)
    lengths, rows_of, cols, starts, ends = [], [], [], [], []
    for r, row in enumerate(pack_plan.rows):
        off = 0
        for i in row:
            s = samples[i]
            n = s.input_ids.numel()
            ids[r, off:off + n], lmask[r, off:off + n] = s.input_ids, s.loss_mask
            pos[r, off:off + n] = torch.arange(n)
            a, v = anchors_of(i, s)
            a = a[v]
            k = a.numel()
            rows_of.append(torch.full((k,), r, dtype=torch.long))
            cols.append(a + off)
            starts.append(torch.full((k,), off, dtype=torch.long))
            ends.append(torch.full((k,), off + n, dtype=torch.long))
            lengths.append(n)
            off += n
        pos[r, off:] = torch.arange(row_len - off)  # the padding tail: a run of its own, never attended
    n_valid = sum(t.numel() for t in cols)
    if n_valid > block_budget:
        raise ValueError(f"make_packed_batch: {n_valid} blocks over the budget of {block_budget}")
    pad = block_budget - n_valid
    zeros = torch.zeros(pad, dtype=torch.long)
    cat = (lambda parts: torch.cat([*parts, zeros]))  # noqa: E731 - the valid blocks, then the padding slots
    valid = torch.zeros(block_budget, dtype=torch.bool)
    valid[:n_valid] = True
    runs, longest = run_bounds(pos)
    return PackedBatch(input_ids=ids, position_ids=pos, loss_mask=lmask,
                       lengths=torch.tensor(lengths, dtype=torch.long), anchor_row=cat(rows_of),
                       anchor_col=cat(cols), doc_start=cat(starts), doc_end=cat(ends), anchor_valid=valid,
                       rows_total=rows_total, runs=runs, longest_run=longest)


def warm_packed_batches(sample, rows_total: int, row_len: int, block_budget: int) -> list[PackedBatch]:
    """Micro-batches at every shape packed training uses, from one sample: for each number of rows
    used (1..rows_total), rows that hold two conversations (a document mask) and rows that one
    conversation fills (none: the target's plain causal path). The blocks are all valid. The drafter's
    shapes: the first (blocks in row order) and the `rows_total`-row one without boundaries (blocks
    spread over every row) cover both of chunked training's (`PackedBatch.chunk`)."""
    out = []
    n = min(row_len, sample.input_ids.numel())
    for full in (False, True):
        for R in range(rows_total, 0, -1):  # all rows first: its chunks read windows of rows, or all rows
            ids = torch.zeros(R, row_len, dtype=torch.long)
            ids[:, :n] = sample.input_ids[:n]
            pos = torch.arange(row_len).repeat(R, 1)
            if not full:
                pos[:, row_len // 2:] = torch.arange(row_len - row_len // 2)  # a second run: a document boundary
            lmask = torch.ones(R, row_len, dtype=torch.bool)
            k = torch.arange(block_budget)
            # blocks in row order (chunks read a window of rows), except one batch where every row has
            # blocks all through (chunks read every row): the two drafter shapes of chunked training
            by_row = k % R if (full and R == rows_total) else k * R // block_budget
            runs, longest = run_bounds(pos)
            out.append(PackedBatch(
                input_ids=ids, position_ids=pos, loss_mask=lmask, lengths=torch.full((R,), row_len),
                anchor_row=by_row, anchor_col=torch.zeros(block_budget, dtype=torch.long),
                doc_start=torch.zeros(block_budget, dtype=torch.long),
                doc_end=torch.full((block_budget,), row_len), anchor_valid=torch.ones(block_budget, dtype=torch.bool),
                rows_total=rows_total, runs=runs, longest_run=longest))
    return out
