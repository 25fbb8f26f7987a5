"""The drafter a config asks for: its spec read from the target (sizes, RoPE, taps) and the built,
seeded (optionally compiled) module."""

from __future__ import annotations

import torch

from dflash.config import Config
from dflash.model.drafter import DFlashDrafter, DrafterSpec
from dflash.model.target import Target


def drafter_spec(cfg: Config, target: Target) -> DrafterSpec:
    tc, d = target.config, cfg.drafter
    layer_types = tuple("sliding_attention" if i in d.sliding_layers else "full_attention" for i in range(d.num_layers))
    return DrafterSpec(
        hidden_size=target.hidden_size, num_hidden_layers=d.num_layers,
        num_attention_heads=d.num_attention_heads or tc.num_attention_heads,
        num_key_value_heads=d.num_key_value_heads or tc.num_key_value_heads,
        head_dim=d.head_dim or getattr(tc, "head_dim", None) or tc.hidden_size // tc.num_attention_heads,
        intermediate_size=d.intermediate_size or tc.intermediate_size, vocab_size=target.vocab_size,
        rms_norm_eps=float(getattr(tc, "rms_norm_eps", 1e-6)), rope_theta=float(_rope_theta(tc)),
        rope_scaling=target_rope_scaling(tc), attention_bias=bool(getattr(tc, "attention_bias", False)),
        max_position_embeddings=int(getattr(tc, "max_position_embeddings", 40960)), block_size=d.block_size,
        num_target_layers=target.num_layers, target_layer_ids=target.layer_ids, mask_token_id=target.mask_token_id,
        layer_types=layer_types, sliding_window=d.sliding_window if d.sliding_layers else None,
    )


def empty_drafter(spec: DrafterSpec, device: torch.device | str) -> DFlashDrafter:
    """A drafter whose parameters are allocated on `device` and left uninitialized: built on the meta
    device (nn.Linear's default kaiming init never runs, nothing is made on the CPU and copied over),
    then materialized there. Its non-persistent RoPE buffer is computed on the CPU as in
    DFlashDrafter.__init__ and moved (the same bits as before). Fill it: `init_weights` or a state dict."""
    from dflash.model.drafter import rope_frequencies

    device = torch.device(device)
    with torch.device("meta"):
        drafter = DFlashDrafter(spec)
    drafter.to_empty(device=device)
    inv_freq, _ = rope_frequencies(spec)
    drafter.inv_freq = inv_freq.to(device)
    return drafter


def build_drafter(cfg: Config, spec: DrafterSpec, device: torch.device,
                  state: dict[str, torch.Tensor] | None = None, *, init: bool = True) -> DFlashDrafter:
    """A drafter on `device`: seeded init (or `state`'s weights, without any init; `init=False`: left
    uninitialized, for a caller that loads a checked state into it next), and on CUDA with
    `train.compile_layers` every decoder layer compiled (parameters and state_dict keep their names;
    each copy gets its own compiled wrappers).

    Init: built empty on `device` (`empty_drafter`), then `init_weights` from a generator seeded with
    `train.seed` on that device: on CPU the same draws as ever (a CPU generator, module order); on
    CUDA drawn on the GPU (a CUDA generator: other values than a CPU init, the same on every GPU of
    one torch build), where the CPU init of an 8B-sized drafter took ~14 s plus a 4.2 GB copy."""
    device = torch.device(device)
    drafter = empty_drafter(spec, device)
    if state is not None:
        drafter.load_state_dict(state)
    elif init:
        drafter.init_weights(torch.Generator(device=device).manual_seed(cfg.train.seed))
    if cfg.train.compile_layers and device.type == "cuda":
        drafter.compile_layers(dynamic=False)
    return drafter


def _rope_parameters(tc) -> dict:
    """The target's RoPE parameters (transformers 5 `rope_parameters`, 4.x `rope_scaling` + `rope_theta`);
    a per-layer-type dict (Gemma 3) gives its full-attention entry."""
    rp = dict(getattr(tc, "rope_parameters", None) or getattr(tc, "rope_scaling", None) or {})
    if "full_attention" in rp and isinstance(rp["full_attention"], dict):
        rp = dict(rp["full_attention"])
    return rp


def _rope_theta(tc) -> float:
    return _rope_parameters(tc).get("rope_theta") or getattr(tc, "rope_theta", None) or 10000.0


def target_rope_scaling(tc) -> dict | None:
    """The target's RoPE scaling without the theta ({"rope_type": "yarn", "factor": 4.0, ...}); None = plain."""
    rp = {k: v for k, v in _rope_parameters(tc).items() if k != "rope_theta"}
    rope_type = rp.get("rope_type", rp.get("type", "default"))
    return None if rope_type == "default" else {**rp, "rope_type": rope_type}
