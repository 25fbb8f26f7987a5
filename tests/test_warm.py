"""warm: sequential prewarm, the verify pass, hand-off (in-process and exec), device validation."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from cli.main import app
from compilewatch.devices import handoff, warm
from compilewatch.tracing import targets
from compilewatch.errors import BadInput
from tests.helpers import invoke, invoke_json, requires_cuda

ROOT = Path(__file__).resolve().parents[1]
TINY = targets.FlexShape(context=64, blocks=4, block_size=16, heads=2, head_dim=16)
TINY_ARGS = ["--seq", "64", "--blocks", "4", "--heads", "2", "--head-dim", "16", "--backend", "aot_eager"]


class FlipDtype:
    """Injected recompile: float32 on the first call, float64 afterwards (a dtype guard fails)."""

    name = "flip"

    def __init__(self) -> None:
        self.calls = 0
        self.fn = None

    def build(self) -> None:
        self.fn = torch.compile(lambda x: (x * 3).cos(), backend="eager")

    def run(self, device: str) -> None:
        self.calls += 1
        dtype = torch.float32 if self.calls == 1 else torch.float64
        self.fn(torch.ones(4, device=device, dtype=dtype))


@pytest.fixture(autouse=True)
def _cold():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_prewarm_two_devices_sequentially_then_verify_compiles_nothing():
    events = []
    wl = targets.FlexAttentionWorkload("aot_eager", TINY)
    report = warm.prewarm("cpu,cpu", wl, progress=events.append)
    assert report.ok, report.verdicts
    assert report.devices == ("cpu", "cpu")
    assert report.warm[0].frames_compiled >= 1 and report.warm[0].compile_windows >= 1
    assert report.warm[1].frames_compiled == 0  # same device, same compiled wrapper: nothing new
    assert [r.phase for r in report.verify] == ["verify", "verify"]
    assert all(r.frames_compiled == 0 and r.compile_windows == 0 and r.recompile is None for r in report.verify)
    assert report.warm[0].memory_metric == "rss_delta"
    assert [(e.phase, e.state, e.index) for e in events] == [
        ("warm", "start", 0), ("warm", "done", 0), ("warm", "start", 1), ("warm", "done", 1),
        ("verify", "start", 0), ("verify", "done", 0), ("verify", "start", 1), ("verify", "done", 1)]
    assert events[1].result is report.warm[0]
    assert "compiled nothing" in report.verdicts[-1]


def test_build_runs_once_and_compiled_wrapper_is_shared():
    wl = targets.FlexAttentionWorkload("aot_eager", TINY)
    wl.build()
    first = wl._compiled
    warm.prewarm("cpu", wl)
    assert wl._compiled is first


@pytest.mark.parametrize("strict", [True, False])
def test_verify_catches_injected_recompile_with_function_and_reason(strict):
    report = warm.prewarm("cpu", FlipDtype(), strict=strict)
    assert report.warm[0].ok
    assert not report.ok
    (rc,) = report.recompiles
    assert rc.function == "<lambda>"
    assert any("dtype mismatch" in r for r in rc.reasons), rc
    assert any("<lambda> recompiled on cpu" in v for v in report.verdicts)
    if strict:  # fail_on_recompile: torch refused to compile and named the source line
        assert rc.location and rc.location.endswith(f"{Path(__file__).name}:{rc.location.rsplit(':', 1)[1]}")
        assert report.verify[0].frames_compiled == 0
    else:  # let it compile: counted from torch's counters and guard failures
        assert report.verify[0].frames_compiled == 1


def test_workload_error_is_reported_and_verify_skipped():
    def broken(device):
        raise ValueError("no such kernel")

    report = warm.prewarm("cpu", broken)
    assert not report.ok
    assert report.warm[0].error == "ValueError: no such kernel"
    assert report.verify == ()
    assert "nothing was verified" in report.verdicts[-1]


def test_bad_devices_raise_badinput_listing_visible():
    with pytest.raises(BadInput) as e:
        warm.prewarm("cuda:7", lambda d: None)
    assert "cpu" in (e.value.hint or "")


def test_resolve_workload_forms(tmp_path):
    (tmp_path / "wl_forms.py").write_text(textwrap.dedent("""
        calls = []
        def step(device):
            calls.append(device)
        class MyWorkload:
            name = "mine"
            def build(self): calls.append("build")
            def run(self, device): calls.append("run " + device)
        instance = MyWorkload()
    """))
    f = tmp_path / "wl_forms.py"
    w = targets.resolve_workload(f"{f}:step")
    w.build()
    w.run("cpu")
    mod = sys.modules["wl_forms"]  # aliased under its stem: a program's `import wl_forms` gets this copy
    assert mod.calls == ["cpu"]
    assert targets.resolve_workload(f"{f}:MyWorkload").name == "mine"
    assert type(targets.resolve_workload(f"{f}:instance")).__name__ == "MyWorkload"
    with pytest.raises(BadInput):
        targets.resolve_workload("nope")
    with pytest.raises(BadInput):
        targets.FlexShape(dtype="fp8")
    sys.modules.pop("wl_forms", None)


def test_entry_points_mapping_warms_each_and_a_failure_names_its_entry_point():
    """CompileGuard's old warm took {name: fn(device)}: prewarm takes the same mapping."""
    f = torch.compile(lambda x: (x * 2).sin(), backend="aot_eager")
    calls = []
    report = warm.prewarm("cpu,cpu", {"step": lambda d: f(torch.ones(4, device=d)), "log": calls.append})
    assert report.ok, report.verdicts
    assert calls == ["cpu", "cpu", "cpu", "cpu"]  # warm and verify, both devices
    assert report.warm[0].compile_windows == 1 and report.warm[0].trace_windows >= 1  # aot_eager traces
    assert report.warm[1].trace_windows == 0 and all(r.trace_windows == 0 for r in report.verify)

    def bad(device):
        raise ValueError("no such kernel")

    report = warm.prewarm("cpu", {"step": lambda d: None, "eval": bad})
    assert not report.ok and report.warm[0].error == "entry point 'eval': ValueError: no such kernel"


def test_verify_only_proves_reuse_without_a_warm_pass_and_refuses_a_first_compile():
    """verify_only: one strict pass. Two modules of one class share the first one's compiled code (one
    code object, guards that hold for both): the second's first call compiles nothing. A function
    nothing compiled before is refused (a recompile in the report), not compiled quietly."""
    torch._dynamo.reset()
    a, b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
    fa, fb = torch.compile(a, backend="aot_eager"), torch.compile(b, backend="aot_eager")
    calls = []

    def step(f):
        def run(device):
            calls.append(f)
            f(torch.ones(2, 4, device=device)).sum().backward()
        return run

    first = warm.prewarm("cpu", step(fa))
    assert first.ok and first.warm[0].frames_compiled >= 1
    again = warm.prewarm("cpu", step(fb), verify_only=True)
    assert again.ok, again.verdicts
    assert again.warm == () and len(again.verify) == 1 and again.verify[0].frames_compiled == 0
    assert calls == [fa, fa, fb]
    assert again.verdicts[0].startswith("no warm pass (verify only)")
    fresh = torch.compile(lambda x: (x * 3).cos(), backend="aot_eager")
    cold = warm.prewarm("cpu", lambda d: fresh(torch.ones(3, device=d)), verify_only=True)
    assert not cold.ok and cold.verify[0].recompile is not None and cold.warm == ()


# --- workload plugins (the compilewatch.workloads entry-point group) -----------------------------------


def test_dflash_registers_its_workload_through_the_entry_point():
    from importlib.metadata import entry_points

    (ep,) = [e for e in entry_points(group=targets.ENTRY_POINT_GROUP) if e.name == "dflash"]
    from dflash.engine import warm_workload

    assert ep.load() is warm_workload.make
    assert "dflash" in targets.workload_names()
    wl = targets.resolve_workload("dflash", "aot_eager", TINY)
    assert isinstance(wl, warm_workload.DFlashAttention) and wl.name == "dflash"
    report = warm.prewarm("cpu", wl)
    assert report.ok, report.verdicts
    assert report.warm[0].frames_compiled >= 1 and report.verify[0].compile_windows == 0


def test_dflash_workload_is_the_trainers_mask_and_compiled_flex_attention():
    """Reuse, not a copy: the mask is dflash.model.mask's (the same BlockMask build_masks makes for those
    anchors), and with inductor the compiled callable is the trainer's own."""
    from dflash.model import mask as dmask
    from dflash.engine import warm_workload

    wl = warm_workload.make(targets.WorkloadOptions("inductor", TINY))
    assert wl._compile() is dmask.compiled_kernels()["flex_attention"]
    got = wl.block_mask("cpu")
    anchors = warm_workload.anchors_for(TINY.context, TINY.blocks, TINY.block_size, TINY.batch)
    want = dmask.build_masks(anchors, TINY.context, TINY.block_size, "flex")["full"]
    assert got.seq_lengths == want.seq_lengths == (128, 128)  # Q = 4x16, KV = 64 + 64, padded to 128
    assert torch.equal(got.to_dense(), want.to_dense())
    with pytest.raises(BadInput, match="larger than block_size"):
        warm_workload.make(targets.WorkloadOptions("inductor", targets.FlexShape(context=16, block_size=16)))


def test_compilewatch_alone_has_no_dflash_workload(monkeypatch):
    """Without dflash's entry point (another environment), compilewatch knows no `dflash` workload."""
    import importlib.metadata as md

    monkeypatch.setattr(md, "entry_points", lambda **kw: [])
    with pytest.raises(BadInput) as e:
        targets.resolve_workload("dflash")
    assert "flex_attention, compile;" in (e.value.hint or "")


def test_compilewatch_contains_no_dflash_code():
    """compilewatch imports nothing from dflash and names nothing after it (the DFlash mask and its
    workload live in dflash/, which plugs in through the entry point)."""
    import ast

    for path in sorted((ROOT / "compilewatch").rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                assert not any(a.name.split(".")[0] == "dflash" for a in node.names), path
            elif isinstance(node, ast.ImportFrom):
                assert (node.module or "").split(".")[0] != "dflash", path
            name = getattr(node, "name", None) or getattr(node, "id", None) or getattr(node, "attr", None)
            if isinstance(name, str):
                assert "dflash" not in name.lower(), (path, node.lineno, name)


def test_cli_workload_dflash_json():
    data = invoke_json(app, ["warm", "--devices", "cpu", "--workload", "dflash", *TINY_ARGS, "--block-size", "16"])
    assert data["workload"] == "dflash" and data["ok"]


def test_cli_unknown_workload_exit_2_names_the_installed_ones():
    result = invoke(app, ["warm", "--devices", "cpu", "--workload", "nope"])
    assert result.exit_code == 2
    assert "unknown workload 'nope'" in result.stderr
    assert "flex_attention, compile, dflash" in result.stderr and "Traceback" not in result.stderr


def test_cli_plugin_that_fails_to_import_exit_2_with_its_error(tmp_path, monkeypatch):
    import importlib.metadata as md

    (tmp_path / "wl_broken_plugin.py").write_text("import not_a_module_xyz\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    broken = md.EntryPoint("broken", "wl_broken_plugin:make", targets.ENTRY_POINT_GROUP)
    real = md.entry_points
    monkeypatch.setattr(md, "entry_points", lambda **kw: [*real(**kw), broken])
    result = invoke(app, ["warm", "--devices", "cpu", "--workload", "broken"])
    sys.modules.pop("wl_broken_plugin", None)
    assert result.exit_code == 2
    assert "workload plugin 'broken' (wl_broken_plugin:make) failed to import" in result.stderr
    assert "ModuleNotFoundError" in result.stderr and "not_a_module_xyz" in result.stderr
    assert "Traceback" not in result.stderr


# --- CLI -------------------------------------------------------------------------------------------


def test_cli_json_two_cpu_devices():
    data = invoke_json(app, ["warm", "--devices", "cpu,cpu", *TINY_ARGS])
    assert data["devices"] == ["cpu", "cpu"]
    assert [r["phase"] for r in data["warm"] + data["verify"]] == ["warm", "warm", "verify", "verify"]
    assert data["warm"][0]["counters"]["frames_ok"] >= 1
    assert "fxgraph_cache_hit" in data["warm"][0]["counters"]
    assert all(r["recompile"] is None for r in data["verify"])


def test_cli_recompile_exits_1_naming_function(tmp_path):
    wl = tmp_path / "wl_flip.py"
    wl.write_text(textwrap.dedent("""
        import torch
        f = torch.compile(lambda x: x + 1, backend="eager")
        n = [0]
        def step(device):
            n[0] += 1
            f(torch.ones(2, dtype=torch.float32 if n[0] == 1 else torch.float64))
    """))
    result = invoke(app, ["warm", "--devices", "cpu", "--workload", f"{wl}:step"])
    sys.modules.pop("wl_flip", None)
    assert result.exit_code == 1, result.stdout
    assert "recompile on cpu: <lambda>" in result.stdout
    assert "dtype mismatch" in result.stdout


def test_cli_bad_devices_exit_2():
    result = invoke(app, ["warm", "--devices", "5,6,7"])
    assert result.exit_code == 2
    assert "asked for cuda:5, cuda:6, cuda:7: none of them is visible" in result.stderr
    assert "CPU-only build" in result.stderr or "no CUDA driver or GPU is present" in result.stderr
    assert "Traceback" not in result.stderr


def test_cli_missing_script_exit_2_before_warming(tmp_path):
    result = invoke(app, ["warm", "--devices", "cpu", "--", str(tmp_path / "nope.py")])
    assert result.exit_code == 2
    assert "does not exist" in result.stderr
    assert "warming" not in result.stderr


def test_handoff_in_process_keeps_compiled_state(tmp_path, monkeypatch):
    """The script imports the module warm compiled and calls its function under fail_on_recompile:
    it raises if anything compiles. It also writes what it saw, so the test can check argv/__name__."""
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    monkeypatch.setattr(sys, "path", list(sys.path))
    (tmp_path / "wl_shared.py").write_text(textwrap.dedent("""
        import torch
        f = torch.compile(lambda x: (x * 2).sin(), backend="aot_eager")
        def step(device):
            return f(torch.ones(8, device=device))
    """))
    out = tmp_path / "seen.json"
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(f"""
        import json, sys, torch
        from torch._dynamo import utils
        import wl_shared
        before = dict(utils.counters["frames"])
        with torch.compiler.set_stance("fail_on_recompile"):
            wl_shared.step("cpu")
        json.dump({{"argv": sys.argv, "name": __name__, "before": before,
                   "after": dict(utils.counters["frames"])}}, open({str(out)!r}, "w"))
    """))
    monkeypatch.chdir(tmp_path)
    result = invoke(app, ["warm", "--devices", "cpu", "--workload", "wl_shared.py:step", "--",
                          sys.executable, "train.py", "--epochs", "1"])
    sys.modules.pop("wl_shared", None)
    assert result.exit_code == 0, (result.stdout, result.stderr)
    assert "hand-off: running script train.py in this process" in result.stderr
    seen = json.loads(out.read_text())
    assert seen["argv"] == ["train.py", "--epochs", "1"]
    assert seen["name"] == "__main__"
    assert seen["before"] == seen["after"] and seen["after"]["ok"] >= 1


def test_handoff_in_process_exit_code_propagates(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    monkeypatch.setattr(sys, "path", list(sys.path))
    script = tmp_path / "fail.py"
    script.write_text("import sys\nsys.exit(3)\n")
    result = invoke(app, ["warm", "--devices", "cpu", "--workload", "compile", "--backend", "eager", "--", str(script)])
    assert result.exit_code == 3


def test_handoff_exec_python_c_in_subprocess(tmp_path):
    """`python -c` is not a script: it is exec'd (the CLI process is replaced), which writes the file."""
    marker = tmp_path / "exec-ran.txt"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-m", "cli.main", "warm", "--devices", "cpu", "--workload", "compile", "--backend", "eager",
         "--", sys.executable, "-c", f"open({str(marker)!r}, 'w').write('ran')"],
        capture_output=True, text=True, env=env, timeout=120, cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr
    assert marker.read_text() == "ran"
    assert "hand-off: exec" in proc.stderr and "only the on-disk caches carry over" in proc.stderr


def test_handoff_plan_classification(tmp_path, monkeypatch):
    script = tmp_path / "t.py"
    script.write_text("")
    (tmp_path / "pkg").mkdir()  # -m MODULE must be found (in the current dir, as python -m looks)
    (tmp_path / "pkg" / "__init__.py").write_text("")
    monkeypatch.chdir(tmp_path)
    assert handoff.plan([str(script), "a"]).mode == "in-process"
    p = handoff.plan([sys.executable, str(script), "--x"])
    assert (p.mode, p.kind, p.argv) == ("in-process", "script", (str(script), "--x"))
    p = handoff.plan([sys.executable, "-m", "pkg.train", "1"])
    assert (p.mode, p.kind, p.target, p.argv) == ("in-process", "module", "pkg.train", ("pkg.train", "1"))
    assert handoff.plan(["-m", "pkg.train"]).mode == "in-process"
    assert handoff.plan([sys.executable, "-u", str(script)]).mode == "exec"
    assert handoff.plan([sys.executable, "-c", "pass"]).mode == "exec"
    assert handoff.plan(["true"]).mode == "exec"
    with pytest.raises(BadInput):
        handoff.plan(["definitely-not-a-command-xyz"])
    with pytest.raises(BadInput):
        handoff.plan(["-m"])


def test_bare_fail_on_recompile_message_is_explained_from_counters():
    """Older torch raises the stance error without naming the function: warm re-runs that device
    without the stance and reads the guard failure from torch's counters."""
    rc = warm.parse_recompile_error("cpu", "Detected recompile when torch.compile stance is 'fail_on_recompile'")
    assert rc is not None and rc.function == "?"
    wl = FlipDtype()
    warm.prewarm("cpu", wl, verify=False)
    explained = warm._explain(wl, "cpu", rc)
    assert explained.function == "<lambda>" and any("dtype mismatch" in r for r in explained.reasons)
    assert warm.parse_recompile_error("cpu", "RuntimeError: something else") is None


@pytest.mark.gpu
@requires_cuda(min_gpus=1, bf16=True)
@pytest.mark.parametrize("workload", ["flex_attention", "dflash"])
def test_prewarm_cuda_inductor_fwd_bwd(workload):
    shape = targets.FlexShape(context=512, blocks=16, block_size=16, heads=4, head_dim=64)
    report = warm.prewarm("0", targets.resolve_workload(workload, "inductor", shape))
    assert report.ok, report.verdicts
    w = report.warm[0]
    assert w.memory_metric == "cuda_max_allocated" and w.peak_memory_bytes > 0
    assert w.compile_windows >= 2  # forward + lazy backward
    assert report.verify[0].frames_compiled == 0 and report.verify[0].compile_windows == 0
