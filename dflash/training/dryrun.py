"""A dry run of a full-scale config on the meta device: every shape of one training step, no weights.

`dry_run(cfg)` builds the target from its config (the local directory's config.json, or a Qwen3-8B-
shaped one when the recipe's target is not on this machine) and the drafter on `torch.device("meta")`,
where tensors have shapes and dtypes but no storage, then runs one worst-case micro-batch (every
sequence `data.max_length` tokens long, `data.num_anchors` anchors each) through the same path
training takes: target taps -> blocks -> masks -> drafter -> loss -> backward, and writes nothing.
It proves that the config, the taps, the drafter spec, the mask and the export config agree at full
scale before any GPU time or weights are spent. Numbers it reports (parameter counts, memory of the
fp32 master weights + AdamW state) follow from the shapes alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dflash.config import Config

# Qwen3-8B's config.json (Qwen/Qwen3-8B): the target of the qwen3_8b recipe, used when it is not local
QWEN3_8B = dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                rope_theta=1_000_000.0, rms_norm_eps=1e-6, attention_bias=False, tie_word_embeddings=False,
                eos_token_id=151645, bos_token_id=151643)
QWEN3_MASK_ID = 151669  # the first free id after Qwen3's 151669 tokenizer entries (its table has spare rows)


@dataclass(frozen=True)
class DryRunReport:
    target_source: str  # the config.json read, or "Qwen3-8B shape (built in)"
    target_layers: int
    target_hidden: int
    layer_ids: tuple[int, ...]
    drafter_params: int
    drafter_trainable_bytes: int  # fp32 weights + grads + AdamW's two moments
    taps_shape: tuple[int, ...]  # (batch, S, k·H)
    hidden_shape: tuple[int, ...]  # (batch, N·B, H)
    loss_shape: tuple[int, ...]
    grads: int  # drafter parameters that received a gradient
    export_config: dict[str, Any]
    notes: tuple[str, ...]


class _MetaTarget:
    """What the trainer reads from a dflash.model.target.Target, for a target built on the meta device."""

    def __init__(self, model, layer_ids: tuple[int, ...], mask_token_id: int) -> None:
        self.model, self.layer_ids, self.mask_token_id = model, layer_ids, mask_token_id
        self.config = model.config
        self.hidden_size = int(self.config.hidden_size)
        self.num_layers = int(self.config.num_hidden_layers)
        self.vocab_size = int(model.get_input_embeddings().weight.shape[0])


def _target_config(cfg: Config):
    from transformers import Qwen3Config

    from dflash.config import EMBEDDED_TARGET

    if cfg.target.path == EMBEDDED_TARGET:  # the tiny recipe's own target, shape for shape
        from dflash.model.target import build_tiny_tokenizer, tiny_target_config

        return tiny_target_config(len(build_tiny_tokenizer())), "embedded:tiny (built in)"
    path = Path(cfg.target.path).expanduser()
    if (path / "config.json").is_file():  # read as training reads it: a broken one is bad input, not a traceback
        from dflash.model.target import load_config

        return load_config(cfg.target), str(path / "config.json")
    return Qwen3Config(**QWEN3_8B), "Qwen3-8B shape (built in)"  # a recipe's target not on this machine


def dry_run(cfg: Config) -> DryRunReport:
    """One worst-case step of `cfg` on the meta device (see the module docstring)."""
    from transformers import AutoModelForCausalLM

    from dflash.checkpoint.store import export_config, spec_from_config
    from dflash.model.loss import draft_loss, loss_weights, make_blocks
    from dflash.model.mask import build_masks
    from dflash.model.drafter import DFlashDrafter
    from dflash.model.target import choose_taps
    from dflash.model.build import drafter_spec

    tc, source = _target_config(cfg)
    meta = torch.device("meta")
    with meta:
        target_model = AutoModelForCausalLM.from_config(tc)
    layer_ids = choose_taps(cfg.target.layer_ids, int(tc.num_hidden_layers), cfg.drafter.num_layers)
    vocab = int(target_model.get_input_embeddings().weight.shape[0])
    target = _MetaTarget(target_model, layer_ids, min(QWEN3_MASK_ID, vocab - 1))
    spec = drafter_spec(cfg, target)
    with meta:
        drafter = DFlashDrafter(spec)

    bsz, seq, n, bs = cfg.data.batch_size, cfg.data.max_length, cfg.data.num_anchors, spec.block_size
    ids = torch.zeros(bsz, seq, dtype=torch.long, device=meta)
    # an explicit causal 4-D mask: transformers' own mask builder inspects values (`.all()`), which meta
    # tensors do not have; training passes no mask (right padding, dflash.model.target.Target.taps)
    causal = torch.ones(bsz, 1, seq, seq, dtype=torch.bool, device=meta).tril()
    with torch.no_grad():
        out = target_model(input_ids=ids, attention_mask=causal, output_hidden_states=True, use_cache=False,
                           logits_to_keep=1)
        taps = torch.cat([out.hidden_states[i + 1] for i in layer_ids], dim=-1)  # (B, S, k·H)
    anchors = torch.zeros(bsz, n, dtype=torch.long, device=meta)
    blocks = make_blocks(ids, torch.ones(bsz, seq, dtype=torch.bool, device=meta),
                         torch.full((bsz,), seq, device=meta), anchors, torch.ones(bsz, n, dtype=torch.bool, device=meta),
                         bs, spec.mask_token_id)
    masks = build_masks(anchors, seq, bs, "sdpa", spec.sliding_window,
                        need_sliding="sliding_attention" in spec.layer_types)
    ctx_pos = torch.arange(seq, device=meta).expand(bsz, seq)
    with torch.no_grad():
        embeds = target_model.get_input_embeddings()(blocks.ids)  # (B, N·B, H)
    hidden = drafter(embeds, taps, blocks.pos, ctx_pos, masks=masks)  # (B, N·B, H)
    loss = draft_loss(hidden, target_model.get_output_embeddings(), blocks,
                      loss_weights(bs, cfg.gamma, device=meta), 1.0).loss
    loss.backward()

    exported = export_config(spec, torch.bfloat16)
    notes = []
    if spec_from_config(exported) != spec:
        notes.append("the export config does not read back to the same drafter spec")
    params = sum(p.numel() for p in drafter.parameters())
    return DryRunReport(
        target_source=source, target_layers=target.num_layers, target_hidden=target.hidden_size, layer_ids=layer_ids,
        drafter_params=params, drafter_trainable_bytes=params * 16, taps_shape=tuple(taps.shape),
        hidden_shape=tuple(hidden.shape), loss_shape=tuple(loss.shape),
        grads=sum(p.grad is not None for p in drafter.parameters()), export_config=exported, notes=tuple(notes))
