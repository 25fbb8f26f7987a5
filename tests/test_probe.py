"""probe: instrumentation of Tracer.trace, counters, the --threads race runner, and the CLI."""

from __future__ import annotations

import json
import threading

import pytest
import torch
import torch.fx

from cli.main import app
from compilewatch.devices import probe as probe_lib
from compilewatch.tracing import torchcompat, tracehooks
from compilewatch.errors import BadInput
from tests.helpers import invoke, invoke_json
from tests.race_cases import needs_global_flag, needs_per_thread_flag


def test_create_block_mask_does_not_trace():
    """The seeds' finding: create_block_mask (uncompiled) enters Tracer.trace 0 times."""
    report = probe_lib.probe("create_block_mask")
    assert report.ok
    assert len(report.traces) == 0
    assert "does not trace" in report.verdicts[0]
    assert report.fx_flag_after is False


def test_flex_attention_traces_with_stacks():
    report = probe_lib.probe("flex_attention", backend="aot_eager")
    assert report.ok, report.error
    assert len(report.traces) > 0
    assert set(report.traces_per_tracer) == {"PythonKeyTracer"}  # make_fx's tracer, a Tracer subclass
    if torchcompat.compiling_flag_held_for_session():  # 2.13+; on 2.11 is_compiling() is False in AOT's traces
        assert all(t.compiling for t in report.traces)  # dynamo holds is_compiling() while AOT traces
    assert report.counters.frames_total >= 1
    assert report.compiles and report.compiles[0].compile_id.startswith("0/")
    # each entry names where torch took over
    assert any(f.file.startswith("torch/") for f in report.traces[0].stack)


def test_compile_target_counts_fwd_and_bwd_traces():
    report = probe_lib.probe("compile", backend="aot_eager")
    assert report.ok
    assert len(report.traces) >= 1
    assert report.counters.frames_ok >= 1


def test_recompile_reasons_are_reported(tmp_path):
    target = tmp_path / "recomp.py"
    target.write_text(
        "import torch\n"
        "f = torch.compile(lambda x: x * 2, backend='eager')\n"
        "def run():\n"
        "    f(torch.ones(3))\n"
        "    f(torch.ones(3, dtype=torch.float64))\n"
    )
    report = probe_lib.probe(f"{target}:run")
    assert report.ok
    assert report.counters.recompiles >= 1
    assert any("dtype" in r for r in report.counters.recompile_reasons)
    assert any(c.recompile for c in report.compiles)


def test_instrumentation_is_removed_afterwards():
    original = torch.fx.Tracer.__dict__["trace"]
    probe_lib.probe("compile", backend="aot_eager")
    assert torch.fx.Tracer.__dict__["trace"] is original
    assert not tracehooks.installed()
    # nested subscribers: the patch stays until the last one leaves
    a, b = tracehooks.TraceRecorder(), tracehooks.TraceRecorder()
    with a:
        with b:
            assert torch.fx.Tracer.__dict__["trace"] is not original
        assert tracehooks.installed()
        torch.fx.symbolic_trace(torch.nn.Linear(2, 2))
    assert torch.fx.Tracer.__dict__["trace"] is original
    assert len(a.windows) == 1 and a.windows[0].tracer == "Tracer" and a.windows[0].target == "Linear"


def test_target_error_is_reported_not_raised(tmp_path):
    target = tmp_path / "boom.py"
    target.write_text("def run(device):\n    raise ValueError('boom on ' + device)\n")
    report = probe_lib.probe(f"{target}:run")
    assert not report.ok
    assert report.error == "ValueError: boom on cpu"


@pytest.mark.parametrize(
    "spec, fragment",
    [
        ("no_such_target", "unknown target"),
        ("no_such_module_xyz:fn", "cannot import"),
        ("json:no_such_attr", "has no attribute"),
        ("json:__name__", "not callable"),
        ("missing/file.py:fn", "does not exist"),
    ],
)
def test_bad_targets_raise_bad_input(spec, fragment):
    with pytest.raises(BadInput, match=fragment):
        probe_lib.probe(spec)


@needs_global_flag
def test_cross_thread_flag_leak_is_deterministic():
    """Hold a symbolic_trace open in thread B (the traced function waits on an Event) while thread A
    calls a compiled function: the nested-FX error, every time, collected as a thread outcome."""
    compiled = torch.compile(lambda x: x + 1, backend="eager")
    compiled(torch.ones(2))  # compiled beforehand: A only calls it
    inside, release = threading.Event(), threading.Event()

    class Waits(torch.nn.Module):
        def forward(self, x):
            inside.set()
            release.wait(30)
            return x * 2

    def tracer_thread():
        torch.fx.symbolic_trace(Waits())

    def victim_thread():
        inside.wait(30)
        try:
            compiled(torch.ones(2))
        finally:
            release.set()

    for _ in range(3):
        inside.clear()
        release.clear()
        outcomes, stacks = probe_lib.run_threads([tracer_thread, victim_thread], timeout=60,
                                                 names=["tracer", "victim"])
        assert [o.outcome for o in outcomes] == ["ok", "error"]
        assert "symbolically trace a dynamo-optimized function" in outcomes[1].error
        assert stacks == {}


@needs_per_thread_flag
def test_per_thread_flag_a_foreign_trace_no_longer_breaks_compiled_calls():
    """torch 2.14+: the same setup as above, and the victim's compiled call succeeds every time."""
    compiled = torch.compile(lambda x: x + 1, backend="eager")
    compiled(torch.ones(2))
    inside, release = threading.Event(), threading.Event()

    def traced(x):
        inside.set()
        release.wait(30)
        return x * 2

    def victim_thread():
        inside.wait(30)
        try:
            assert torch.equal(compiled(torch.ones(2)), torch.full((2,), 2.0))
        finally:
            release.set()

    for _ in range(3):
        inside.clear()
        release.clear()
        outcomes, _ = probe_lib.run_threads([lambda: torch.fx.symbolic_trace(traced), victim_thread], timeout=60,
                                            names=["tracer", "victim"])
        assert [o.outcome for o in outcomes] == ["ok", "ok"], [o.error for o in outcomes]


def test_run_threads_reports_hang_with_all_stacks():
    never = threading.Event()
    outcomes, stacks = probe_lib.run_threads([lambda: never.wait(), lambda: None], timeout=0.2,
                                             names=["stuck", "fine"])
    try:
        assert [o.outcome for o in outcomes] == ["hang", "ok"]
        assert any(name.startswith("stuck") for name in stacks)
        stuck = next(v for k, v in stacks.items() if k.startswith("stuck"))
        assert any(f.function == "wait" for f in stuck)
    finally:
        never.set()


def test_probe_threads_overlapping_make_fx_reports_outcomes(tmp_path):
    report = probe_lib.probe_threads("compile", 3, backend="aot_eager", timeout=120)
    assert len(report.threads) == 3
    assert len(report.traces) >= 1 and all(t.thread.startswith("worker-") for t in report.traces)
    assert set(report.traces_per_thread) <= {"worker-0", "worker-1", "worker-2"}
    assert report.cache_dir != str(tmp_path / "inductor-cache")  # a fresh dir by default


# --- CLI -----------------------------------------------------------------------------------------

def test_cli_version_and_help():
    r = invoke(app, ["--version"])
    assert r.exit_code == 0 and r.stdout.startswith("compilewatch ")
    r = invoke(app, ["probe", "--help"])
    assert r.exit_code == 0 and "--threads" in r.stdout


def test_cli_list_json():
    rows = invoke_json(app, ["probe", "--list"])
    assert {r["name"] for r in rows} == {"create_block_mask", "flex_attention", "compile"}


def test_cli_probe_create_block_mask_json():
    data = invoke_json(app, ["probe", "create_block_mask"])
    assert data["traces"] == [] and data["ok"] is True
    assert data["counters"]["frames_total"] == 0
    assert data["fx_flag_after"] is False and data["stuck_after"] is False
    race = data["race"]  # what this torch fixed upstream and what it did not, in the verdicts too
    assert race["fx_flag"] in ("global", "thread_local") and race["not_fixed"]
    assert data["verdicts"][-1] == f"torch {race['torch_version']}: {race['headline']}"


def test_cli_probe_human_output_says_it_does_not_trace():
    r = invoke(app, ["probe", "create_block_mask"])
    assert r.exit_code == 0
    assert "Tracer.trace entries: 0" in r.stdout
    assert "does not trace" in r.stdout


@pytest.mark.parametrize("args", [["probe", "nope"], ["probe", "create_block_mask", "--device", "cuda:7"],
                                  ["probe", "create_block_mask", "--device", "tpu"], ["probe"]])
def test_cli_bad_input_exits_2_without_traceback(args):
    r = invoke(app, args)
    assert r.exit_code == 2
    assert "Traceback" not in r.stdout + r.stderr
    assert "error:" in r.stderr


def test_cli_target_failure_exits_1(tmp_path):
    target = tmp_path / "boom.py"
    target.write_text("def run():\n    raise RuntimeError('nope')\n")
    data = invoke_json(app, ["probe", f"{target}:run"], expect_code=1)
    assert data["error"] == "RuntimeError: nope"


def test_cli_threads_json(tmp_path):
    r = invoke(app, ["probe", "compile", "--backend", "aot_eager", "--threads", "2", "--timeout", "120", "--json"])
    data = json.loads(r.stdout)
    assert [t["name"] for t in data["threads"]] == ["worker-0", "worker-1"]
    failed = any(t["outcome"] != "ok" for t in data["threads"]) or data["fx_flag_stuck"] or data["compile_failures"]
    assert r.exit_code == (1 if failed else 0)
    assert isinstance(data["traces"], list) and {"thread", "tracer", "target", "stack"} <= set(data["traces"][0])


KEEPS_ITS_ERRORS = """
import threading
import torch

_lock = threading.Lock()
_calls = []


def run():
    # each thread recompiles the same lambda code with a new exponent: the known NYI SymInt assert
    # (automatic dynamic shapes) on the 2nd/3rd compile; the errors are returned, not raised
    with _lock:
        _calls.append(1)
        p = 1 + len(_calls)
    f = torch.compile(lambda t, q: (t ** q).sum(), backend="aot_eager")
    errors = []
    try:
        f(torch.randn(8, requires_grad=True), p).backward()
    except Exception as e:
        errors.append(e)
    return {"errors": errors}
"""


def test_probe_threads_reports_errors_the_function_returns(tmp_path):
    target = tmp_path / "keeps.py"
    target.write_text(KEEPS_ITS_ERRORS)
    report = probe_lib.probe_threads(f"{target}:run", 3, backend="aot_eager", timeout=120)
    returned = [o for o in report.threads if o.returned_errors]
    if tuple(int(p) for p in torch.__version__.split(".")[:2]) >= (2, 14):  # the assert is fixed there
        assert not returned and not report.failed and report.verdicts[0].startswith("all 3 threads finished")
        return
    assert returned and report.failed
    assert all(o.outcome == "error" and "NYI SymInt equality" in o.returned_errors[0] for o in returned)
    assert report.compile_failures and all("NYI SymInt equality" in c.error for c in report.compile_failures)
    assert report.counters.frames_ok < report.counters.frames_total
    assert not any(v.startswith("all 3 threads finished") for v in report.verdicts)
    assert report.verdicts[0].startswith("failure:") and "not a thread race" in report.verdicts[0]
    assert any(v.startswith(f"dynamo frames compiled ok: {report.counters.frames_ok} of ") for v in report.verdicts)
    assert any("dynamic=False" in v for v in report.verdicts if v.startswith("fix:"))


def test_returned_errors_finds_exceptions_and_error_strings():
    assert probe_lib.returned_errors(None) == [] and probe_lib.returned_errors({"loss": 1.5, "msg": "ok"}) == []
    assert probe_lib.returned_errors([ValueError("x")]) == ["ValueError: x"]
    assert probe_lib.returned_errors({"errors": {"t1": ["RuntimeError: boom"]}}) == ["RuntimeError: boom"]
