"""What a decoding produces and what an eval reports, shared by the batch-1 reference loop
(dflash.eval.reference) and the batched decoder (dflash.eval.batched).

- `Generation`: one prompt's new tokens and, for speculative decoding, every verify round's acceptance
  length, drafts accepted and drafts proposed.
- `EvalResult` (`summarize`): τ = mean acceptance length per verify round (bonus token included),
  its histogram, acceptance by block position, speedup = plain / speculative wall time for the same
  prompts and token budget, and whether speculative decoding gave plain greedy decoding's tokens.
- Acceptance by block position k (1..B-1): of the rounds that drafted a token at position k, the
  share whose first k drafts were all accepted (so it falls with k; position 1's share is the rate of
  rounds that accept anything).
"""

from __future__ import annotations

import functools
import inspect
import statistics
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class Generation:
    tokens: list[int]  # new tokens only
    acceptance: list[int]  # per verify round (empty for plain decoding)
    seconds: float  # batched decoding: the whole batch's wall time (its prompts were decoded together)
    accepted: list[int] = field(default_factory=list)  # per round: drafts accepted (before EOS / budget cuts)
    drafted: list[int] = field(default_factory=list)  # per round: drafts proposed (block length - 1)


@dataclass(frozen=True)
class Divergence:
    """Where one prompt's speculative tokens first differ from its plain greedy tokens, and how close the
    target's logits were there (`dflash.eval.divergence.weigh`)."""

    prompt: int  # the prompt's index
    position: int  # index among the new tokens
    plain_token: int | None  # None: that decoding had ended
    spec_token: int | None
    shared_tokens: tuple[int, ...] = ()  # the new tokens both decodings produced before `position`
    logit_gap: float | None = None  # |logit(plain) - logit(spec)| from one fresh target forward of the shared prefix
    tolerance: float | None = None  # what rounding in the target's dtype can move two logits by there
    near_tie: bool = False  # logit_gap <= tolerance: the two decodings' arithmetic can pick either token


@dataclass(frozen=True)
class EvalResult:
    prompts: int
    rounds: int
    tau: float  # mean acceptance length per verify round, bonus token included
    max_tau: int  # block_size: every draft accepted plus the bonus
    acceptance_histogram: dict[int, int]
    generated_tokens: int
    plain_seconds: float
    spec_seconds: float
    speedup: float  # plain / speculative wall time (both batch-1, or both batched over the same prompts)
    plain_tokens_per_s: float
    spec_tokens_per_s: float
    outputs_match: bool  # speculative == plain greedy output for every prompt
    mismatched_prompts: int
    # per block position 1..B-1: share of the rounds drafting it that accepted drafts 1..k (None: never drafted)
    acceptance_by_position: tuple[float | None, ...] = ()
    near_tie_prompts: int = 0  # mismatched prompts whose first difference is a near-tie of the target's logits
    divergences: tuple[Divergence, ...] = ()  # each mismatched prompt's first difference

    @property
    def differ_beyond_rounding(self) -> int:
        """Mismatched prompts not explained by rounding: the ones a lossless check fails on."""
        return self.mismatched_prompts - self.near_tie_prompts


def acceptance_by_position(accepted: list[int], drafted: list[int], block_size: int) -> list[float | None]:
    """Per block position k = 1..B-1: of the rounds that drafted position k, the share that accepted
    drafts 1..k (None where no round drafted k)."""
    out: list[float | None] = []
    for k in range(1, block_size):
        n = sum(1 for d in drafted if d >= k)
        out.append(sum(1 for a, d in zip(accepted, drafted) if d >= k and a >= k) / n if n else None)
    return out


def summarize(plain: list[Generation], spec: list[Generation], plain_seconds: float, spec_seconds: float,
              block_size: int) -> EvalResult:
    """The EvalResult of plain and speculative generations of the same prompts (in the same order)."""
    acc = [a for g in spec for a in g.acceptance]
    accepted = [a for g in spec for a in g.accepted]
    drafted = [d for g in spec for d in g.drafted]
    n_tokens = sum(len(g.tokens) for g in spec)
    divergences = tuple(d for i, (p, s) in enumerate(zip(plain, spec)) if (d := first_divergence(i, p.tokens, s.tokens)))
    mismatches = len(divergences)
    hist: dict[int, int] = {}
    for a in acc:
        hist[a] = hist.get(a, 0) + 1
    return EvalResult(
        prompts=len(spec), rounds=len(acc), tau=statistics.fmean(acc) if acc else float("nan"),
        max_tau=block_size, acceptance_histogram=dict(sorted(hist.items())), generated_tokens=n_tokens,
        plain_seconds=plain_seconds, spec_seconds=spec_seconds,
        speedup=plain_seconds / spec_seconds if spec_seconds else float("nan"),
        plain_tokens_per_s=n_tokens / plain_seconds if plain_seconds else float("nan"),
        spec_tokens_per_s=n_tokens / spec_seconds if spec_seconds else float("nan"),
        outputs_match=mismatches == 0, mismatched_prompts=mismatches,
        acceptance_by_position=tuple(acceptance_by_position(accepted, drafted, block_size)),
        divergences=divergences,
    )


def first_divergence(prompt: int, plain: list[int], spec: list[int]) -> Divergence | None:
    """The first new-token position where `spec` differs from `plain` (None when they are equal); a token
    is None where that decoding had already ended."""
    if plain == spec:
        return None
    j = next((k for k, (a, b) in enumerate(zip(plain, spec)) if a != b), min(len(plain), len(spec)))
    return Divergence(prompt, j, plain[j] if j < len(plain) else None, spec[j] if j < len(spec) else None,
                      tuple(plain[:j]))


@functools.cache
def _cache_kw(model_cls: type) -> str:
    """transformers 5.2x renamed `past_key_values` to `cache`; use whichever this version takes."""
    return "cache" if "cache" in inspect.signature(model_cls.forward).parameters else "past_key_values"


def with_cache(target, cache) -> dict:
    """The keyword arguments that hand `cache` to the target's forward."""
    return {_cache_kw(type(target.model)): cache, "use_cache": True}


def sync(device: torch.device) -> None:
    """Wait for the device (CUDA work is asynchronous: a wall clock read needs it done)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
