"""Why speculative decoding's tokens differ from plain greedy decoding's, where they do.

Greedy speculative decoding is lossless in exact arithmetic: every token it keeps is the target's argmax
on the same prefix. On a GPU the two decodings compute that argmax with different kernels (the verify pass
scores a block of positions at once, plain decoding one position against its K/V cache), and in bf16 the
logits they get differ by a few units of the last place. Where the target's top two logits are that
close, either token can win: the outputs then part ways without anything being wrong (on a random-weight
8B target that happens at almost every prompt: its logits are nearly flat; docs/benchmarks.md).

`weigh` runs the target on each mismatched prompt's shared prefix (the prompt and the new tokens the two
decodings agree on; several prefixes a forward) and compares the logits of the two tokens they chose there. Within `tolerance`
(NEAR_TIE_EPS machine epsilons of the target's dtype, relative to the larger logit's magnitude, at least
1) it is a near-tie: reported, not a failure. A wider gap (or one decoding stopping where the other goes
on) is a real difference, which `dflash eval` fails on (exit 1). In fp32 the tolerance is ~1e-6 of the
logits, so any real difference is a failure there.
"""

from __future__ import annotations

import dataclasses

import torch

from dflash.eval.batched import target_mask
from dflash.eval.generation import Divergence, EvalResult

NEAR_TIE_EPS = 8  # machine epsilons (relative to the logit's size): bf16 0.0078 each, so ~6% of the logit.
# Measured at 8B with random bf16 weights on an H200 (docs/benchmarks.md): 16 of 16 prompts parted, at gaps of
# 0 to 0.125 (up to 4 bf16 units in the last place) with logits of ~5.5, where this tolerance is ~0.34.
BATCH = 8  # prefixes weighed in one forward


def tolerance(dtype: torch.dtype, a: float, b: float) -> float:
    """How far rounding in `dtype` can move two logits of sizes `a`, `b` apart (see the module doc)."""
    return NEAR_TIE_EPS * torch.finfo(dtype).eps * max(1.0, abs(a), abs(b))


@torch.inference_mode()
def weigh(result: EvalResult, target, prompts: list[list[int]], batch: int = BATCH) -> EvalResult:
    """`result` with each divergence's logit gap, tolerance and near-tie verdict, and `near_tie_prompts`:
    the target's decoder runs on the mismatched prompts' shared prefixes (each prompt and the new tokens both
    decodings agree on), `batch` at a time, right-padded, and its LM head reads only each prefix's last position."""
    if not result.divergences:
        return result
    # the dtype the target computes in: a bf16 target rounds its logits in bf16 even where it returns fp32
    dtype = getattr(target, "dtype", None) or next(target.model.parameters()).dtype
    asked = [d for d in result.divergences if d.plain_token is not None and d.spec_token is not None]
    # (one decoding ending where the other goes on is not a question of rounding: left as a difference)
    gaps: dict[int, tuple[float, float]] = {}
    for i in range(0, len(asked), batch):
        part = asked[i: i + batch]
        last = _last_logits(target, [list(prompts[d.prompt]) + list(d.shared_tokens) for d in part])
        for d, row in zip(part, last):
            gaps[id(d)] = (float(row[d.plain_token]), float(row[d.spec_token]))
    weighed = []
    for d in result.divergences:
        if id(d) in gaps:
            a, b = gaps[id(d)]
            tol = tolerance(dtype, a, b)
            d = dataclasses.replace(d, logit_gap=abs(a - b), tolerance=tol, near_tie=abs(a - b) <= tol)
        weighed.append(d)
    return dataclasses.replace(result, divergences=tuple(weighed), near_tie_prompts=sum(d.near_tie for d in weighed))


def _last_logits(target, seqs: list[list[int]]) -> torch.Tensor:
    """(len(seqs), vocab) fp32: the target's next-token logits after each sequence (right-padded together;
    the decoder's last hidden state at each sequence's end through the LM head)."""
    longest = max(map(len, seqs))
    ids = torch.zeros(len(seqs), longest, dtype=torch.long)
    for r, s in enumerate(seqs):
        ids[r, : len(s)] = torch.tensor(s, dtype=torch.long)
    dev = target.device
    ids = ids.to(dev)
    # the 4-D causal mask the eval's own prefill passes (right-padded: a real position never reads a pad),
    # which transformers takes as given, rather than a 2-D padding mask it would build one from
    causal = torch.ones((longest, longest), dtype=torch.bool, device=dev).tril()[None, None]
    pos = torch.arange(longest, device=dev)[None].expand(len(seqs), longest)
    hidden = target.model.get_decoder()(input_ids=ids, position_ids=pos, attention_mask=target_mask(
        target, causal.expand(len(seqs), 1, longest, longest))).last_hidden_state
    ends = torch.tensor([len(s) - 1 for s in seqs], device=hidden.device)
    return target.head(hidden[torch.arange(len(seqs), device=hidden.device), ends]).float()
