"""Why speculative decoding's tokens differ from plain greedy decoding's, where they do.

Greedy speculative decoding is lossless in exact arithmetic: every token it keeps is the target's argmax
on the same prefix. On a GPU the two decodings compute that argmax with different kernels (the verify pass
scores a block of positions at once, plain decoding one position against its K/V cache), and in bf16 the
logits they get differ by a few units of the last place. Where the target's top two logits are that
close, either token can win: the outputs then part ways without anything being wrong (on a random-weight
8B target that happens at almost every prompt: its logits are nearly flat; docs/benchmarks.md).

`weigh` runs the target once on each mismatched prompt's shared prefix (the prompt and the new tokens the
two decodings agree on) and compares the logits of the two tokens they chose there. Within `tolerance`
(NEAR_TIE_EPS machine epsilons of the target's dtype, relative to the larger logit's magnitude, at least
1) it is a near-tie: reported, not a failure. A wider gap (or one decoding stopping where the other goes
on) is a real difference, which `dflash eval` fails on (exit 1). In fp32 the tolerance is ~1e-6 of the
logits, so any difference is a failure there.
"""

from __future__ import annotations

import dataclasses

import torch

from dflash.eval.generation import Divergence, EvalResult

NEAR_TIE_EPS = 4  # machine epsilons (relative to the logit's size): bf16 0.0078 each, so ~3% of the logit


def tolerance(dtype: torch.dtype, a: float, b: float) -> float:
    """How far rounding in `dtype` can move two logits of sizes `a`, `b` apart (see the module doc)."""
    return NEAR_TIE_EPS * torch.finfo(dtype).eps * max(1.0, abs(a), abs(b))


@torch.inference_mode()
def weigh(result: EvalResult, target, prompts: list[list[int]]) -> EvalResult:
    """`result` with each divergence's logit gap, tolerance and near-tie verdict, and `near_tie_prompts`
    (one target forward per mismatched prompt, of its prompt and the new tokens both decodings share)."""
    if not result.divergences:
        return result
    # the dtype the target computes in: a bf16 target rounds its logits in bf16 even where it returns fp32
    dtype = getattr(target, "dtype", None) or next(target.model.parameters()).dtype
    weighed = []
    for d in result.divergences:
        if d.plain_token is None or d.spec_token is None:
            weighed.append(d)  # one decoding ended where the other went on: not a question of rounding
            continue
        prefix = list(prompts[d.prompt]) + list(d.shared_tokens)
        ids = torch.tensor([prefix], dtype=torch.long, device=target.device)
        logits = target.model(input_ids=ids).logits[0, -1].float()
        a, b = float(logits[d.plain_token]), float(logits[d.spec_token])
        tol = tolerance(dtype, a, b)
        weighed.append(dataclasses.replace(d, logit_gap=abs(a - b), tolerance=tol, near_tie=abs(a - b) <= tol))
    return dataclasses.replace(result, divergences=tuple(weighed), near_tie_prompts=sum(d.near_tie for d in weighed))

