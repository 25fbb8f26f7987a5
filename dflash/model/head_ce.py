"""The frozen LM head and the per-row cross-entropy as one op, in row chunks.

At Qwen3-8B shapes the head turns 512 blocks × 15 slots = 7680 rows of width 4096 into 151936 logits
each: 1.17 G logits, 4.7 GB in fp32, plus the same again for their gradient. The plain
`F.cross_entropy(head(h).float())` keeps all of that alive until backward, and `head(h)` on the
strided (batch, N, B-1, H) view of the hidden states ran as a batched matmul of 16-row problems
(torch.profiler on one H200, torch 2.11: its two kernels took ≈ 273 ms of a ≈ 420 ms step;
docs/benchmarks.md, "Drafter step: before and after"). Here:

- the rows are made contiguous once, so the head is one [rows, H] × [H, V] GEMM per chunk;
- each chunk's logits live only inside the forward: it computes the CE, the argmax, and the gradient
  of `Σ w·CE` with respect to the logits, `w·(softmax − onehot)`, in the compute dtype (what the plain
  path hands to the head's backward anyway);
- the hidden states' gradient `d @ W` (for an upstream gradient of 1) is computed in the forward, chunk by
  chunk, so no chunk's `d` outlives it (a trainable head keeps them: its weight gradient needs them all);
- backward then only scales that by the incoming gradient.

Numerics match the plain path: logits are computed in the compute dtype (bf16 under autocast), the
softmax and CE in fp32, the logits' gradient rounded to the compute dtype before the GEMM. The one
difference is where the scalar upstream gradient (1/Σw) is applied: after the GEMM instead of
before the rounding, a relative difference within the compute dtype's rounding.

What runs the per-chunk part (CE, argmax, the logits' gradient; `ce_and_grad` is the reference):

- CUDA with triton: one hand-written Triton kernel (dflash.model.ce_triton: two passes over each row,
  fp32 math, d written once). The compiled `ce_and_grad` (a reduction and a pointwise kernel) took
  ≈ 28 ms a step at Qwen3-8B shapes on one H200, torch 2.11, for ≈ 17 GB of bf16 logits: about 3x the
  memory-bandwidth bound of reading the logits and writing d (≈ 7-11 ms at 4.8 TB/s). The kernel: 0.51 ms
  a 1,766-row chunk against the compiled op's 0.80 (`benchmarks/ce_kernel.py`, docs/benchmarks.md);
- CUDA without triton, `use_triton_ce(False)`, or logits in another dtype (fp64): `torch.compile(ce_and_grad)`;
- elsewhere, or `use_compiled_ce(False)` on CUDA: `ce_and_grad` eagerly.
"""

from __future__ import annotations

import contextlib
import functools

import torch

CHUNK_ELEMENTS = 1 << 28  # logits per chunk: 1 GiB in fp32 (1766 rows at a 151936 vocabulary)

_USE_COMPILED = True  # overrides for tests and benchmarks
_USE_TRITON = True


def use_compiled_ce(enabled: bool) -> None:
    """Force the eager per-chunk CE on CUDA (tests compare it with the compiled one)."""
    global _USE_COMPILED
    _USE_COMPILED = enabled


def use_triton_ce(enabled: bool) -> None:
    """False: the compiled `ce_and_grad` on CUDA instead of the Triton kernel (tests compare the two)."""
    global _USE_TRITON
    _USE_TRITON = enabled


def ce_and_grad(logits: torch.Tensor, labels: torch.Tensor, w: torch.Tensor):
    """logits (R, V) in the compute dtype, labels (R,), w (R,) fp32 -> (ce (R,) fp32 (fp64 for fp64), argmax (R,),
    d (R, V) = w·(softmax − onehot) in the logits' dtype: the gradient of Σ w·ce)."""
    lf = logits.to(torch.promote_types(logits.dtype, torch.float32))  # fp32 (fp64 stays fp64)
    lse = torch.logsumexp(lf, dim=-1)  # (R,)
    ce = lse - lf.gather(-1, labels[:, None]).squeeze(-1)  # (R,)
    p = torch.exp(lf - lse[:, None])  # (R, V) softmax
    cols = torch.arange(lf.shape[-1], device=lf.device)
    d = torch.where(cols == labels[:, None], p - 1.0, p) * w[:, None]
    return ce, logits.argmax(-1), d.to(logits.dtype)


@functools.cache
def _compiled_ce_and_grad():
    return torch.compile(ce_and_grad, dynamic=False)


@functools.cache
def _triton_ce_and_grad():
    """ce_triton.ce_and_grad_triton, or None where triton does not import. Cached."""
    try:
        from dflash.model.ce_triton import ce_and_grad_triton
    except ImportError:
        return None
    return ce_and_grad_triton


def _chunk_fn(device: torch.device, dtype: torch.dtype = torch.bfloat16):
    """The per-chunk CE for logits of `dtype` on `device` (the module docstring says which and why)."""
    if device.type != "cuda" or not _USE_COMPILED:
        return ce_and_grad
    if _USE_TRITON and dtype in (torch.bfloat16, torch.float16, torch.float32):
        fn = _triton_ce_and_grad()
        if fn is not None:
            return fn
    return _compiled_ce_and_grad()


def chunk_bounds(rows: int, chunk_rows: int) -> list[tuple[int, int]]:
    """Split `rows` into ceil(rows / chunk_rows) near-equal chunks (sizes differ by at most one, so a
    shape-specialized compile sees at most two shapes)."""
    n = max(1, -(-rows // chunk_rows))
    cuts = [rows * i // n for i in range(n + 1)]
    return [(lo, hi) for lo, hi in zip(cuts, cuts[1:]) if hi > lo]


class _HeadCE(torch.autograd.Function):
    """Forward: per chunk, the logits GEMM, the CE kernel, and, when only the hidden states need a gradient
    (the frozen head of training), that gradient's GEMM at once: `d @ W` for an upstream gradient of 1, so
    a chunk's logit gradient `d` is freed with its chunk instead of living until backward (at 8B, 56,640
    rows of a micro-batch held 17 GB of `d`; now the (rows, H) result, 0.46 GB). Backward scales it by the
    upstream gradient: the same GEMMs on the same operands, in the same order, as computing it there.
    With a trainable head (weight or bias gradients) the `d`s are kept for backward, as before."""

    @staticmethod
    def forward(ctx, h, weight, bias, labels, w, chunk_rows, graded):
        # h (R, H), weight (V, H), bias (V,) or None, all in the compute dtype; labels (R,); w (R,) fp32;
        # graded: grad mode was on at the call (inside forward it is always off; needs_input_grad ignores it)
        fn = _chunk_fn(h.device, h.dtype)
        bounds = chunk_bounds(h.shape[0], chunk_rows)
        need_h, need_w, need_b = (graded and n for n in ctx.needs_input_grad[:3])
        keep_d = need_w or (need_b and bias is not None)  # a trainable head's gradients need every chunk's d
        grad_h = torch.empty_like(h) if need_h and not keep_d else None  # d Σw·ce / d h for an upstream 1
        ces, preds, grads = [], [], []
        for lo, hi in bounds:
            logits = torch.nn.functional.linear(h[lo:hi], weight, bias)  # (r, V): one GEMM
            ce, pred, d = fn(logits, labels[lo:hi], w[lo:hi])  # d (r, V): d Σw·ce / d logits, compute dtype
            del logits
            ces.append(ce)
            preds.append(pred)
            if grad_h is not None:
                torch.mm(d, weight, out=grad_h[lo:hi])  # (r, H); d is freed with this chunk
            elif keep_d:
                grads.append(d)
            del d
        ctx.save_for_backward(h, weight)
        ctx.bounds, ctx.grads, ctx.grad_h, ctx.has_bias = bounds, grads, grad_h, bias is not None
        pred = torch.cat(preds)
        ctx.mark_non_differentiable(pred)
        return (torch.cat(ces) * w).sum(), pred

    @staticmethod
    def backward(ctx, grad_wce, _grad_pred):
        h, weight = ctx.saved_tensors
        g = grad_wce.to(h.dtype)
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        grad_h = ctx.grad_h if need_h else None
        if need_h and grad_h is None:
            grad_h = torch.empty_like(h)
        grad_w = torch.zeros_like(weight) if need_w else None
        grad_b = torch.zeros(weight.shape[0], dtype=h.dtype, device=h.device) if ctx.has_bias and need_b else None
        for (lo, hi), d in zip(ctx.bounds, ctx.grads):  # kept only for a trainable head
            if need_h:
                torch.mm(d, weight, out=grad_h[lo:hi])  # (r, H)
            if grad_w is not None:
                grad_w.addmm_(d.t(), h[lo:hi])  # (V, H)
            if grad_b is not None:
                grad_b += d.sum(0)
        ctx.grads = ctx.grad_h = None  # free the logits' gradients now
        return (None if grad_h is None else grad_h * g, None if grad_w is None else grad_w * g,
                None if grad_b is None else grad_b * g, None, None, None, None)


def _autocast_on(device_type: str) -> bool:
    """Whether autocast is on for this device type; False for types autocast does not know (meta: a dry run)."""
    try:
        return torch.is_autocast_enabled(device_type)
    except RuntimeError:
        return False


def head_cross_entropy(h: torch.Tensor, head: torch.nn.Linear, labels: torch.Tensor, w: torch.Tensor,
                       chunk_rows: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Σ w·CE(head(h), labels) and argmax(head(h)) for rows h (..., H), labels (...), w (...) fp32,
    without keeping logits. Computes in the autocast dtype when autocast is on (as `head(h)` would),
    else in h's dtype. Returns (weighted CE sum (fp32 scalar), argmax with labels' shape)."""
    dev = h.device.type
    autocast = _autocast_on(dev)
    dtype = torch.get_autocast_dtype(dev) if autocast else h.dtype
    shape = labels.shape
    h2 = h.reshape(-1, h.shape[-1]).to(dtype).contiguous()  # (R, H)
    weight = head.weight.to(dtype)
    bias = head.bias.to(dtype) if head.bias is not None else None
    rows = chunk_rows or max(1, CHUNK_ELEMENTS // weight.shape[0])
    with torch.autocast(dev, enabled=False) if autocast else contextlib.nullcontext():
        wce, pred = _HeadCE.apply(h2, weight, bias, labels.reshape(-1),
                                  w.reshape(-1).to(torch.promote_types(dtype, torch.float32)), rows,
                                  torch.is_grad_enabled())
    return wce, pred.view(shape)
