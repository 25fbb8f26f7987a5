"""`compilewatch run`: the watcher inside a child process, no edits to the child's code."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from cli.main import app
from tests.helpers import invoke
from tests.race_cases import GLOBAL_FLAG
from tests.timeline_format import validate

ROOT = Path(__file__).resolve().parent.parent

RACE = textwrap.dedent("""
    import sys, threading, torch, torch.fx
    print("dynamo imported early:", "torch._dynamo" in sys.modules)  # the watcher must not import it
    step = torch.compile(lambda x: x.sin() + 1, backend="eager")
    x = torch.randn(4)
    step(x)
    tracing, done = threading.Event(), threading.Event()
    def traced(a):
        tracing.set(); done.wait(30); return a * 2
    def tracer():
        torch.fx.symbolic_trace(traced)
    lin = torch.nn.Linear(4, 4)
    def worker():
        tracing.wait(30)
        try:
            try:
                step(x)  # fails where torch keeps the FX flag module-global (up to 2.13)
            except RuntimeError as e:
                print("worker failed:", str(e)[:40])
            try:
                lin(x)  # fails on every torch so far: nn.Module.__call__ is patched on the class
            except NameError as e:
                print("worker failed:", str(e)[:40])
        finally:
            done.set()
    threads = [threading.Thread(target=tracer, name="data-tracer"), threading.Thread(target=worker, name="gpu-worker-1")]
    for t in threads: t.start()
    for t in threads: t.join()
    raise SystemExit(3)
""")


def _cli(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "cli.main", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=120)


def test_run_reports_setter_and_victim_threads_by_name(tmp_path):
    script = tmp_path / "race.py"
    script.write_text(RACE)
    report, timeline = tmp_path / "watch.jsonl", tmp_path / "race.json"
    res = _cli(["run", "--json", "--report", str(report), "--timeline", str(timeline), "--", sys.executable,
                str(script)], tmp_path)
    assert res.returncode == 3, res.stderr  # the child's exit code, passed through
    data = json.loads(res.stdout)  # --json: stdout is only JSON (the child's stdout went to stderr)
    assert "worker failed" in res.stderr and "dynamo imported early: False" in res.stderr
    assert data["summary"]["counts"]["compile"] == 1  # compile callbacks registered when dynamo was imported
    s = data["summary"]
    assert s["setter_threads"] == ["data-tracer"] and s["victim_threads"] == ["gpu-worker-1"]
    assert any("data-tracer" in v and "gpu-worker-1" in v for v in s["verdicts"])
    assert data["exit_code"] == 3 and len(data["processes"]) == 1
    kinds = [json.loads(line)["kind"] for line in report.read_text().splitlines()]
    assert kinds[0] == "start" and "module_call_leak" in kinds and kinds[-1] == "end"
    assert ("flag_leak" in kinds) == GLOBAL_FLAG  # torch 2.14+ keeps the flag per thread: no flag leak
    trace = json.loads(timeline.read_text())
    assert validate(trace) == [] and data["timeline"] == str(timeline)
    tracks = {m["args"]["name"] for m in trace["traceEvents"] if m.get("name") == "thread_name"}
    assert {"data-tracer", "gpu-worker-1"} <= tracks


def test_run_human_output_names_threads_and_handles_python_dash_m(tmp_path):
    pkg = tmp_path / "racepkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "__main__.py").write_text(RACE.replace("raise SystemExit(3)", ""))
    res = _cli(["run", "--", sys.executable, "-m", "racepkg"], tmp_path)
    assert res.returncode == 1, res.stderr  # the program exits 0; the failures the watcher saw are a finding
    assert "setter thread(s): data-tracer" in res.stderr and "victim thread(s): gpu-worker-1" in res.stderr
    assert "module call leak" in res.stderr and ("flag leak" in res.stderr) == GLOBAL_FLAG


def test_run_without_torch_passes_exit_code_and_reports_nothing(tmp_path):
    res = invoke(app, ["run", "--json", "--", sys.executable, "-c", "import sys; sys.exit(5)"])
    assert res.exit_code == 5
    data = json.loads(res.stdout)
    assert data["processes"] == [] and data["summary"]["ok"]


def test_run_keeps_a_users_sitecustomize(tmp_path):
    site = tmp_path / "usersite"
    site.mkdir()
    (site / "sitecustomize.py").write_text("import builtins; builtins.USER_SITE = 42\n")
    res = subprocess.run([sys.executable, "-m", "cli.main", "run", "--", sys.executable, "-c",
                          "import builtins, sys; sys.exit(7 if getattr(builtins, 'USER_SITE', 0) == 42 else 1)"],
                         env={**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(site)])},
                         capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert res.returncode == 7, res.stderr


def test_run_bad_input_exits_2():
    assert invoke(app, ["run"]).exit_code == 2
    res = invoke(app, ["run", "--stall-after", "0", "--", sys.executable, "-c", "pass"])
    assert res.exit_code == 2 and "stall-after" in res.stderr
    res = invoke(app, ["run", "--", "no-such-program-xyz"])
    assert res.exit_code == 2 and "command not found" in res.stderr


def test_run_prints_user_text_verbatim():
    res = invoke(app, ["run", "--", sys.executable, "-c", "x = [1]; y = '[bold]'"])
    assert res.exit_code == 0 and "x = [1]; y = '[bold]'" in res.stderr  # not eaten as rich markup


SIGNALLED = textwrap.dedent("""
    import subprocess, sys, threading, torch  # torch: the watcher installs in this process
    grandchild = subprocess.Popen([sys.executable, "-c", "import threading; threading.Event().wait()"])
    with open(sys.argv[1], "w") as ready:  # a FIFO: the test reads it, then signals compilewatch
        ready.write(f"{grandchild.pid}\\n")
    threading.Event().wait()  # until a signal ends us
""")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_run_forwards_a_signal_to_the_program_group_and_still_reports(tmp_path, sig):
    script, fifo, tmp = tmp_path / "prog.py", tmp_path / "ready", tmp_path / "tmp"
    script.write_text(SIGNALLED)
    os.mkfifo(fifo)
    tmp.mkdir()
    report = tmp_path / "watch.jsonl"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TMPDIR": str(tmp)}
    proc = subprocess.Popen([sys.executable, "-m", "cli.main", "run", "--report", str(report), "--", sys.executable,
                             str(script), str(fifo)], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    got: list[str] = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_text()), daemon=True)
    reader.start()
    reader.join(120)  # opening the FIFO blocks until the program (torch imported, watcher on) writes it
    assert got, "the program never signalled readiness"
    proc.send_signal(sig)
    # communicate() returns at EOF of stderr, which the grandchild holds too: it returns only once the
    # whole process group is gone (an orphaned program would keep it open and time out here)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + sig, err  # the program died of the forwarded signal
    assert f"forwarded {signal.Signals(sig).name}" in err
    kinds = [json.loads(line)["kind"] for line in report.read_text().splitlines()]
    assert kinds and kinds[0] == "start"  # the report was written from what the program recorded
    assert not list(tmp.glob("compilewatch-run-*"))  # the run dir was removed


WAITS = textwrap.dedent("""
    import os, sys, threading, torch  # torch: the watcher installs in this process
    with open(sys.argv[1], "w") as ready:  # a FIFO: the test reads it, then kills compilewatch
        ready.write(f"{os.getpid()}\\n")
    threading.Event().wait()  # until a signal ends us
""")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_killed_run_takes_its_program_down(tmp_path):
    """SIGKILL (an OOM kill, Slurm after the grace period) leaves `run` no chance to forward anything:
    the kernel's parent-death signal stops the program instead of leaving it running unwatched."""
    script, fifo = tmp_path / "prog.py", tmp_path / "ready"
    script.write_text(WAITS)
    os.mkfifo(fifo)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "cli.main", "run", "--", sys.executable, str(script), str(fifo)],
                            cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    got: list[str] = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_text()), daemon=True)
    reader.start()
    reader.join(120)  # opening the FIFO blocks until the program (torch imported, watcher on) writes it
    assert got, "the program never signalled readiness"
    program = int(got[0])
    proc.kill()
    try:
        # the program holds run's stdout/stderr pipes: EOF comes only when it has exited too
        proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        os.kill(program, signal.SIGKILL)
        proc.communicate()
        pytest.fail("the program kept running after `compilewatch run` was killed")
    assert proc.returncode == -signal.SIGKILL


def test_the_summary_line_counts_findings_apart_from_what_was_watched():
    """Two findings listed that recurred to 4 events: '2 failures (4 events); watched 6 trace windows,
    1 compile', never '4 failure(s) compile 1, flag_leak 2, thread_error 2, trace 6'."""
    from types import SimpleNamespace

    from cli.run import summary_line

    f = lambda sev, n: SimpleNamespace(severity=sev, count=n)  # noqa: E731
    s = SimpleNamespace(ok=False, findings=(f("failure", 2), f("failure", 2)),
                        counts={"trace": 6, "compile": 1, "flag_leak": 2, "thread_error": 2, "start": 1})
    assert summary_line(s) == "2 failures (4 events); watched 6 trace windows, 1 compile"
    s = SimpleNamespace(ok=True, findings=(f("risk", 1),), counts={"trace": 1})
    assert summary_line(s) == "ok, 1 risk (no harm observed); watched 1 trace window"
    assert summary_line(SimpleNamespace(ok=True, findings=(), counts={})) == "ok"


def test_run_echoes_a_multi_line_command_quoted(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    exe = Path(sys.executable).with_name("compilewatch")
    p = subprocess.run([str(exe), "run", "--", sys.executable, "-c", "import torch\nx = 1"], capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    head = next(ln for ln in p.stderr.splitlines() if ln.startswith("compilewatch run"))
    assert head.split(": exit")[0].endswith("-c 'import torch\\nx = 1'")  # one line, the break written \n
