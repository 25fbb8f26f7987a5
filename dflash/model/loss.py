"""Blocks, labels and the DFlash loss.

- A block is `[anchor token, MASK × (B-1)]` at positions `anchor .. anchor+B-1`.
- **Same-position labels**: slot k is trained to predict the token at `anchor + k` (no shift).
- Slot 0 (the anchor) is not trained: its logits are never computed.
- Loss = `Σ w·CE / Σ w` with `w_k = exp(-(k-1)/γ)` for k ≥ 1, times the loss mask (assistant tokens,
  valid blocks, positions inside the sequence). Early slots weigh more: a wrong token ends acceptance.
- The denominator `Σ w` is a property of the data, not of the model, so it can be computed for a whole
  global batch before any forward: micro-batches (accumulation) and replicas (a multi-device engine
  summing gradients) then give exactly the gradient of the global-batch loss.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from dflash.model.head_ce import head_cross_entropy
from dflash.model.mask import build_masks, build_packed_masks

if TYPE_CHECKING:
    from dflash.data.dataset import Batch
    from dflash.data.packing import PackedBatch
    from dflash.model.drafter import DFlashDrafter


def loss_weights(block_size: int, gamma: float, device=None) -> torch.Tensor:
    """(B,) weights: 0 for slot 0, exp(-(k-1)/γ) for slot k ≥ 1."""
    k = torch.arange(block_size, dtype=torch.float32, device=device)
    w = torch.exp(-(k - 1) / gamma)
    w[0] = 0.0
    return w


@dataclass(frozen=True, slots=True)
class Blocks:
    """One micro-batch's blocks. N anchors per sequence, B slots per block."""

    ids: torch.Tensor  # (batch, N*B) block token ids: [anchor, MASK, ...] per block
    pos: torch.Tensor  # (batch, N*B) positions anchor + k
    labels: torch.Tensor  # (batch, N, B) the token at anchor + k (slot 0: the anchor itself)
    label_mask: torch.Tensor  # (batch, N, B) float: loss-masked, valid block, inside the sequence; slot 0 = 0


def make_blocks(input_ids: torch.Tensor, loss_mask: torch.Tensor, lengths: torch.Tensor,
                anchors: torch.Tensor, anchor_valid: torch.Tensor, block_size: int, mask_token_id: int) -> Blocks:
    """Build blocks for anchors (batch, N) over sequences (batch, S) with valid `lengths` (batch,)."""
    batch, n = anchors.shape
    seq = input_ids.shape[1]
    offs = torch.arange(block_size, device=anchors.device)
    pos = anchors[:, :, None] + offs  # (batch, N, B)
    inside = pos < lengths[:, None, None]
    idx = pos.clamp(max=seq - 1)
    labels = torch.gather(input_ids, 1, idx.view(batch, -1)).view(batch, n, block_size)  # (batch, N, B)
    lmask = torch.gather(loss_mask, 1, idx.view(batch, -1)).view(batch, n, block_size).bool()
    label_mask = (lmask & inside & anchor_valid[:, :, None]).float()
    label_mask[:, :, 0] = 0.0  # the anchor slot is given, not predicted
    ids = torch.full_like(labels, mask_token_id)
    ids[:, :, 0] = labels[:, :, 0]  # (batch, N, B): [anchor, MASK × (B-1)]
    return Blocks(ids=ids.view(batch, n * block_size), pos=pos.view(batch, n * block_size),
                  labels=labels, label_mask=label_mask)


def make_packed_blocks(batch: PackedBatch, block_size: int, mask_token_id: int) -> Blocks:
    """`make_blocks` for a packed micro-batch (dflash/data/packing.py): its N block slots as one row
    (batch 1). Each valid block has the ids, labels, label mask and (conversation-local) positions the
    padded layout gives it; a padding slot is all masked."""
    R, L = batch.input_ids.shape
    offs = torch.arange(block_size, device=batch.anchor_col.device)
    col = batch.anchor_col[:, None] + offs  # (N, B) columns of the block's row
    inside = col < batch.doc_end[:, None]  # inside its conversation (not the next one's tokens)
    flat = batch.anchor_row[:, None] * L + col.clamp(max=L - 1)
    labels = batch.input_ids.reshape(-1)[flat]  # (N, B)
    lmask = batch.loss_mask.reshape(-1)[flat]
    label_mask = (lmask & inside & batch.anchor_valid[:, None]).float()
    label_mask[:, 0] = 0.0
    ids = torch.full_like(labels, mask_token_id)
    ids[:, 0] = labels[:, 0]
    pos = (batch.anchor_col - batch.doc_start)[:, None] + offs  # positions within the conversation
    n = labels.shape[0]
    return Blocks(ids=ids.view(1, n * block_size), pos=pos.view(1, n * block_size), labels=labels[None],
                  label_mask=label_mask[None])


def blocks_of(batch: Batch | PackedBatch, block_size: int, mask_token_id: int) -> Blocks:
    """The blocks of a padded or a packed micro-batch."""
    if getattr(batch, "packed", False):
        return make_packed_blocks(batch, block_size, mask_token_id)
    return make_blocks(batch.input_ids, batch.loss_mask, batch.lengths, batch.anchors, batch.anchor_valid,
                       block_size, mask_token_id)


def weight_sum(blocks: Blocks, weights: torch.Tensor) -> torch.Tensor:
    """Σ w over trained slots: the loss denominator contributed by these blocks (data only)."""
    return (blocks.label_mask * weights).sum()


@dataclass(frozen=True, slots=True)
class LossOutput:
    loss: torch.Tensor  # Σ w·CE / denominator: backward on this (sums to the global-batch loss)
    weighted_ce: torch.Tensor  # Σ w·CE (detached)
    weight: torch.Tensor  # Σ w (detached)
    correct: torch.Tensor  # (B,) argmax == label counts per slot (detached)
    count: torch.Tensor  # (B,) trained labels per slot
    accepted: torch.Tensor  # Σ over blocks of the leading run of correct slots 1.. (detached)
    full_blocks: torch.Tensor  # blocks counted in `accepted`: all B-1 slots trainable


def draft_loss(hidden: torch.Tensor, head, blocks: Blocks, weights: torch.Tensor,
               denominator: torch.Tensor | float) -> LossOutput:
    """hidden (batch, N*B, H) from the drafter; head: the target's LM head (frozen, an nn.Linear).
    The head and CE run fused in row chunks (dflash/model/head_ce.py): the logits are never kept."""
    batch, n, bsz = blocks.labels.shape
    h = hidden.view(batch, n, bsz, -1)[:, :, 1:]  # (batch, N, B-1, H): slot 0 is never read out
    labels = blocks.labels[:, :, 1:]
    lmask = blocks.label_mask[:, :, 1:]
    w = lmask * weights[1:]  # (batch, N, B-1)
    wce, pred = head_cross_entropy(h, head, labels, w)  # one GEMM per row chunk; no fp32 logits kept
    with torch.no_grad():
        correct = (pred == labels) & lmask.bool()  # (batch, N, B-1)
        full = lmask.bool().all(-1)  # blocks whose every slot is trainable
        run = correct.long().cumprod(-1).sum(-1)  # leading correct slots per block
        zero = torch.zeros(1, device=hidden.device)
        out_correct = torch.cat([zero, correct.sum((0, 1)).float()])
        out_count = torch.cat([zero, lmask.sum((0, 1))])
    return LossOutput(loss=wce / denominator, weighted_ce=wce.detach(), weight=w.sum().detach(),
                      correct=out_correct, count=out_count, accepted=(run * full).sum().float(),
                      full_blocks=full.sum().float())


def estimated_tau(accepted: float, full_blocks: float) -> float:
    """Acceptance length expected from training accuracy: 1 (the bonus) + mean leading correct run."""
    return 1.0 + accepted / full_blocks if full_blocks > 0 else math.nan


def drafter_loss(drafter: DFlashDrafter, embed: torch.nn.Module, head: torch.nn.Module, taps: torch.Tensor,
                 batch: Batch, *, mask_token_id: int, weights: torch.Tensor, denominator: torch.Tensor | float,
                 backend: str, compute_dtype: torch.dtype) -> LossOutput:
    """One micro-batch's loss on the drafter's device (no backward). Everything passed in lives there:
    `taps` (B, S, k·H) may come from a target on another device; `embed`/`head` are the target's frozen
    modules (or copies of them on this device). A multi-device engine calls this per replica."""
    if getattr(batch, "packed", False):
        return _packed_drafter_loss(drafter, embed, head, taps, batch, mask_token_id=mask_token_id, weights=weights,
                                    denominator=denominator, backend=backend, compute_dtype=compute_dtype)
    spec = drafter.spec
    dev = taps.device
    blocks = make_blocks(batch.input_ids, batch.loss_mask, batch.lengths, batch.anchors, batch.anchor_valid,
                         spec.block_size, mask_token_id)
    seq = batch.input_ids.shape[1]
    masks = build_masks(batch.anchors, seq, spec.block_size, backend, spec.sliding_window,
                        need_sliding="sliding_attention" in spec.layer_types)
    ctx_pos = torch.arange(seq, device=dev).expand(batch.input_ids.shape[0], seq)  # (B, S)
    return _blocks_loss(drafter, embed, head, blocks, taps, ctx_pos, masks, weights, denominator, compute_dtype)


def _packed_drafter_loss(drafter: DFlashDrafter, embed: torch.nn.Module, head: torch.nn.Module, taps: torch.Tensor,
                         batch: PackedBatch, *, mask_token_id: int, weights: torch.Tensor,
                         denominator: torch.Tensor | float, backend: str, compute_dtype: torch.dtype) -> LossOutput:
    """`drafter_loss` of a packed micro-batch: the taps (R, L, k·H) of the rows used, zero-padded to
    `rows_total` rows (one drafter shape per run), as one context row; the N block slots as one query row."""
    spec = drafter.spec
    R, L = batch.input_ids.shape
    rows = max(R, batch.rows_total)
    ctx = taps.reshape(1, R * L, -1)
    ctx_pos = batch.position_ids.reshape(1, R * L)
    if rows > R:  # rows nobody uses: no block sees them (the mask), zeros keep the shape fixed
        ctx = torch.cat([ctx, ctx.new_zeros(1, (rows - R) * L, ctx.shape[-1])], dim=1)
        ctx_pos = torch.cat([ctx_pos, ctx_pos.new_zeros(1, (rows - R) * L)], dim=1)
    blocks = make_packed_blocks(batch, spec.block_size, mask_token_id)
    src = batch.host if batch.host is not None else batch  # the mask is built on the CPU copy when there is one
    masks = build_packed_masks(src.anchor_row, src.doc_start, src.anchor_col, L, rows * L, spec.block_size,
                               backend, spec.sliding_window, need_sliding="sliding_attention" in spec.layer_types,
                               device=taps.device)
    return _blocks_loss(drafter, embed, head, blocks, ctx, ctx_pos, masks, weights, denominator, compute_dtype)


def _blocks_loss(drafter: DFlashDrafter, embed: torch.nn.Module, head: torch.nn.Module, blocks: Blocks,
                 ctx: torch.Tensor, ctx_pos: torch.Tensor, masks, weights: torch.Tensor,
                 denominator: torch.Tensor | float, compute_dtype: torch.dtype) -> LossOutput:
    """The drafter over `blocks` (embedded by the frozen target embedding) with the context `ctx` (taps at
    `ctx_pos`), then the loss, under autocast to `compute_dtype`: what the padded and packed layouts share."""
    with torch.no_grad():
        embeds = embed(blocks.ids)  # (rows, N*bs, H), frozen
    autocast = torch.autocast(ctx.device.type, dtype=compute_dtype, enabled=compute_dtype != torch.float32)
    with autocast:
        hidden = drafter(embeds, ctx, blocks.pos, ctx_pos, masks=masks)  # (rows, N*bs, H)
        return draft_loss(hidden, head, blocks, weights, denominator)


def loss_backward(drafter: DFlashDrafter, embed: torch.nn.Module, head: torch.nn.Module, taps: torch.Tensor,
                  batch: Batch | PackedBatch, *, chunks: int = 1, **kwargs) -> LossOutput:
    """`drafter_loss` and its backward (the gradients add up in `.grad`). A packed micro-batch with
    `chunks` > 1 runs its blocks chunk by chunk (`PackedBatch.chunk`), a backward after each, so only
    one chunk's activations are alive at once; the outputs are summed (the same numbers as one pass,
    to float rounding: the denominator is the global one)."""
    if not getattr(batch, "packed", False) or chunks <= 1:
        out = drafter_loss(drafter, embed, head, taps, batch, **kwargs)
        out.loss.backward()
        return out
    total: LossOutput | None = None
    for c in range(chunks):
        part_batch, rows = batch.chunk(c, chunks)
        out = drafter_loss(drafter, embed, head, taps[rows], part_batch, **kwargs)
        out.loss.backward()
        part = LossOutput(loss=out.loss.detach(), weighted_ce=out.weighted_ce, weight=out.weight, correct=out.correct,
                          count=out.count, accepted=out.accepted, full_blocks=out.full_blocks)
        total = part if total is None else LossOutput(*(a + b for a, b in zip(_fields(total), _fields(part))))
    assert total is not None
    return total


def _fields(o: LossOutput) -> tuple:
    return (o.loss, o.weighted_ce, o.weight, o.correct, o.count, o.accepted, o.full_blocks)
