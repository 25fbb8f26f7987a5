"""The seeds' races as deterministic, single-trial reproductions (Events only, no sleeps).

Each trial starts a "setter" thread that traces a function which waits on an Event while it holds
the FX tracing state, and a "victim" thread that does one thing inside that window. Returns what
each thread raised (None: nothing). Shared by test_watch.py and test_guard.py.

What a trial does depends on how the installed torch keeps the FX flag (compilewatch.tracing.torchcompat):
tests of the module-global flag's leak are marked `needs_global_flag` and skip, with the reason, on a
torch that keeps it per thread (2.14+), where `needs_per_thread_flag` tests check that nothing leaks.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Callable

import pytest
import torch
import torch.fx
from torch.fx.experimental.proxy_tensor import make_fx

from compilewatch.tracing import torchcompat

WAIT = 30.0  # upper bound for an Event wait; a correct run never comes close


FLAG = torchcompat.fx_flag_layout()
GLOBAL_FLAG = FLAG.kind == "global"
needs_global_flag = pytest.mark.skipif(
    not GLOBAL_FLAG, reason=f"needs torch's module-global FX flag (_is_fx_tracing_flag); this torch: {FLAG.why}")
needs_per_thread_flag = pytest.mark.skipif(
    not FLAG.per_thread, reason=f"needs a torch that keeps the FX flag per thread (2.14+); this torch: {FLAG.why}")


@dataclass
class Trial:
    setter_error: BaseException | None = None
    victim_error: BaseException | None = None
    victim_result: Any = None
    flags_after: list = field(default_factory=lambda: [None, None])  # each thread's own FX flag as its trace ended


def _run(setter: Callable[[], None], victim: Callable[[], Any], trial: Trial) -> Trial:
    def setter_body() -> None:
        try:
            setter()
        except BaseException as e:  # noqa: BLE001 - the trial's outcome
            trial.setter_error = e

    def victim_body() -> None:
        try:
            trial.victim_result = victim()
        except BaseException as e:  # noqa: BLE001
            trial.victim_error = e

    ts = threading.Thread(target=setter_body, name="setter")
    tv = threading.Thread(target=victim_body, name="victim")
    ts.start()
    tv.start()
    tv.join(WAIT)
    ts.join(WAIT)
    assert not ts.is_alive() and not tv.is_alive(), "trial threads did not finish"
    return trial


def trace_window(tracer: str, inside: threading.Event, release: threading.Event) -> Callable[[], None]:
    """A setter that traces (fx.symbolic_trace or make_fx) a function that signals `inside` and then
    waits for `release` while the trace is open."""

    def traced_fn(a):
        inside.set()
        release.wait(WAIT)
        return a * 2

    def setter() -> None:
        try:
            if tracer == "make_fx":
                make_fx(traced_fn)(torch.ones(2))
            else:
                torch.fx.symbolic_trace(traced_fn)
        finally:
            inside.set()

    return setter


def leak_trial(call: Callable[[], Any], tracer: str = "symbolic_trace") -> Trial:
    """The victim runs `call` (a compiled function call) while the setter's trace is open."""
    inside, release = threading.Event(), threading.Event()

    def victim():
        inside.wait(WAIT)
        try:
            return call()
        finally:
            release.set()

    return _run(trace_window(tracer, inside, release), victim, Trial())


def overlap_trial() -> Trial:
    """Two symbolic traces overlap: A enters, B enters, A leaves first, then B (restore order wrong)."""
    a_in, b_in, a_done = threading.Event(), threading.Event(), threading.Event()

    def fa(x):
        a_in.set()
        b_in.wait(WAIT)
        return x + 1

    def fb(x):
        b_in.set()
        a_done.wait(WAIT)
        return x + 2

    trial = Trial()

    def setter():
        try:
            torch.fx.symbolic_trace(fa)
        finally:
            a_in.set()
            a_done.set()
            trial.flags_after[0] = torchcompat.fx_flag()

    def victim():
        a_in.wait(WAIT)
        try:
            torch.fx.symbolic_trace(fb)
        finally:
            b_in.set()
            trial.flags_after[1] = torchcompat.fx_flag()

    return _run(setter, victim, trial)


def _sin1(x):
    return x.sin() + 1


# one compiled function shared by the race tests (compiled once per process, warmed by the fixture)
step = torch.compile(_sin1, backend="eager")
X = torch.randn(4)


@pytest.fixture(autouse=True)
def clean_race_state():
    """Autouse in every module that imports it: warm `step`, and repair any stuck FX state after."""
    from compilewatch.tracing import fxpatch

    step(X)
    yield
    fxpatch.repair_state()
