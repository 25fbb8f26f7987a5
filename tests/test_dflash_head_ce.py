"""dflash.model.head_ce: the chunked head + CE gives the plain `F.cross_entropy(head(h).float())` loss, gradients
and argmax (float64: equal up to summation order), for any chunking; under bf16 autocast it stays within
bf16 rounding of the plain path."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dflash.model.head_ce import chunk_bounds, head_cross_entropy
from dflash.model.loss import draft_loss, loss_weights, make_blocks, weight_sum
from tests.helpers import requires_cuda


def plain(h, head, labels, w):
    """What dflash.model.loss did before head_ce: logits kept, CE in fp32 (here: at least fp32, so float64
    cases test the logic exactly)."""
    logits = head(h)
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="none")
    return (ce * w.reshape(-1)).sum(), logits.argmax(-1)


def case(dtype, bias=False, rows=(2, 5, 3), hdim=8, vocab=11, seed=0):
    g = torch.Generator().manual_seed(seed)
    head = torch.nn.Linear(hdim, vocab, bias=bias).to(dtype)
    with torch.no_grad():
        head.weight.copy_(torch.randn(vocab, hdim, generator=g))
        if bias:
            head.bias.copy_(torch.randn(vocab, generator=g))
    h = torch.randn(*rows, hdim, generator=g, dtype=dtype)
    labels = torch.randint(0, vocab, rows, generator=g)
    w = torch.rand(rows, generator=g) * (torch.rand(rows, generator=g) > 0.3)  # some rows masked out
    return head, h, labels, w


@pytest.mark.parametrize("chunk_rows", [None, 1, 4, 7, 30])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_plain_loss_grads_and_argmax_float64(chunk_rows, bias):
    head, h, labels, w = case(torch.float64, bias=bias)
    h1 = h.clone().requires_grad_(True)
    ref, ref_pred = plain(h1, head, labels, w)
    ref.backward()
    ref_grads = [h1.grad] + [p.grad.clone() for p in head.parameters()]
    head.zero_grad()
    h2 = h.clone().requires_grad_(True)
    wce, pred = head_cross_entropy(h2, head, labels, w, chunk_rows=chunk_rows)
    (wce * 0.37).backward()  # a non-unit upstream gradient (the 1/Σw of the real loss)
    torch.testing.assert_close(wce, ref, rtol=1e-12, atol=1e-12)
    assert torch.equal(pred, ref_pred)
    grads = [h2.grad] + [p.grad for p in head.parameters()]
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want * 0.37, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("chunk_rows", [None, 1, 4, 30])
def test_frozen_head_gives_the_plain_gradient_and_keeps_no_logit_gradient(chunk_rows):
    """The training case (a frozen head): the hidden states' gradient is computed chunk by chunk in the
    forward, so nothing of size rows × vocab is kept for backward; values as the plain path's (float64)."""
    head, h, labels, w = case(torch.float64)
    head.requires_grad_(False)
    h1 = h.clone().requires_grad_(True)
    ref, _ = plain(h1, head, labels, w)
    ref.backward()
    h2 = h.clone().requires_grad_(True)
    wce, _ = head_cross_entropy(h2, head, labels, w, chunk_rows=chunk_rows)
    node = wce.grad_fn
    while node is not None and not hasattr(node, "grad_h"):  # the _HeadCE node, under the reshapes' nodes
        node = next((f for f, _ in node.next_functions if f is not None), None)
    assert node is not None and node.grads == [] and node.grad_h.shape == (h.numel() // h.shape[-1], h.shape[-1])
    (wce * 0.37).backward()
    torch.testing.assert_close(wce, ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(h2.grad, h1.grad * 0.37, rtol=1e-12, atol=1e-12)


def test_no_gradient_work_without_grad_mode():
    """Under no_grad (an eval's loss) the forward computes no hidden-state gradient and keeps nothing for one."""
    head, h, labels, w = case(torch.float64, bias=True)
    h.requires_grad_(True)
    with torch.no_grad():
        wce, pred = head_cross_entropy(h, head, labels, w, chunk_rows=3)
    ref, ref_pred = plain(h.detach(), head, labels, w)
    assert wce.grad_fn is None and torch.equal(pred, ref_pred)
    torch.testing.assert_close(wce, ref.detach(), rtol=1e-12, atol=1e-12)


def test_frozen_head_gets_no_gradient():
    head, h, labels, w = case(torch.float64)
    head.requires_grad_(False)
    h.requires_grad_(True)
    head_cross_entropy(h, head, labels, w, chunk_rows=3)[0].backward()
    assert head.weight.grad is None and h.grad is not None


def test_bf16_autocast_within_rounding_of_plain_path():
    """Under bf16 autocast both compute the logits in bf16 and the CE in fp32: the loss and argmax
    agree up to summation order. The input gradient is a bf16 GEMM in both, with the upstream scalar
    applied before (plain) or after (chunked) rounding the logits' gradient to bf16: each is as far
    from the float64 gradient as bf16 allows, and the chunked one no farther than twice the plain one."""
    for seed in range(3):
        head, h, labels, w = case(torch.bfloat16, rows=(3, 6, 5), hdim=32, vocab=97, seed=seed)
        head.requires_grad_(False)
        outs = []
        for fn in (plain, lambda *a: head_cross_entropy(*a, chunk_rows=8)):
            x = h.float().requires_grad_(True)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                wce, pred = fn(x, head, labels, w)
            (wce / 7.0).backward()
            outs.append((wce.detach(), pred, x.grad))
        (a, pa, ga), (b, pb, gb) = outs
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)  # same bf16 logits, fp32 CE
        assert torch.equal(pa, pb)
        x = h.double().requires_grad_(True)
        (plain(x, head.double(), labels, w.double())[0] / 7.0).backward()
        scale = float(x.grad.abs().max())
        err_plain, err_new = float((ga - x.grad).abs().max()), float((gb - x.grad).abs().max())
        assert err_plain < 2 ** -5 * scale and err_new <= max(2 * err_plain, 2 ** -8 * scale)


def test_chunk_bounds_cover_rows_in_near_equal_chunks():
    for rows, chunk in [(7680, 1766), (10, 3), (5, 10), (1, 1), (9, 9)]:
        b = chunk_bounds(rows, chunk)
        assert b[0][0] == 0 and b[-1][1] == rows
        assert all(hi == lo2 for (_, hi), (lo2, _) in zip(b, b[1:]))
        sizes = {hi - lo for lo, hi in b}
        assert max(sizes) <= chunk and max(sizes) - min(sizes) <= 1
    assert chunk_bounds(7680, 1766) == [(i * 1536, (i + 1) * 1536) for i in range(5)]


def test_draft_loss_matches_plain_formula_float64():
    """The whole draft_loss (weights, mask, slot 0 skipped, accuracy, accepted run) against the
    formula written out with kept logits."""
    torch.manual_seed(3)
    bs, n, vocab, hdim = 4, 3, 13, 6
    ids = torch.randint(0, vocab - 1, (2, 20))
    lm = torch.rand(2, 20) > 0.2
    anchors = torch.tensor([[0, 5, 14], [2, 9, 16]])
    valid = torch.tensor([[True, True, True], [True, False, True]])
    blocks = make_blocks(ids, lm, torch.tensor([20, 18]), anchors, valid, bs, vocab - 1)
    head = torch.nn.Linear(hdim, vocab, bias=False).double().requires_grad_(False)
    hidden = torch.randn(2, n * bs, hdim, dtype=torch.float64, requires_grad=True)
    w = loss_weights(bs, 4.0).double()
    denom = weight_sum(blocks, w)
    out = draft_loss(hidden, head, blocks, w, denom)
    out.loss.backward()
    g = hidden.grad.clone()
    hidden.grad = None
    h = hidden.view(2, n, bs, hdim)[:, :, 1:]
    wt = blocks.label_mask[:, :, 1:] * w[1:]
    ref, pred = plain(h, head, blocks.labels[:, :, 1:], wt)
    (ref / denom).backward()
    torch.testing.assert_close(out.loss, ref / denom, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(g, hidden.grad, rtol=1e-12, atol=1e-12)
    correct = (pred == blocks.labels[:, :, 1:]) & blocks.label_mask[:, :, 1:].bool()
    assert out.correct[1:].tolist() == correct.sum((0, 1)).double().tolist()


def cuda_runs(switch, head, h, labels, w, chunk_rows: int) -> list[tuple]:
    """(Σw·CE, argmax, h's gradient) of head_cross_entropy on CUDA under bf16 autocast with `switch(True)`,
    then `switch(False)` (a head_ce switch: use_compiled_ce, use_triton_ce); the switch is left on."""
    outs = []
    for on in (True, False):
        switch(on)
        try:
            x = h.cuda().float().requires_grad_(True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                wce, pred = head_cross_entropy(x, head, labels, w, chunk_rows=chunk_rows)
            wce.backward()
            outs.append((wce.detach(), pred, x.grad))
        finally:
            switch(True)
    return outs


@pytest.mark.gpu
@requires_cuda(bf16=True)
def test_compiled_chunk_ce_matches_eager_on_cuda():
    """CUDA's per-chunk CE (the Triton kernel where triton imports, else the compiled op; tests/test_ce_triton.py
    compares the two) gives the eager one's loss, argmax and gradient."""
    from dflash.model import head_ce

    head, h, labels, w = case(torch.bfloat16, rows=(4, 16, 15), hdim=64, vocab=1000, seed=2)
    head = head.cuda().requires_grad_(False)
    (a, pa, ga), (b, pb, gb) = cuda_runs(head_ce.use_compiled_ce, head, h, labels.cuda(), w.cuda(), chunk_rows=100)
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-4)  # fp32 reductions in another order
    assert torch.equal(pa, pb)
    torch.testing.assert_close(ga, gb, rtol=2 ** -7, atol=1e-3)  # the logits' gradient is rounded to bf16 in both
