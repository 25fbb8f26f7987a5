"""dflash.eval.batched: every prompt decoded together over preallocated K/V slots gives the batch-1
reference's tokens and per-round acceptance, prompt for prompt (greedy, fp32, CPU).

The drafter here is trained for a few steps on the tiny target's own greedy continuations of the test
prompts, so it accepts 1 to 8 tokens a round: a random drafter accepts nothing, and identical
acceptance lengths of all-1 rounds would say little about the accepted-prefix bookkeeping."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from dflash.config import tiny
from dflash.data.dataset import embedded_prompts
from dflash.eval.batched import batched_unsupported, plain_batch, speculative_batch
from dflash.eval.evaluate import (DrafterProposer, evaluate, evaluate_drafter, plain_generate, prompt_ids,
                                  speculative_generate)
from dflash.model.build import drafter_spec
from dflash.model.drafter import DFlashDrafter
from tests.dflash_helpers import chat_file, tiny_target  # noqa: F401 (fixtures)
from tests.helpers import requires_cuda

NEW = 40  # new tokens per prompt
TRAIN_STEPS = 15


def mixed_prompts(target, n: int = 6) -> list[list[int]]:
    """Prompts of 5 to 40 tokens (cut from the embedded prompts): rows of different lengths."""
    return [p[: 5 + 7 * i] for i, p in enumerate(prompt_ids(target.tokenizer, embedded_prompts(n, seed=5)))]


def late_eos(target, prompts, rows: int) -> list[int]:
    """A token from each of the first `rows` prompts' greedy continuations that no prompt's
    continuation holds before its 5th token: as EOS ids they end those rows mid-way, at different
    rounds, and no row at its first tokens."""
    gens = [plain_generate(target, p, NEW).tokens for p in prompts]
    out: list[int] = []
    for g in gens[:rows]:
        out.append(next(x for x in g[6:] if x not in out and all(x not in h[:5] for h in gens)))
    return out


def trained_drafter(target, sliding: bool) -> DFlashDrafter:
    """A tiny drafter fit for TRAIN_STEPS passes to the target's greedy continuations of the test
    prompts (every anchor of each sequence, plain CE on slots 1..B-1): it accepts a varied number of
    drafts per round. `sliding`: layer 0 sliding-window (window 12, shorter than the sequences)."""
    from dflash.config import tiny
    from dflash.model.loss import make_blocks
    from dflash.model.mask import build_masks

    spec = drafter_spec(tiny(), target)
    if sliding:
        spec = dataclasses.replace(spec, layer_types=("sliding_attention",) + spec.layer_types[1:], sliding_window=12)
    drafter = DFlashDrafter(spec)
    drafter.init_weights(torch.Generator().manual_seed(0))
    bs = spec.block_size
    data = []
    for p in mixed_prompts(target):
        ids = torch.tensor([p + plain_generate(target, p, NEW).tokens])
        n_pos = ids.shape[1]
        anchors = torch.arange(2, n_pos - 1)[None]
        blocks = make_blocks(ids, torch.ones_like(ids, dtype=torch.bool), torch.tensor([n_pos]), anchors,
                             torch.ones_like(anchors, dtype=torch.bool), bs, target.mask_token_id)
        masks = build_masks(anchors, n_pos, bs, "sdpa", spec.sliding_window, need_sliding=sliding)
        data.append((target.taps(ids), blocks, masks, n_pos, anchors.shape[1]))
    opt = torch.optim.AdamW(drafter.parameters(), lr=1e-2)
    for _ in range(TRAIN_STEPS):
        for taps, blocks, masks, n_pos, n in data:
            h = drafter(target.embed(blocks.ids), taps, blocks.pos, torch.arange(n_pos)[None], masks=masks)
            logits = target.head(h.view(1, n, bs, -1)[:, :, 1:])  # (1, N, B-1, V)
            ce = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                   blocks.labels[:, :, 1:].reshape(-1), reduction="none")
            w = blocks.label_mask[:, :, 1:].reshape(-1)
            opt.zero_grad()
            ((ce * w).sum() / w.sum()).backward()
            opt.step()
    return drafter.eval()


@pytest.fixture(scope="module", params=["full", "sliding"])
def drafter(request, tiny_target):
    return trained_drafter(tiny_target, sliding=request.param == "sliding")


def reference(drafter, target, prompts, new=NEW):
    proposer = DrafterProposer(drafter, target)
    return [speculative_generate(proposer, target, p, new, drafter.spec.block_size) for p in prompts]


def test_batched_greedy_gives_the_reference_tokens_and_acceptance(drafter, tiny_target):
    prompts = mixed_prompts(tiny_target)
    ref = reference(drafter, tiny_target, prompts)
    out = speculative_batch(drafter, tiny_target, prompts, NEW, drafter.spec.block_size)
    assert len(out.generations) == len(prompts) and not out.graphs  # CPU: eager steps
    for r, g in zip(ref, out.generations):
        assert g.tokens == r.tokens and len(g.tokens) == NEW
        assert (g.acceptance, g.accepted, g.drafted) == (r.acceptance, r.accepted, r.drafted)
    rounds = [len(r.acceptance) for r in ref]
    assert len(set(rounds)) > 1 and out.steps == max(rounds)  # rows at their own pace; the batch as long as the longest
    lengths = {a for r in ref for a in r.acceptance}
    assert max(lengths) >= 5 and 1 in lengths  # the drafter accepts, and not always: the bookkeeping is exercised


def test_plain_batch_gives_plain_greedy_tokens(tiny_target):
    prompts = mixed_prompts(tiny_target)
    out = plain_batch(tiny_target, prompts, NEW)
    assert [g.tokens for g in out.generations] == [plain_generate(tiny_target, p, NEW).tokens for p in prompts]
    assert out.steps == NEW - 1  # the prefill gives each row its first token


def test_rows_that_end_early_leave_the_batch_with_the_reference_tokens(drafter, tiny_target, monkeypatch):
    """An EOS that some rows reach mid-way (a token of one prompt's continuation made an EOS): those
    rows stop at it, in both decoders, and leave the batch; the others go on to the budget."""
    prompts = mixed_prompts(tiny_target)
    eos = plain_generate(tiny_target, prompts[3], NEW).tokens[12]
    monkeypatch.setattr(tiny_target.model.config, "eos_token_id", [tiny_target.model.config.eos_token_id, eos])
    ref = reference(drafter, tiny_target, prompts)
    ended = [len(r.tokens) < NEW for r in ref]
    assert any(ended) and not all(ended)
    out = speculative_batch(drafter, tiny_target, prompts, NEW, drafter.spec.block_size)
    for r, g in zip(ref, out.generations):
        assert (g.tokens, g.acceptance, g.accepted, g.drafted) == (r.tokens, r.acceptance, r.accepted, r.drafted)
    plain = plain_batch(tiny_target, prompts, NEW)
    assert [g.tokens for g in plain.generations] == [plain_generate(tiny_target, p, NEW).tokens for p in prompts]


def test_evaluate_drafter_reports_what_the_reference_evaluate_reports(drafter, tiny_target):
    prompts = mixed_prompts(tiny_target, 4)
    seen = []
    got = evaluate_drafter(drafter, tiny_target, prompts, NEW, drafter.spec.block_size,
                           progress=lambda d, n: seen.append((d, n)))
    ref = evaluate(DrafterProposer(drafter, tiny_target), tiny_target, prompts, NEW, drafter.spec.block_size)
    same = ("prompts", "rounds", "tau", "max_tau", "acceptance_histogram", "generated_tokens", "outputs_match",
            "mismatched_prompts", "acceptance_by_position")
    assert {k: getattr(got, k) for k in same} == {k: getattr(ref, k) for k in same}
    assert got.outputs_match and got.tau > 1.5 and got.spec_seconds > 0 and got.plain_seconds > 0
    assert seen[0] == (0, 4) and seen[-1] == (4, 4) and [d for d, _ in seen] == sorted(d for d, _ in seen)


def test_eager_attention_targets_get_additive_masks_and_the_same_tokens(drafter, tiny_target, monkeypatch):
    """transformers' eager attention adds its mask: the batched decoder hands it 0 / -inf, not bools."""
    monkeypatch.setattr(tiny_target.model.config, "_attn_implementation", "eager")
    prompts = mixed_prompts(tiny_target, 3)
    out = speculative_batch(drafter, tiny_target, prompts, 16, drafter.spec.block_size)
    for r, g in zip(reference(drafter, tiny_target, prompts, 16), out.generations):
        assert (g.tokens, g.acceptance) == (r.tokens, r.acceptance)


def test_near_zero_temperature_sampling_is_greedy_decoding(drafter, tiny_target):
    """Sampled verification at T → 0 keeps exactly the argmax drafts and draws the argmax: the batched
    sampling's bookkeeping (accept, residual, bonus) gives the greedy tokens and acceptance."""
    prompts = mixed_prompts(tiny_target, 4)
    greedy = speculative_batch(drafter, tiny_target, prompts, NEW, drafter.spec.block_size)
    cold = speculative_batch(drafter, tiny_target, prompts, NEW, drafter.spec.block_size, temperature=1e-6,
                             generator=torch.Generator().manual_seed(3))
    for g, c in zip(greedy.generations, cold.generations):
        assert (c.tokens, c.acceptance) == (g.tokens, g.acceptance)


def test_sampling_at_a_temperature_is_seeded_and_stays_in_bounds(drafter, tiny_target):
    prompts = mixed_prompts(tiny_target, 3)
    bs = drafter.spec.block_size
    runs = [speculative_batch(drafter, tiny_target, prompts, 24, bs, temperature=0.8,
                              generator=torch.Generator().manual_seed(7)) for _ in range(2)]
    assert [g.tokens for g in runs[0].generations] == [g.tokens for g in runs[1].generations]
    for g in runs[0].generations:
        assert len(g.tokens) == 24 and all(1 <= a <= bs for a in g.acceptance) and sum(g.acceptance) == 23
        assert all(0 <= a <= d for a, d in zip(g.accepted, g.drafted))


def test_what_cannot_be_batched_is_named_and_decoded_one_prompt_at_a_time(drafter, tiny_target, monkeypatch):
    fake = SimpleNamespace(config=SimpleNamespace(_attn_implementation="flash_attention_2"), has_body=True)
    assert "flash_attention_2" in batched_unsupported(fake)
    fake.config = SimpleNamespace(_attn_implementation="sdpa", layer_types=["full_attention", "sliding_attention"])
    assert "sliding-window" in batched_unsupported(fake)
    assert "drafts nothing" in batched_unsupported(tiny_target, block_size=1)
    assert batched_unsupported(tiny_target, 8) is None
    import dflash.eval.evaluate as ev

    monkeypatch.setattr(ev, "batched_unsupported", lambda target, bs: "a reason")
    notes = []
    prompts = mixed_prompts(tiny_target, 2)
    got = evaluate_drafter(drafter, tiny_target, prompts, 12, drafter.spec.block_size, on_note=notes.append)
    ref = evaluate(DrafterProposer(drafter, tiny_target), tiny_target, prompts, 12, drafter.spec.block_size)
    assert notes == ["decoded one prompt at a time: a reason"] and got.tau == ref.tau
    from dflash.eval.reuse import EvalState

    state = EvalState()  # a run's eval through the reference: its parts say so
    evaluate_drafter(drafter, tiny_target, prompts, 12, drafter.spec.block_size, state=state)
    assert [k for k, _ in state.last.parts_s] == ["reference", "weigh"] and state.last.parts_s[0][1] > 0


def test_an_empty_prompt_is_bad_input(drafter, tiny_target):
    from compilewatch import BadInput

    with pytest.raises(BadInput, match="prompt 1 is empty"):
        speculative_batch(drafter, tiny_target, [[5, 6], []], 4, drafter.spec.block_size)


def run_benchmark(args: list[str], capsys) -> list[dict]:
    """benchmarks/dflash_eval_batched.py's main(args) in this process (torch's thread count restored):
    the JSON lines it printed."""
    import importlib.util
    import json
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "dflash_eval_batched.py"
    spec = importlib.util.spec_from_file_location("dflash_eval_batched", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    before = torch.get_num_threads()
    try:
        assert bench.main(args) == 0
    finally:
        torch.set_num_threads(before)
    return [json.loads(line) for line in capsys.readouterr().out.splitlines()]


def test_the_benchmark_prints_a_json_line_per_case(capsys):
    """benchmarks/dflash_eval_batched.py on the embedded tiny target: both decoders timed, same τ."""
    rows = run_benchmark(["--cases", "2x8,3x5"], capsys)
    assert [r["case"] for r in rows] == ["2x8", "3x5"]
    for r in rows:
        assert r["batched"]["tau"] == r["old"]["tau"] and r["batched"]["rounds"] == r["old"]["rounds"]
        assert r["same_as_batched"].startswith(f"{r['prompts']}/{r['prompts']} ") and r["batched"]["spec_s"] > 0


class CPUReplay:
    """A stand-in for a captured CUDA graph on the CPU: fixed input and output tensors, a replay reruns
    the step on the inputs and overwrites the outputs in place (what a replay does to a graph's
    outputs), so the batched loop's graph mode (every slot read, finished rows kept until half the
    batch is done, outputs reused between replays) runs here as it does on a GPU."""

    def __init__(self, fn, full_len, static):
        self.fn, self.full_len, self.static = fn, full_len, static
        self.outputs = tuple(o.clone() for o in fn(full_len, *static))

    def replay(self):
        for o, new in zip(self.outputs, self.fn(self.full_len, *self.static)):
            o.copy_(new)


def stand_in_graphs(monkeypatch, captured: list):
    """StepRunner's capture replaced by CPUReplay, each capture appended to `captured` as (step, batch
    size), and graphs 'available': the batched loop's graph mode on the CPU."""
    import dflash.eval.batched as batched
    from dflash.eval.graphs import StepRunner

    def capture(self, key, inputs):
        captured.append((self.name, key))
        static = [x.clone() for x in inputs]
        graph = CPUReplay(self.fn, self.full_len, static)
        self.graphs[key] = (graph, static, graph.outputs)
        return graph.outputs

    monkeypatch.setattr(StepRunner, "_capture", capture)
    monkeypatch.setattr(batched, "graphs_available", lambda device: True)


def test_graph_mode_bookkeeping_gives_the_reference_tokens(drafter, tiny_target, monkeypatch):
    captured = []
    stand_in_graphs(monkeypatch, captured)
    prompts = mixed_prompts(tiny_target)
    eos = late_eos(tiny_target, prompts, 4)
    monkeypatch.setattr(tiny_target.model.config, "eos_token_id", [tiny_target.model.config.eos_token_id, *eos])
    ref = reference(drafter, tiny_target, prompts)
    assert sum(len(r.tokens) < NEW for r in ref) >= 4  # more than half end early: the batch shrinks once
    out = speculative_batch(drafter, tiny_target, prompts, NEW, drafter.spec.block_size)
    assert out.graphs and not out.notes
    for r, g in zip(ref, out.generations):
        assert (g.tokens, g.acceptance, g.accepted, g.drafted) == (r.tokens, r.acceptance, r.accepted, r.drafted)
    sizes = [k for name, k in captured if name == "verify"]
    assert sizes[0] == 6 and len(sizes) > 1 and all(k <= 3 for k in sizes[1:])  # rows left at half: captured again
    plain = plain_batch(tiny_target, prompts, NEW)
    assert plain.graphs and [g.tokens for g in plain.generations] == [plain_generate(tiny_target, p, NEW).tokens
                                                                     for p in prompts]


def counting_graphs(monkeypatch):
    """CPUReplay as StepRunner's capture, doing the real capture's runs of the step (a warm-up, the
    capture, one replay), graphs 'available', TargetSlots.select counted; returns (counts, sizes):
    counts[runner, "captures" | "calls" | "fn"] (the step run, for any reason) and the batch sizes
    each runner was called at."""
    import collections

    import dflash.eval.batched as batched
    from dflash.eval.graphs import StepRunner
    from dflash.eval.slots import TargetSlots

    counts: collections.Counter = collections.Counter()
    sizes: dict[str, set[int]] = collections.defaultdict(set)

    def capture(self, key, inputs):
        counts[self.name, "captures"] += 1
        static = [x.clone() for x in inputs]
        self.fn(self.full_len, *static)  # the warm-up
        graph = CPUReplay(self.fn, self.full_len, static)
        graph.replay()
        self.graphs[key] = (graph, static, graph.outputs)
        return graph.outputs

    init, call, select = StepRunner.__init__, StepRunner.__call__, TargetSlots.select

    def counted_init(self, name, fn, full_len, use_graphs):
        def counted(kv, *inputs):
            counts[name, "fn"] += 1
            return fn(kv, *inputs)
        init(self, name, counted, full_len, use_graphs)

    def counted_call(self, kv, *inputs):
        counts[self.name, "calls"] += 1
        sizes[self.name].add(int(inputs[0].shape[0]))
        return call(self, kv, *inputs)

    def counted_select(self, keep):
        counts["select"] += 1
        return select(self, keep)

    monkeypatch.setattr(StepRunner, "_capture", capture)
    monkeypatch.setattr(StepRunner, "__init__", counted_init)
    monkeypatch.setattr(StepRunner, "__call__", counted_call)
    monkeypatch.setattr(TargetSlots, "select", counted_select)
    monkeypatch.setattr(batched, "graphs_available", lambda device: True)
    return counts, sizes


def test_graph_mode_work_is_bounded_by_the_batch_sizes_not_the_rounds(tiny_target, monkeypatch):
    """A batch that shrinks as rows end (EOS at different rounds), prefilled in chunks, with a random
    drafter (one token a round, as the 8B benchmark's): each step captured once per batch size it runs
    at (none per round), checked against eager once per size, the slots selected once per shrink; a
    kept workspace's next decode captures nothing and checks each kept size once."""
    import dflash.eval.batched as batched
    from dflash.eval.batched import SpecWorkspace, spec_length

    counts, sizes = counting_graphs(monkeypatch)
    monkeypatch.setattr(batched, "PREFILL_TOKENS", 64)
    n = 8
    prompts = mixed_prompts(tiny_target, n)
    assert len(batched._chunks([len(p) for p in prompts])) >= 3
    eos = late_eos(tiny_target, prompts, 4)  # 5 rows end early, from the 6th token to the 33rd
    monkeypatch.setattr(tiny_target.model.config, "eos_token_id", [tiny_target.model.config.eos_token_id, *eos])
    d = DFlashDrafter(drafter_spec(tiny(), tiny_target))
    d.init_weights(torch.Generator().manual_seed(1))
    d.eval()
    bs = d.spec.block_size

    def bounded(names, steps):
        for name in names:
            k = len(sizes[name])
            assert 1 < k <= n.bit_length()  # it shrank; each size at most half the last
            assert counts[name, "captures"] == k  # once per batch size
            # the step runs once a call, and per batch size a warm-up, the capture and one eager check
            assert counts[name, "fn"] <= counts[name, "calls"] + 3 * k
        assert counts[names[0], "calls"] == steps and counts["select"] == len(sizes[names[0]]) - 1

    plain = plain_batch(tiny_target, prompts, NEW)
    assert plain.graphs and not plain.notes
    bounded(["plain"], plain.steps)
    counts.clear()
    sizes.clear()
    ws = SpecWorkspace(d, tiny_target, n, spec_length(prompts, NEW, bs), bs, True, keep=True)
    out = speculative_batch(d, tiny_target, prompts, NEW, bs, workspace=ws)
    assert out.graphs and not out.notes and out.steps >= NEW - 1  # τ ≈ 1: a round per token
    bounded(["verify", "draft"], out.steps)
    first = {name: set(s) for name, s in sizes.items()}
    counts.clear()
    sizes.clear()
    again = speculative_batch(d, tiny_target, prompts, NEW, bs, workspace=ws)
    assert again.graphs and again.captured == 0 and again.steps == out.steps
    for name in ("verify", "draft"):
        assert sizes[name] == first[name] and counts[name, "captures"] == 0
        assert counts[name, "fn"] == counts[name, "calls"] + len(sizes[name])  # one eager check per kept size


def test_a_decode_frees_its_slots_and_graphs_when_it_returns(tiny_target, monkeypatch):
    """A speculative decode's own workspace (slots, graphs) goes with the call, not at the next cyclic
    GC: its steps hold it weakly (at 8B and 64 rows it is ~5 GB of slots and the graphs' pools)."""
    import gc
    import weakref

    import dflash.eval.batched as batched

    counting_graphs(monkeypatch)
    made = []
    init = batched.SpecWorkspace.__init__

    def record(self, *a, **kw):
        init(self, *a, **kw)
        made.append(weakref.ref(self))

    monkeypatch.setattr(batched.SpecWorkspace, "__init__", record)
    d = DFlashDrafter(drafter_spec(tiny(), tiny_target))
    d.init_weights(torch.Generator().manual_seed(1))
    prompts = mixed_prompts(tiny_target, 3)
    gc.collect()
    gc.disable()
    try:
        out = speculative_batch(d.eval(), tiny_target, prompts, 6, d.spec.block_size)
        assert out.graphs and len(made) == 1 and made[0]() is None
    finally:
        gc.enable()


# ----------------------------------------------------------------------------- GPU (run with -m gpu)
@pytest.mark.gpu
@requires_cuda()
def test_cuda_graph_steps_give_the_reference_tokens(tiny_target, monkeypatch):
    """On CUDA (fp32 tiny target): the batched decoder's steps run as CUDA graphs (each checked against
    its eager run when captured) and give the batch-1 reference's tokens and acceptance; again when
    most rows end early at an EOS (the batch shrinks: graphs captured again for the smaller size)."""
    import copy

    dev = torch.device("cuda:0")
    target = dataclasses.replace(tiny_target, model=copy.deepcopy(tiny_target.model).to(dev), device=dev)
    drafter = trained_drafter(tiny_target, sliding=False).to(dev)
    prompts = mixed_prompts(target)
    for ending_early in (False, True):
        if ending_early:
            eos = late_eos(target, prompts, 4)
            monkeypatch.setattr(target.model.config, "eos_token_id", [target.model.config.eos_token_id, *eos])
        out = speculative_batch(drafter, target, prompts, NEW, drafter.spec.block_size)
        assert out.graphs and not out.notes, out.notes
        ref = reference(drafter, target, prompts)
        for r, g in zip(ref, out.generations):
            assert (g.tokens, g.acceptance) == (r.tokens, r.acceptance)
        assert sum(len(r.tokens) < NEW for r in ref) >= (4 if ending_early else 0)
        plain = plain_batch(target, prompts, NEW)
        assert plain.graphs and [g.tokens for g in plain.generations] == [plain_generate(target, p, NEW).tokens
                                                                         for p in prompts]


def test_a_replay_is_judged_against_the_eager_outputs_scale_not_each_element():
    """bf16 rounding of a logit row scales with the row's magnitudes: an error of 0.05 on logits of ~30 is
    rounding (the 8B plain step's replay differed that way element-wise and ran eagerly), an output off by
    its own scale (stale inputs baked into a graph) is not."""
    from dflash.eval.graphs import StepRunner

    runner = StepRunner("plain", lambda kv, x: (x,), 4, use_graphs=True)
    eager = torch.tensor([[30.0, -28.0, 0.01, 0.0]])
    rounded = eager + torch.tensor([[0.05, -0.05, 0.04, -0.04]])  # 0.04 on ~0: 400% element-wise
    assert not torch.allclose(rounded, eager, rtol=2e-2, atol=2e-2)
    assert runner._agree((rounded,), (eager,), "a second call") and runner.use_graphs
    stale = eager.flip(-1)
    assert not runner._agree((stale,), (eager,), "a second call") and not runner.use_graphs
    assert "max |replay − eager| 30 at scale 30" in runner.note and "ran eagerly" in runner.note


# ----------------------------------------------------------------------------- a decode that cannot fit
def test_a_decode_whose_slots_cannot_fit_is_bad_input_before_anything_is_allocated(tiny_target, monkeypatch):
    """A huge --max-new-tokens preallocated its K/V slots: on a CPU the kernel's OOM killer ended the process
    without a word. Now BadInput (exit 2) naming the need, what is free and what to lower."""
    from compilewatch import BadInput
    from dflash.eval import slots

    d = trained_drafter(tiny_target, sliding=False)
    prompts = mixed_prompts(tiny_target, 2)
    with pytest.raises(BadInput) as e:
        evaluate_drafter(d, tiny_target, prompts, 10 ** 9, d.spec.block_size)  # ~1.6 TB of slots
    assert "GiB of K/V slots on cpu" in str(e.value) and "--max-new-tokens" in e.value.hint
    need = slots.slot_bytes(d, tiny_target, 2, max(map(len, prompts)) + NEW + d.spec.block_size, False)
    monkeypatch.setattr(slots, "free_bytes", lambda device: int(need / slots.FIT) - 1)
    with pytest.raises(BadInput):
        evaluate_drafter(d, tiny_target, prompts, NEW, d.spec.block_size)
    monkeypatch.setattr(slots, "free_bytes", lambda device: int(need / slots.FIT) + 1)
    assert evaluate_drafter(d, tiny_target, prompts, NEW, d.spec.block_size).prompts == 2


def test_a_run_whose_evals_cannot_fit_stops_at_its_start(tmp_path, chat_file):
    """Not at the first eval, after hours of training: before the first step, nothing written."""
    from compilewatch import BadInput
    from dflash.training.trainer import Trainer
    from tests.dflash_helpers import small_config

    run = tmp_path / "run"
    for over, key in (({"eval.every": 1}, "eval.every_prompts"), ({"eval.at_end": True}, "eval.num_prompts")):
        with pytest.raises(BadInput) as e:
            Trainer.from_config(small_config(run, chat_file, **{"eval.max_new_tokens": 10 ** 9, **over}))
        assert "GiB of K/V slots" in str(e.value) and f"--set {key}=N" in e.value.hint
        assert not (run / "config.toml").exists() and not (run / "checkpoints").exists()
