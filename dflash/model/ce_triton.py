"""The per-chunk CE of dflash.model.head_ce as one hand-written Triton kernel (CUDA's path).

`ce_and_grad_triton(logits, labels, w)` returns what `head_ce.ce_and_grad` returns: the per-row CE
(fp32), the argmax (int64, first index of the max), and `d = w·(softmax − onehot)` rounded to the
logits' dtype. Each program owns whole rows and makes two passes over a row in BLOCK_V-wide tiles:

1. per-lane running max, sum of exp (fp32, rescaled when the max moves: one exp an element) and the
   first index of the max, combined across lanes at the end; the label's logit is one scalar load;
2. the row again (from L2 where it is still there: pass 1 loads ask L2 to keep their lines, pass 2's
   loads and d's stores to drop theirs first), writing `d`.

That is the least traffic a row that does not fit on one SM allows: the logits read once from DRAM
(twice where L2 has lost them) and d written once. Rows with w == 0 skip pass 2's loads (d is zeros).
The grid is persistent (`programs_per_sm` programs per SM, each looping over rows) so that the rows in
flight stay few enough for L2 to hold them between the passes; 0 launches one program per row.

V is a runtime argument (a new vocabulary does not recompile); Triton compiles once per dtype and
BLOCK_V / num_warps. Importing this module imports triton: head_ce imports it lazily, only on CUDA.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

# The fastest of benchmarks/ce_kernel.py's configurations on one H200 (torch 2.11, triton 3.6; 1,766 rows of
# 151,936 bf16 logits): 0.513 ms a chunk, 2.1 TB/s, against 0.800 ms for the compiled ce_and_grad and 0.66 ms at 8 warps.
BLOCK_V = 4096
NUM_WARPS = 16
PROGRAMS_PER_SM = 2
DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@triton.jit
def _ce_grad_kernel(logits_ptr, labels_ptr, w_ptr, ce_ptr, argmax_ptr, d_ptr, R, V,
                    BLOCK_V: tl.constexpr):
    cols0 = tl.arange(0, BLOCK_V)
    for row in range(tl.program_id(0), R, tl.num_programs(0)):
        base = tl.cast(row, tl.int64) * V  # R·V may pass 2**31
        label = tl.load(labels_ptr + row)
        wt = tl.load(w_ptr + row).to(tl.float32)
        # pass 1: each lane keeps its own max m, Σexp(x − m) s and first index of the max
        m = tl.full([BLOCK_V], float("-inf"), tl.float32)
        s = tl.zeros([BLOCK_V], tl.float32)
        idx = tl.zeros([BLOCK_V], tl.int32)
        for start in range(0, V, BLOCK_V):
            cols = start + cols0
            x = tl.load(logits_ptr + base + cols, mask=cols < V, other=float("-inf"),
                        eviction_policy="evict_last").to(tl.float32)
            # one exp an element: exp(min − max) rescales s when x is the new max, else is x's term;
            # a lane past V has min = max = -inf: subtract 0 there, not -inf (NaN), so its term is 0
            up = x > m  # strict: a lane keeps the first of equal values
            hi = tl.maximum(m, x)
            e = tl.exp(tl.minimum(m, x) - tl.where(hi > float("-inf"), hi, 0.0))
            s = tl.where(up, s * e + 1.0, s + e)
            idx = tl.where(up, cols, idx)
            m = hi
        mx = tl.max(m, axis=0)  # finite: V ≥ 1 and the logits are finite
        lse = mx + tl.log(tl.sum(s * tl.exp(m - mx), axis=0))
        amax = tl.min(tl.where(m == mx, idx, V), axis=0)  # the first index over lanes too
        x_label = tl.load(logits_ptr + base + label).to(tl.float32)
        tl.store(ce_ptr + row, lse - x_label)
        tl.store(argmax_ptr + row, amax.to(tl.int64))
        # pass 2: d = w·(softmax − onehot), rounded once to the logits' dtype
        read_to = tl.where(wt != 0.0, V, 0)  # w == 0: d is zeros, nothing to read
        for start in range(0, V, BLOCK_V):
            cols = start + cols0
            inside = cols < V
            x = tl.load(logits_ptr + base + cols, mask=cols < read_to, other=0.0,
                        eviction_policy="evict_first").to(tl.float32)
            p = tl.exp(x - lse)
            d = tl.where(cols == label, p - 1.0, p) * wt
            tl.store(d_ptr + base + cols, d.to(d_ptr.dtype.element_ty), mask=inside,
                     eviction_policy="evict_first")


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def ce_and_grad_triton(logits: torch.Tensor, labels: torch.Tensor, w: torch.Tensor, *, block_v: int = BLOCK_V,
                       num_warps: int = NUM_WARPS, programs_per_sm: int = PROGRAMS_PER_SM):
    """head_ce.ce_and_grad's contract for logits (R, V) in bf16, fp16 or fp32; labels (R,) in [0, V);
    w (R,): (ce (R,) fp32, argmax (R,) int64, d (R, V) in logits.dtype). The keywords pick the launch
    (benchmarks/ce_kernel.py compares them)."""
    if logits.dtype not in DTYPES:
        raise TypeError(f"ce_and_grad_triton: logits dtype {logits.dtype} (expected one of {DTYPES})")
    logits, labels, w = logits.contiguous(), labels.contiguous(), w.contiguous()
    rows, vocab = logits.shape
    ce = torch.empty(rows, dtype=torch.float32, device=logits.device)
    pred = torch.empty(rows, dtype=torch.int64, device=logits.device)
    d = torch.empty_like(logits)
    if rows == 0:
        return ce, pred, d
    sms = _sm_count(logits.device.index or 0) if logits.is_cuda else 4  # 4: the interpreter (CPU tensors)
    grid = (rows if programs_per_sm <= 0 else min(rows, sms * programs_per_sm),)
    _ce_grad_kernel[grid](logits, labels, w, ce, pred, d, rows, vocab, BLOCK_V=block_v, num_warps=num_warps)
    return ce, pred, d
