"""The reference speculative decoder: one prompt at a time, a transformers DynamicCache cropped each
round, a drafter context that grows by torch.cat. Batched decoding (dflash.eval.batched) is held to
its tokens and acceptance; `dflash eval`, `dflash check` and periodic eval run the batched one
where the target allows (dflash.eval.evaluate).

The loop follows the reference (z-lab `dflash_generate`, greedy, batch 1):
1. Prefill the target on the prompt with `output_hidden_states`; its taps are the drafter's context;
   the target's argmax is the first new token.
2. Each round the block is `[last token, MASK × (B-1)]` at positions `start .. start+B-1`; the drafter
   fills slots 1..B-1 in one forward (its context K/V are cached and grow by the accepted tokens).
3. The target verifies the whole block in one forward; accepted = the longest prefix of draft tokens
   equal to the target's argmax at the previous position; the round appends those plus the target's
   bonus token, so its acceptance length is accepted + 1 (at most B).
4. The target's KV cache is cropped to the accepted length; the accepted positions' taps extend the
   drafter's context.
τ = mean acceptance length per round. Greedy speculative decoding produces exactly the tokens of
greedy plain decoding, which `evaluate` checks (`outputs_match`). Speedup = plain / speculative
wall time for the same prompts and token budget (dflash.eval.generation).

`temperature > 0` (`dflash check --temperature`): the target samples, and a draft token d is accepted
with probability p(d) (speculative sampling with the drafter's greedy proposal: q is one-hot, so
min(1, p/q) = p(d)); a rejected position draws from p without d, the bonus from p. The output then
follows the target's sampling distribution (not plain greedy decoding's tokens).
"""

from __future__ import annotations

import time
from typing import Callable, Protocol

import torch

from dflash.eval.generation import EvalResult, Generation, summarize, sync, with_cache
from dflash.model.drafter import ContextCache, DFlashDrafter
from dflash.model.mask import build_masks


class Proposer(Protocol):
    """Drafts tokens for one block. `tokens`: the sequence so far, ending with the block's anchor;
    `new_ctx`: target taps (1, n, k·H) of the positions accepted since the last call."""

    def reset(self) -> None: ...
    def propose(self, tokens: list[int], new_ctx: torch.Tensor, block_len: int) -> list[int]: ...


class DrafterProposer:
    """A DFlashDrafter drafting through the target's frozen embedding and LM head."""

    def __init__(self, drafter: DFlashDrafter, target) -> None:
        self.drafter, self.target = drafter, target
        self.cache = ContextCache(drafter.spec.num_hidden_layers)
        self.ctx_len = 0

    def reset(self) -> None:
        self.cache = ContextCache(self.drafter.spec.num_hidden_layers)
        self.ctx_len = 0

    @torch.no_grad()
    def propose(self, tokens: list[int], new_ctx: torch.Tensor, block_len: int) -> list[int]:
        spec, dev = self.drafter.spec, self.target.device
        start = len(tokens) - 1  # the anchor's position
        block = torch.full((1, block_len), spec.mask_token_id, dtype=torch.long, device=dev)
        block[0, 0] = tokens[-1]
        n_new = new_ctx.shape[1]
        ctx_pos = torch.arange(self.ctx_len, self.ctx_len + n_new, device=dev)[None]  # (1, n)
        self.ctx_len += n_new
        block_pos = torch.arange(start, start + block_len, device=dev)[None]  # (1, block_len)
        masks = None
        if "sliding_attention" in spec.layer_types:
            anchors = torch.tensor([[start]], device=dev)
            masks = build_masks(anchors, self.ctx_len, block_len, "sdpa", spec.sliding_window, need_sliding=True)
        param = next(self.drafter.parameters())
        h = self.drafter(self.target.embed(block).to(param.dtype), new_ctx.to(param.dtype), block_pos, ctx_pos,
                         masks=masks, cache=self.cache)  # (1, block_len, H)
        logits = self.target.head(h[:, 1:].to(self.target.dtype))  # (1, block_len-1, V)
        return logits.argmax(-1)[0].tolist()


def _crop(cache, length: int) -> None:
    remove = cache.get_seq_length() - length
    if remove > 0:
        cache.crop(-remove)  # "remove this many": works across transformers versions


@torch.no_grad()
def plain_generate(target, prompt: list[int], max_new_tokens: int) -> Generation:
    """Greedy decoding with the target alone, one token per forward (the baseline)."""
    from transformers import DynamicCache

    dev, eos = target.device, set(target.eos_ids)
    t0 = time.perf_counter()
    cache = DynamicCache(config=target.config)
    out = target.model(input_ids=torch.tensor([prompt], device=dev), **with_cache(target, cache), logits_to_keep=1)
    tok = int(out.logits[0, -1].argmax())
    new = [tok]
    while len(new) < max_new_tokens and tok not in eos:
        out = target.model(input_ids=torch.tensor([[tok]], device=dev), **with_cache(target, cache))
        tok = int(out.logits[0, -1].argmax())
        new.append(tok)
    sync(dev)
    return Generation(tokens=new, acceptance=[], seconds=time.perf_counter() - t0)


@torch.no_grad()
def speculative_generate(proposer: Proposer, target, prompt: list[int], max_new_tokens: int,
                         block_size: int, temperature: float = 0.0,
                         generator: torch.Generator | None = None) -> Generation:
    """Speculative decoding per the reference loop (module docstring): greedy at temperature 0, else
    speculative sampling with the drafter's greedy drafts (`generator`: the sampling's randomness)."""
    from transformers import DynamicCache

    dev, eos = target.device, set(target.eos_ids)
    t0 = time.perf_counter()
    proposer.reset()
    # every layer keeps all its K/V (a sliding-window layer's cache of the config's kind cannot be cropped back once
    # the window is reached: Mistral, Gemma 2); the window is the attention mask's, from the config either way
    cache = DynamicCache()
    out = target.model(input_ids=torch.tensor([prompt], device=dev), **with_cache(target, cache),
                       output_hidden_states=True, logits_to_keep=1)
    tokens = list(prompt) + [_pick(out.logits[0, -1:], temperature, generator)[0]]
    new_ctx = torch.cat([out.hidden_states[i + 1] for i in target.layer_ids], dim=-1)  # (1, P, k·H)
    max_len = len(prompt) + max_new_tokens
    acceptance: list[int] = []
    accepted_n: list[int] = []
    drafted_n: list[int] = []
    start = len(prompt)  # position of the block's anchor (the newest token, not yet seen by the target)
    while len(tokens) < max_len and tokens[-1] not in eos:
        vs = min(block_size, max_len - start)
        block = [tokens[-1]]
        if vs > 1:
            block += proposer.propose(tokens, new_ctx, vs)
        out = target.model(input_ids=torch.tensor([block], device=dev), **with_cache(target, cache),
                           position_ids=torch.arange(start, start + vs, device=dev)[None], output_hidden_states=True)
        if temperature > 0:
            accepted, last = _verify_sampled(block, out.logits[0].float(), temperature, generator)
        else:
            posterior = out.logits[0].argmax(-1).tolist()  # target's next token after each block position
            accepted = 0
            while accepted < vs - 1 and block[accepted + 1] == posterior[accepted]:
                accepted += 1
            last = posterior[accepted]
        accepted_n.append(accepted)
        drafted_n.append(vs - 1)
        produced = block[1: accepted + 1] + [last]
        for i, t in enumerate(produced):  # stop at the first EOS
            if t in eos:
                produced = produced[: i + 1]
                break
        produced = produced[: max_len - len(tokens)]
        tokens += produced
        acceptance.append(len(produced))
        _crop(cache, start + accepted + 1)  # keep the anchor and the accepted drafts
        new_ctx = torch.cat([out.hidden_states[i + 1] for i in target.layer_ids], dim=-1)[:, : accepted + 1]
        start += accepted + 1
    sync(dev)
    return Generation(tokens=tokens[len(prompt):], acceptance=acceptance, seconds=time.perf_counter() - t0,
                      accepted=accepted_n, drafted=drafted_n)


def _pick(logits: torch.Tensor, temperature: float, generator: torch.Generator | None) -> list[int]:
    """The next token after each row of `logits` (n, V): argmax, or a sample at `temperature`."""
    if temperature <= 0:
        return logits.argmax(-1).tolist()
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    return torch.multinomial(probs.cpu(), 1, generator=generator)[:, 0].tolist()


def _verify_sampled(block: list[int], logits: torch.Tensor, temperature: float,
                    generator: torch.Generator | None) -> tuple[int, int]:
    """(accepted drafts, the token after them) for one block under speculative sampling with a
    one-hot (greedy) proposal: accept draft d at row i with probability p_i(d); on a rejection draw
    from p_i with d removed; after all drafts, the bonus from the last row."""
    probs = torch.softmax(logits / temperature, dim=-1).cpu()  # (vs, V)
    vs = len(block)
    for i in range(vs - 1):
        d = block[i + 1]
        if float(torch.rand((), generator=generator)) < float(probs[i, d]):
            continue
        residual = probs[i].clone()
        residual[d] = 0.0
        if float(residual.sum()) <= 0:  # p was one-hot on d (then d is always accepted): unreachable
            return i, d
        return i, int(torch.multinomial(residual, 1, generator=generator))
    return vs - 1, int(torch.multinomial(probs[vs - 1], 1, generator=generator))


def evaluate(proposer: Proposer, target, prompts: list[list[int]], max_new_tokens: int, block_size: int,
             progress: Callable[[int, int], None] | None = None) -> EvalResult:
    """Run plain and speculative greedy decoding on every prompt, one prompt at a time; compare and
    time them. `progress(done, total)`: (0, total) once everything is loaded, then after each prompt."""
    if progress:
        progress(0, len(prompts))
    if prompts:  # warm both paths once (allocator, first-call overheads) outside the timing
        plain_generate(target, prompts[0], 2)
        speculative_generate(proposer, target, prompts[0], 2, block_size)
    plains, specs = [], []
    for i, p in enumerate(prompts):
        plains.append(plain_generate(target, p, max_new_tokens))
        specs.append(speculative_generate(proposer, target, p, max_new_tokens, block_size))
        if progress:
            progress(i + 1, len(prompts))
    return summarize(plains, specs, sum(g.seconds for g in plains), sum(g.seconds for g in specs), block_size)
