"""The target's attention over packed rows: flash attention over each conversation, not a dense mask.

A packed micro-batch (dflash/data/packing.py) holds several conversations back to back in each row, with
positions restarting at each one. transformers' `sdpa` path turns those positions into a dense
block-diagonal causal mask (R × L × L bools), and SDPA then runs its masked kernel over every row's whole
L × L grid: on one H200 (torch 2.11, Qwen3-8B heads, 4 rows of 3,072 tokens of mixed-length chats) 1.98 ms
a layer, against 0.77 ms for flash attention over the conversations alone
(`torch.nn.attention.varlen.varlen_attn`; benchmarks/attention_kernels.py).

How it is wired, without changing the model or its config:
- `install()` puts a wrapper in front of transformers' "sdpa" attention function (`ALL_ATTENTION_FUNCTIONS`,
  the registry every transformers model looks its attention up in). The wrapper is transformers' own sdpa
  function for every call that does not carry `MARKER=True`; so are eval, generation and anyone else's use of
  transformers in the process.
- The target's taps (`dflash.model.target._Tapper`) pass `MARKER=True` through the model's forward (transformers
  hands unknown keyword arguments down to the attention function) inside `documents(runs, longest)`, which
  keeps the conversations' boundaries (cumulative lengths, from the packed batch: no GPU sync) for this
  thread. Rows that each hold one run (a conversation filling its row) keep transformers' causal path.
- The varlen call itself (`_attend_documents`) is not traced by torch.compile (`torch.compiler.disable`): its
  lengths change with every micro-batch, and a compiled layer would otherwise guard on them. A compiled
  target layer is then two graphs around it, one compile for every micro-batch shape as before.

Where it applies (`varlen_ok`): CUDA, bf16/fp16, a full-attention layer (no sliding window, no softcap); the
dense-mask path otherwise. On a CPU `_attend_documents` runs SDPA per conversation (tests check the wiring
against the dense mask there; the speed is a GPU matter).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import threading
from typing import Iterator

import torch
import torch.nn.functional as F

MARKER = "dflash_varlen"  # the keyword argument that asks the attention function for the packed path

_LOCAL = threading.local()  # .docs: (cu_seqlens int32 (D+1,) on the device, the longest conversation)
_INSTALL_LOCK = threading.Lock()
_ORIGINAL: list = []  # transformers' sdpa function, once installed


def varlen_ok(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether flash attention over conversations runs here: CUDA with bf16/fp16 (torch.nn.attention.varlen is in
    every torch the project supports, 2.11 and later)."""
    return device.type == "cuda" and dtype in (torch.bfloat16, torch.float16)


@functools.cache
def _varlen_takes_gqa() -> bool:
    """torch 2.13+ asks for `enable_gqa=True` when K/V have fewer heads; 2.11's flash kernel takes them as they are."""
    from torch.nn.attention.varlen import varlen_attn

    return "enable_gqa" in inspect.signature(varlen_attn).parameters


@contextlib.contextmanager
def documents(runs: torch.Tensor, longest: int) -> Iterator[None]:
    """Within: this thread's marked attention calls attend within each run of the flattened rows (`runs`: int32
    cumulative bounds (D+1,) on the attention's device; `longest`: the longest run;
    dflash.data.packing.run_bounds)."""
    prev = getattr(_LOCAL, "docs", None)
    _LOCAL.docs = (runs, longest)
    try:
        yield
    finally:
        _LOCAL.docs = prev


@torch.compiler.disable
def _attend_documents(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float | None) -> torch.Tensor:
    """Causal attention within each conversation: q (B, H, S, D), k/v (B, Hkv, S, D) -> (B, S, H, D), the layout
    transformers' attention functions return."""
    docs = getattr(_LOCAL, "docs", None)
    if docs is None:
        raise RuntimeError(f"{MARKER}=True outside dflash.model.packed_attention.documents(): no conversation boundaries")
    cu, longest = docs
    b, h, s, d = query.shape
    hkv = key.shape[1]
    q = query.transpose(1, 2).reshape(b * s, h, d)
    k = key.transpose(1, 2).reshape(b * s, hkv, d)
    v = value.transpose(1, 2).reshape(b * s, hkv, d)
    if q.is_cuda:
        from torch.nn.attention.varlen import varlen_attn

        gqa = {"enable_gqa": True} if h != hkv and _varlen_takes_gqa() else {}
        out = varlen_attn(q, k, v, cu, cu, longest, longest, scale=scale, window_size=(-1, 0), **gqa)
    else:  # the reference: SDPA per conversation
        out = torch.empty_like(q)
        bounds = cu.tolist()
        for lo, hi in zip(bounds, bounds[1:]):
            qi, ki, vi = (t[lo:hi].transpose(0, 1)[None] for t in (q, k, v))  # (1, heads, n, D)
            out[lo:hi] = F.scaled_dot_product_attention(qi, ki, vi, is_causal=True, scale=scale,
                                                        enable_gqa=h != hkv)[0].transpose(0, 1)
    return out.view(b, s, h, d)


def _packed_sdpa(module, query, key, value, attention_mask, dropout: float = 0.0, scaling: float | None = None,
                 **kwargs):
    """transformers' sdpa attention, or, for a call marked `MARKER=True` on a full-attention layer, flash
    attention within each conversation of the packed rows (the mask is then not read: it is the same
    block-diagonal causal pattern)."""
    marked = kwargs.pop(MARKER, False)
    plain = (kwargs.get("sliding_window") is not None or kwargs.get("softcap") is not None
             or dropout or getattr(module, "is_causal", True) is False)
    if not marked or plain:
        return _ORIGINAL[0](module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    return _attend_documents(query, key, value, scaling), None


def install() -> None:
    """Put `_packed_sdpa` in front of transformers' "sdpa" attention (once; idempotent, thread-safe)."""
    if _ORIGINAL:
        return
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    with _INSTALL_LOCK:
        if not _ORIGINAL:
            _ORIGINAL.append(ALL_ATTENTION_FUNCTIONS["sdpa"])
            ALL_ATTENTION_FUNCTIONS["sdpa"] = _packed_sdpa
