"""The overlapped start (issue 28, fast restart; issue 39): on --resume the checkpoint is read in a
thread beside the target, the data and the drafter (dflash.training.build, dflash.training.startup.Background). It must
give exactly the sequential start's run, and its failures must surface as the sequential start's
errors, never as a hang. CPU, the small config of tests/dflash_helpers.py. Threads are ordered with
Events, never sleeps."""

from __future__ import annotations

import shutil
import threading

import pytest

from compilewatch.errors import BadInput
from dflash.checkpoint import rundir
from dflash.checkpoint.runlock import RunLock
from dflash.training import build
from dflash.training.trainer import Trainer
from tests.dflash_helpers import chat_file, small_config, tiny_target  # noqa: F401 - fixtures

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

    def held_load(start):
        assert data_started.wait(WAIT), "the data phase never began while the checkpoint was read"
        return real_load(start)

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

    def broken(start):
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

    def slow_load(start):
        assert target_failed.wait(WAIT)
        try:
            return real_load(start)
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
