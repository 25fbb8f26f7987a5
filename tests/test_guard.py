"""compilewatch.tracing.guard: the same races as test_watch.py, with the guard: zero failures."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.fx
import torch.fx._symbolic_trace as st
from torch.fx.experimental.proxy_tensor import make_fx

from compilewatch.tracing import fxpatch, torchcompat
from compilewatch.errors import CompilewatchError
from compilewatch.tracing.guard import CompileGuard, GuardError, support
from compilewatch.devices.warm import prewarm
from compilewatch.tracing.watcher import Watcher
from tests.race_cases import (FLAG, GLOBAL_FLAG, WAIT, Trial, leak_trial, overlap_trial, X,  # noqa: F401
                              clean_race_state, step)  # (autouse fixture)

TRIALS = 20
_TL_OK, _TL_WHY = fxpatch.readers_patchable()
needs_thread_local = pytest.mark.skipif(not _TL_OK, reason=f"thread-local FX state unsupported here: {_TL_WHY}")


@pytest.fixture
def guard():
    g = CompileGuard(thread_local=None).install()  # thread-local where this torch allows it
    try:
        yield g
    finally:
        g.close()


def test_support_describes_this_torch():
    s = support()
    assert s.torch_version == torch.__version__
    assert s.freeze and s.compiling_flag_global and s.thread_local_flag == _TL_OK
    assert s.dynamo_config_per_thread == (tuple(int(p) for p in torch.__version__.split(".")[:2]) >= (2, 12))
    # what this torch fixed upstream and what the guard still has to cover, probed (not by version)
    assert s.fx_flag == FLAG.kind
    assert (torchcompat.FLAG_FIXED in s.fixed_upstream) == FLAG.per_thread
    assert (torchcompat.FLAG_NOT_FIXED in s.not_fixed_upstream) == GLOBAL_FLAG
    assert torchcompat.PATCH_NOT_FIXED in s.not_fixed_upstream  # every torch so far, 2.15 included
    assert torchcompat.PATCHER_NOT_FIXED in s.not_fixed_upstream
    if FLAG.per_thread:
        assert "torch keeps the FX flag per thread itself" in s.thread_local_why


@needs_thread_local
@pytest.mark.parametrize("tracer", ["symbolic_trace", "make_fx"])
def test_thread_local_flag_stops_the_leak(guard, tracer):
    with Watcher() as w:
        trials = [leak_trial(lambda: step(X), tracer) for _ in range(TRIALS)]
    assert [(t.setter_error, t.victim_error) for t in trials] == [(None, None)] * TRIALS
    assert all(torch.equal(t.victim_result, X.sin() + 1) for t in trials)
    s = w.summary()
    assert s.ok, s.verdicts
    # a global flag: the watcher saw it set, the guard kept it local; a per-thread flag never reads True there
    assert s.counts.get("leak_prevented") == (TRIALS if GLOBAL_FLAG else None)


@needs_thread_local
def test_thread_local_module_calls_are_not_routed_through_a_foreign_tracer(guard):
    lin = torch.nn.Linear(4, 4)
    expected = lin(X)
    with Watcher() as w:
        trials = [leak_trial(lambda: lin(X)) for _ in range(TRIALS)]
    assert all(t.victim_error is None and torch.equal(t.victim_result, expected) for t in trials)
    assert w.summary().ok


@needs_thread_local
def test_thread_local_overlapping_traces_leave_nothing_stuck(guard):
    with Watcher() as w:
        trials = [overlap_trial() for _ in range(TRIALS)]
        assert not fxpatch.stuck_state().stuck and torchcompat.fx_flag() is False
    assert [(t.setter_error, t.victim_error) for t in trials] == [(None, None)] * TRIALS
    assert w.summary().ok


@needs_thread_local
def test_torch_facts_are_the_same_with_the_guard_installed(guard):
    """The probes see through compilewatch's own patches: the guard does not make torch look fixed."""
    assert guard.thread_local and fxpatch.thread_local_enabled()
    race = torchcompat.race_facts()
    assert race.patcher_global and race.module_patch_on_class and race.fx_flag == FLAG.kind
    assert torchcompat.PATCHER_NOT_FIXED in support().not_fixed_upstream


@needs_thread_local
def test_thread_local_mode_keeps_same_thread_tracing_semantics(guard):
    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, x):
            return self.lin(x).relu()

    gm = torch.fx.symbolic_trace(Block())
    assert [n.op for n in gm.graph.nodes] == ["placeholder", "call_module", "call_method", "output"]
    assert make_fx(lambda a: a * 2)(torch.ones(2)).graph is not None
    # a compiled call inside the thread's own symbolic trace is still refused, as torch does
    with pytest.raises(RuntimeError, match="symbolically trace"):
        torch.fx.symbolic_trace(lambda a: step(a))
    f = torch.compile(lambda x, w: (x @ w).relu().sum(), backend="aot_eager")
    w_ = torch.randn(4, 4, requires_grad=True)
    f(torch.randn(3, 4), w_).backward()
    assert w_.grad is not None


def test_freeze_turns_a_worker_recompile_into_a_clear_error(guard):
    fn = torch.compile(lambda x: x * 3, backend="eager")
    report = prewarm(["cpu"], {"fn": lambda dev: fn(torch.randn(4, device=dev))})
    assert report.ok and report.warm[0].compile_windows == 1 and report.verify[0].compile_windows == 0
    guard.freeze()
    out: dict = {}

    def worker():
        out["same"] = fn(torch.randn(4))  # warmed: runs
        try:
            fn(torch.randn(4, 3))  # a new rank: would compile here
        except GuardError as e:
            out["err"] = e

    with Watcher() as w:
        t = threading.Thread(target=worker, name="worker-1")
        t.start()
        t.join(WAIT)
    err = out["err"]
    assert isinstance(err, RuntimeError)  # GuardError is a RuntimeError: generic handlers still see it
    assert "worker-1" in err.message and "<lambda>" in err.message and "after freeze()" in err.message
    assert "rank mismatch" in err.message  # torch's own guard-failure reason
    assert err.hint and "warm" in err.hint
    (ev,) = [e for e in w.events if e.kind == "guard_blocked"]
    assert ev.thread == "worker-1"
    guard.thaw()
    assert fn(torch.randn(4, 3)).shape == (4, 3)


def test_freeze_blocks_a_never_warmed_function_and_allow_compiles_lets_one_thread(guard):
    guard.freeze()
    cold = torch.compile(lambda x: x - 1, backend="eager")
    with pytest.raises(GuardError, match="never compiled"):
        cold(X)
    with guard.allow_compiles():
        assert torch.equal(cold(X), X - 1)


def test_warm_then_freeze_gives_zero_failures_across_threads(guard):
    fns = [torch.compile(lambda x, k=k: (x * k).sin(), backend="eager") for k in range(3)]
    devices = ["cpu"]
    report = prewarm(devices, {f"fn{k}": (lambda dev, f=f: f(torch.randn(8, device=dev))) for k, f in enumerate(fns)})
    assert report.ok
    guard.freeze()
    errors = []
    for _ in range(TRIALS):
        barrier = threading.Barrier(3)

        def body(f):
            barrier.wait(WAIT)
            try:
                for _ in range(5):
                    f(torch.randn(8))
            except Exception as e:  # noqa: BLE001
                errors.append(e)

        ts = [threading.Thread(target=body, args=(f,), name=f"w{k}") for k, f in enumerate(fns)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(WAIT)
    assert errors == []


def test_serialize_keeps_compiled_calls_out_of_a_trace_window():
    order: list[str] = []
    g = CompileGuard(thread_local=False, serialize=True).install()
    try:
        wrapped = g.wrap(lambda: (order.append("call"), step(X))[1])
        for _ in range(TRIALS):
            order.clear()
            inside, asked = threading.Event(), threading.Event()

            def traced(a):
                order.append("trace-in")
                inside.set()
                asked.wait(WAIT)
                order.append("trace-out")
                return a + 1

            def victim():
                inside.wait(WAIT)
                asked.set()  # from here the victim is blocked until the trace has ended
                return wrapped()

            import tests.race_cases as rc

            trial = rc._run(lambda: torch.fx.symbolic_trace(traced), victim, Trial())
            assert trial.victim_error is None and trial.setter_error is None
            assert order == ["trace-in", "trace-out", "call"]
    finally:
        g.close()


def test_serialize_late_compile_inside_shared_sections_does_not_deadlock():
    g = CompileGuard(thread_local=False, serialize=True).install()
    try:
        late = torch.compile(lambda x: x.tanh(), backend="eager")
        other_in, about_to_compile = threading.Event(), threading.Event()
        results = {}

        def compiler():
            with g.shared():
                other_in.wait(WAIT)
                about_to_compile.set()
                results["compiler"] = late(X)  # gives its share up, waits for `other`, compiles

        def other():
            with g.shared():
                other_in.set()
                about_to_compile.wait(WAIT)
                results["other"] = step(X)

        ts = [threading.Thread(target=compiler, name="compiler"), threading.Thread(target=other, name="other")]
        for t in ts:
            t.start()
        for t in ts:
            t.join(WAIT)
        assert not any(t.is_alive() for t in ts), "deadlock"
        assert torch.equal(results["compiler"], X.tanh()) and g.serialized_compiles >= 1
    finally:
        g.close()


@needs_thread_local
def test_close_restores_dynamo_and_fx():
    import torch._dynamo.eval_frame as ef

    before = (ef._callback_from_stance, st._new_patcher, st.is_fx_symbolic_tracing.__code__)
    with CompileGuard(thread_local=True):
        assert ef._callback_from_stance is not before[0] and fxpatch.thread_local_enabled()
    assert (ef._callback_from_stance, st._new_patcher, st.is_fx_symbolic_tracing.__code__) == before
    assert not fxpatch.thread_local_enabled()


def test_guard_on_an_unrecognised_torch_installs_no_fx_patch(monkeypatch):
    """thread_local=None: the guard runs without the thread-local mode; thread_local=True: it refuses,
    leaving nothing installed (no dynamo hook, no Tracer.trace patch)."""
    import torch._dynamo.eval_frame as ef

    from compilewatch.tracing import tracehooks

    monkeypatch.setattr(torchcompat, "fx_flag_layout", lambda: torchcompat.FlagLayout("unknown", "simulated layout"))
    assert support().thread_local_flag is False and support().fx_flag == "unknown"
    hook = ef._callback_from_stance
    with CompileGuard() as g:
        assert not g.thread_local and not fxpatch.thread_local_enabled() and not tracehooks.installed()
    with pytest.raises(CompilewatchError, match="simulated layout"):
        CompileGuard(thread_local=True).install()
    assert ef._callback_from_stance is hook and not tracehooks.installed()


def test_one_guard_at_a_time(guard):
    from compilewatch.errors import BadInput

    with pytest.raises(BadInput, match="already installed"):
        CompileGuard().install()


def test_close_while_a_thread_is_inside_the_hook(monkeypatch):
    """The engine closes the guard while stuck daemon threads live: a thread that read dynamo's hook
    before close() (and one parked inside it) still gets torch's own callback afterwards, no TypeError."""
    import torch._dynamo.eval_frame as ef

    entered, release = threading.Event(), threading.Event()

    def torch_from_stance(callback):  # stands in for torch's function; parks the first caller
        if threading.current_thread().name == "parked":
            entered.set()
            release.wait()
        return callback

    monkeypatch.setattr(ef, "_callback_from_stance", torch_from_stance)
    g = CompileGuard(thread_local=False)
    hook = ef._callback_from_stance  # what dynamo reads at call time: the guard's wrapper
    assert hook is not torch_from_stance
    results, errors = [], []

    def call():
        try:
            results.append(hook(False))
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    parked = threading.Thread(target=call, name="parked", daemon=True)
    parked.start()
    assert entered.wait(60)
    g.close()  # while `parked` is inside the hook
    assert ef._callback_from_stance is torch_from_stance
    late = threading.Thread(target=call, name="late")  # read the hook before close(), calls it after
    late.start()
    late.join()
    release.set()
    parked.join()
    assert errors == [] and results == [False, False]
    with CompileGuard(thread_local=False):  # a later guard installs over torch's function again
        assert ef._callback_from_stance is hook


def test_deprecated_guard_warm_still_warms_and_names_its_replacement(guard):
    """CompileGuard.warm was the documented warm in the previous release: it keeps working for one
    release (same entry points and devices, a verify pass, `.ok`) with a DeprecationWarning that names
    compilewatch.prewarm; it warms inside allow_compiles(), so it also works after freeze()."""
    fn = torch.compile(lambda x: x * 5, backend="eager")
    with pytest.warns(DeprecationWarning, match=r"compilewatch\.prewarm\(devices, entry_points\)"):
        report = guard.warm({"step": lambda dev: fn(torch.randn(4, device=dev))}, devices=["cpu"])
    assert report.ok and report.warm[0].compile_windows == 1 and report.verify[0].compile_windows == 0
    guard.freeze()
    late = torch.compile(lambda x: x - 1, backend="eager")
    with pytest.warns(DeprecationWarning):
        assert guard.warm(lambda dev: late(torch.randn(2, device=dev))).ok  # one callable, default device cpu
    assert guard.frozen and late(torch.randn(2)).shape == (2,)  # warmed: no compile, no GuardError
