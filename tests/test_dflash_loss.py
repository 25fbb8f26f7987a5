"""dflash.model.loss: weights, same-position labels, the weighted CE, exact accumulation via the denominator."""

from __future__ import annotations

import math

import torch

from dflash.model.loss import draft_loss, estimated_tau, loss_weights, make_blocks, weight_sum
from tests.numerics import assert_same_sum


def test_loss_weights():
    for bs, gamma in [(16, 7.0), (10, 5.0), (8, 4.0)]:
        w = loss_weights(bs, gamma)
        assert w[0] == 0.0  # slot 0 (the anchor) is not trained
        expect = torch.tensor([0.0] + [math.exp(-(k - 1) / gamma) for k in range(1, bs)])
        torch.testing.assert_close(w, expect)
        assert w[1] == 1.0 and bool((w[2:] < w[1:-1]).all())


def blocks_for(ids, lmask, anchors, valid, bs=4, mask_id=99):
    ids, lmask = torch.tensor([ids]), torch.tensor([lmask], dtype=torch.bool)
    return make_blocks(ids, lmask, torch.tensor([ids.shape[1]]), torch.tensor([anchors]), torch.tensor([valid]), bs, mask_id)


def test_blocks_same_position_labels():
    ids = [10, 11, 12, 13, 14, 15, 16, 17, 18]
    lm = [0, 0, 1, 1, 1, 1, 0, 1, 1]
    b = blocks_for(ids, lm, [2, 6], [True, True])
    assert b.ids.tolist() == [[12, 99, 99, 99, 16, 99, 99, 99]]  # [anchor, MASK × (B-1)]
    assert b.pos.tolist() == [[2, 3, 4, 5, 6, 7, 8, 9]]
    assert b.labels.tolist() == [[[12, 13, 14, 15], [16, 17, 18, 18]]]  # slot k -> token at anchor + k, no shift
    # slot 0 untrained; loss mask applied; position 9 lies outside the sequence
    assert b.label_mask.tolist() == [[[0, 1, 1, 1], [0, 1, 1, 0]]]
    invalid = blocks_for(ids, lm, [2, 0], [True, False])
    assert invalid.label_mask[0, 1].sum() == 0  # padding anchors are never trained


def test_draft_loss_is_weighted_mean_ce():
    torch.manual_seed(0)
    vocab, hdim, bs = 7, 5, 4
    head = torch.nn.Linear(hdim, vocab, bias=False)
    b = blocks_for([1, 2, 3, 4, 5, 6, 0, 1, 2], [1] * 9, [0, 3], [True, True], bs=bs, mask_id=6)
    hidden = torch.randn(1, 2 * bs, hdim)
    w = loss_weights(bs, 4.0)
    out = draft_loss(hidden, head, b, w, weight_sum(b, w))
    num = den = 0.0
    head.requires_grad_(False)
    for j in range(2):
        for k in range(1, bs):
            m = float(b.label_mask[0, j, k])
            logp = torch.log_softmax(head(hidden[0, j * bs + k]), -1)
            num += m * float(w[k]) * -float(logp[b.labels[0, j, k]])
            den += m * float(w[k])
    assert math.isclose(float(out.loss.detach()), num / den, rel_tol=1e-5)
    assert float(out.count[0]) == 0 and out.count.shape == (bs,)


def test_global_denominator_makes_accumulation_exact():
    """Two micro-batches with the global Σw give the gradient of the one concatenated batch."""
    torch.manual_seed(1)
    head = torch.nn.Linear(6, 9, bias=False)
    w = loss_weights(4, 4.0)
    b1 = blocks_for([1, 2, 3, 4, 5, 6, 7], [0, 1, 1, 1, 1, 1, 1], [1, 3], [True, True])
    b2 = blocks_for([8, 7, 6, 5, 4, 3, 2], [1, 1, 1, 0, 0, 1, 1], [0, 2], [True, False])
    h1, h2 = torch.randn(1, 8, 6), torch.randn(1, 8, 6)
    denom = weight_sum(b1, w) + weight_sum(b2, w)
    (draft_loss(h1, head, b1, w, denom).loss + draft_loss(h2, head, b2, w, denom).loss).backward()
    g_acc = head.weight.grad.clone()
    head.weight.grad = None
    from dflash.model.loss import Blocks

    both = Blocks(ids=torch.cat([b1.ids, b2.ids]), pos=torch.cat([b1.pos, b2.pos]),
                  labels=torch.cat([b1.labels, b2.labels]), label_mask=torch.cat([b1.label_mask, b2.label_mask]))
    draft_loss(torch.cat([h1, h2]), head, both, w, weight_sum(both, w)).loss.backward()
    assert_same_sum(g_acc, head.weight.grad, terms=both.ids.numel())  # 16 positions summed in another split


def test_estimated_tau_counts_leading_correct_slots():
    head = torch.nn.Linear(3, 5, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.eye(5, 3))  # logits = first 3 features: argmax is controllable
    b = blocks_for([0, 1, 2, 1, 0, 2, 1, 1], [1] * 8, [0, 4], [True, True])  # labels [0,1,2,1], [0,2,1,1]
    hidden = torch.zeros(1, 8, 3)
    for slot, tok in enumerate([0, 1, 2, 0, 0, 2, 0, 1]):  # block 0: slots 1,2 right, 3 wrong; block 1: slot 1 right, 2 wrong
        hidden[0, slot, tok] = 5.0
    out = draft_loss(hidden, head, b, loss_weights(4, 4.0), 1.0)
    assert out.correct.tolist() == [0.0, 2.0, 1.0, 1.0]
    assert float(out.full_blocks) == 2 and float(out.accepted) == 3  # runs of 2 and 1
    assert estimated_tau(float(out.accepted), float(out.full_blocks)) == 2.5
