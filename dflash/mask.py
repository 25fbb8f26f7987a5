"""The DFlash training mask, written once as a flex `mask_mod`, and the attention backend choice.

Layout: Q = N blocks × B slots; KV = [context S | the same N×B block tokens]. Block j (anchor a_j):
- sees context positions `kv < a_j`, **strictly**: the anchor's own target hidden state is not
  available at inference (the anchor is the target's bonus token, not yet verified), and `<=` here
  trains a drafter that copies the answer from the context (~70% train accuracy, τ ≈ 1 served);
- sees its own block's B slots, bidirectionally (sliding-window layers: causally, as served);
- sees nothing else (no other block).
Rows never end up empty (a block always sees itself), so SDPA never produces NaN; blocks beyond a
sequence's valid length are masked in the loss instead.

Backends: `flex` builds a BlockMask with `create_block_mask` and runs `torch.compile(flex_attention)`
(CUDA; flex has no backward on CPU); `sdpa` evaluates the *same* mask_mod over the full grid into a
dense boolean mask for `scaled_dot_product_attention` (CPU, and the fallback). The choice is made
once per device type by `detect_backend`; `train.attention` overrides it.

The compiled pieces live behind `compiled_kernels()` so a multi-device engine can warm them on each
device, one device after another, before worker threads start (compilewatch's warm barrier).
"""

from __future__ import annotations

import functools
from typing import Callable, Literal

import torch
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

from compilewatch.errors import BadInput

Backend = Literal["flex", "sdpa"]


def make_mask_mod(anchors: torch.Tensor, ctx_len: int, block_size: int,
                  sliding_window: int | None = None) -> Callable:
    """mask_mod(b, h, q_idx, kv_idx) -> bool for anchors (B, N). Pure tensor ops: it broadcasts,
    vmaps (flex) and compiles."""

    def mask_mod(b, h, q_idx, kv_idx):
        j = q_idx // block_size  # which block the query is in
        anchor = anchors[b, j]
        in_ctx = kv_idx < ctx_len
        ctx_ok = in_ctx & (kv_idx < anchor)  # strict: positions before the anchor only
        kv_blk = kv_idx - ctx_len
        same_block = (~in_ctx) & (kv_blk // block_size == j)
        if sliding_window is None:
            return ctx_ok | same_block
        q_pos = anchor + q_idx % block_size
        ctx_ok = ctx_ok & (q_pos - kv_idx < sliding_window)
        causal = (kv_blk % block_size) <= (q_idx % block_size)
        return ctx_ok | (same_block & causal)

    return mask_mod


def dense_mask(mask_mod: Callable, batch: int, q_len: int, kv_len: int, device) -> torch.Tensor:
    """Evaluate `mask_mod` over the whole grid by broadcasting: (B, 1, Q, KV) bool for SDPA."""
    b = torch.arange(batch, device=device)[:, None, None, None]
    h = torch.zeros((), dtype=torch.long, device=device)
    q = torch.arange(q_len, device=device)[None, None, :, None]
    kv = torch.arange(kv_len, device=device)[None, None, None, :]
    return mask_mod(b, h, q, kv).expand(batch, 1, q_len, kv_len)


def is_block_mask(mask) -> bool:
    return isinstance(mask, BlockMask)


@functools.cache
def flex_compiles_on(device_type: str) -> bool:
    """Whether compiled flex_attention (with backward) is available on this device type. Cached."""
    if device_type != "cuda" or not torch.cuda.is_available():
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def detect_backend(device: torch.device | str, requested: str = "auto") -> Backend:
    """`auto` -> flex where it compiles (CUDA + triton), else sdpa. `flex` on CPU is bad input."""
    device_type = torch.device(device).type
    if requested == "sdpa":
        return "sdpa"
    if requested == "flex":
        if not flex_compiles_on(device_type):
            raise BadInput(f"train.attention=flex needs a CUDA device with triton (device is {device_type})",
                           hint="flex_attention has no backward on CPU; use train.attention=sdpa or auto")
        return "flex"
    if requested != "auto":
        raise BadInput(f"train.attention={requested!r}", hint="expected auto, flex or sdpa")
    return "flex" if flex_compiles_on(device_type) else "sdpa"


_USE_COMPILED_FLEX = True  # override for tests and benchmarks: use_compiled_flex(False)


def use_compiled_flex(enabled: bool) -> None:
    """Force eager flex_attention on CUDA (benchmarks compare it; tests check fast == fallback)."""
    global _USE_COMPILED_FLEX
    _USE_COMPILED_FLEX = enabled


@functools.cache
def _compiled_flex():
    return torch.compile(flex_attention, dynamic=False)


def flex_attention_fn(device: torch.device) -> Callable:
    """Compiled flex_attention on CUDA; the eager (dense math, forward-only) one elsewhere."""
    if device.type == "cuda" and _USE_COMPILED_FLEX:
        return _compiled_flex()
    return flex_attention


def compiled_kernels() -> dict[str, Callable]:
    """The compiled callables a training step uses (for per-device warm-up, then a compile freeze)."""
    return {"flex_attention": _compiled_flex()}


def build_masks(anchors: torch.Tensor, ctx_len: int, block_size: int, backend: Backend,
                sliding_window: int | None = None, need_sliding: bool = False) -> dict:
    """The masks one step needs: {"full": m, "sliding": m or None}; m is a BlockMask (flex) or a
    dense (B, 1, Q, KV) bool tensor (sdpa)."""
    batch, n = anchors.shape
    q_len, kv_len = n * block_size, ctx_len + n * block_size
    mods = {"full": make_mask_mod(anchors, ctx_len, block_size)}
    if need_sliding:
        mods["sliding"] = make_mask_mod(anchors, ctx_len, block_size, sliding_window)
    out: dict = {"full": None, "sliding": None}
    for kind, mod in mods.items():
        if backend == "flex":
            # compiled create_block_mask avoids a dense Q×KV grid; it fails for Q_LEN <= 128 (pytorch#160018)
            compile_it = anchors.device.type == "cuda" and q_len > 128
            out[kind] = create_block_mask(mod, batch, None, q_len, kv_len, device=anchors.device, _compile=compile_it)
        else:
            out[kind] = dense_mask(mod, batch, q_len, kv_len, anchors.device)
    return out
