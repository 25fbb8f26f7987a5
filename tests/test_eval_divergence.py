"""Where speculative and plain greedy decoding part (dflash/eval/generation.first_divergence) and whether
the target's logits there are a near-tie that rounding decides (dflash/eval/divergence.weigh)."""

from __future__ import annotations

import types

import pytest
import torch

from dflash.eval.divergence import NEAR_TIE_EPS, tolerance, weigh
from dflash.eval.generation import Generation, first_divergence, summarize
from tests.dflash_helpers import tiny_target  # noqa: F401 - fixture


def _gen(tokens):
    return Generation(tokens=list(tokens), acceptance=[1] * max(1, len(tokens)), seconds=1.0)


def test_first_divergence_finds_the_first_differing_new_token_or_an_early_end():
    assert first_divergence(0, [1, 2, 3], [1, 2, 3]) is None
    d = first_divergence(4, [1, 2, 3, 9], [1, 2, 5, 9])
    assert (d.prompt, d.position, d.plain_token, d.spec_token, d.shared_tokens) == (4, 2, 3, 5, (1, 2))
    d = first_divergence(1, [1, 2, 3], [1, 2])  # speculative stopped where plain went on
    assert (d.position, d.plain_token, d.spec_token) == (2, 3, None)


def test_summarize_lists_each_mismatched_prompt_once():
    plain = [_gen([1, 2, 3]), _gen([4, 5, 6]), _gen([7, 8])]
    spec = [_gen([1, 2, 3]), _gen([4, 9, 6]), _gen([7, 0])]
    r = summarize(plain, spec, 1.0, 1.0, block_size=4)
    assert not r.outputs_match and r.mismatched_prompts == 2 == len(r.divergences)
    assert [(d.prompt, d.position) for d in r.divergences] == [(1, 1), (2, 1)]
    assert r.near_tie_prompts == 0 and r.differ_beyond_rounding == 2


def test_tolerance_is_a_few_epsilons_of_the_dtype_relative_to_the_logits():
    assert tolerance(torch.bfloat16, 20.0, -3.0) == pytest.approx(NEAR_TIE_EPS * 2 ** -7 * 20)
    assert tolerance(torch.bfloat16, 0.1, 0.2) == pytest.approx(NEAR_TIE_EPS * 2 ** -7)  # at least 1 x eps
    assert tolerance(torch.float32, 20.0, 20.0) < 1e-4  # fp32: any real gap is a difference


class _FixedLogits(torch.nn.Module):
    """A target whose next-token logits are fixed whatever the prefix (a one-wide hidden state through a head
    holding the logits), and which records what its decoder was asked."""

    def __init__(self, logits):
        super().__init__()
        self.head = torch.nn.Linear(1, len(logits), bias=False)
        with torch.no_grad():
            self.head.weight.copy_(torch.tensor(logits)[:, None])
        self.seen = []

    def get_decoder(self):
        def decoder(input_ids, position_ids, attention_mask):
            b, n = input_ids.shape  # right-padded rows under one 4-D causal mask, positions from 0
            assert attention_mask.shape == (b, 1, n, n) and torch.equal(attention_mask[0, 0], torch.ones(n, n).tril().bool())
            assert torch.equal(position_ids, torch.arange(n).expand(b, n))
            self.seen.append(input_ids.tolist())
            return types.SimpleNamespace(last_hidden_state=torch.ones(*input_ids.shape, 1))
        return decoder


def test_weigh_calls_a_bf16_near_tie_rounding_and_a_wide_gap_a_difference():
    model = _FixedLogits([0.0, 10.0, 10.02, 8.0])  # tokens 1 and 2 tied within bf16 rounding; 3 far below
    target = types.SimpleNamespace(model=model, head=model.head, dtype=torch.bfloat16, device=torch.device("cpu"))
    plain = [_gen([1, 1, 1]), _gen([2, 1]), _gen([1, 1])]
    spec = [_gen([1, 2, 1]), _gen([2, 3]), _gen([1])]
    prompts = [[100, 101], [102], [103]]
    r = weigh(summarize(plain, spec, 1.0, 1.0, 4), target, prompts)
    tie, wide, ended = r.divergences
    assert tie.near_tie and tie.logit_gap == pytest.approx(0.02, abs=1e-5) and tie.tolerance > 0.02
    assert not wide.near_tie and wide.logit_gap == pytest.approx(2.0) and wide.tolerance < 2.0
    assert not ended.near_tie and ended.logit_gap is None  # one decoding ended: not a rounding question
    assert r.near_tie_prompts == 1 and r.differ_beyond_rounding == 2
    # the target was asked about each prompt plus the new tokens both decodings shared, in one padded forward
    assert model.seen == [[[100, 101, 1], [102, 2, 0]]]
    r1 = weigh(summarize(plain, spec, 1.0, 1.0, 4), target, prompts, batch=1)  # one prefix a forward: the same
    assert r1.divergences == r.divergences and model.seen[1:] == [[[100, 101, 1]], [[102, 2]]]


def test_weigh_on_the_real_tiny_target_in_fp32_fails_a_second_choice(tiny_target):
    """The embedded target (fp32): a speculative token that is the target's second choice at the shared prefix
    is a real difference (fp32 rounds far below any real gap)."""
    prompt = tiny_target.tokenizer("ba be bi", add_special_tokens=False)["input_ids"]
    with torch.inference_mode():
        logits = tiny_target.model(input_ids=torch.tensor([prompt])).logits[0, -1].float()
    best, second = torch.topk(logits, 2).indices.tolist()
    other = tiny_target.tokenizer("bo bu", add_special_tokens=False)["input_ids"]  # a shorter prefix beside it
    plain, spec = [_gen([best]), _gen([best, best])], [_gen([second]), _gen([best, second])]
    r = weigh(summarize(plain, spec, 1.0, 1.0, 4), tiny_target, [prompt, other])
    d, _ = r.divergences
    assert d.logit_gap == pytest.approx(float(logits[best] - logits[second]), rel=1e-4, abs=1e-5)  # padded or not
    assert not d.near_tie and d.tolerance < 1e-4 and r.differ_beyond_rounding == 2
    assert weigh(summarize([_gen([best])], [_gen([best])], 1.0, 1.0, 4), tiny_target, [prompt]).divergences == ()
