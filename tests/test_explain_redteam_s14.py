"""`cache explain` red-teamed: causes named right on real compiles, and every bad input one message, exit 2.

The real-compile test runs one fresh process (three small inductor compiles on CPU, ~15 s on 2 cores):
a shape change made while an environment variable inductor reads also changed (too late to matter: the
shape is the cause, the variable a risk), and `dynamic=True` (a symbolic size input added in front: the
inputs are named as lists, not paired position by position). The rest writes key stores and reports by
hand: what a damaged, hostile or stale record does.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cli.main import app
from compilewatch.explain import store as S
from compilewatch.explain.explain import diff_parts, explain_run

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = r'''
import os, sys
import torch
from compilewatch.explain import record

os.environ["TORCHINDUCTOR_CACHE_DIR"] = sys.argv[1]
os.environ.pop("TORCHINDUCTOR_COMPILE_THREADS", None)
rec = record.start(run="base")
ns = {}
exec(compile("def f(x):\n    return (x.sin() + 1) * 2\n", "redteam_fn.py", "exec"), ns)


def run(name, inp, dynamic):
    rec.run = name
    if rec._env_at is not None:  # the environment is read again for this run (not after a second)
        rec._env_at = (float("-inf"), rec._env_at[1])
    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(ns["f"], backend="inductor", dynamic=dynamic)(inp)


run("base", torch.randn(8, 8), False)
os.environ["TORCHINDUCTOR_COMPILE_THREADS"] = "1"  # read by inductor at import: too late to change anything
run("envshape", torch.randn(16, 8), False)
del os.environ["TORCHINDUCTOR_COMPILE_THREADS"]
run("dynamic", torch.randn(8, 8), True)
record.stop()
'''


@pytest.fixture(scope="module")
def real(tmp_path_factory):
    d = tmp_path_factory.mktemp("redteam")
    script = d / "scenarios.py"
    script.write_text(SCRIPT)
    cache = d / "cache"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    p = subprocess.run([sys.executable, str(script), str(cache)], capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    return cache


def _fx(r):
    return next(e for e in r.explanations if e.kind == "fxgraph")


@pytest.mark.slow
def test_a_variable_that_changed_nothing_is_a_risk_and_the_shape_is_the_cause(real):
    r = explain_run(real, run="envshape")
    e = _fx(r)
    assert e.cause == "input dtype/shape/stride/device", e.text
    assert e.diffs[0].part == "example_inputs[0]" and "[16, 8]" in e.diffs[0].text
    risk = [d for d in e.diffs if d.part == "env[TORCHINDUCTOR_COMPILE_THREADS]"]
    assert risk and risk[0].risk and e.diffs[-1] is risk[0] and "a risk, not this miss's cause" in risk[0].text
    assert r.causes[0].cause == "input dtype/shape/stride/device"


@pytest.mark.slow
def test_dynamic_shapes_name_the_inputs_as_lists_not_a_tensor_against_a_size(real):
    e = _fx(explain_run(real, run="dynamic"))
    assert e.cause == "input dtype/shape/stride/device", e.text
    d = e.diffs[0]
    assert d.part == "example_inputs[*]" and "sizes became symbolic: dynamic shapes" in d.text, d.text
    assert "1 input (float32 [" in d.text and "2 inputs (symbolic size s" in d.text, d.text
    assert not any(x.part.startswith("example_inputs[") and x.part != "example_inputs[*]" for x in e.diffs)
    assert not any(x.part.startswith("env[") for x in e.diffs)  # nothing spurious


# --- without compiling --------------------------------------------------------------------------
def test_env_diffs_are_causes_only_through_a_part_they_set():
    base = {"env:recorded": ["1", "1"], "example_inputs[0]": ["a", "float32 [8, 8]"],
            "inductor_config[size_asserts]": ["t", "True"], "inductor_config[max_autotune]": ["f", "False"]}
    shape_only = dict(base, **{"example_inputs[0]": ["b", "float32 [16, 8]"], "env[TORCHINDUCTOR_FOO]": ["x", "1"]})
    d = diff_parts(base, shape_only)
    assert [x.part for x in d] == ["example_inputs[0]", "env[TORCHINDUCTOR_FOO]"] and d[1].risk and not d[0].risk
    linked = dict(base, **{"inductor_config[size_asserts]": ["u", "False"], "env[TORCHINDUCTOR_SIZE_ASSERTS]": ["y", "0"]})
    d = diff_parts(base, linked)
    assert d[0].part == "env[TORCHINDUCTOR_SIZE_ASSERTS]" and not any(x.risk for x in d)
    other = dict(base, **{"inductor_config[max_autotune]": ["g", "True"], "env[TORCHINDUCTOR_FOO]": ["x", "1"]})
    d = diff_parts(base, other)  # torch's config source says which variables max_autotune reads (session 16)
    assert [(x.part, x.risk) for x in d] == [("inductor_config[max_autotune]", False), ("env[TORCHINDUCTOR_FOO]", True)]
    unknown = dict(base, **{"inductor_config[a_flag_no_torch_has]": ["g", "1"], "env[TORCHINDUCTOR_FOO]": ["x", "1"]})
    assert not any(x.risk for x in diff_parts(base, unknown))  # a flag torch's source does not map: it may


def _write_store(cache, lines, raw=""):
    st = S.store_dir(cache)
    st.mkdir(parents=True, mode=0o700, exist_ok=True)
    os.chmod(st, 0o700)
    (st / S.FILE).write_text("".join(json.dumps(x) + "\n" for x in lines) + raw)
    os.chmod(st / S.FILE, 0o600)
    return st


def _lookup(key, run, hit, pid=1, t=1.0, **kw):
    return {"v": 1, "type": "lookup", "t": t, "pid": pid, "run": run, "kind": "fxgraph", "key": key, "hit": hit,
            "name": "f", "backward": False, "compile_id": "0/0", "cache_dir": "/x", "torch": "t",
            "groups": {"graph": "g1"}, **kw}


GROUP = {"v": 1, "type": "group", "id": "g1", "group": "graph", "parts": {"gm": ["a", None]}}


@pytest.mark.parametrize("a_ended_at, verdict", [(9.0, "not_saved"), (1.2, "entry_gone")])
def test_two_processes_compiling_one_graph_at_once_is_not_an_entry_gone(tmp_path, a_ended_at, verdict):
    """Process 1 misses k1 and compiles it; process 2 misses k1 0.5 s later. While process 1 still runs (it
    recorded its compile time after), the entry was not written yet; once it had ended, it is gone."""
    cache = tmp_path / "c"
    _write_store(cache, [GROUP, _lookup("k1", "r1", False), _lookup("k1", "r2", False, pid=2, t=1.5),
                         {"v": 1, "type": "timing", "t": a_ended_at, "pid": 1, "run": "r1", "phases": {"other": 0.1}}])
    e = explain_run(cache, run="r2").explanations[0]
    assert e.verdict == verdict, e.text
    if verdict == "not_saved":
        assert "process 1 (run r1) missed the same key 0.5 s before and was still running" in e.text


def _cli(*args):
    res = CliRunner().invoke(app, ["cache", "explain", *map(str, args)])
    assert "Traceback" not in res.output, res.output
    return res


@pytest.mark.parametrize("content", ["", None])
def test_a_store_without_its_file_or_empty_is_bad_input_not_a_clean_run(tmp_path, content):
    cache = tmp_path / "c"
    st = _write_store(cache, [])
    if content is None:
        (st / S.FILE).unlink()
    res = _cli("--dir", cache)
    assert res.exit_code == 2 and "records no cache lookups" in res.output and "hint:" in res.output, res.output


@pytest.mark.parametrize("bad", [
    "[" * 100_000 + "]" * 100_000,  # nested too deeply for json
    json.dumps({"v": 1, "type": "lookup", "key": "k9", "t": "yesterday", "hit": False}),
    json.dumps({"v": 1, "type": "lookup", "key": "k9", "groups": ["g1"], "hit": False}),
    json.dumps({"v": 1, "type": "lookup", "key": "k9", "pid": "x", "run": [1], "hit": 0}),
    json.dumps({"v": 1, "type": "group", "id": "g2", "parts": {"gm": 5}}),
    json.dumps({"v": 1, "type": "timing", "pid": [1], "run": "r1", "phases": {"x": 1}, "total_s": "x"}),
    json.dumps({"v": 1, "type": "timing", "pid": 1, "run": "r1", "phases": {"x": 1}, "top": [[1, 2, "x", 4]]}),
    json.dumps({"v": True, "type": "lookup", "key": "k9"}),
])
def test_a_hostile_store_line_is_left_out_and_counted(tmp_path, bad):
    cache = tmp_path / "c"
    _write_store(cache, [GROUP, _lookup("k1", "r1", True)], raw=bad + "\n")
    data = S.read(S.store_dir(cache))
    assert data.skipped == 1 and [r["key"] for r in data.lookups] == ["k1"] and "g2" not in data.groups
    res = _cli("--dir", cache)
    assert res.exit_code == 0 and "1 hit / 0 miss" in res.output and "do not have the store's format" in res.output


def test_a_directory_where_the_store_file_should_be_says_what_to_do(tmp_path):
    cache = tmp_path / "c"
    st = _write_store(cache, [])
    (st / S.FILE).unlink()
    (st / S.FILE).mkdir()
    res = _cli("--dir", cache)
    assert res.exit_code == 2 and "is a directory" in res.output and "rm -r" in res.output, res.output


def _report(tmp_path, ev):
    rep = tmp_path / "w.jsonl"
    rep.write_text(json.dumps(ev) + "\n")
    return rep


@pytest.mark.parametrize("ev, message", [
    ({"kind": "cache_lookups", "pid": [1], "detail": {"stores": ["STORE"], "run": "r1"}}, "pid is not an integer"),
    ({"kind": "cache_lookups", "pid": "abc", "detail": {"stores": ["STORE"], "run": "r1"}}, "pid is not an integer"),
    ({"kind": "cache_lookups", "pid": 1, "detail": {"stores": ["/etc"], "run": "r1"}}, "not a compilewatch key store"),
    ({"kind": "cache_lookups", "pid": 1, "detail": {"stores": {"a": 1}, "run": "r1"}}, "stores are not a list"),
    ({"kind": "cache_lookups", "pid": 1, "detail": {"stores": ["STORE"], "run": "gone"}}, "hold no lookups of its run"),
])
def test_a_hostile_or_stale_report_is_one_message_and_exit_2(tmp_path, ev, message):
    st = _write_store(tmp_path / "c", [GROUP, _lookup("k1", "r1", True)])
    ev = json.loads(json.dumps(ev).replace("STORE", str(st)))
    res = _cli(_report(tmp_path, ev))
    assert res.exit_code == 2 and message in res.output and "hint:" in res.output, res.output


def test_against_an_empty_dir_or_a_fifo_says_so(tmp_path):
    cache = tmp_path / "c"
    _write_store(cache, [GROUP, _lookup("k1", "r1", True)])
    (tmp_path / "empty").mkdir()
    res = _cli("--dir", cache, "--against", tmp_path / "empty")
    assert res.exit_code == 0 and "holds no FX-graph entries" in res.output, res.output
    os.mkfifo(tmp_path / "ff")
    res = _cli("--dir", cache, "--against", tmp_path / "ff")
    assert res.exit_code == 2 and "neither a directory nor a regular file" in res.output, res.output


def test_report_and_against_together_says_what_to_do(tmp_path):
    res = _cli(tmp_path / "r.jsonl", "--against", tmp_path)
    assert res.exit_code == 2 and "not both" in res.output and "one at a time" in res.output
