"""One drafting step for a batch of rows over preallocated context slots (dflash.eval.slots).

The same arithmetic as `DFlashDrafter.forward` with a `ContextCache` (what `DrafterProposer` runs,
the reference), reading the drafter's own modules, with two differences in where K/V live:
- the new context positions' K/V are written into their slots instead of `torch.cat` onto a growing
  cache, and
- the block's own K/V are written into the slots right after the row's context (the block starts at
  the anchor's position, the first slot the context does not hold), so attention reads one buffer,
  [context | block | stale slots], with no concatenation; a mask (`draft_masks`) keeps each query to
  what the reference shows it: the row's context (sliding layers: within the window) and the first
  `vs` slots of its block (sliding layers: causally).
The layer loop mirrors dflash.model.drafter (DecoderLayer, Attention); tests/test_eval_batched.py
holds it to the reference's drafts, token for token.
"""

from __future__ import annotations

import torch

from dflash.eval.slots import ContextSlots, write
from dflash.model.drafter import DFlashDrafter, apply_rope, attend, rope_cos_sin


def draft_masks(start: torch.Tensor, vs: torch.Tensor, block: int, kv_len: int, sliding_window: int | None,
                need_sliding: bool) -> dict:
    """{"full": m, "sliding": m or None}, m (b, 1, block or 1, kv_len) bool: what block slot i of row b may
    read. start (b,): the anchor's position (= the row's context length); vs (b,): valid block slots.
    Full layers: every context slot and the valid block slots. Sliding layers (the reference's
    make_mask_mod): context slots s with (start + i) - s < window, block slots j <= i."""
    dev = start.device
    s = torch.arange(kv_len, device=dev)[None, None, :]  # (1, 1, KV) slot
    i = torch.arange(block, device=dev)[None, :, None]  # (1, Q, 1) block slot of the query
    st = start[:, None, None]  # (b, 1, 1)
    j = s - st  # (b, 1, KV): block slot a key slot holds (negative: context)
    in_ctx = s < st
    in_blk = (j >= 0) & (j < vs[:, None, None])
    out = {"full": (in_ctx | in_blk)[:, None], "sliding": None}  # (b, 1, 1, KV): the same for every query
    if need_sliding:
        out["sliding"] = ((in_ctx & (st + i - s < sliding_window)) | (in_blk & (j <= i)))[:, None]
    return out


@torch.no_grad()
def draft_logits(drafter: DFlashDrafter, target, ctx: ContextSlots, block_ids: torch.Tensor, taps: torch.Tensor,
                 ctx_pos: torch.Tensor, block_pos: torch.Tensor, masks: dict, *, rows: torch.Tensor | None = None,
                 kv_len: int | None = None) -> torch.Tensor:
    """Logits (b, Q-1, V) of the drafts for block slots 1..Q-1.

    block_ids (b, Q): [anchor, MASK, ...]; taps (b, n, k·H): target taps of context positions
    `ctx_pos` (b, n), new since the row's last step (written to their slots; entries past a row's
    real count land in slots the block or a later step overwrites, never read: the masks); block_pos
    (b, Q) = start + 0..Q-1; masks from `draft_masks` over `kv_len` slots (None: all of them). `rows`:
    the slot rows these are (a prefill chunk; None: every row, in order)."""
    param = next(drafter.parameters())
    x = target.embed(block_ids).to(param.dtype)  # (b, Q, H)
    b, q_len, _ = x.shape
    ctx_h = drafter.hidden_norm(drafter.fc(taps.to(param.dtype)))  # (b, n, H): fused context
    cos_q, sin_q = rope_cos_sin(block_pos, drafter.inv_freq, drafter.rope_attention_scaling)  # (b, Q, D)
    cos_c, sin_c = rope_cos_sin(ctx_pos, drafter.inv_freq, drafter.rope_attention_scaling)  # (b, n, D)
    n = ctx.length if kv_len is None else kv_len
    for li, layer in enumerate(drafter.layers):
        att = layer.self_attn
        ck, cv = att.context_kv(ctx_h, cos_c, sin_c)  # (b, nkv, n, D) each
        write(ctx.k[li], rows, ctx_pos, ck)
        write(ctx.v[li], rows, ctx_pos, cv)
        h = layer.input_layernorm(x)
        q = att.q_norm(att.q_proj(h).view(b, q_len, att.nh, att.d)).transpose(1, 2)  # (b, nh, Q, D)
        k = att.k_norm(att.k_proj(h).view(b, q_len, att.nkv, att.d)).transpose(1, 2)  # (b, nkv, Q, D)
        v = att.v_proj(h).view(b, q_len, att.nkv, att.d).transpose(1, 2)  # (b, nkv, Q, D)
        q, k = apply_rope(q, cos_q, sin_q), apply_rope(k, cos_q, sin_q)
        write(ctx.k[li], rows, block_pos, k)  # the block right after the context: no concatenation
        write(ctx.v[li], rows, block_pos, v)
        keys, values = ctx.k[li][:, :, :n], ctx.v[li][:, :, :n]  # (B, nkv, KV, D)
        if rows is not None:
            keys, values = keys.index_select(0, rows), values.index_select(0, rows)
        mask = masks["sliding" if layer.sliding else "full"]
        out = attend(q, keys, values, mask)  # (b, nh, Q, D)
        x = x + att.o_proj(out.transpose(1, 2).reshape(b, q_len, att.nh * att.d))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    h = drafter.norm(x)  # (b, Q, H)
    return target.head(h[:, 1:].to(target.dtype))  # (b, Q-1, V)
