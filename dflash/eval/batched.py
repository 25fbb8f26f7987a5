"""Batched decoding for eval: every prompt of an eval decoded together, speculative and plain.

The loop is the reference's (dflash.eval.reference: draft a block, verify it, keep the longest
accepted prefix plus the target's next token), run for B rows at once:
- **Slots, not caches that grow.** The target's K/V and the drafter's context live in buffers made
  once for the longest prompt + max_new_tokens + a block (dflash.eval.slots); a row's token at
  position p is in slot p. A round writes the block at each row's own positions; masks keep every
  query to its row's committed slots, so a rejected draft needs no crop: the next round writes
  over it.
- **Rows move at their own pace.** Each row accepts its own number of drafts per round; the batch
  runs until every row has its tokens or an EOS. A finished row leaves the batch (its slots with
  it): at once when the steps run eagerly, when half the batch is done under CUDA graphs (each
  batch size is a graph to capture).
- **Prefill in chunks.** Prompts, longest first, right-padded, at most PREFILL_TOKENS per forward
  (a chunk's hidden states of every layer are live at once); each chunk's taps become the drafter's
  context and its first drafts.
- **Steps as CUDA graphs where the device allows** (dflash.eval.graphs): the verify forward, the
  drafter's block and the plain decode step, each checked against eager runs when captured and on
  the next call. Elsewhere (CPU) they run eagerly, reading only the slots in use.
- **Kept from one eval to the next.** A `SpecWorkspace` is one decode shape's slots and steps;
  `speculative_batch` makes one per call unless handed one that fits. A run's evals keep one, with
  its CUDA graphs, and the first eval's plain decode (dflash.eval.reuse, `evaluate_batched(state=)`).
- **Same tokens, same acceptance.** Greedy: identical generated tokens and per-round acceptance to the
  batch-1 reference on the same prompts (tests/test_eval_batched.py, fp32 CPU; in bf16 two logits
  within rounding of each other may tie the other way, as they may between the reference's own
  speculative and plain decoding). Temperature > 0: the
  same speculative sampling (accept draft d with probability p(d); else draw from p without d), drawn
  on the device from a generator seeded like the caller's, so the draws differ from the
  reference's (which draws on the CPU, one prompt after another) while following the same
  distribution.

The target must take a 4-D attention mask and this duck-typed cache: transformers' sdpa or eager
attention with full-attention layers (Qwen3, Qwen2, Llama, ...). `batched_unsupported` says when it
does not; callers then run the reference loop.
"""

from __future__ import annotations

import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from dflash.eval.draft_step import draft_logits, draft_masks
from dflash.eval.generation import EvalResult, Generation, summarize, sync, with_cache
from dflash.eval.graphs import StepRunner, graphs_available
from dflash.eval.slots import ContextSlots, TargetSlots, check_fits

PREFILL_TOKENS = 8192  # rows × longest prompt per prefill forward (its per-layer hidden states are live at once)


@dataclass(frozen=True)
class BatchDecode:
    """A batch's generations, in prompt order; `seconds` is the whole batch's wall time (each
    Generation carries it too: the prompts were decoded together)."""

    generations: tuple[Generation, ...]
    seconds: float
    steps: int  # batched forwards after the prefill: verify rounds, or plain decode steps
    graphs: bool  # the steps ran as CUDA graphs
    notes: tuple[str, ...] = ()  # why graphs were turned off, when they were
    captured: int = 0  # CUDA graphs captured by this decode
    reused: int = 0  # CUDA graphs of an earlier decode (a kept SpecWorkspace) replayed by this one
    setup_s: float = 0.0  # of `seconds`: graph warm-ups, captures and replay checks


def _setup(runners: list[StepRunner]) -> tuple[int, int, float]:
    """(captured, reused, setup seconds) of a decode's runners (dflash.eval.graphs)."""
    return (sum(r.captures for r in runners), sum(len(r.reused) for r in runners),
            sum(r.setup_s for r in runners))


def batched_unsupported(target, block_size: int = 2) -> str | None:
    """Why `target` cannot be decoded batched here (None: it can)."""
    if not getattr(target, "has_body", True):
        return "the target holds no decoder (an embedding + head view)"
    impl = getattr(target.config, "_attn_implementation", None)
    if impl not in ("sdpa", "eager"):
        return f"attention implementation {impl!r} (batched decoding passes 4-D masks: sdpa or eager)"
    types = getattr(target.config, "layer_types", None)
    if any(t != "full_attention" for t in (types or ())):
        return "the target has sliding-window layers"
    if types is None and getattr(target.config, "sliding_window", None) and \
            getattr(target.config, "use_sliding_window", True):  # Mistral-style: one window for every layer
        return "the target has sliding-window attention"
    if block_size < 2:
        return f"block size {block_size} drafts nothing"
    return None


@dataclass(slots=True)
class _Row:
    """One prompt's decoding state (host side)."""

    index: int
    tokens: list[int]  # prompt + generated so far; the last one is the anchor (not yet seen by the target)
    max_len: int
    start: int  # the anchor's position
    prev_start: int = 0  # the previous round's anchor position: where the new context taps sit
    done: bool = False
    acceptance: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)
    drafted: list[int] = field(default_factory=list)

    def vs(self, block: int) -> int:
        """Block length this round: the reference's min(block, max_len - start); >= 1 (a finished
        row still in the batch drafts a block nobody reads)."""
        return max(1, min(block, self.max_len - self.start))


def _check_prompts(prompts: list[list[int]]) -> None:
    from compilewatch import BadInput

    empty = [i for i, p in enumerate(prompts) if not p]
    if empty:
        raise BadInput(f"prompt {empty[0]} is empty (no tokens): nothing to decode from",
                       hint="every prompt needs at least one token (its chat template renders some)")


def _chunks(lengths: list[int]) -> list[list[int]]:
    """Row indices, longest prompt first, grouped so that rows × longest ≤ PREFILL_TOKENS (≥ 1 row)."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    out: list[list[int]] = []
    for i in order:
        if out and (len(out[-1]) + 1) * lengths[out[-1][0]] <= PREFILL_TOKENS:
            out[-1].append(i)
        else:
            out.append([i])
    return out


def target_mask(target, mask: torch.Tensor) -> torch.Tensor:
    """A bool mask (True = read) as the target's attention takes it, additive in the target's dtype, made
    once for every layer. sdpa: 0 / -inf, what sdpa makes of a bool mask itself (ATen's
    convert_boolean_attn_mask), which it would do again in each layer's call; eager: 0 / the dtype's min."""
    impl = getattr(getattr(target, "config", None), "_attn_implementation", None)
    if impl not in ("eager", "sdpa"):
        return mask
    fill = torch.finfo(target.dtype).min if impl == "eager" else float("-inf")
    return torch.zeros(mask.shape, dtype=target.dtype, device=mask.device).masked_fill(~mask, fill)


def _forward(target, slots: TargetSlots, ids: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor, **kw):
    return target.model(input_ids=ids, position_ids=pos, attention_mask=target_mask(target, mask),
                        **with_cache(target, slots), **kw)


def _prefill(target, slots: TargetSlots, prompts: list[list[int]], rows: list[int], hidden: bool):
    """Prompts `rows` right-padded into one forward, written to their slots. Returns (logits at each
    row's last prompt token (b, V), the model output, the padded length)."""
    dev = target.device
    lens = [len(prompts[i]) for i in rows]
    P = max(lens)
    ids = torch.zeros((len(rows), P), dtype=torch.long)
    for j, i in enumerate(rows):
        ids[j, : lens[j]] = torch.tensor(prompts[i])
    ids = ids.to(dev)
    pos = torch.arange(P, device=dev)[None].expand(len(rows), P)  # (b, P): slot = position
    causal = torch.ones((P, P), dtype=torch.bool, device=dev).tril()[None, None].expand(len(rows), 1, P, P)
    lasts = sorted(set(n - 1 for n in lens))
    slots.set_step(pos, rows=torch.tensor(rows, device=dev), prefill=True)
    out = _forward(target, slots, ids, pos, causal, logits_to_keep=torch.tensor(lasts, device=dev),
                   output_hidden_states=hidden)
    which = torch.tensor([lasts.index(n - 1) for n in lens], device=dev)
    return out.logits[torch.arange(len(rows), device=dev), which], out, P  # (b, V)


def _pick(logits: torch.Tensor, temperature: float, gen: torch.Generator | None) -> torch.Tensor:
    """(b, V) -> (b,): argmax, or a sample at `temperature` (on the logits' device)."""
    if temperature <= 0:
        return logits.argmax(-1)
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    return torch.multinomial(probs, 1, generator=gen)[:, 0]


def accept(block: torch.Tensor, logits: torch.Tensor, vs: torch.Tensor, temperature: float,
           gen: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(accepted drafts (B,), the token after them (B,)) for blocks (B, Q) of which the first vs[b]
    slots are real, given the target's logits (B, Q, V) after each slot. Greedy: the longest prefix of
    drafts equal to the target's argmax. Sampled: draft d at slot i kept with probability p_i(d);
    at the first rejection a draw from p_i without d; all kept: the bonus from p at slot vs-1."""
    B, Q = block.shape
    dev = block.device
    drafts = block[:, 1:]  # (B, Q-1)
    live = torch.arange(Q - 1, device=dev)[None] < (vs - 1)[:, None]  # (B, Q-1): drafted slots
    if temperature <= 0:
        post = logits.argmax(-1)  # (B, Q)
        acc = ((drafts == post[:, :-1]) & live).long().cumprod(1).sum(1)  # (B,)
        return acc, post.gather(1, acc[:, None])[:, 0]
    probs = torch.softmax(logits.float() / temperature, dim=-1)  # (B, Q, V)
    p_d = probs[:, :-1].gather(2, drafts[..., None])[..., 0]  # (B, Q-1)
    u = torch.rand(p_d.shape, generator=gen, device=dev)
    acc = ((u < p_d) & live).long().cumprod(1).sum(1)  # (B,)
    row = probs[torch.arange(B, device=dev), acc]  # (B, V): p at the first rejected slot, or the bonus row
    rejected = acc < vs - 1
    d = drafts.gather(1, acc.clamp(max=Q - 2)[:, None])  # (B, 1): the rejected draft
    residual = row.scatter(1, d, 0.0)
    residual = torch.where((rejected & (residual.sum(1) > 0))[:, None], residual, row)  # p one-hot on d: keep d
    return acc, torch.multinomial(residual, 1, generator=gen)[:, 0]


def device_generator(gen: torch.Generator | None, device: torch.device) -> torch.Generator | None:
    """`gen` when it draws on `device`, else a generator there seeded with `gen`'s seed."""
    if gen is None or gen.device.type == device.type:
        return gen
    return torch.Generator(device=device).manual_seed(gen.initial_seed())


class _Batch:
    """The rows in the batch (finished ones until they are dropped) and what is indexed by them."""

    def __init__(self, rows: list[_Row], caches: list, runners: list[StepRunner], graphs: bool,
                 device: torch.device, reset: bool = True) -> None:
        """`reset`: dropping rows reallocates the caches' buffers, so the runners forget their graphs
        (False: the caches keep buffers per batch size, `keep_sizes`, and the graphs stay valid)."""
        self.rows, self.caches, self.runners, self.graphs, self.device = rows, caches, runners, graphs, device
        self.reset = reset

    def live(self) -> int:
        return sum(not r.done for r in self.rows)

    def compact(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Drop finished rows when due (eagerly: at once; graphs: when half are done); return
        `tensors` (row-indexed) for the rows that stay."""
        live = self.live()
        if live == len(self.rows) or live == 0 or (self.graphs and live > len(self.rows) // 2):
            return tensors
        keep = [b for b, r in enumerate(self.rows) if not r.done]
        idx = torch.tensor(keep, device=self.device)
        for c in self.caches:
            c.select(idx)
        for r in self.runners if self.reset else ():
            r.reset()
        self.rows = [self.rows[b] for b in keep]
        return tuple(t.index_select(0, idx) for t in tensors)


def _finish(row: _Row, produced: list[int], eos: set[int]) -> None:
    """Append a round's tokens, cut at the first EOS and at the budget (the reference's cuts), record
    the round's acceptance length, and mark the row finished when it is."""
    for i, t in enumerate(produced):
        if t in eos:
            produced = produced[: i + 1]
            break
    produced = produced[: row.max_len - len(row.tokens)]
    row.tokens += produced
    row.acceptance.append(len(produced))
    row.done = len(row.tokens) >= row.max_len or row.tokens[-1] in eos


def _weak_step(method: Callable[..., tuple[torch.Tensor, ...]]) -> Callable[..., tuple[torch.Tensor, ...]]:
    """A SpecWorkspace's step for its runners, holding the workspace weakly: a runner holding its own
    workspace would be a reference cycle, and a decode's workspace made for one call (its slots, at 8B
    and 64 rows ~5 GB, and its CUDA graphs' pools) would outlive the call until the cyclic GC ran."""
    ref = weakref.WeakMethod(method)

    def step(kv: int, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return ref()(kv, *inputs)

    return step


class SpecWorkspace:
    """Speculative decoding's buffers and steps for one drafter, target and batch shape (`rows` rows
    of `length` slots): the target's and the drafter's slots, and the verify and draft steps over
    them (StepRunners). `speculative_batch` makes one per call; a run's evals keep one
    (dflash.eval.reuse; `keep` with graphs: buffers per batch size, so its CUDA graphs stay valid)
    and hand it to the next decode of the same shape, which then captures nothing."""

    def __init__(self, drafter, target, rows: int, length: int, block_size: int, graphs: bool,
                 keep: bool = False) -> None:
        dev, bs = target.device, block_size
        self.drafter, self.target, self.rows, self.length, self.block_size = drafter, target, rows, length, bs
        # buffers per batch size only where graphs read them by address: eagerly a smaller batch's are
        # made anew when rows leave (as without a kept workspace) and the full batch's are kept
        self.graphs, self.keep_sizes, self.decodes = graphs, keep and graphs, 0
        att = drafter.layers[0].self_attn
        self.dtype = next(drafter.parameters()).dtype
        self.slots = TargetSlots(rows, length, keep_full=keep, keep_sizes=self.keep_sizes)
        self.ctx = ContextSlots(len(drafter.layers), rows, length, att.nkv, att.d, self.dtype, dev,
                                keep_full=keep, keep_sizes=self.keep_sizes)
        self.sliding = "sliding_attention" in drafter.spec.layer_types
        self.ar = torch.arange(bs, device=dev)
        self.masks_id = torch.full((1, bs - 1), drafter.spec.mask_token_id, dtype=torch.long, device=dev)
        self.runners = [StepRunner("verify", _weak_step(self._verify), length, graphs),
                        StepRunner("draft", _weak_step(self._draft), length, graphs)]

    def fits(self, drafter, target, rows: int, length: int, block_size: int, graphs: bool) -> bool:
        """Whether a decode of this shape with these models can run here."""
        return (drafter is self.drafter and target is self.target and (rows, length, block_size, graphs) ==
                (self.rows, self.length, self.block_size, self.graphs)
                and next(drafter.parameters()).dtype == self.dtype)

    def begin(self) -> None:
        """Ready for a decode: the full batch's slots, the runners' counts at 0."""
        self.slots.restore()
        self.ctx.restore()
        for r in self.runners:
            r.begin()
        self.decodes += 1

    def _verify(self, kv: int, block: torch.Tensor, start: torch.Tensor):
        target, dev = self.target, self.target.device
        pos = start[:, None] + self.ar  # (B, Q)
        self.slots.set_step(pos, kv_len=kv)
        mask = torch.arange(kv, device=dev)[None, None, None, :] <= pos[:, None, :, None]  # (B, 1, Q, KV)
        out = _forward(target, self.slots, block, pos, mask, output_hidden_states=True)
        return out.logits, torch.cat([out.hidden_states[i + 1] for i in target.layer_ids], dim=-1)

    def _draft(self, kv: int, anchor: torch.Tensor, taps: torch.Tensor, prev: torch.Tensor, start: torch.Tensor,
               vs: torch.Tensor):
        bs, ar, spec = self.block_size, self.ar, self.drafter.spec
        block = torch.cat([anchor[:, None], self.masks_id.expand(anchor.shape[0], -1)], 1)
        masks = draft_masks(start, vs, bs, kv, spec.sliding_window, self.sliding)
        return (draft_logits(self.drafter, self.target, self.ctx, block, taps, prev[:, None] + ar,
                             start[:, None] + ar, masks, kv_len=kv),)


def spec_length(prompts: list[list[int]], max_new_tokens: int, block_size: int) -> int:
    """Slots a row needs for speculative decoding of `prompts`: the longest + the budget + a block."""
    return max(len(p) for p in prompts) + max_new_tokens + block_size


def resolve_graphs(device: torch.device, use_graphs: bool | None) -> bool:
    """Whether steps run as CUDA graphs: None = where the device allows."""
    return graphs_available(device) if use_graphs is None else use_graphs and graphs_available(device)


@torch.no_grad()
def speculative_batch(drafter, target, prompts: list[list[int]], max_new_tokens: int, block_size: int,
                      temperature: float = 0.0, generator: torch.Generator | None = None,
                      use_graphs: bool | None = None, on_done: Callable[[int], None] | None = None,
                      workspace: SpecWorkspace | None = None) -> BatchDecode:
    """Speculative decoding of every prompt at once (module docstring). `on_done(n)`: n rows finished.
    `workspace`: buffers and steps kept from an earlier decode (used when it `fits` this one)."""
    _check_prompts(prompts)
    dev, eos, bs = target.device, set(target.eos_ids), block_size
    graphs = resolve_graphs(dev, use_graphs)
    gen = device_generator(generator, dev)
    t0 = time.perf_counter()
    rows = [_Row(i, list(p), len(p) + max_new_tokens, len(p)) for i, p in enumerate(prompts)]
    if not rows:
        return BatchDecode((), 0.0, 0, graphs)
    L = spec_length(prompts, max_new_tokens, bs)
    ws = workspace
    if ws is None or not ws.fits(drafter, target, len(rows), L, bs, graphs):
        # also for callers that do not go through evaluate_batched (dflash check: a huge --max-new-tokens was
        # torch's allocation traceback, or the OOM killer)
        check_fits(drafter, target, len(rows), max(map(len, prompts)), max_new_tokens, L, False)
        ws = SpecWorkspace(drafter, target, len(rows), L, bs, graphs)
    ws.begin()
    spec, slots, ctx, ar = drafter.spec, ws.slots, ws.ctx, ws.ar
    drafts = torch.empty((len(rows), bs - 1), dtype=torch.long, device=dev)
    firsts = torch.empty(len(rows), dtype=torch.long, device=dev)
    for chunk in _chunks([len(p) for p in prompts]):
        logits, out, P = _prefill(target, slots, prompts, chunk, hidden=True)
        first = _pick(logits, temperature, gen)  # (b,)
        taps = torch.cat([out.hidden_states[i + 1] for i in target.layer_ids], dim=-1)  # (b, P, k·H)
        del out
        r_t = torch.tensor(chunk, device=dev)
        start = torch.tensor([rows[i].start for i in chunk], device=dev)
        vs = torch.tensor([rows[i].vs(bs) for i in chunk], device=dev)
        block = torch.cat([first[:, None], ws.masks_id.expand(len(chunk), -1)], 1)  # (b, Q)
        dl = draft_logits(drafter, target, ctx, block, taps, torch.arange(P, device=dev)[None].expand(len(chunk), P),
                          start[:, None] + ar, draft_masks(start, vs, bs, P + bs, spec.sliding_window, ws.sliding),
                          rows=r_t, kv_len=P + bs)
        drafts[r_t], firsts[r_t] = dl.argmax(-1), first
    for r, t in zip(rows, firsts.tolist()):
        r.tokens.append(t)
        r.done = len(r.tokens) >= r.max_len or t in eos

    runners = ws.runners
    batch = _Batch(rows, [slots, ctx], runners, graphs, dev, reset=not ws.keep_sizes)
    (drafts,) = batch.compact(drafts)
    steps, finished = 0, sum(r.done for r in rows)
    while batch.live():
        host = torch.tensor([[r.start for r in batch.rows], [r.vs(bs) for r in batch.rows],
                             [r.tokens[-1] for r in batch.rows]], device=dev)
        start, vs, anchor = host[0], host[1], host[2]
        kv = max(r.start for r in batch.rows) + bs
        block = torch.cat([anchor[:, None], drafts], 1)  # (B, Q)
        logits, taps = runners[0](kv, block, start)
        acc, last = accept(block, logits, vs, temperature, gen)
        got = torch.cat([block, acc[:, None], last[:, None]], 1).tolist()  # the round's one sync
        steps += 1
        for r, g in zip(batch.rows, got):
            if r.done:
                continue
            a, n = g[bs], r.vs(bs)
            r.accepted.append(a)
            r.drafted.append(n - 1)
            _finish(r, g[1: a + 1] + [g[bs + 1]], eos)
            r.prev_start, r.start = r.start, r.start + a + 1
        if on_done is not None and sum(r.done for r in rows) != finished:
            finished = sum(r.done for r in rows)
            on_done(finished)
        if not batch.live():
            break
        taps, drafts = batch.compact(taps, drafts)
        host = torch.tensor([[r.tokens[-1] for r in batch.rows], [r.prev_start for r in batch.rows],
                             [r.start for r in batch.rows], [r.vs(bs) for r in batch.rows]], device=dev)
        kv = max(r.start for r in batch.rows) + bs
        (dl,) = runners[1](kv, host[0], taps, host[1], host[2], host[3])
        drafts = dl.argmax(-1)
    sync(dev)
    seconds = time.perf_counter() - t0
    gens = tuple(Generation(tokens=r.tokens[len(prompts[r.index]):], acceptance=r.acceptance, seconds=seconds,
                            accepted=r.accepted, drafted=r.drafted) for r in rows)
    return BatchDecode(gens, seconds, steps, graphs and all(x.use_graphs for x in runners),
                       tuple(x.note for x in runners if x.note), *_setup(runners))


@torch.no_grad()
def plain_batch(target, prompts: list[list[int]], max_new_tokens: int, use_graphs: bool | None = None,
                on_done: Callable[[int], None] | None = None) -> BatchDecode:
    """Greedy decoding of every prompt at once with the target alone, one token per row per step."""
    _check_prompts(prompts)
    dev, eos = target.device, set(target.eos_ids)
    graphs = resolve_graphs(dev, use_graphs)
    t0 = time.perf_counter()
    rows = [_Row(i, list(p), len(p) + max_new_tokens, len(p)) for i, p in enumerate(prompts)]
    if not rows:
        return BatchDecode((), 0.0, 0, graphs)
    L = max(len(p) for p in prompts) + max_new_tokens + 1
    slots = TargetSlots(len(rows), L)
    firsts = torch.empty(len(rows), dtype=torch.long, device=dev)
    for chunk in _chunks([len(p) for p in prompts]):
        logits, _, _ = _prefill(target, slots, prompts, chunk, hidden=False)
        firsts[torch.tensor(chunk, device=dev)] = logits.argmax(-1)
    for r, t in zip(rows, firsts.tolist()):
        r.tokens.append(t)
        r.done = len(r.tokens) >= r.max_len or t in eos

    def step(kv: int, tok: torch.Tensor, pos: torch.Tensor):
        slots.set_step(pos[:, None], kv_len=kv)
        mask = torch.arange(kv, device=dev)[None, None, None, :] <= pos[:, None, None, None]  # (B, 1, 1, KV)
        return (_forward(target, slots, tok[:, None], pos[:, None], mask).logits[:, -1],)  # (B, V)

    runner = StepRunner("plain", step, L, graphs)
    batch = _Batch(rows, [slots], [runner], graphs, dev)
    steps, finished = 0, sum(r.done for r in rows)
    while batch.live():
        batch.compact()
        host = torch.tensor([[r.tokens[-1] for r in batch.rows], [len(r.tokens) - 1 for r in batch.rows]], device=dev)
        (logits,) = runner(max(len(r.tokens) for r in batch.rows), host[0], host[1])
        steps += 1
        for r, t in zip(batch.rows, logits.argmax(-1).tolist()):
            if not r.done:
                r.tokens.append(t)
                r.done = len(r.tokens) >= r.max_len or t in eos
        if on_done is not None and sum(r.done for r in rows) != finished:
            finished = sum(r.done for r in rows)
            on_done(finished)
    sync(dev)
    seconds = time.perf_counter() - t0
    gens = tuple(Generation(tokens=r.tokens[len(prompts[r.index]):], acceptance=[], seconds=seconds) for r in rows)
    return BatchDecode(gens, seconds, steps, graphs and runner.use_graphs, (runner.note,) if runner.note else (),
                       *_setup([runner]))


def evaluate_batched(drafter, target, prompts: list[list[int]], max_new_tokens: int, block_size: int,
                     progress: Callable[[int, int], None] | None = None, use_graphs: bool | None = None,
                     state: Any = None, step: int | None = None) -> tuple[EvalResult, tuple[str, ...]]:
    """Plain and speculative greedy decoding of all prompts, each pass batched; compared and timed.
    Speedup = plain batch wall time / speculative batch wall time (same prompts, same batch, same
    token budget; graph captures counted in each). `progress(done, total)`: (0, total) first, then as
    rows finish (done = the mean of the two passes' finished rows). Returns (result, notes).

    `state` (a dflash.eval.reuse.EvalState, which imports this module: a run's evals; `step` the
    training step of this one): the warm-up only at its first eval (of the speculative path alone when a
    kept baseline spares this eval the plain pass); the speculative buffers and CUDA
    graphs it keeps; and its plain baseline instead of a plain pass where that provably applies (the
    same target, unchanged, the same prompts and budget), timed then less its graph setup; the speedup
    then takes this eval's graph setup off the speculative pass too (decoding against decoding). What was
    reused is `state.last`."""
    n = len(prompts)
    graphs = resolve_graphs(target.device, use_graphs)
    if prompts:
        _check_prompts(prompts)
        longest = max(len(p) for p in prompts)
        check_fits(drafter, target, n, longest, max_new_tokens, spec_length(prompts, max_new_tokens, block_size),
                   graphs and state is not None)
    if progress:
        progress(0, n)
    base = state.baseline_for(target, prompts, max_new_tokens, graphs) if state is not None and prompts else None
    warm_up_s = None
    if prompts and (state is None or state.evals == 0):  # warm the paths this eval times once (allocator,
        t0 = time.perf_counter()                            # kernels, first-call overheads) outside the timing
        if base is None:  # a kept baseline (a resumed run's, another run's) times no plain decode here
            plain_batch(target, prompts[:1], 2, use_graphs=False)
        speculative_batch(drafter, target, prompts[:1], 2, block_size, use_graphs=False)
        warm_up_s = time.perf_counter() - t0
    done = [0, 0]

    def report(which: int):
        def on_done(k: int) -> None:
            done[which] = k
            if progress:
                progress((done[0] + done[1]) // 2, n)
        return on_done

    if base is None:
        plain = plain_batch(target, prompts, max_new_tokens, use_graphs=use_graphs, on_done=report(0))
        plain_gens, plain_s, notes = plain.generations, plain.seconds, plain.notes
        if state is not None and prompts:
            state.keep_baseline(target, prompts, max_new_tokens, graphs, plain, step)
    else:
        plain = None
        plain_gens, plain_s, notes = base.generations, base.seconds, (base.note(),)
        report(0)(n)
    ws = state.workspace_for(drafter, target, prompts, max_new_tokens, block_size, graphs) \
        if state is not None and prompts else None
    spec = speculative_batch(drafter, target, prompts, max_new_tokens, block_size, use_graphs=use_graphs,
                             on_done=report(1), workspace=ws)
    if progress and (done[0] + done[1]) // 2 < n:
        progress(n, n)
    if state is not None:
        state.record(plain, spec, base, warm_up_s)
    # a kept baseline's time is its decode less its graph setup: compare it with this pass's decode less
    # its own (a new process's first eval captures; a later one checks each kept graph once)
    spec_s = spec.seconds - spec.setup_s if base is not None else spec.seconds
    result = summarize(list(plain_gens), list(spec.generations), plain_s, spec_s, block_size)
    return result, notes + spec.notes
