"""The DFlash drafter: a few Qwen3 decoder layers that denoise a block of masked tokens in one pass.

Design choices (the DFlash paper and its reference code, z-lab/dflash `dflash/model.py`):
- **KV injection.** The target's hidden states at the tapped layers are concatenated and fused,
  `fc: Linear(k·H → H, bias=False)` then `hidden_norm` (RMSNorm), into one context shared by every
  draft layer. Each layer projects that context with its *own* k_proj/v_proj and prepends it to the
  block's keys/values: K = cat(k_proj(ctx), k_proj(block)). Queries come from the block tokens only.
- **QK-norm and RoPE** as in Qwen3; context keys sit at their sequence positions, block tokens at
  `anchor + k`, so relative positions match what the target saw. RoPE follows the target's
  `rope_theta` and scaling (YaRN, linear, llama3, ...: transformers' own `ROPE_INIT_FUNCTIONS`
  give the frequencies and YaRN's attention factor), as SGLang/vLLM build the drafter's rotary
  embedding from its config.
- **Attention bias** on q/k/v/o when the target's config has `attention_bias` (the reference's
  Qwen3DFlashAttention and vLLM put it on all four).
- **Strict context.** During training, block j sees context positions `< anchor_j` (strictly) and its
  own block bidirectionally (dflash/model/mask.py). At inference the context is exactly the accepted tokens
  whose target hidden states exist, i.e. the positions before the anchor.
- **Same-position labels.** Block slot k predicts the token at `anchor + k` (no shift); slot 0 holds
  the anchor and is not trained (dflash/model/loss.py).
- **No own embedding or LM head.** The block is embedded with the target's frozen embedding and
  read out with the target's frozen LM head after this model's final `norm`.
- **Optional sliding-window layers** (`layer_types`): what the authors' code (`is_causal` =
  sliding layer), SGLang (sliding = causal DECODER attention with window_left = sliding_window-1)
  and vLLM (`_dflash_layer_causal`) run: causal inside the block, keys within the window
  (`q_pos - k_pos < sliding_window`, the current token included, HF's convention). Full layers see
  their whole block (bidirectional).

Parameter names are the reference format that SGLang / vLLM map: `layers.{i}.self_attn.{q,k,v,o}_proj`,
`layers.{i}.self_attn.{q,k}_norm`, `layers.{i}.mlp.{gate,up,down}_proj`,
`layers.{i}.{input,post_attention}_layernorm`, `norm`, `fc`, `hidden_norm`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from dflash.model import mask as masks


@dataclass(kw_only=True, slots=True, frozen=True)
class DrafterSpec:
    """The drafter's shape; mirrors the exported config.json (a Qwen3 config plus DFlash fields)."""

    hidden_size: int  # = the target's hidden size (the context and the target's head need it)
    num_hidden_layers: int  # draft layers (paper: 5)
    num_attention_heads: int  # query heads (default: the target's)
    num_key_value_heads: int  # K/V heads, GQA (default: the target's)
    head_dim: int  # per-head width (default: the target's)
    intermediate_size: int  # SwiGLU width (default: the target's)
    vocab_size: int  # the target's vocabulary (embedding rows)
    rms_norm_eps: float = 1e-6  # Qwen3's default
    rope_theta: float = 1_000_000.0  # Qwen3's default; copied from the target
    rope_scaling: dict | None = None  # the target's RoPE scaling ({"rope_type": "yarn", "factor": ...}); None = plain
    attention_bias: bool = False  # q/k/v/o biases, as the target's `attention_bias`
    max_position_embeddings: int = 40960  # Qwen3-8B's
    block_size: int = 16  # anchor + 15 predictions (paper)
    num_target_layers: int = 36  # the target's depth (exported for serving engines)
    target_layer_ids: tuple[int, ...] = (1, 9, 17, 25, 33)  # taps: hidden_states[id + 1]
    mask_token_id: int = 0  # the tokenizer's <|MASK|>
    layer_types: tuple[str, ...] = field(default=())  # per layer: full_attention | sliding_attention
    sliding_window: int | None = None  # window of sliding_attention layers

    def __post_init__(self) -> None:
        if not self.layer_types:
            object.__setattr__(self, "layer_types", ("full_attention",) * self.num_hidden_layers)
        if len(self.layer_types) != self.num_hidden_layers:
            raise ValueError("layer_types: need one entry per draft layer")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads: must be a multiple of num_key_value_heads")


class RMSNorm(nn.Module):
    """Root-mean-square norm computed in fp32 (Qwen3RMSNorm)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        if x.is_cuda and not torch.compiler.is_compiling():
            # Eager on a GPU (the fused context, the context keys, the final norm): the same fp32 math as
            # ATen's fused RMSNorm, one kernel each way instead of one per op over fp32 copies of x
            # (torch.rms_norm dispatches to `_fused_rms_norm` on CUDA). Compiled layers trace the formula
            # below, which inductor fuses itself.
            with torch.autocast("cuda", enabled=False):
                return torch.rms_norm(x.float(), (x.shape[-1],), self.weight.float(), self.eps).to(dtype)
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * self.weight.float()).to(dtype)  # stays in the input dtype under autocast


def rope_frequencies(spec: DrafterSpec) -> tuple[torch.Tensor, float]:
    """(inv_freq (head_dim/2,) fp32, attention scaling) for the spec's RoPE: the plain formula, or
    transformers' ROPE_INIT_FUNCTIONS for a scaled one (a Qwen3Config carries the parameters)."""
    rope_type = (spec.rope_scaling or {}).get("rope_type", (spec.rope_scaling or {}).get("type", "default"))
    if rope_type == "default":
        d = spec.head_dim
        return 1.0 / (spec.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)), 1.0
    from transformers import Qwen3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise ValueError(f"rope_scaling: rope_type {rope_type!r} is not one of {', '.join(ROPE_INIT_FUNCTIONS)}")
    cfg = Qwen3Config(hidden_size=spec.hidden_size, num_attention_heads=spec.num_attention_heads,
                      head_dim=spec.head_dim, max_position_embeddings=spec.max_position_embeddings,
                      rope_theta=spec.rope_theta, rope_scaling=dict(spec.rope_scaling))
    with torch.device("cpu"):  # transformers copies to the device it is given: not possible out of a meta context
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](cfg, torch.device("cpu"))
    return inv_freq.float().to(torch.get_default_device()), float(scaling)


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, scaling: float = 1.0):
    """fp32 cos/sin for integer positions (..., T) -> (..., T, head_dim), HF's half-rotation layout,
    times the attention scaling (YaRN's factor; 1 otherwise), as HF's rotary embeddings do."""
    freqs = positions.float()[..., None] * inv_freq.float()  # (..., T, head_dim/2); fp32 even if .to(bf16)
    emb = torch.cat([freqs, freqs], dim=-1)  # (..., T, head_dim)
    if scaling == 1.0:  # plain RoPE: two kernels fewer, the same values
        return emb.cos(), emb.sin()
    return emb.cos() * scaling, emb.sin() * scaling


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (B, heads, T, D); cos/sin: (B, T, D)."""
    cos, sin = cos[:, None].to(x.dtype), sin[:, None].to(x.dtype)  # (B, 1, T, D)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask) -> torch.Tensor:
    """Masked attention with GQA: q (B, nh, Q, D), k/v (B, nkv, KV, D) -> (B, nh, Q, D). `mask` is a
    flex BlockMask (over lengths padded to flex's block size), a dense bool (B, 1, Q, KV), or None (all)."""
    if masks.is_block_mask(mask):
        with torch.autocast(q.device.type, enabled=False):  # q, k, v already share the compute dtype
            return masks.flex_attend(q, k, v, mask)  # pads to the mask's lengths, slices back
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


class Attention(nn.Module):
    """Q from the block; K/V = [this layer's projection of the fused context | the block]."""

    def __init__(self, spec: DrafterSpec) -> None:
        super().__init__()
        h, nh, nkv, d = spec.hidden_size, spec.num_attention_heads, spec.num_key_value_heads, spec.head_dim
        self.nh, self.nkv, self.d = nh, nkv, d
        bias = spec.attention_bias
        self.q_proj = nn.Linear(h, nh * d, bias=bias)
        self.k_proj = nn.Linear(h, nkv * d, bias=bias)
        self.v_proj = nn.Linear(h, nkv * d, bias=bias)
        self.o_proj = nn.Linear(nh * d, h, bias=bias)
        self.q_norm = RMSNorm(d, spec.rms_norm_eps)
        self.k_norm = RMSNorm(d, spec.rms_norm_eps)

    def context_kv(self, ctx: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """K/V of the fused context (B, S, H) -> two (B, nkv, S, D); cacheable at inference."""
        b, s, _ = ctx.shape
        k = self.k_norm(self.k_proj(ctx).view(b, s, self.nkv, self.d)).transpose(1, 2)  # (B, nkv, S, D)
        v = self.v_proj(ctx).view(b, s, self.nkv, self.d).transpose(1, 2)  # (B, nkv, S, D)
        return apply_rope(k, cos, sin), v

    def forward(self, x: torch.Tensor, ctx_k: torch.Tensor, ctx_v: torch.Tensor,
                cos: torch.Tensor, sin: torch.Tensor, mask) -> torch.Tensor:
        b, t, _ = x.shape  # (B, Q, H): the blocks, N*block_size tokens per row
        q = self.q_norm(self.q_proj(x).view(b, t, self.nh, self.d)).transpose(1, 2)  # (B, nh, Q, D)
        k = self.k_norm(self.k_proj(x).view(b, t, self.nkv, self.d)).transpose(1, 2)  # (B, nkv, Q, D)
        v = self.v_proj(x).view(b, t, self.nkv, self.d).transpose(1, 2)  # (B, nkv, Q, D)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        k = torch.cat([ctx_k, k], dim=2)  # (B, nkv, S+Q, D)
        v = torch.cat([ctx_v, v], dim=2)  # (B, nkv, S+Q, D)
        out = attend(q, k, v, mask)  # (B, nh, Q, D)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, self.nh * self.d))  # (B, Q, H)


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, spec: DrafterSpec) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(spec.hidden_size, spec.intermediate_size, bias=False)
        self.up_proj = nn.Linear(spec.hidden_size, spec.intermediate_size, bias=False)
        self.down_proj = nn.Linear(spec.intermediate_size, spec.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """Pre-norm Qwen3 decoder layer whose attention also reads the injected context."""

    def __init__(self, spec: DrafterSpec, index: int) -> None:
        super().__init__()
        self.sliding = spec.layer_types[index] == "sliding_attention"
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.self_attn = Attention(spec)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.mlp = MLP(spec)

    def forward(self, x, ctx_k, ctx_v, cos, sin, mask) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), ctx_k, ctx_v, cos, sin, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class ContextCache:
    """Inference-time per-layer context K/V; grows by the accepted tokens' taps each round."""

    def __init__(self, num_layers: int) -> None:
        self.k: list[torch.Tensor | None] = [None] * num_layers
        self.v: list[torch.Tensor | None] = [None] * num_layers

    def extend(self, i: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.k[i] = k if self.k[i] is None else torch.cat([self.k[i], k], dim=2)
        self.v[i] = v if self.v[i] is None else torch.cat([self.v[i], v], dim=2)
        return self.k[i], self.v[i]


class DFlashDrafter(nn.Module):
    """Fused target context + block embeddings -> final-normed hidden states of the block."""

    def __init__(self, spec: DrafterSpec) -> None:
        super().__init__()
        self.spec = spec
        k = len(spec.target_layer_ids)
        self.fc = nn.Linear(k * spec.hidden_size, spec.hidden_size, bias=False)  # fuse k taps
        self.hidden_norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.layers = nn.ModuleList(DecoderLayer(spec, i) for i in range(spec.num_hidden_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        inv_freq, self.rope_attention_scaling = rope_frequencies(spec)
        self.register_buffer("inv_freq", inv_freq, persistent=False)  # (head_dim/2,), not exported
        self.layers_compiled = False  # compile_layers() sets it

    def compile_layers(self, **compile_kwargs) -> None:
        """torch.compile each decoder layer (`nn.Module.compile`: parameter names and state_dict keys
        unchanged). Every layer then shares one compiled code object, and with it the guards: layer 0
        gets an input that requires grad like the others' (see `forward`), so a bucket compiles once."""
        for layer in self.layers:
            layer.compile(**compile_kwargs)
        self.layers_compiled = True

    def init_weights(self, generator: torch.Generator | None = None, std: float = 0.02) -> None:
        """Normal(0, std) linears, zero biases, ones for norms (Qwen3's init), from an explicit generator.
        The draws are made on the generator's device (a CPU generator: on the CPU, as always; a CUDA one:
        on the GPU, no host work or copy) in module order."""
        where = generator.device if generator is not None else None
        for m in self.modules():
            if isinstance(m, nn.Linear):
                with torch.no_grad():
                    m.weight.copy_(torch.randn(m.weight.shape, generator=generator, device=where) * std)
                    if m.bias is not None:
                        m.bias.zero_()
            elif isinstance(m, RMSNorm):
                nn.init.ones_(m.weight)

    def forward(self, block_embeds: torch.Tensor, target_hidden: torch.Tensor, block_pos: torch.Tensor,
                ctx_pos: torch.Tensor, masks=None, cache: ContextCache | None = None) -> torch.Tensor:
        """block_embeds (B, Q, H); target_hidden (B, S, k·H) taps; block_pos (B, Q) and ctx_pos (B, S)
        positions; masks: per layer kind {"full": m, "sliding": m} (or None = see everything).
        With `cache`, target_hidden holds only the new context positions; returns (B, Q, H)."""
        ctx = self.hidden_norm(self.fc(target_hidden))  # (B, S, H): fused context
        cos_q, sin_q = rope_cos_sin(block_pos, self.inv_freq, self.rope_attention_scaling)  # (B, Q, D)
        cos_c, sin_c = rope_cos_sin(ctx_pos, self.inv_freq, self.rope_attention_scaling)  # (B, S, D)
        x = block_embeds
        if self.layers_compiled and torch.is_grad_enabled() and not x.requires_grad:
            # The embeddings come from the frozen target (no grad); every later layer's input requires
            # grad. Compiled layers guard on requires_grad, so layer 0 was a second graph per bucket
            # (H200 / torch 2.11: 8 compiles for 4 buckets). A fresh leaf that requires grad: the same
            # values and parameter gradients (its own gradient is computed and dropped with it).
            x = x.detach().requires_grad_()
        for i, layer in enumerate(self.layers):
            ctx_k, ctx_v = layer.self_attn.context_kv(ctx, cos_c, sin_c)  # (B, nkv, S, D) each
            if cache is not None:
                ctx_k, ctx_v = cache.extend(i, ctx_k, ctx_v)
            mask = None if masks is None else masks["sliding" if layer.sliding else "full"]
            x = layer(x, ctx_k, ctx_v, cos_q, sin_q, mask)
        return self.norm(x)  # (B, Q, H); the target's LM head reads this


def default_layer_ids(num_target_layers: int, num_draft_layers: int) -> tuple[int, ...]:
    """Distinct taps spread over the target: the reference formula `round(1 + i*(L-4)/(n-1))` (one draft
    layer taps `L // 2`); where it repeats a layer (shallow targets), evenly spread over [1, L-3] when
    that has room, else over [0, L-1]. ValueError when n > L (no n distinct layers)."""
    L, n = num_target_layers, num_draft_layers
    if not 1 <= n <= L:
        raise ValueError(f"{n} taps cannot be distinct layers of a {L}-layer target")
    if n == 1:
        return (L // 2,)
    ids = tuple(int(round(1 + i * (L - 4) / (n - 1))) for i in range(n))
    if list(ids) == sorted(set(ids)) and ids[0] >= 0 and ids[-1] < L:
        return ids
    lo, hi = (1, L - 3) if L - 3 >= n else (0, L - 1)  # spacing >= 1 keeps the rounded ids distinct
    return tuple(int(round(lo + i * (hi - lo) / (n - 1))) for i in range(n))
