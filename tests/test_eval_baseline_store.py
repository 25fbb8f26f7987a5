"""dflash.eval.baseline_store: a run's plain baseline kept in RUN/eval_baseline.json, taken by a
resumed run's first eval only where it provably applies, measured again (with a note) otherwise;
the file is untrusted data, bounded and checked (CPU, eager, the tiny target)."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest

from dflash.eval import baseline_store
from dflash.eval.evaluate import evaluate_drafter
from dflash.eval.reuse import EvalState
from tests.dflash_helpers import chat_file, small_config, tiny_target  # noqa: F401 (fixtures)
from tests.helpers import requires_cuda
from tests.test_eval_batched import NEW, mixed_prompts, trained_drafter
from tests.test_eval_reuse import facts


@pytest.fixture(scope="module")
def drafter(tiny_target):
    return trained_drafter(tiny_target, sliding=False)


def _measured(drafter, target, prompts, path, step=3) -> EvalState:
    state = EvalState(store=path)
    evaluate_drafter(drafter, target, prompts, NEW, drafter.spec.block_size, state=state, step=step)
    assert state.last.plain_baseline == "measured" and path.is_file()
    return state


def test_a_new_process_takes_the_stored_baseline_and_gives_a_fresh_evals_result(drafter, tiny_target, tmp_path):
    prompts = mixed_prompts(tiny_target, 3)
    path = tmp_path / baseline_store.FILE
    first = _measured(drafter, tiny_target, prompts, path)
    again = EvalState(store=path)  # what a resumed process makes
    r = evaluate_drafter(drafter, tiny_target, prompts, NEW, drafter.spec.block_size, state=again, step=9)
    assert again.last.plain_baseline == "step 3, from eval_baseline.json" and dict(again.last.parts_s)["plain"] == 0
    assert again.baseline.stored == str(path) and again.store_note is None
    assert [g.tokens for g in again.baseline.generations] == [g.tokens for g in first.baseline.generations]
    assert again.baseline.seconds == pytest.approx(first.baseline.seconds)
    fresh = evaluate_drafter(drafter, tiny_target, prompts, NEW, drafter.spec.block_size)
    assert facts(r) == facts(fresh)
    assert "read from" in again.baseline.note() and "an earlier process of this run" in again.baseline.note()


def test_a_first_eval_with_a_kept_baseline_decodes_nothing_plainly(drafter, tiny_target, tmp_path, monkeypatch):
    """No plain pass and no plain warm-up (its first-call costs would be paid for nothing timed)."""
    from dflash.eval import batched

    prompts = mixed_prompts(tiny_target, 2)
    path = tmp_path / baseline_store.FILE
    _measured(drafter, tiny_target, prompts, path)
    calls = []
    real = batched.plain_batch
    monkeypatch.setattr(batched, "plain_batch", lambda *a, **k: calls.append(len(a[1])) or real(*a, **k))
    again = EvalState(store=path)
    evaluate_drafter(drafter, tiny_target, prompts, NEW, drafter.spec.block_size, state=again, step=4)
    assert calls == [] and again.last.warmed_up and dict(again.last.parts_s)["warm_up"] > 0
    fresh = EvalState(store=tmp_path / "elsewhere.json")
    evaluate_drafter(drafter, tiny_target, prompts, NEW, drafter.spec.block_size, state=fresh, step=4)
    assert calls == [1, 2]  # without one: the plain warm-up (one prompt), then the plain pass


def test_a_kept_baselines_speedup_compares_decoding_with_decoding(drafter, tiny_target, tmp_path, monkeypatch):
    """The kept time is the plain decode less its graph setup: the speculative pass's setup (a new process's
    captures; on CPU none, so one is made up here) comes off it too. A measured baseline keeps both setups."""
    from dflash.eval import batched

    real = batched.speculative_batch
    monkeypatch.setattr(batched, "speculative_batch",
                        lambda *a, **k: dataclasses.replace(d := real(*a, **k), setup_s=d.seconds / 4))
    prompts = mixed_prompts(tiny_target, 2)
    path = tmp_path / baseline_store.FILE
    first = EvalState(store=path)
    r1 = evaluate_drafter(drafter, tiny_target, prompts, NEW, drafter.spec.block_size, state=first, step=1)
    spec1 = dict(first.last.parts_s)["speculative"]
    assert r1.speedup == pytest.approx(dict(first.last.parts_s)["plain"] / spec1, rel=1e-2)
    again = EvalState(store=path)
    r2 = evaluate_drafter(drafter, tiny_target, prompts, NEW, drafter.spec.block_size, state=again, step=2)
    spec2 = dict(again.last.parts_s)["speculative"]
    assert r2.spec_seconds == pytest.approx(spec2 * 3 / 4, rel=1e-2)
    assert r2.speedup == pytest.approx(again.baseline.seconds / (spec2 * 3 / 4), rel=1e-2)


def _rewrite(path, **changes):
    rec = json.loads(path.read_text())
    for k, v in changes.items():
        if k.startswith("identity."):
            rec["identity"][k.split(".", 1)[1]] = v
        else:
            rec[k] = v
    path.write_text(json.dumps(rec))


@pytest.mark.parametrize("change, why", [
    ({"identity.device": "NVIDIA H100 80GB HBM3"}, "device was 'NVIDIA H100 80GB HBM3' then, is 'cpu: "),
    ({"identity.device": "cpu: Another CPU, 1 threads"}, "device was 'cpu: Another CPU, 1 threads' then, is 'cpu: "),
    ({"identity.torch": "2.0.0"}, "torch was '2.0.0' then"),
    ({"identity.fp8": True}, "fp8 was 'True' then, is 'False' now"),
    ({"identity.source": "/elsewhere"}, "source was '/elsewhere' then"),
    ({"identity.files": [["model.safetensors", 1, 2]]}, "the target's files changed since (model.safetensors)"),
    ({"identity.files": "x"}, "the target's files changed since"),
    ({"identity.files": [[["unhashable"]]]}, "the target's files changed since"),
    ({"max_new_tokens": NEW + 1}, "other prompts or another token budget"),
    ({"prompts": "0" * 64}, "other prompts or another token budget"),
    ({"graphs": True}, "CUDA graphs were on then"),
    ({"tokens": [[10 ** 9]] * 3}, "its tokens do not check"),
    ({"tokens": [[1.5]] * 3}, "its tokens do not check"),
    ({"tokens": [[True]] * 3}, "its tokens do not check"),
    ({"tokens": [[1] * (NEW + 1)] * 3}, "its tokens do not check"),
    ({"tokens": [[1]] * 2}, "its tokens do not check"),
    ({"seconds": -1.0}, "its times do not check"),
    ({"seconds": "fast"}, "its times do not check"),
    ({"setup_s": float("nan")}, "its times do not check"),
    ({"step": "3"}, "its step does not check"),
    ({"format": 99}, "not a baseline of this dflash's format"),
])
def test_a_stored_baseline_that_does_not_apply_is_measured_again_and_replaced(drafter, tiny_target, tmp_path,
                                                                             change, why):
    prompts = mixed_prompts(tiny_target, 3)
    path = tmp_path / baseline_store.FILE
    first = _measured(drafter, tiny_target, prompts, path)
    _rewrite(path, **change)
    state = EvalState(store=path)
    evaluate_drafter(drafter, tiny_target, prompts, NEW, drafter.spec.block_size, state=state, step=5)
    assert state.last.plain_baseline == "measured" and why in state.store_note and str(path) in state.store_note
    assert state.baseline.stored is None and state.baseline.step == 5
    assert [g.tokens for g in state.baseline.generations] == [g.tokens for g in first.baseline.generations]
    assert json.loads(path.read_text())["step"] == 5  # replaced by this measurement
    assert EvalState(store=path).baseline_for(tiny_target, prompts, NEW, False) is not None  # and it applies


@pytest.mark.parametrize("content, why", [
    (b"\xff\xfe not utf-8", "is not JSON"), (b"[" * 100_000, "is not JSON"), (b"{}", "not a baseline"),
    (b"[]", "not a baseline"), (b"null", "not a baseline"),
])
def test_a_damaged_file_is_not_json_and_costs_a_measurement_only(drafter, tiny_target, tmp_path, content, why):
    prompts = mixed_prompts(tiny_target, 2)
    path = tmp_path / baseline_store.FILE
    path.write_bytes(content)
    state = EvalState(store=path)
    evaluate_drafter(drafter, tiny_target, prompts, NEW, drafter.spec.block_size, state=state, step=1)
    assert state.last.plain_baseline == "measured" and why in state.store_note


@pytest.mark.parametrize("kind", ["fifo", "device", "directory"])
def test_a_path_that_is_not_a_regular_file_is_not_opened(tiny_target, tmp_path, kind):
    """A FIFO would block the open (the eval would hang), a device would never end: neither is read."""
    path = tmp_path / baseline_store.FILE
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "device":
        path.symlink_to("/dev/zero")
    else:
        path.mkdir()
    prompts = mixed_prompts(tiny_target, 2)
    base, note = baseline_store.read(path, tiny_target, prompts, NEW, False)
    assert base is None and "is not a regular file" in note


def test_an_oversized_file_is_not_read(drafter, tiny_target, tmp_path, monkeypatch):
    monkeypatch.setattr(baseline_store, "MAX_BYTES", 64)
    prompts = mixed_prompts(tiny_target, 2)
    path = tmp_path / baseline_store.FILE
    _measured(drafter, tiny_target, prompts, path)
    assert path.stat().st_size > 64
    base, note = baseline_store.read(path, tiny_target, prompts, NEW, False)
    assert base is None and "over 0 MiB: not read" in note


def test_a_changed_target_file_means_measured_again(drafter, tmp_path, local_target_dir_copy):
    from dflash.config import TargetConfig
    from dflash.model.target import load_target

    import torch

    target = load_target(TargetConfig(path=str(local_target_dir_copy)), 2, torch.device("cpu"))
    prompts = mixed_prompts(target, 2)
    path = tmp_path / baseline_store.FILE
    state = EvalState(store=path)
    d = trained_drafter(target, sliding=False)
    evaluate_drafter(d, target, prompts, NEW, d.spec.block_size, state=state, step=1)
    assert EvalState(store=path).baseline_for(target, prompts, NEW, False) is not None
    weights = next(local_target_dir_copy.glob("*.safetensors"))
    st = weights.stat()
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))  # rewritten in place, say
    later = EvalState(store=path)
    assert later.baseline_for(target, prompts, NEW, False) is None and "the target's files changed since (model.safetensors)" in later.store_note


@pytest.fixture()
def local_target_dir_copy(tmp_path):
    """A small saved target of our own (its files' times are this test's to change)."""
    from transformers import Qwen3ForCausalLM

    import torch

    from dflash.model.target import build_tiny_tokenizer, tiny_target_config

    tok = build_tiny_tokenizer()
    torch.manual_seed(5)
    model = Qwen3ForCausalLM(tiny_target_config(len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                                head_dim=8))
    path = tmp_path / "target"
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def test_a_store_that_cannot_be_written_costs_a_note_not_the_eval(drafter, tiny_target, tmp_path, monkeypatch):
    import compilewatch

    def full(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(compilewatch, "atomic_write_text", full)
    prompts = mixed_prompts(tiny_target, 2)
    state = EvalState(store=tmp_path / baseline_store.FILE)
    evaluate_drafter(drafter, tiny_target, prompts, NEW, drafter.spec.block_size, state=state, step=1)
    assert state.baseline is not None and "not kept" in state.store_note and "No space left" in state.store_note
    assert not (tmp_path / baseline_store.FILE).exists()


def test_a_resumed_run_takes_its_baseline_from_the_run_directory(tmp_path, chat_file):
    from dflash.training.trainer import Trainer

    over = {"eval.every": 1, "eval.every_prompts": 2, "eval.num_prompts": 2, "eval.max_new_tokens": 8,
            "checkpoint.every": 2}
    events = []
    t = Trainer.from_config(small_config(tmp_path, chat_file, **{**over, "train.max_steps": 2}),
                            on_event=lambda k, d: events.append(d) if k == "periodic_eval" else None)
    try:
        t.train()
    finally:
        t.close()
    assert (tmp_path / baseline_store.FILE).is_file()
    t = Trainer.from_config(small_config(tmp_path, chat_file, **{**over, "train.max_steps": 3}), resume=True,
                            on_event=lambda k, d: events.append(d) if k == "periodic_eval" else None)
    try:
        result = t.train()
    finally:
        t.close()
    assert [(e["step"], e["plain_baseline"], e["warmed_up"], e["parts_s"]["plain"] == 0) for e in events] == [
        (1, "measured", True, False), (2, "step 1", False, True), (3, "step 1, from eval_baseline.json", True, True)]
    assert any("read from" in n and baseline_store.FILE in n for n in result.notes)
    assert dataclasses.asdict(result)  # the result still serializes


# ----------------------------------------------------------------------------- shared between runs
def _shared_state(tmp_path, name: str, shared) -> EvalState:
    run = tmp_path / name
    run.mkdir(exist_ok=True)
    return EvalState(store=run / baseline_store.FILE, shared=shared, run=str(run))


def test_a_new_run_takes_another_runs_baseline_from_the_shared_directory(drafter, tiny_target, tmp_path):
    prompts = mixed_prompts(tiny_target, 3)
    shared = tmp_path / "shared"
    first = _shared_state(tmp_path, "run-a", shared)
    evaluate_drafter(drafter, tiny_target, prompts, NEW, drafter.spec.block_size, state=first, step=4)
    (kept,) = shared.iterdir()
    assert kept == baseline_store.shared_path(shared, tiny_target, prompts, NEW, False)
    assert json.loads(kept.read_text())["run"] == str(tmp_path / "run-a")
    second = _shared_state(tmp_path, "run-b", shared)
    r = evaluate_drafter(drafter, tiny_target, prompts, NEW, drafter.spec.block_size, state=second, step=2)
    assert second.last.plain_baseline == f"step 4 of run run-a, from {kept.name}"
    assert dict(second.last.parts_s)["plain"] == 0 and second.store_note is None
    assert "run " + str(tmp_path / "run-a") + " measured it" in second.baseline.note()
    assert facts(r) == facts(evaluate_drafter(drafter, tiny_target, prompts, NEW, drafter.spec.block_size))
    # kept in run-b's own file too (with who measured it): its resume needs no shared directory
    resumed = _shared_state(tmp_path, "run-b", None)
    evaluate_drafter(drafter, tiny_target, prompts, NEW, drafter.spec.block_size, state=resumed, step=3)
    assert resumed.last.plain_baseline == "step 4 of run run-a, from eval_baseline.json"


def test_another_budget_or_prompts_is_another_shared_baseline(drafter, tiny_target, tmp_path):
    prompts = mixed_prompts(tiny_target, 3)
    shared = tmp_path / "shared"
    evaluate_drafter(drafter, tiny_target, prompts, NEW, drafter.spec.block_size,
                     state=_shared_state(tmp_path, "a", shared), step=1)
    for other_prompts, budget in ((prompts, NEW - 2), (prompts[:2], NEW)):
        state = _shared_state(tmp_path, f"b{budget}{len(other_prompts)}", shared)
        evaluate_drafter(drafter, tiny_target, other_prompts, budget, drafter.spec.block_size, state=state, step=1)
        assert state.last.plain_baseline == "measured" and state.store_note is None
    assert len(list(shared.iterdir())) == 3


def test_a_damaged_shared_baseline_is_measured_again_and_replaced(drafter, tiny_target, tmp_path):
    prompts = mixed_prompts(tiny_target, 2)
    shared = tmp_path / "shared"
    path = baseline_store.shared_path(shared, tiny_target, prompts, NEW, False)
    shared.mkdir()
    path.write_text('{"format": 1, "identity": {}}')
    state = _shared_state(tmp_path, "a", shared)
    evaluate_drafter(drafter, tiny_target, prompts, NEW, drafter.spec.block_size, state=state, step=1)
    assert state.last.plain_baseline == "measured" and str(path) in state.store_note
    assert json.loads(path.read_text())["run"] == str(tmp_path / "a")  # replaced
    _rewrite(path, run=["not", "a", "path"])
    base, note = baseline_store.read(path, tiny_target, prompts, NEW, False)
    assert base is None and "its run does not check" in note


def test_the_shared_directory_keeps_the_newest_and_only_its_own_files(drafter, tiny_target, tmp_path, monkeypatch):
    monkeypatch.setattr(baseline_store, "SHARED_KEEP", 2)
    shared = tmp_path / "shared"
    shared.mkdir()
    mine = shared / "notes.txt"
    mine.write_text("a user's file")
    alien = shared / ("0" * 32 + ".json.bak")
    alien.write_text("{}")
    prompts = mixed_prompts(tiny_target, 3)
    made = []
    for i, budget in enumerate((NEW - 4, NEW - 2, NEW)):
        evaluate_drafter(drafter, tiny_target, prompts, budget, drafter.spec.block_size,
                         state=_shared_state(tmp_path, f"r{i}", shared), step=1)
        made.append(baseline_store.shared_path(shared, tiny_target, prompts, budget, False))
        os.utime(made[-1], ns=(i * 10**9, i * 10**9))  # written one after another (a coarse clock ties them)
    assert sorted(shared.iterdir()) == sorted([mine, alien, *made[1:]])


def test_a_shared_directory_that_cannot_be_written_costs_a_note(drafter, tiny_target, tmp_path):
    blocker = tmp_path / "shared"
    blocker.write_text("a file where the directory would be")
    prompts = mixed_prompts(tiny_target, 2)
    state = _shared_state(tmp_path, "a", blocker)
    evaluate_drafter(drafter, tiny_target, prompts, NEW, drafter.spec.block_size, state=state, step=1)
    assert state.baseline is not None and "not kept in" in state.store_note and str(blocker) in state.store_note
    assert (tmp_path / "a" / baseline_store.FILE).is_file() and blocker.read_text().startswith("a file")


@pytest.mark.parametrize("setting, env, expect", [
    (None, None, "XDG/dflash/eval"), (None, "ENV", "ENV"), (None, "off", None), ("off", "ENV", None),
    ("DIR", "ENV", "DIR"), ("~/x", None, "HOME/x"),
])
def test_where_the_shared_directory_is(tmp_path, monkeypatch, setting, env, expect):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "XDG"))
    monkeypatch.setenv("HOME", str(tmp_path / "HOME"))
    if env is None:
        monkeypatch.delenv(baseline_store.SHARED_ENV)
    else:
        monkeypatch.setenv(baseline_store.SHARED_ENV, env if env == "off" else str(tmp_path / env))
    setting = setting if setting in (None, "off", "~/x") else str(tmp_path / setting)
    root = baseline_store.shared_root(setting)
    assert root == (None if expect is None else tmp_path / expect)


def test_two_new_runs_share_the_baseline_and_off_turns_it_off(tmp_path, chat_file):
    from dflash.training.trainer import Trainer

    over = {"eval.every": 2, "eval.every_prompts": 2, "eval.num_prompts": 2, "eval.max_new_tokens": 8,
            "train.max_steps": 2}

    def run(name, **more):
        events = []
        t = Trainer.from_config(small_config(tmp_path / name, chat_file, **{**over, **more}),
                                on_event=lambda k, d: events.append(d) if k == "periodic_eval" else None)
        try:
            result = t.train()
        finally:
            t.close()
        (e,) = events
        return e, result

    e1, _ = run("one")
    e2, r2 = run("two")
    e3, _ = run("three", **{"eval.baseline_cache": "off"})
    assert (e1["plain_baseline"], e1["parts_s"]["plain"] > 0) == ("measured", True)
    assert e2["plain_baseline"].startswith("step 2 of run one, from ") and e2["parts_s"]["plain"] == 0
    assert any("run " + str((tmp_path / "one").resolve()) + " measured it" in n for n in r2.notes)
    assert e3["plain_baseline"] == "measured"
    assert e1["tau"] == e2["tau"]  # the same seed, the same drafter: only the plain pass was skipped


# ----------------------------------------------------------------------------- GPU (run with -m gpu)
@pytest.mark.gpu
@requires_cuda()
def test_on_cuda_a_stored_graph_mode_baseline_applies_and_gives_a_fresh_evals_tokens(tiny_target, tmp_path):
    """CUDA graphs on: the stored baseline's identity names the GPU; a new state takes it, and its tokens are a
    fresh plain decode's."""
    import copy

    import torch

    from dflash.eval.batched import plain_batch

    dev = torch.device("cuda:0")
    target = dataclasses.replace(tiny_target, model=copy.deepcopy(tiny_target.model).to(dev), device=dev)
    d = trained_drafter(tiny_target, sliding=False).to(dev)
    prompts = mixed_prompts(target, 3)
    path = tmp_path / baseline_store.FILE
    first = EvalState(store=path)
    evaluate_drafter(d, target, prompts, NEW, d.spec.block_size, state=first, step=1)
    assert json.loads(path.read_text())["identity"]["device"] == torch.cuda.get_device_name(dev)
    again = EvalState(store=path)
    evaluate_drafter(d, target, prompts, NEW, d.spec.block_size, state=again, step=2)
    assert again.last.plain_baseline == "step 1, from eval_baseline.json" and again.store_note is None
    fresh = plain_batch(target, prompts, NEW)
    assert [g.tokens for g in again.baseline.generations] == [g.tokens for g in fresh.generations]
