"""dflash.eval.evaluate: the reference speculative-decoding loop. A drafter that reproduces the target gets max τ;
any drafter leaves the output identical to plain greedy decoding."""

from __future__ import annotations

import torch

from dflash.data.dataset import embedded_prompts
from dflash.eval.evaluate import DrafterProposer, evaluate, plain_generate, prompt_ids, speculative_generate
from dflash.model.drafter import DFlashDrafter
from dflash.model.build import drafter_spec
from tests.dflash_helpers import tiny_target  # noqa: F401 (fixture)

BS = 8


class OracleProposer:
    """Drafts exactly what the target will say: greedy target decoding from the tokens so far."""

    def __init__(self, target) -> None:
        self.target = target
        self.contexts: list[int] = []

    def reset(self) -> None:
        self.contexts = []

    def propose(self, tokens, new_ctx, block_len):
        self.contexts.append(new_ctx.shape[1])
        return plain_generate(self.target, tokens, block_len - 1).tokens


class WrongProposer(OracleProposer):
    """Always drafts a token the target never predicts first (acceptance 1 every round)."""

    def propose(self, tokens, new_ctx, block_len):
        right = super().propose(tokens, new_ctx, block_len)
        return [(right[0] + 1) % 300 + 3] + right[1:]


def prompts(target, n=3):
    return prompt_ids(target.tokenizer, embedded_prompts(n, seed=5))


def test_exact_drafter_gets_max_tau(tiny_target):
    oracle = OracleProposer(tiny_target)
    # the prefill yields 1 token, then every round yields BS: 1 + 4·BS new tokens = 4 full rounds
    r = evaluate(oracle, tiny_target, prompts(tiny_target), max_new_tokens=4 * BS + 1, block_size=BS)
    assert r.outputs_match and r.max_tau == BS
    assert r.tau == BS and r.acceptance_histogram == {BS: r.rounds}  # every draft accepted + the bonus
    assert r.rounds == 3 * 4


def test_context_grows_by_accepted_tokens(tiny_target):
    p = prompts(tiny_target, 1)[0]
    oracle = OracleProposer(tiny_target)
    speculative_generate(oracle, tiny_target, p, 3 * BS + 1, BS)
    assert oracle.contexts == [len(p), BS, BS]  # prompt taps, then anchor + accepted drafts each round
    wrong = WrongProposer(tiny_target)
    g = speculative_generate(wrong, tiny_target, p, 6, BS)
    assert g.acceptance == [1] * 5 and wrong.contexts == [len(p)] + [1] * 4  # 1 (prefill) + 5 rounds
    assert g.tokens == plain_generate(tiny_target, p, 6).tokens


def test_real_drafter_keeps_output_identical(tiny_target):
    from dflash.config import tiny

    drafter = DFlashDrafter(drafter_spec(tiny(), tiny_target))
    drafter.init_weights(torch.Generator().manual_seed(0))
    r = evaluate(DrafterProposer(drafter.eval(), tiny_target), tiny_target, prompts(tiny_target, 2), 20, BS)
    assert r.outputs_match and 1.0 <= r.tau <= BS and r.generated_tokens == 40


def test_training_forward_equals_inference_draft(tiny_target):
    """The block the trainer scores at anchor a is exactly what the eval loop drafts at position a:
    same context (taps < a), same positions, same labels (no shift). Catches off-by-one masks/labels."""
    from dflash.config import tiny
    from dflash.model.loss import make_blocks
    from dflash.model.mask import build_masks

    drafter = DFlashDrafter(drafter_spec(tiny(), tiny_target))
    drafter.init_weights(torch.Generator().manual_seed(1), std=0.1)
    drafter.eval()
    ids = torch.randint(10, 300, (1, 40), generator=torch.Generator().manual_seed(2))
    taps = tiny_target.taps(ids)
    anchors = torch.tensor([[5, 20, 31]])
    blocks = make_blocks(ids, torch.ones_like(ids, dtype=torch.bool), torch.tensor([40]), anchors,
                         torch.ones(1, 3, dtype=torch.bool), BS, tiny_target.mask_token_id)
    with torch.no_grad():
        h = drafter(tiny_target.embed(blocks.ids), taps, blocks.pos, torch.arange(40)[None],
                    masks=build_masks(anchors, 40, BS, "sdpa"))
        trained = tiny_target.head(h.view(1, 3, BS, -1)[:, :, 1:]).argmax(-1)[0]
    for j, a in enumerate(anchors[0].tolist()):
        proposer = DrafterProposer(drafter, tiny_target)
        draft = proposer.propose(ids[0, : a + 1].tolist(), taps[:, :a], BS)
        assert draft == trained[j].tolist()
        assert blocks.labels[0, j].tolist() == ids[0, a: a + BS].tolist()
