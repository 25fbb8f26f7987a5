"""dflash.model.ce_triton: the Triton per-chunk CE gives the eager `ce_and_grad`'s CE, argmax and logits'
gradient (GPU; and on CPU through Triton's interpreter when TRITON_INTERPRET=1), and head_ce picks it only
on CUDA with triton importable and `use_triton_ce` on."""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest
import torch

from dflash.model import head_ce
from dflash.model.head_ce import ce_and_grad
from tests.helpers import requires_cuda
from tests.test_dflash_head_ce import cuda_runs

HAS_TRITON = importlib.util.find_spec("triton") is not None
needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
# TRITON_INTERPRET is read when @triton.jit decorates, so it must be set before the process imports ce_triton
interpreted = pytest.mark.skipif(not (HAS_TRITON and os.environ.get("TRITON_INTERPRET") == "1"),
                                 reason="runs the kernel in Triton's interpreter: needs triton and TRITON_INTERPRET=1")

# ≥ one ulp relative (fp32: a few ulps of lse ≈ 16 move p by ~2e-6 relative)
ULP = {torch.bfloat16: 2 ** -7, torch.float16: 2 ** -10, torch.float32: 2 ** -16}


def make(rows, vocab, dtype, device, seed=0, zero_w=True):
    """Logits of CE-like spread, a planted unique max in every other row (natural bf16 ties stay in the
    rest: both sides must pick the first), labels over the whole range, some weights 0."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=g) * 4
    planted = torch.randint(0, vocab, (rows,), generator=g)
    for r in range(0, rows, 2):
        logits[r, planted[r]] = logits[r].max() + 2.0
    labels = torch.randint(0, vocab, (rows,), generator=g)
    labels[-1] = vocab - 1  # the last column: the masked tail of the last tile
    w = torch.rand(rows, generator=g)
    if zero_w:
        w[::3] = 0.0
    return logits.to(dtype).to(device), labels.to(device), w.to(device)


def check(logits, labels, w, **launch):
    from dflash.model.ce_triton import ce_and_grad_triton

    ce, pred, d = ce_and_grad_triton(logits, labels, w, **launch)
    ref_ce, ref_pred, ref_d = ce_and_grad(logits, labels, w)
    assert ce.dtype == torch.float32 and pred.dtype == torch.int64 and d.dtype == logits.dtype
    torch.testing.assert_close(ce, ref_ce, rtol=1e-4, atol=1e-5)  # fp32 sums in another order
    assert torch.equal(pred, ref_pred)  # first index of the max, as torch.argmax
    # Both compute d in fp32 and round once to the logits' dtype; their fp32 values differ in the last bits
    # (summation order, exp), so a value near a rounding boundary may land one step apart: one ulp relative
    # (rtol) or, below fp16's normal range, one subnormal step (atol 2**-24).
    torch.testing.assert_close(d, ref_d, rtol=ULP[logits.dtype], atol=2 ** -24)
    assert not d[w == 0].any()  # rows with w == 0: d all zeros


# --- GPU -------------------------------------------------------------------------------------------------

@pytest.mark.gpu
@needs_triton
@requires_cuda(bf16=True)
@pytest.mark.parametrize("rows, vocab", [(1, 151936), (7, 151936), (1766, 151936), (5, 1000), (64, 32000)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_matches_eager_on_cuda(rows, vocab, dtype):
    check(*make(rows, vocab, dtype, "cuda"))


@pytest.mark.gpu
@needs_triton
@requires_cuda(bf16=True)
@pytest.mark.parametrize("launch", [dict(programs_per_sm=0), dict(programs_per_sm=1, block_v=8192, num_warps=16),
                                    dict(programs_per_sm=4, block_v=2048, num_warps=4)])
def test_launch_configs_agree_on_cuda(launch):
    check(*make(300, 151936, torch.bfloat16, "cuda", seed=1), **launch)
    check(*make(9, 4000, torch.float32, "cuda", seed=2), **launch)


@pytest.mark.gpu
@needs_triton
@requires_cuda(bf16=True)
def test_argmax_tie_takes_the_first_index_on_cuda():
    tie_first_index("cuda")


@pytest.mark.gpu
@needs_triton
@requires_cuda(bf16=True)
def test_head_cross_entropy_triton_matches_compiled_on_cuda():
    """Loss, argmax and the hidden states' gradient through the whole op, Triton kernel vs compiled CE."""
    g = torch.Generator().manual_seed(4)
    hdim, vocab = 128, 32000
    head = torch.nn.Linear(hdim, vocab, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.randn(vocab, hdim, generator=g) * 0.2)
    head = head.cuda().requires_grad_(False)
    h = torch.randn(4, 16, 15, hdim, generator=g)
    labels = torch.randint(0, vocab, (4, 16, 15), generator=g).cuda()
    w = (torch.rand(4, 16, 15, generator=g) * (torch.rand(4, 16, 15, generator=g) > 0.3)).cuda()
    (a, pa, ga), (b, pb, gb) = cuda_runs(head_ce.use_triton_ce, head, h, labels, w, chunk_rows=333)  # uneven chunks
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-4)  # fp32 reductions in another order
    assert torch.equal(pa, pb)
    torch.testing.assert_close(ga, gb, rtol=2 ** -7, atol=1e-3)  # d rounded to bf16 in both, maybe one ulp apart


# --- CPU: which function runs where -------------------------------------------------------------------

def test_chunk_fn_picks_triton_only_on_cuda_with_triton(monkeypatch):
    def kernel(*a):
        raise AssertionError("not called")

    def compiled(*a):
        raise AssertionError("not called")

    monkeypatch.setattr(head_ce, "_compiled_ce_and_grad", lambda: compiled)
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    try:
        monkeypatch.setattr(head_ce, "_triton_ce_and_grad", lambda: kernel)
        assert head_ce._chunk_fn(cpu, torch.bfloat16) is ce_and_grad
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            assert head_ce._chunk_fn(cuda, dtype) is kernel
        assert head_ce._chunk_fn(cuda, torch.float64) is compiled  # the kernel computes in fp32
        head_ce.use_triton_ce(False)
        assert head_ce._chunk_fn(cuda, torch.bfloat16) is compiled
        head_ce.use_triton_ce(True)
        head_ce.use_compiled_ce(False)
        assert head_ce._chunk_fn(cuda, torch.bfloat16) is ce_and_grad
        head_ce.use_compiled_ce(True)
        monkeypatch.setattr(head_ce, "_triton_ce_and_grad", lambda: None)  # triton does not import
        assert head_ce._chunk_fn(cuda, torch.bfloat16) is compiled
        assert head_ce._chunk_fn(cpu, torch.bfloat16) is ce_and_grad
    finally:
        head_ce.use_triton_ce(True)
        head_ce.use_compiled_ce(True)


def test_triton_that_does_not_import_falls_back(monkeypatch):
    monkeypatch.setitem(sys.modules, "triton", None)  # `import triton` raises ImportError
    monkeypatch.delitem(sys.modules, "dflash.model.ce_triton", raising=False)
    assert head_ce._triton_ce_and_grad.__wrapped__() is None


# --- CPU: the kernel through Triton's interpreter -----------------------------------------------------

def tie_first_index(device, block_v=4096):
    """Equal maxima in one lane of two tiles, in two lanes of one tile, and a later lane of an earlier tile
    against an earlier lane of a later one: the first column wins, as in torch.argmax."""
    vocab = 3 * block_v + 17
    logits = torch.zeros(4, vocab)
    for r, cols in enumerate([(5, 5 + block_v), (7, 900), (1000, block_v + 3), (vocab - 1, vocab - 2)]):
        logits[r, list(cols)] = 9.0
    logits = logits.to(torch.bfloat16).to(device)
    labels = torch.tensor([0, 7, 1, vocab - 1], device=device)
    w = torch.ones(4, device=device)
    check(logits, labels, w, block_v=block_v)
    from dflash.model.ce_triton import ce_and_grad_triton

    assert ce_and_grad_triton(logits, labels, w, block_v=block_v)[1].tolist() == [5, 7, 1000, vocab - 2]


@interpreted
@pytest.mark.parametrize("rows, vocab, dtype", [(1, 1000, torch.bfloat16), (5, 5000, torch.float16),
                                                (3, 8192, torch.bfloat16), (6, 2500, torch.float32),
                                                (2, 32000, torch.bfloat16)])
@pytest.mark.parametrize("programs_per_sm", [0, 1])  # one program per row; a persistent grid of 4 (rows loop)
def test_matches_eager_interpreted(rows, vocab, dtype, programs_per_sm):
    check(*make(rows, vocab, dtype, "cpu", seed=rows), block_v=1024, num_warps=4, programs_per_sm=programs_per_sm)


@interpreted
def test_argmax_tie_takes_the_first_index_interpreted():
    tie_first_index("cpu", block_v=1024)
