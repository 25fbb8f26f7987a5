"""Red-team findings on the thread-safety features (guard, tracehooks, prewarm, timeline input).

Deterministic: threads meet on Events; a Ctrl-C landing in a lock wait is simulated by a Condition
whose first wait() raises KeyboardInterrupt (what Python does when SIGINT arrives in that wait)."""

from __future__ import annotations

import json
import sys
import threading

import pytest
import torch
import torch.fx

from compilewatch.devices.warm import prewarm
from compilewatch.errors import BadInput
from compilewatch.tracing import fxpatch, timeline, torchcompat, tracehooks
from compilewatch.tracing.guard import CompileGuard, _RWLock

WAIT = 30.0  # upper bound for an Event wait; a correct run never comes close


class _InterruptedOnce(threading.Condition):
    """The first wait() raises KeyboardInterrupt, as a Ctrl-C arriving in it does."""

    def __init__(self) -> None:
        super().__init__()
        self.armed = True

    def wait(self, timeout=None):
        if self.armed:
            self.armed = False
            raise KeyboardInterrupt
        return super().wait(timeout)


class _Add(torch.nn.Module):
    def forward(self, x):
        return x + 1


def test_ctrl_c_while_a_serialized_trace_waits_leaves_no_open_window_and_a_sound_lock():
    """Finding: Ctrl-C while `Tracer.trace` waited for serialize's exclusive lock (another thread in
    `guard.shared()`) escaped tracehooks before its try/finally: the window stayed open forever
    (thread_is_tracing() True, when_idle refused, a stall for the watcher) and the reader count went
    to -1 (a later compile could overlap a shared call)."""
    layout = torchcompat.fx_flag_layout().kind
    assert layout in ("global", "thread_local", "unknown")
    inside, release = threading.Event(), threading.Event()
    with CompileGuard(serialize=True) as g:
        g._rw._cond = _InterruptedOnce()

        def reader() -> None:
            with g.shared():
                inside.set()
                release.wait(WAIT)

        t = threading.Thread(target=reader, name="shared-holder")
        t.start()
        assert inside.wait(WAIT)
        with pytest.raises(KeyboardInterrupt):
            with g.shared():
                torch.fx.symbolic_trace(_Add())
        release.set()
        t.join(WAIT)
        assert not t.is_alive()
        assert tracehooks.active_windows() == [] and not tracehooks.thread_is_tracing()
        assert (g._rw._readers, g._rw._writer, g._rw._waiting) == (0, None, 0)
        done = threading.Event()
        worker = threading.Thread(target=lambda: (torch.fx.symbolic_trace(_Add()), done.set()), daemon=True)
        worker.start()
        assert done.wait(WAIT)  # the lock still works: a later trace gets it
    assert not fxpatch.stuck_state().stuck


def test_listener_interrupted_on_trace_entry_still_closes_the_window():
    class Interrupting:
        def on_trace_enter(self, window):
            raise KeyboardInterrupt

        def on_trace_exit(self, window):
            exits.append(window.window_id)

    exits: list[int] = []
    listener = Interrupting()
    original = torch.fx.Tracer.__dict__["trace"]
    tracehooks.subscribe(listener)
    try:
        with pytest.raises(KeyboardInterrupt):
            torch.fx.symbolic_trace(_Add())
        assert tracehooks.active_windows() == [] and not tracehooks.thread_is_tracing()
        assert len(exits) == 1  # on_trace_exit ran: listeners that took something on entry give it back
    finally:
        tracehooks.unsubscribe(listener)
    assert torch.fx.Tracer.__dict__["trace"] is original


def test_rwlock_interrupted_upgrade_keeps_reader_count():
    lock = _RWLock()
    lock._cond = _InterruptedOnce()
    holding, release, b_done = threading.Event(), threading.Event(), threading.Event()
    result: dict[str, object] = {}

    def a() -> None:
        lock.acquire_shared()
        holding.set()
        release.wait(WAIT)
        lock.release_shared()

    def b() -> None:
        lock.acquire_shared()
        try:
            lock.acquire_exclusive()  # waits for `a`: the wait is interrupted
        except KeyboardInterrupt:
            result["interrupted"] = True
        lock.release_shared()  # the share was given up: nothing left to release
        result["readers_after_b"] = lock._readers
        b_done.set()

    ta = threading.Thread(target=a)
    ta.start()
    assert holding.wait(WAIT)
    tb = threading.Thread(target=b)
    tb.start()
    assert b_done.wait(WAIT)
    tb.join(WAIT)
    assert result == {"interrupted": True, "readers_after_b": 1}  # only `a` holds a share
    release.set()
    ta.join(WAIT)
    assert (lock._readers, lock._waiting, lock._writer) == (0, 0, None)
    lock.acquire_exclusive()  # nobody holds anything: immediate
    assert lock.is_writer()
    lock.release_exclusive()


def test_prewarm_reports_a_workload_that_exits_instead_of_exiting():
    """Finding: a workload that calls sys.exit (argparse on warm's argv does) ended `compilewatch
    warm` with that code and argparse's usage line naming compilewatch; now a workload error, exit 1."""
    r = prewarm(["cpu"], lambda device: sys.exit(3), verify=False)
    assert not r.ok and r.warm[0].error == "SystemExit: 3"
    assert r.verdicts[0] == "warm failed on cpu: SystemExit: 3"


def test_prewarm_reports_a_build_that_raises():
    """Finding: a Workload whose build() raised escaped prewarm (a traceback from `compilewatch warm`,
    exit 1 without a report), against "never raises for the workload's own errors"."""

    class Broken:
        name = "broken"

        def build(self) -> None:
            raise ValueError("build broke")

        def run(self, device: str) -> None:
            raise AssertionError("run must not be called after a failed build")

    r = prewarm(["cpu", "cpu"], Broken())
    assert not r.ok and r.verify == ()
    assert [run.error for run in r.warm] == ["build() failed: ValueError: build broke"]
    assert r.verdicts[0] == "warm failed on cpu: build() failed: ValueError: build broke"


@pytest.mark.parametrize("event, field", [
    ({"kind": "flag_leak", "setters": [{"since": "abc", "thread_id": 2}]}, "setters"),
    ({"kind": "trace", "start": -1e308, "end": 1e308, "tracer": "T", "target": "x"}, "start"),
    ({"kind": "trace", "time": 1e300}, "time"),
])
def test_timeline_of_hostile_times_is_bad_input(tmp_path, event, field):
    """Finding: a setter's `since` that is not a number crashed `compilewatch timeline` (ValueError
    traceback); times near the float limit wrote `dur: null` / Infinity into the JSON."""
    report = tmp_path / "r.jsonl"
    report.write_text(json.dumps({"time": 1.0, "pid": 1, "thread_id": 1, "seq": 1, **event}) + "\n")
    with pytest.raises(BadInput, match=f"field '{field}'"):
        timeline.convert(report, tmp_path / "t.json")
    assert not (tmp_path / "t.json").exists()


def test_prewarm_still_raises_bad_input_a_workloads_build_names():
    """A build() failure is reported as a failed run; bad input it raises (BadInput: a target that cannot be
    read) stays bad input, exit 2."""
    import pytest

    from compilewatch import prewarm
    from compilewatch.errors import BadInput
    from compilewatch.tracing.targets import Workload

    class W(Workload):
        name = "w"

        def build(self):
            raise BadInput("the target /nowhere cannot be read")

        def run(self, device):
            raise AssertionError("never runs")

    with pytest.raises(BadInput, match="cannot be read"):
        prewarm("cpu", W())
