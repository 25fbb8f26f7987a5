"""dflash.eval.reuse: a run's evals share one EvalState (slots, CUDA graphs, the plain baseline), and
an eval that reuses it gives what a fresh eval of the same drafter weights gives: the same τ,
acceptance and tokens; after the drafter trains, the new weights' (fp32, CPU, eager; graph-mode
bookkeeping through a CPU stand-in for captured graphs; real graphs on CUDA, `-m gpu`)."""

from __future__ import annotations

import copy
import dataclasses
from types import SimpleNamespace

import pytest
import torch

from dflash.eval.batched import SpecWorkspace, spec_length, speculative_batch
from dflash.eval.evaluate import evaluate_drafter, plain_generate
from dflash.eval.reuse import EvalState
from dflash.model.build import drafter_spec
from dflash.model.drafter import DFlashDrafter
from tests.dflash_helpers import chat_file, small_config, tiny_target  # noqa: F401 (fixtures)
from tests.helpers import requires_cuda
from tests.test_eval_batched import NEW, late_eos, mixed_prompts, reference, run_benchmark, stand_in_graphs, trained_drafter

SAME = ("prompts", "rounds", "tau", "max_tau", "acceptance_histogram", "generated_tokens", "outputs_match",
        "mismatched_prompts", "acceptance_by_position")


@pytest.fixture(scope="module")
def drafter(tiny_target):
    return trained_drafter(tiny_target, sliding=False)


def random_drafter(target) -> DFlashDrafter:
    """An untrained drafter of the same shape (its τ is about 1: other weights, other acceptance)."""
    from dflash.config import tiny

    d = DFlashDrafter(drafter_spec(tiny(), target))
    d.init_weights(torch.Generator().manual_seed(1))
    return d.eval()


def facts(r):
    return {k: getattr(r, k) for k in SAME}


def test_a_second_eval_reusing_the_state_gives_a_fresh_evals_result(drafter, tiny_target):
    prompts = mixed_prompts(tiny_target, 4)
    bs = drafter.spec.block_size
    state = EvalState()
    first = evaluate_drafter(drafter, tiny_target, prompts, NEW, bs, state=state, step=2)
    assert state.last.plain_baseline == "measured" and state.last.warmed_up
    ws = state.workspace
    notes = []
    second = evaluate_drafter(drafter, tiny_target, prompts, NEW, bs, state=state, step=4, on_note=notes.append)
    fresh = evaluate_drafter(drafter, tiny_target, prompts, NEW, bs)
    assert facts(first) == facts(second) == facts(fresh) and second.outputs_match and second.tau > 1.5
    assert state.workspace is ws and ws.decodes == 2  # the same slots and steps
    assert state.last.plain_baseline == "step 2" and not state.last.warmed_up
    assert second.plain_seconds == state.baseline.seconds  # the first eval's plain time (no graph setup on CPU)
    assert len(notes) == 1 and notes[0].startswith("plain baseline from step 2's eval (the target is frozen)")


def test_after_a_drafter_update_the_reused_state_decodes_with_the_new_weights(drafter, tiny_target):
    prompts = mixed_prompts(tiny_target, 4)
    bs = drafter.spec.block_size
    training = copy.deepcopy(drafter)  # the drafter the run trains, updated in place between evals
    state = EvalState()
    before = evaluate_drafter(training, tiny_target, prompts, NEW, bs, state=state, step=2)
    other = random_drafter(tiny_target)
    with torch.no_grad():
        for p, q in zip(training.parameters(), other.parameters()):
            p.copy_(q)  # what an optimizer step does: the same tensors, new values
    after = evaluate_drafter(training, tiny_target, prompts, NEW, bs, state=state, step=4)
    assert facts(after) == facts(evaluate_drafter(other, tiny_target, prompts, NEW, bs))
    assert after.tau != before.tau and state.workspace.decodes == 2


def test_a_kept_workspace_gives_the_reference_tokens_as_rows_leave_the_batch(drafter, tiny_target, monkeypatch):
    """Eagerly every finished row leaves at once, into new buffers; the kept full batch's buffers,
    with what an earlier decode (with other rows ending) left in them, serve the next decode."""
    prompts = mixed_prompts(tiny_target)
    bs = drafter.spec.block_size
    ws = SpecWorkspace(drafter, tiny_target, len(prompts), spec_length(prompts, NEW, bs), bs, False, keep=True)
    speculative_batch(drafter, tiny_target, prompts, NEW, bs, workspace=ws)  # every row to the budget
    eos = late_eos(tiny_target, prompts, 4)
    monkeypatch.setattr(tiny_target.model.config, "eos_token_id", [tiny_target.model.config.eos_token_id, *eos])
    for _ in range(2):
        out = speculative_batch(drafter, tiny_target, prompts, NEW, bs, workspace=ws)
        for r, g in zip(reference(drafter, tiny_target, prompts), out.generations):
            assert (g.tokens, g.acceptance, g.accepted, g.drafted) == (r.tokens, r.acceptance, r.accepted, r.drafted)
    assert ws.decodes == 3 and set(ws.slots.sizes) == set(ws.ctx.sizes) == {len(prompts)}  # eager: the full batch's


def test_graphs_are_captured_at_the_first_eval_and_replayed_at_the_next(drafter, tiny_target, monkeypatch):
    captured: list = []
    stand_in_graphs(monkeypatch, captured)
    prompts = mixed_prompts(tiny_target)
    eos = late_eos(tiny_target, prompts, 4)
    monkeypatch.setattr(tiny_target.model.config, "eos_token_id", [tiny_target.model.config.eos_token_id, *eos])
    bs = drafter.spec.block_size
    state = EvalState()
    first = evaluate_drafter(drafter, tiny_target, prompts, NEW, bs, state=state, step=2)
    one = state.last
    sizes = {k for name, k in captured if name == "verify"}
    assert one.graphs_captured == len(captured) and one.graphs_reused == 0 and len(sizes) > 1  # the batch shrank
    spec_graphs = sum(name != "plain" for name, _ in captured)
    captured.clear()
    second = evaluate_drafter(drafter, tiny_target, prompts, NEW, bs, state=state, step=4)
    two = state.last
    assert captured == [] and two.graphs_captured == 0 and two.graphs_reused == spec_graphs  # and no plain pass
    assert len(state.workspace.slots.sizes) == len(sizes)  # buffers per batch size, which the graphs read
    assert two.plain_baseline == "step 2" and facts(first) == facts(second)
    out = speculative_batch(drafter, tiny_target, prompts, NEW, bs, workspace=state.workspace)
    assert out.graphs and out.captured == 0 and not out.notes
    for r, g in zip(reference(drafter, tiny_target, prompts), out.generations):
        assert (g.tokens, g.acceptance, g.accepted, g.drafted) == (r.tokens, r.acceptance, r.accepted, r.drafted)


def test_a_kept_graph_that_replays_wrong_is_caught_and_captured_again(drafter, tiny_target, monkeypatch):
    """A graph that no longer computes the step (as one reading a replaced tensor would): its first
    replay of the next decode is checked against eager, the eager result is used, it is captured again."""
    captured: list = []
    stand_in_graphs(monkeypatch, captured)
    prompts = mixed_prompts(tiny_target, 4)
    bs = drafter.spec.block_size
    ws = SpecWorkspace(drafter, tiny_target, len(prompts), spec_length(prompts, NEW, bs), bs, True, keep=True)
    speculative_batch(drafter, tiny_target, prompts, NEW, bs, workspace=ws)
    draft = ws.runners[1]
    for graph, _, outputs in draft.graphs.values():
        graph.replay = lambda outputs=outputs: [o.add_(1.0) for o in outputs]  # stale: wrong logits
    captured.clear()
    out = speculative_batch(drafter, tiny_target, prompts, NEW, bs, workspace=ws)
    (note,) = out.notes
    assert out.graphs and note.startswith("draft: CUDA graph replay of an earlier decode's graph differed from the "
                                          "eager step (outputs [0]: max |replay − eager| ")
    assert note.endswith("); captured again")
    assert {name for name, _ in captured} == {"draft"} and out.captured == len(captured)  # verify's kept graphs pass
    for r, g in zip(reference(drafter, tiny_target, prompts), out.generations):
        assert (g.tokens, g.acceptance) == (r.tokens, r.acceptance)


def test_the_plain_baseline_applies_only_to_the_same_prompts_budget_and_unchanged_target(drafter, tiny_target):
    prompts = mixed_prompts(tiny_target, 3)
    bs = drafter.spec.block_size
    state = EvalState()
    evaluate_drafter(drafter, tiny_target, prompts, 12, bs, state=state, step=1)
    base = state.baseline
    assert base.applies(tiny_target, prompts, 12, False)
    assert not base.applies(tiny_target, prompts[:2], 12, False) and not base.applies(tiny_target, prompts, 13, False)
    assert not base.applies(dataclasses.replace(tiny_target), prompts, 12, False)  # another target object
    evaluate_drafter(drafter, tiny_target, prompts[:2], 12, bs, state=state, step=2)  # other prompts: measured
    assert state.last.plain_baseline == "measured" and state.baseline is base
    assert [g.tokens for g in base.generations] == [plain_generate(tiny_target, p, 12).tokens for p in prompts]
    p = next(tiny_target.model.parameters())
    with torch.no_grad():
        p.mul_(1.0)  # an in-place write (same values): the baseline no longer provably applies
    assert not base.applies(tiny_target, prompts, 12, False)
    evaluate_drafter(drafter, tiny_target, prompts, 12, bs, state=state, step=3)
    assert state.last.plain_baseline == "measured"


def test_the_split_topologys_drafter_copy_is_made_once_and_updated_in_place(drafter, tiny_target):
    from dflash.config import tiny
    from dflash.eval.in_training import _drafter_beside

    trainer = SimpleNamespace(cfg=tiny(), drafter=copy.deepcopy(drafter), target=object(), full_target=tiny_target)
    state = EvalState()
    copy1 = _drafter_beside(trainer, state, torch.device("cpu"))
    ptrs = [p.data_ptr() for p in copy1.parameters()]
    with torch.no_grad():
        for p, q in zip(trainer.drafter.parameters(), random_drafter(tiny_target).parameters()):
            p.copy_(q)
    copy2 = _drafter_beside(trainer, state, torch.device("cpu"))
    assert copy2 is copy1 and [p.data_ptr() for p in copy2.parameters()] == ptrs  # the graphs' addresses
    assert all(torch.equal(a, b) for a, b in zip(copy2.parameters(), trainer.drafter.parameters()))


def test_periodic_evals_of_a_run_report_what_they_reused(tmp_path, chat_file):
    from dflash.eval.in_training import eval_state
    from dflash.training.trainer import Trainer

    cfg = small_config(tmp_path, chat_file, **{"train.max_steps": 4, "eval.every": 2, "eval.every_prompts": 2,
                                               "eval.num_prompts": 2, "eval.max_new_tokens": 8, "eval.at_end": True})
    events = []
    t = Trainer.from_config(cfg, on_event=lambda k, d: events.append((k, d)))
    try:
        result = t.train()
        evals = [d for k, d in events if k == "periodic_eval"]
        assert [(e["step"], e["plain_baseline"], e["warmed_up"], e["graphs_captured"]) for e in evals] == [
            (2, "measured", True, 0), (4, "step 2", False, 0)]  # CPU: eager steps
        # each event says where its seconds went: the first warmed up and measured the plain pass, the second did neither
        assert [list(e["parts_s"]) for e in evals] == [["warm_up", "plain", "speculative", "weigh"]] * 2
        first, second = (e["parts_s"] for e in evals)
        assert first["warm_up"] > 0 and first["plain"] > 0 and second["warm_up"] == 0 and second["plain"] == 0
        assert all(sum(e["parts_s"].values()) <= e["seconds"] for e in evals)  # parts of the event's own wall time
        assert eval_state(t).evals == 3 and eval_state(t).last.plain_baseline == "step 2"  # the end-of-run one too
        assert any(n.startswith("eval: plain baseline from step 2's eval") for n in result.notes)
        again = t.evaluate()  # the state reused once more: what a fresh eval of these weights gives
        prompts = [list(p) for p in eval_state(t).baseline.prompts]
        fresh = evaluate_drafter(t.drafter.eval(), t.full_target, prompts, 8, cfg.drafter.block_size)
        assert facts(again) == facts(fresh) == facts(result.eval)
    finally:
        t.close()


def test_the_benchmark_runs_periodic_evals_on_one_state(capsys):
    """benchmarks/dflash_eval_batched.py --periodic on the embedded tiny target: one line per eval, the
    first measuring everything, the later ones reusing; the fresh decode of the last weights agrees."""
    rows = run_benchmark(["--cases", "2x8", "--periodic", "3", "--check-fresh", "--profile-first"], capsys)
    assert [(r.get("eval"), r.get("plain_baseline"), r.get("warmed_up")) for r in rows[:3]] == [
        (1, "measured", True), (2, "step 1", False), (3, "step 1", False)]
    assert all(r["case"] == "2x8" and r["eval_wall_s"] > 0 for r in rows)
    assert rows[3]["fresh"] and rows[3]["same_as_last_periodic"] is True
    # the first eval's calls: the warm-up's plain and speculative decodes, then the measured passes
    assert len(rows[0]["calls_s"]["plain"]) == 2 and len(rows[1]["calls_s"].get("plain", [])) == 0
    assert set(rows[0]["parts_s"]) == {"warm_up", "plain", "speculative", "weigh"}
    assert any("evaluate_drafter" in line for line in rows[0]["host_profile"]) and "host_profile" not in rows[1]


# ----------------------------------------------------------------------------- GPU (run with -m gpu)
@pytest.mark.gpu
@requires_cuda()
def test_cuda_graphs_kept_across_decodes_replay_the_updated_weights(tiny_target):
    """On CUDA (fp32 tiny target): the second decode through a kept workspace captures nothing, its
    reused graphs pass their eager check, and after the drafter's weights change in place (an
    optimizer step does that) its replays give the reference tokens of the new weights."""
    dev = torch.device("cuda:0")
    target = dataclasses.replace(tiny_target, model=copy.deepcopy(tiny_target.model).to(dev), device=dev)
    drafter = trained_drafter(tiny_target, sliding=False).to(dev)
    prompts = mixed_prompts(target)
    bs = drafter.spec.block_size
    ws = SpecWorkspace(drafter, target, len(prompts), spec_length(prompts, NEW, bs), bs, True, keep=True)
    first = speculative_batch(drafter, target, prompts, NEW, bs, workspace=ws)
    assert first.graphs and first.captured >= 2 and not first.notes, first.notes
    for weights in ("same", "updated"):
        if weights == "updated":
            with torch.no_grad():
                for p, q in zip(drafter.parameters(), random_drafter(tiny_target).to(dev).parameters()):
                    p.copy_(0.5 * p + 0.5 * q)
        out = speculative_batch(drafter, target, prompts, NEW, bs, workspace=ws)
        assert out.graphs and out.captured == 0 and out.reused >= 2 and not out.notes, out.notes
        for r, g in zip(reference(drafter, target, prompts), out.generations):
            assert (g.tokens, g.acceptance) == (r.tokens, r.acceptance)


def test_a_periodic_eval_is_not_timed_beside_pinning_and_says_what_ran_beside_it(tmp_path, chat_file, monkeypatch):
    """The checkpoint buffers pinned after step 1 (Saver.reserve, on CUDA) are waited for before the
    eval's timed decodes (its plain baseline is reused all run long); a checkpoint write still running
    is named in the event, not waited for. Fault injection: a stand-in reservation thread and write."""
    import threading

    import dflash.eval.in_training as in_training
    from dflash.training.trainer import Trainer

    cfg = small_config(tmp_path, chat_file, **{"train.max_steps": 2, "eval.every": 1, "eval.every_prompts": 1,
                                               "eval.num_prompts": 1, "eval.max_new_tokens": 4, "eval.at_end": False,
                                               "checkpoint.every": 100})
    order, release, writing = [], threading.Event(), threading.Event()
    events = []

    def on_event(kind, data):
        events.append((kind, data))
        if kind == "step" and data["metrics"].step == 1:
            release.set()  # the "pinning" may end now; the eval must still come after it
        if kind == "periodic_eval":
            writing.set()  # the stand-in write ends once the eval that ran beside it is reported

    def pin():
        release.wait()
        order.append("pinned")

    real = in_training.evaluate_trainer
    monkeypatch.setattr(in_training, "evaluate_trainer", lambda t, limit=None: (order.append("eval"), real(t, limit))[1])
    t = Trainer.from_config(cfg, on_event=on_event)
    try:
        t.saver._reserving = threading.Thread(target=pin, daemon=True)
        t.saver._reserving.start()
        t.train(until=1)
        assert order == ["pinned", "eval"]
        writing.clear()
        t.saver._thread = threading.Thread(target=writing.wait, daemon=True)  # a save's write, running at step 2
        t.saver._thread.start()
        t.train(until=2)
        evals = [d for k, d in events if k == "periodic_eval"]
        assert [e["beside"] for e in evals] == [[], ["a checkpoint write"]]
        assert evals[0]["waited_for_pinning_s"] >= 0 and evals[1]["waited_for_pinning_s"] == 0
        assert order == ["pinned", "eval", "eval"]
    finally:
        writing.set()
        release.set()
        t.close()
