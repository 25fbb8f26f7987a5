"""The overlapped start (issue 28, fast restart; issue 39): on --resume the checkpoint is read in a
thread beside the target, the data and the drafter (dflash.training.build, dflash.training.startup.Background). It must
give exactly the sequential start's run, and its failures must surface as the sequential start's
errors, never as a hang. CPU, the small config of tests/dflash_helpers.py. Threads are ordered with
Events, never sleeps."""

from __future__ import annotations

import shutil
import threading

import pytest
import torch

from compilewatch.errors import BadInput
from dflash.checkpoint import rundir
from dflash.checkpoint.runlock import RunLock
from dflash.training import build
from dflash.training.trainer import Trainer
from tests.dflash_helpers import chat_file, small_config, tiny_target  # noqa: F401 - fixtures
from tests.helpers import requires_cuda

WAIT = 120  # seconds: a generous bound on an Event that a correct start sets within a second


def _first_run(tmp_path, chat_file):
    run = tmp_path / "first"
    t = Trainer.from_config(small_config(run, chat_file, **{"train.max_steps": 4, "checkpoint.every": 2}))
    try:
        t.train(until=2)  # a checkpoint at step 2 of a 4-step run
    finally:
        t.close()
    return run


def _resume(run, chat_file, overlap, events=None):
    cfg = small_config(run, chat_file, **{"train.max_steps": 4, "checkpoint.every": 2})
    on_event = (lambda k, d: events.append((k, d))) if events is not None else None
    return build.build_trainer(cfg, Trainer, resume=True, overlap=overlap, on_event=on_event)


def _no_start_threads() -> bool:
    return not [t for t in threading.enumerate() if t.name.startswith("dflash-start-")]


def test_overlapped_resume_trains_bit_identically_to_the_sequential_one(tmp_path, chat_file, monkeypatch):
    """Two copies of one run resumed at step 2, one overlapped and one sequential: the same state is
    loaded and the two steps after it give the same losses and bit-identical weights. The
    overlapped read is held until the data phase has begun, so it provably ran beside the target
    and the data, and its phase says so."""
    first = _first_run(tmp_path, chat_file)
    copies = {o: shutil.copytree(first, tmp_path / f"resume-{o}") for o in (True, False)}

    data_started = threading.Event()
    real_load, real_data = rundir.load_resume_state, build.load_training_data

    def held_load(start, device=None):
        assert data_started.wait(WAIT), "the data phase never began while the checkpoint was read"
        return real_load(start, device)

    def data(*a, **k):
        data_started.set()
        return real_data(*a, **k)

    monkeypatch.setattr(build, "load_resume_state", held_load)
    monkeypatch.setattr(build, "load_training_data", data)
    out = {}
    for overlap in (True, False):
        data_started.clear()
        if not overlap:
            monkeypatch.setattr(build, "load_resume_state", real_load)  # sequential: nothing to hold
        events = []
        t = _resume(copies[overlap], chat_file, overlap, events)
        try:
            assert t.step == 2
            losses = []
            t.on_event = lambda k, d: losses.append(d["metrics"].loss) if k == "step" else None
            t.train()
            out[overlap] = (losses, {k: v.clone() for k, v in t.drafter.state_dict().items()}, events)
        finally:
            t.close()
    (l1, w1, ev1), (l0, w0, ev0) = out[True], out[False]
    assert len(l1) == 2 and l1 == l0
    assert w1.keys() == w0.keys() and all((w1[k] == w0[k]).all() for k in w1)
    done = lambda ev: [d for k, d in ev if k == "phase-done" and d["name"] != "imports"]  # noqa: E731 - once per process
    assert [d["name"] for d in done(ev0)] == ["target", "data", "resume state", "drafter", "first step"]
    # overlapped (issue 39): the data and the drafter from the target's shape, while the target loads
    assert [d["name"] for d in done(ev1)] == ["data", "drafter", "target", "resume state", "trainer", "first step"]
    assert {"target", "data"} <= set(next(d for d in done(ev1) if d["name"] == "resume state")["beside"])
    assert "beside" not in next(d for d in done(ev0) if d["name"] == "resume state")
    assert _no_start_threads()


def test_a_damaged_checkpoint_fails_the_overlapped_start_with_the_sequential_error(tmp_path, chat_file):
    """A byte flipped in training_state.pt (same size: only the manifest's checksum sees it): the
    thread's BadInput is raised by the start, word for word the sequential one, and the run
    directory's lock is released (the next --resume can run)."""
    run = _first_run(tmp_path, chat_file)
    state = run / "checkpoints" / "step_000002" / "training_state.pt"
    raw = bytearray(state.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    state.write_bytes(bytes(raw))
    errors = {}
    for overlap in (True, False):
        with pytest.raises(BadInput) as e:
            _resume(run, chat_file, overlap)
        errors[overlap] = (e.value.message, e.value.hint)
        RunLock(run).acquire().release()  # not left held
    assert errors[True] == errors[False] and "training_state.pt" in errors[True][0]
    assert _no_start_threads()


def test_an_unexpected_error_in_the_thread_is_raised_by_the_start(tmp_path, chat_file, monkeypatch):
    """Not only BadInput: whatever the read raises comes out of the start as that exception."""
    run = _first_run(tmp_path, chat_file)

    def broken(start, device=None):
        raise RuntimeError("injected: the read failed")

    monkeypatch.setattr(build, "load_resume_state", broken)
    with pytest.raises(RuntimeError, match="injected: the read failed"):
        _resume(run, chat_file, True)
    RunLock(run).acquire().release()
    assert _no_start_threads()


def test_a_failing_target_waits_for_the_thread_then_releases_the_lock(tmp_path, chat_file, monkeypatch):
    """The main thread fails (the target) while the checkpoint is still being read: the start waits
    for the read to end before it releases the lock, and raises the target's error."""
    run = _first_run(tmp_path, chat_file)
    target_failed = threading.Event()
    read_ended = threading.Event()
    real_load = rundir.load_resume_state

    def slow_load(start, device=None):
        assert target_failed.wait(WAIT)
        try:
            return real_load(start, device)
        finally:
            read_ended.set()

    def failing_target(*a, **k):
        target_failed.set()
        raise BadInput("injected: no target here", hint="a test")

    monkeypatch.setattr(build, "load_resume_state", slow_load)
    monkeypatch.setattr(build, "load_target", failing_target)
    with pytest.raises(BadInput, match="injected: no target here"):
        _resume(run, chat_file, True)
    assert read_ended.is_set()  # the read ended before the start returned
    RunLock(run).acquire().release()
    assert _no_start_threads()


def _trained_state(device: str):
    """A small model's Trainer-like state after one fused (CUDA) or plain AdamW step."""
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4)).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=device.startswith("cuda"))
    model(torch.randn(3, 8, device=device, generator=None)).sum().backward()
    opt.step()
    state = {"step": 1, "model": {k: v.detach().cpu().clone() for k, v in model.state_dict().items()},
             "optimizer": opt.state_dict(), "spec": {}, "total_steps": 10}
    state["optimizer"] = {**state["optimizer"], "state": {i: {k: v.cpu() for k, v in e.items()}
                                                          for i, e in state["optimizer"]["state"].items()}}
    return model, opt, state


def test_staging_a_state_keeps_it_whole_and_leaves_the_loaded_one_alone():
    from dflash.checkpoint.rundir import staged

    torch.manual_seed(0)
    _, _, state = _trained_state("cpu")
    before = {k: v.clone() for k, v in state["model"].items()}
    out = staged(state, torch.device("cpu"), threads=3)
    assert out is not state and out.keys() == state.keys() and out["step"] == 1
    assert out["optimizer"]["param_groups"] == state["optimizer"]["param_groups"]
    for k, v in before.items():
        assert torch.equal(out["model"][k], v) and torch.equal(state["model"][k], v)
    for i, e in state["optimizer"]["state"].items():
        assert out["optimizer"]["state"][i].keys() == e.keys()
        assert all(torch.equal(out["optimizer"]["state"][i][k], e[k]) for k in e)


@requires_cuda()
def test_a_state_staged_on_the_gpu_loads_into_a_fused_adamw_without_another_copy():
    """The resume thread's copies (`load_resume_state(start, device)`): the weights and moments land on the
    GPU, the step counters stay as saved, and loading keeps the staged moments (no second copy)."""
    from dflash.checkpoint.rundir import staged
    from dflash.checkpoint.state_check import load_optimizer_state

    torch.manual_seed(0)
    model, opt, state = _trained_state("cuda")
    out = staged(state, torch.device("cuda"))
    assert all(v.is_cuda for v in out["model"].values())
    for i, e in out["optimizer"]["state"].items():
        assert e["exp_avg"].is_cuda and e["exp_avg_sq"].is_cuda
        assert e["step"].device == state["optimizer"]["state"][i]["step"].device  # as saved
    fresh = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4)).cuda()
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2, fused=True)
    fresh.load_state_dict(out["model"])
    load_optimizer_state(fresh_opt, out["optimizer"])
    for (k, v), (_, w) in zip(fresh.state_dict().items(), model.state_dict().items()):
        assert torch.equal(v, w), k
    for p_new, p_old in zip(fresh.parameters(), model.parameters()):
        a, b = fresh_opt.state[p_new], opt.state[p_old]
        assert torch.equal(a["exp_avg"], b["exp_avg"]) and torch.equal(a["exp_avg_sq"], b["exp_avg_sq"])
    staged_ptrs = {e["exp_avg"].data_ptr() for e in out["optimizer"]["state"].values()}
    assert {fresh_opt.state[p]["exp_avg"].data_ptr() for p in fresh.parameters()} == staged_ptrs
