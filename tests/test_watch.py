"""The watcher on the seeds' races, reproduced deterministically (CPU, Events only)."""

from __future__ import annotations

import json
import subprocess
import sys
import threading

import pytest
import torch
import torch.fx._symbolic_trace as st

from compilewatch.tracing import fxpatch, torchcompat, tracehooks
from compilewatch.errors import CompilewatchError
from compilewatch.tracing.watcher import Watcher
from compilewatch.tracing.watch_events import KINDS, SCHEMA_VERSION, read_events, summarize
from tests.race_cases import (GLOBAL_FLAG, WAIT, leak_trial, needs_global_flag, needs_per_thread_flag,  # noqa: F401
                              overlap_trial, trace_window, X, clean_race_state, step)  # (autouse fixture)

NESTED = "Detected that you are using FX to symbolically trace a dynamo-optimized function"


def _kinds(w: Watcher, kind: str):
    return [e for e in w.events if e.kind == kind]


@needs_global_flag
@pytest.mark.parametrize("tracer", ["symbolic_trace", "make_fx"])
def test_flag_leak_is_reproduced_and_names_setter_and_victim(tmp_path, tracer):
    with Watcher(tmp_path / "r.jsonl") as w:
        trial = leak_trial(lambda: step(X), tracer)
    assert trial.setter_error is None
    assert isinstance(trial.victim_error, RuntimeError) and NESTED in str(trial.victim_error)
    (leak,) = _kinds(w, "flag_leak")
    assert leak.thread == "victim"
    assert leak.detail["call"].startswith("_sin1")
    assert [s["thread"] for s in leak.detail["setters"]] == ["setter"]
    setter = leak.detail["setters"][0]
    assert setter["tracer"] == ("PythonKeyTracer" if tracer == "make_fx" else "Tracer")
    assert setter["target"].endswith("traced_fn") and any("race_cases.py" in f for f in setter["stack"])
    assert any("race_cases.py" in f for f in leak.detail["victim_stack"])
    s = w.summary()
    assert not s.ok and s.setter_threads == ("setter",) and s.victim_threads == ("victim",)


@needs_per_thread_flag
@pytest.mark.parametrize("tracer", ["symbolic_trace", "make_fx"])
def test_per_thread_flag_does_not_leak_and_nothing_is_reported(tracer):
    """torch 2.14+ fixed the flag leak upstream: the victim's compiled call runs, the watcher stays quiet."""
    with Watcher() as w:
        trial = leak_trial(lambda: step(X), tracer)
    assert trial.setter_error is None and trial.victim_error is None
    assert torch.equal(trial.victim_result, X.sin() + 1)
    assert w.events[0].detail["fx_flag"] == "thread_local" and w.events[0].detail["unwatched"] == []
    s = w.summary()
    assert s.ok and s.counts.get("flag_leak") is None and s.counts.get("trace") == 1, s.verdicts


def test_module_call_during_foreign_trace_is_reported(tmp_path):
    lin = torch.nn.Linear(4, 4)
    with Watcher() as w:
        trial = leak_trial(lambda: lin(X))
    assert isinstance(trial.victim_error, NameError)  # "module is not installed as a submodule"
    (ev,) = _kinds(w, "module_call_leak")
    assert ev.thread == "victim" and ev.detail["module"] == "Linear"
    assert ev.detail["setters"][0]["thread"] == "setter"


def test_overlapping_traces_leave_stuck_state_which_is_reported_and_repaired():
    with Watcher(repair=True) as w:
        trial = overlap_trial()
    assert isinstance(trial.victim_error, AssertionError)  # CURRENT_PATCHER is None in finally block
    (ev,) = _kinds(w, "stuck_state")
    # a per-thread flag (torch 2.14+) is restored by each thread; the class-level patch is still left behind
    assert ev.detail["flag"] == GLOBAL_FLAG and ev.detail["module_call_patched"] and ev.detail["repaired"]
    assert {r["thread"] for r in ev.detail["recent_windows"]} == {"setter", "victim"}
    assert not fxpatch.stuck_state().stuck
    step(X)  # compiled calls work again after the repair


@needs_global_flag
def test_stuck_state_without_repair_breaks_later_calls_and_check_sees_it():
    with Watcher() as w:
        overlap_trial()
        assert w.check()
        assert st._is_fx_tracing_flag is True
        with pytest.raises(RuntimeError, match="symbolically trace"):
            step(X)  # even single-threaded, every later compiled call fails
        w.repair()
        step(X)
    assert [e.kind for e in w.events if e.kind in ("stuck_state", "repair")] == ["stuck_state", "repair"]


class _SpyLock:
    """A module's lock, telling when the thread named `who` has to wait for it."""

    def __init__(self, inner, who: str, waiting: threading.Event) -> None:
        self.inner, self.who, self.waiting = inner, who, waiting

    def __enter__(self):
        if not self.inner.acquire(blocking=False):
            if threading.current_thread().name == self.who:
                self.waiting.set()
            self.inner.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.inner.release()


@needs_global_flag
def test_repair_is_atomic_with_trace_entry(monkeypatch):
    """Check-then-repair cannot reset the state of a trace that starts in between: a trace that
    starts while the watcher repairs waits, and sees its own flag set once inside."""
    parked, release, repaired = threading.Event(), threading.Event(), threading.Event()
    progress = threading.Event()  # the tracer is waiting for tracehooks' lock, or is inside its trace
    inside, seen = [], []
    real_repair = fxpatch.repair_state

    def slow_repair():
        parked.set()
        release.wait(WAIT)
        try:
            return real_repair()
        finally:
            repaired.set()

    def traced(a):
        inside.append(True)
        progress.set()
        repaired.wait(WAIT)  # without the fix the repair runs now, in the middle of this trace
        seen.append(st.is_fx_tracing())
        return a * 2

    with Watcher(repair=True) as w:
        monkeypatch.setattr(fxpatch, "repair_state", slow_repair)
        monkeypatch.setattr(tracehooks, "_lock", _SpyLock(tracehooks._lock, "tracer", progress))
        torchcompat.set_fx_flag(True)  # stuck: no trace open
        checker = threading.Thread(target=w.check, name="checker")
        checker.start()
        assert parked.wait(WAIT)  # the checker found it stuck and is about to repair
        tracer = threading.Thread(target=lambda: torch.fx.symbolic_trace(traced), name="tracer")
        tracer.start()
        assert progress.wait(WAIT)
        assert inside == []  # the trace waits for the repair instead of starting under it
        release.set()
        checker.join(WAIT)
        tracer.join(WAIT)
        monkeypatch.undo()
    assert seen == [True] and not fxpatch.stuck_state().stuck
    (ev,) = _kinds(w, "stuck_state")
    assert ev.detail["flag"] and ev.detail["repaired"]


def test_stuck_module_patch_breaks_later_module_calls_and_check_sees_it():
    """On every torch so far (2.15 too) overlapping traces leave nn.Module.__call__ patched on the class:
    later module calls, even single-threaded, run through a dead tracer."""
    lin = torch.nn.Linear(4, 4)
    with Watcher() as w:
        overlap_trial()
        assert w.check() and fxpatch.stuck_state().module_call_patched
        with pytest.raises(NameError, match="not installed as a submodule"):
            lin(X)
        w.repair()
        assert lin(X).shape == (4,)
    assert [e.kind for e in w.events if e.kind in ("stuck_state", "repair")] == ["stuck_state", "repair"]


def test_trace_stall_is_reported_with_every_stack_within_t_plus_1():
    T = 0.5
    stalled = threading.Event()
    inside, release = threading.Event(), threading.Event()
    with Watcher(stall_after=T, on_event=lambda e: stalled.set() if e.kind == "stall" else None) as w:
        t = threading.Thread(target=trace_window("symbolic_trace", inside, release), name="stuck-tracer")
        t.start()
        inside.wait(WAIT)
        try:
            assert stalled.wait(T + 1.0), "no stall event within T+1 s"
        finally:
            release.set()
            t.join(WAIT)
    (ev,) = _kinds(w, "stall")
    assert ev.thread == "stuck-tracer" and ev.detail["open_for_s"] >= T
    assert "stuck-tracer" in ev.detail["threads_in_compile"]
    names = {k.rsplit(" (", 1)[0] for k in ev.detail["stacks"]}
    assert {"MainThread", "stuck-tracer", "compilewatch-watchdog"} <= names
    assert any("race_cases.py" in f for f in ev.detail["stacks"][next(k for k in ev.detail["stacks"] if k.startswith("stuck-tracer"))])


def test_dynamo_compile_stall_names_the_compiling_thread():
    T = 0.5
    stalled, in_backend, release = threading.Event(), threading.Event(), threading.Event()

    def blocking_backend(gm, inputs):
        in_backend.set()
        release.wait(WAIT)
        return gm.forward

    fn = torch.compile(lambda x: x.cos() * 3, backend=blocking_backend)
    with Watcher(stall_after=T, on_event=lambda e: stalled.set() if e.kind == "stall" else None) as w:
        t = threading.Thread(target=lambda: fn(X), name="compiler")
        t.start()
        in_backend.wait(WAIT)
        try:
            assert stalled.wait(T + 1.0)
        finally:
            release.set()
            t.join(WAIT)
    ev = _kinds(w, "stall")[0]
    assert ev.detail["what"].startswith("dynamo compile") and ev.thread == "compiler"
    assert "compiler" in ev.detail["threads_in_compile"] and "MainThread" not in ev.detail["threads_in_compile"]


def test_stalls_and_durations_use_the_monotonic_clock():
    """A wall-clock step neither fakes a stall nor hides one: open-for times and durations are
    monotonic; `since`/`start` stay wall-clock timestamps."""
    inside, release = threading.Event(), threading.Event()
    w = Watcher(stall_after=60)  # not installed: the test drives the watchdog's tick itself
    with tracehooks.TraceRecorder():
        t = threading.Thread(target=trace_window("symbolic_trace", inside, release), name="slow-tracer")
        t.start()
        try:
            assert inside.wait(WAIT)
            (win,) = [x for x in tracehooks.active_windows() if x.outer_window is None]
            win.start -= 3600  # the wall clock stepped an hour forward since the trace began
            w._tick()
            assert _kinds(w, "stall") == []
            win.mono_start -= 3600  # an hour really passed
            w._tick()
        finally:
            release.set()
            t.join(WAIT)
    (ev,) = _kinds(w, "stall")
    assert ev.thread == "slow-tracer" and ev.detail["since"] == win.start and ev.detail["open_for_s"] >= 3600
    assert win.duration >= 3600 and win.end - win.start >= 3600  # both clocks moved by the same hour here


def test_recompile_after_warm_carries_guard_reason():
    fn = torch.compile(lambda x: x * 2, backend="eager")
    with Watcher() as w:
        fn(torch.randn(3))
        w.mark_warm()
        fn(torch.randn(3))  # same shape: nothing
        fn(torch.randn(3, 2))  # rank change: recompile
    (ev,) = _kinds(w, "recompile_after_warm")
    assert any("rank mismatch" in r or "size mismatch" in r for r in ev.detail["reasons"]), ev.detail


@needs_global_flag
def test_silent_eager_fallback_is_reported():
    def call():
        # dynamo config is per thread since torch 2.12: set it in the victim thread itself
        with torch._dynamo.config.patch(error_on_nested_fx_trace=False):
            return step(X)

    with Watcher() as w:
        trial = leak_trial(call)
    assert trial.victim_error is None and torch.allclose(trial.victim_result, X.sin() + 1)
    (ev,) = _kinds(w, "eager_fallback")
    assert ev.thread == "victim" and ev.detail["cross_thread"] and ev.detail["setters"][0]["thread"] == "setter"


def test_report_is_versioned_jsonl_with_an_end_summary(tmp_path):
    path = tmp_path / "watch.jsonl"
    lin = torch.nn.Linear(4, 4)
    with Watcher(path) as w:
        leak_trial(lambda: lin(X))  # a module-call leak: the race every torch so far still has
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert all(d["schema_version"] == SCHEMA_VERSION and d["kind"] in KINDS for d in lines)
    assert [d["seq"] for d in lines] == list(range(1, len(lines) + 1))
    assert lines[0]["kind"] == "start" and lines[-1]["kind"] == "end"
    assert lines[-1]["summary"]["victim_threads"] == ["victim"]
    events = read_events(path)
    assert summarize(events).setter_threads == w.summary().setter_threads == ("setter",)


def test_no_problem_when_nothing_races(tmp_path):
    with Watcher() as w:
        step(X)
        torch.fx.symbolic_trace(lambda a: a + 1)
    s = w.summary()
    assert s.ok and s.counts.get("trace") == 1 and s.problems == 0


def test_close_restores_every_patch():
    codes = (st.is_fx_symbolic_tracing.__code__, st.is_fx_tracing.__code__)
    patch_method = st._Patcher.__dict__["patch_method"]
    trace = torch.fx.Tracer.__dict__["trace"]
    with Watcher():
        assert st.is_fx_symbolic_tracing.__code__ is not codes[0]
        assert tracehooks.installed()
    assert (st.is_fx_symbolic_tracing.__code__, st.is_fx_tracing.__code__) == codes
    assert st._Patcher.__dict__["patch_method"] is patch_method
    assert torch.fx.Tracer.__dict__["trace"] is trace and not tracehooks.installed()
    assert "_compilewatch_fxflag" not in vars(st)


def test_unrecognised_torch_installs_nothing_and_is_never_ok(monkeypatch):
    """A torch whose FX layout torchcompat does not know (simulated): fxpatch patches nothing (not even
    Tracer.trace), the watcher says what it could not watch and its summary is not ok."""
    trace = torch.fx.Tracer.__dict__["trace"]
    codes = (st.is_fx_symbolic_tracing.__code__, st.is_fx_tracing.__code__)
    monkeypatch.setattr(torchcompat, "fx_flag_layout", lambda: torchcompat.FlagLayout("unknown", "simulated layout"))

    class Obs:
        def on_flag_read(self, read): ...

        def on_foreign_module_call(self, call): ...

    with pytest.raises(CompilewatchError, match="simulated layout"):
        fxpatch.add_observer(Obs())
    with pytest.raises(CompilewatchError, match="simulated layout"):
        fxpatch.enable_thread_local()
    assert torch.fx.Tracer.__dict__["trace"] is trace and not tracehooks.installed()
    assert (st.is_fx_symbolic_tracing.__code__, st.is_fx_tracing.__code__) == codes
    assert not fxpatch.thread_local_enabled()
    with Watcher() as w:
        gm = torch.fx.symbolic_trace(lambda a: a + 1)  # the program's own tracing still works
        assert torch.equal(gm(X), X + 1)
    start = w.events[0]
    assert start.detail["fx_flag"] == "unknown" and "simulated layout" in start.detail["unwatched"][0]["why"]
    s = w.summary()
    assert not s.ok and s.problems == 0 and s.unwatched and "not watched" in s.verdicts[0]
    assert torch.fx.Tracer.__dict__["trace"] is trace and not tracehooks.installed()


def test_importing_compilewatch_does_not_import_torch():
    code = ("import sys, compilewatch; compilewatch.__all__; "
            "assert 'torch' not in sys.modules, 'torch imported'; print(callable(compilewatch.watch))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "True"


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_thread_that_dies_is_a_failure_named_by_its_pattern():
    def worker():
        raise NameError("module is not installed as a submodule")

    with Watcher() as w:
        t = threading.Thread(target=worker, name="dies")
        t.start()
        t.join()
    s = w.summary()
    assert not s.ok and s.failures == 1
    f = s.findings[0]
    assert (f.kind, f.threads, f.pattern) == ("thread_error", ("dies",), "module_not_submodule")
    assert "in worker" in (f.function or "") and "NameError" in f.first["traceback"]


def test_live_output_prints_each_finding_once(monkeypatch):
    import io

    from rich.console import Console

    from cli import output
    from cli.run import _Live
    from compilewatch.tracing.watch_events import WatchEvent

    buf = io.StringIO()
    monkeypatch.setattr(output, "err", Console(file=buf, width=400))
    live = _Live()
    setters = [{"thread": "tracer", "tracer": "Tracer", "target": "f", "where": "p.py:3"}]
    for seq in range(1, 6):  # the same leak from five trace windows of the same setter
        live(WatchEvent("flag_leak", float(seq), 1, "victim", 8, seq,
                        {"call": "g", "outcome": "RuntimeError: x", "setters": setters}))
    live(WatchEvent("trace", 6.0, 1, "tracer", 9, 6, {}))  # info: never printed
    lines = [ln for ln in buf.getvalue().splitlines() if ln.strip()]
    assert len(lines) == 1 and "failure: flag leak" in lines[0]


def test_a_failing_listener_is_reported_as_an_instrument_error():
    """Listener failures (trace hooks, compile callbacks) never break the program and never vanish:
    the watcher's summary counts them and shows the first."""
    from compilewatch.tracing.compile_events import CompileRecorder

    class Broken:
        def on_trace_enter(self, window):
            raise ValueError("enter broke")

        def on_trace_exit(self, window):
            pass

        def on_compile_start(self, window):
            raise KeyError("compile broke")

        def on_compile_end(self, window):
            pass

    broken = Broken()
    with Watcher() as w:
        tracehooks.subscribe(broken)
        try:
            gm = torch.fx.symbolic_trace(lambda a: a + 1)
        finally:
            tracehooks.unsubscribe(broken)
        rec = CompileRecorder(listeners=[broken])
        rec._start()  # what torch's compile-start callback calls
        rec._end()
    assert torch.equal(gm(X), X + 1)
    (ev,) = _kinds(w, "instrument_error")
    assert ev.detail == {"count": 2, "first": "Broken.on_trace_enter: ValueError: enter broke"}
    s = w.summary()
    # an incomplete watch is never ok (like an instrument that could not install), and says why
    assert not s.ok and s.failures == 0 and len(s.instrument_errors) == 1 and s.instrument_errors[0] in s.verdicts
    assert not any(v.startswith("no cross-thread problem seen") for v in s.verdicts)
    assert "2 failure(s)" in s.instrument_errors[0] and "enter broke" in s.instrument_errors[0]


def test_no_instrument_error_event_when_nothing_failed():
    with Watcher() as w:
        torch.fx.symbolic_trace(lambda a: a + 1)
    assert _kinds(w, "instrument_error") == [] and w.summary().instrument_errors == ()


@pytest.mark.skipif(not fxpatch.readers_patchable()[0], reason="thread-local FX state unsupported on this torch")
def test_thread_local_refused_while_a_trace_runs_leaves_nothing_subscribed():
    """fxpatch's error path: enable_thread_local() refused (a trace is open) unsubscribes what it
    subscribed (its no-op listener and the flag keeper) and unpatches the readers."""
    inside, release = threading.Event(), threading.Event()
    codes = (st.is_fx_symbolic_tracing.__code__, st.is_fx_tracing.__code__)
    trace = torch.fx.Tracer.__dict__["trace"]
    with tracehooks.TraceRecorder() as rec:
        t = threading.Thread(target=trace_window("symbolic_trace", inside, release), name="tracer")
        t.start()
        try:
            assert inside.wait(WAIT)
            with pytest.raises(CompilewatchError, match="while a trace is running"):
                fxpatch.enable_thread_local()
        finally:
            release.set()
            t.join(WAIT)
        assert tracehooks._listeners == [rec]
    assert not tracehooks.installed() and torch.fx.Tracer.__dict__["trace"] is trace
    assert (st.is_fx_symbolic_tracing.__code__, st.is_fx_tracing.__code__) == codes
    assert not fxpatch.thread_local_enabled()


def test_adding_an_observer_while_the_last_one_leaves_keeps_trace_hooks(monkeypatch):
    """add_observer subscribes its trace listener under fxpatch's lock: a concurrent remove_observer
    of the last observer cannot unsubscribe it between the subscribe and the registration."""

    class Obs:
        def on_flag_read(self, read): ...

        def on_foreign_module_call(self, call): ...

    first, second = Obs(), Obs()
    parked, release, remover_waits = threading.Event(), threading.Event(), threading.Event()
    real_subscribe = tracehooks.subscribe

    def slow_subscribe(listener):
        real_subscribe(listener)
        if threading.current_thread().name == "adder":
            parked.set()
            release.wait(WAIT)

    fxpatch.add_observer(first)
    try:
        monkeypatch.setattr(tracehooks, "subscribe", slow_subscribe)
        monkeypatch.setattr(fxpatch, "_lock", _SpyLock(fxpatch._lock, "remover", remover_waits))
        adder = threading.Thread(target=fxpatch.add_observer, args=(second,), name="adder")
        adder.start()
        assert parked.wait(WAIT)
        remover = threading.Thread(target=lambda: (fxpatch.remove_observer(first), remover_waits.set()),
                                   name="remover")
        remover.start()
        assert remover_waits.wait(WAIT)  # it waits (fixed) or it has already finished (the race)
        release.set()
        adder.join(WAIT)
        remover.join(WAIT)
        monkeypatch.undo()
        assert fxpatch._observers == [second] and fxpatch._noop in tracehooks._listeners and tracehooks.installed()
    finally:
        fxpatch.remove_observer(first)
        fxpatch.remove_observer(second)
    assert not tracehooks.installed()


@pytest.mark.skipif(not fxpatch.readers_patchable()[0], reason="thread-local FX state unsupported on this torch")
def test_switching_to_thread_local_is_atomic_with_trace_entry(monkeypatch):
    """enable_thread_local() resets and swaps the tracing state under tracehooks' lock: a trace that
    starts meanwhile waits for the switch (it used to be able to start between check and switch)."""
    parked, release, progress = threading.Event(), threading.Event(), threading.Event()
    inside = []
    real_repair = fxpatch.repair_state

    def slow_repair():
        if threading.current_thread().name == "enabler":
            parked.set()
            release.wait(WAIT)
        return real_repair()

    def traced(a):
        inside.append(fxpatch.thread_local_enabled())
        progress.set()
        return a * 2

    monkeypatch.setattr(fxpatch, "repair_state", slow_repair)
    monkeypatch.setattr(tracehooks, "_lock", _SpyLock(tracehooks._lock, "tracer", progress))
    enabler = threading.Thread(target=fxpatch.enable_thread_local, name="enabler")
    enabler.start()
    try:
        assert parked.wait(WAIT)
        tracer = threading.Thread(target=lambda: torch.fx.symbolic_trace(traced), name="tracer")
        tracer.start()
        assert progress.wait(WAIT)
        assert inside == []  # waiting for the switch, not tracing beside it
    finally:
        release.set()
        enabler.join(WAIT)
    tracer.join(WAIT)
    monkeypatch.undo()
    try:
        assert inside == [True] and fxpatch.thread_local_enabled()
    finally:
        fxpatch.disable_thread_local()
    assert not fxpatch.thread_local_enabled() and not tracehooks.installed()
