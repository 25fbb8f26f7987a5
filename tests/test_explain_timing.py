"""Issue 38, part 4 (warm but slow): where a watched process's compile time went, by phase, from torch's
own timed steps (compilewatch.explain.timing).

The first tests feed the timer synthetic steps (no torch); the rest compile for real on CPU: a cold run
and then warm runs of a small forward+backward step in a temp cache dir, each in a fresh process.
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
from compilewatch.explain import timing as T
from compilewatch.explain.explain import compile_time, explain_run

ROOT = Path(__file__).resolve().parents[1]
MS = 1_000_000


def _feed(t: T.Timings, steps: list[tuple[str, str, int]]) -> None:
    for what, name, at_ms in steps:
        (t.start if what == "B" else t.end)(name, at_ms * MS)


def test_each_step_counts_its_own_time_once_and_unlisted_steps_take_their_parents_phase():
    t = T.Timings()
    _feed(t, [("B", "dynamo", 0), ("B", "bytecode_tracing", 10), ("B", "variable_builder_call", 12),
              ("E", "variable_builder_call", 20), ("E", "bytecode_tracing", 60), ("B", "backend_compile", 60),
              ("B", "AOTAutogradCache.inductor_load", 70), ("B", "PyCodeCache.load_by_key_path", 80),
              ("B", "compile_file", 100), ("E", "compile_file", 150), ("E", "PyCodeCache.load_by_key_path", 400),
              ("E", "AOTAutogradCache.inductor_load", 420), ("E", "backend_compile", 430), ("E", "dynamo", 500)])
    s = t.summary("2.99", None)
    ph = s["phases"]
    assert ph["dynamo tracing"] == 0.05  # variable_builder_call (not listed) counts as its parent's phase
    assert ph["AOTAutograd lookup"] == 0.02 and ph["FX-graph load"] == 0.03
    assert ph["kernel compile"] == 0.05 and ph["kernel load"] == 0.27
    assert ph["other"] == 0.08  # the `dynamo` wrapper's own time
    assert s["total_s"] == 0.5 == s["wall_s"] and s["threads"] == 1
    assert sum(ph.values()) == pytest.approx(s["total_s"])
    assert s["top"][0] == ["PyCodeCache.load_by_key_path", "kernel load", 0.27, 1]
    assert T.line(s, warm=True).startswith("warm compile time: 0.50 s — kernel load 0.27 s, dynamo tracing 0.05 s, "
                                           "kernel compile 0.05 s, FX-graph load 0.03 s, AOTAutograd lookup 0.02 s, "
                                           "other 0.08 s")


def test_a_step_ended_without_its_start_or_left_open_is_not_counted_twice():
    t = T.Timings()
    _feed(t, [("E", "bytecode_tracing", 5), ("B", "dynamo", 10), ("B", "bytecode_tracing", 20),
              ("E", "dynamo", 30)])  # bytecode_tracing never closed (an exception): dropped with its parent's end
    s = t.summary("2.99", None)
    assert s["unmatched"] == 1 and s["total_s"] == 0.02 and s["phases"]["other"] == 0.02


def test_steps_of_several_threads_are_summed_and_their_wall_time_counted_once():
    import threading

    t = T.Timings()
    t.start("dynamo", 0)
    th = threading.Thread(target=lambda: (t.start("compile_file", 10 * MS), t.end("compile_file", 40 * MS)))
    th.start()
    th.join()
    t.end("dynamo", 50 * MS)
    s = t.summary("2.99", None)
    assert s["threads"] == 2 and s["total_s"] == 0.08 and s["wall_s"] == 0.05
    assert "summed over 2 threads; 0.05 s of wall time" in T.line(s)


def test_a_phase_this_torch_does_not_time_is_reported_not_available_never_guessed():
    """Simulated: the events this torch's source names, less every autotune event and the triton key's."""
    exposed = T.exposed_events()
    assert exposed is not None
    autotune = dict(T.PHASES)["autotune"]
    hidden = exposed - set(autotune) - {"CacheBase.get_system.triton_key"}
    t = T.Timings()
    _feed(t, [("B", "inductor_codecache_torch_key", 0), ("E", "inductor_codecache_torch_key", 30)])
    s = t.summary("2.13.0+cpu", hidden)
    assert s["unavailable"] == ["autotune"] and "autotune" not in s["phases"]
    assert "CacheBase.get_system.triton_key" in s["unmeasured"]  # its phase is timed by another step
    assert T.line(s).endswith("; not available on torch 2.13.0+cpu: autotune")
    ct = compile_time({**s, "pid": 7, "lookups": {"hit": 3, "miss": 0}})
    assert ct.warm and ct.unavailable == ("autotune",) and "autotune" not in ct.phases
    # a step that ran is available, whatever the source says
    s2 = t.summary("2.13.0+cpu", set())
    assert "cache key" in s2["phases"] and "cache key" not in s2["unavailable"]


def test_every_phase_is_timed_by_the_installed_torch():
    """Read from this torch's source (2.11.0, 2.13.0 and 2.15.0 all time every phase)."""
    exposed = T.exposed_events()
    missing = [p for p, evs in T.PHASES if not any(ev in exposed for ev in evs)]
    assert missing == []


# --- real compiles --------------------------------------------------------------------------------
CHILD = r'''
import json, sys, time
from compilewatch.explain import record, timing
if sys.argv[2] == "hide-autotune":  # simulate a torch whose source times no autotune step
    real = timing.exposed_events
    timing.exposed_events = lambda *a: real(*a) - set(dict(timing.PHASES)["autotune"])
rec = record.start(run=sys.argv[1])
import torch
w = torch.randn(16, 16, requires_grad=True)
ns = {"torch": torch}
# w is an argument, not a global of the exec'd namespace: torch 2.11's AOTAutograd key names a global
# of a namespace that is no module by its address (___unnamed_scope_<id>), so it would never hit again
exec(compile("def step(x, w):\n    return torch.nn.functional.gelu(x @ w).sum()\n", "step_fn.py", "exec"), ns)
step = torch.compile(ns["step"], dynamic=False)
t0 = time.perf_counter()
step(torch.randn(8, 16), w).backward()
measured = time.perf_counter() - t0
logger = torch._dynamo.utils.ChromiumEventLogger
summary = record.stop()
restored = not hasattr(logger.log_event_start, "__compilewatch_original__")
print(json.dumps({"summary": summary, "measured": measured, "restored": restored}))
'''


def _child(script: Path, cache: Path, run: str, mode: str = "") -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TORCHINDUCTOR_CACHE_DIR": str(cache)}
    p = subprocess.run([sys.executable, str(script), run, mode], capture_output=True, text=True, env=env,
                       timeout=420, cwd=ROOT)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def warm(tmp_path_factory):
    d = tmp_path_factory.mktemp("timing")
    script = d / "child.py"
    script.write_text(CHILD)
    cache = d / "cache"
    runs = {"cold": _child(script, cache, "cold")}
    runs["warm"] = _child(script, cache, "warm")
    runs["hidden"] = _child(script, cache, "hidden", "hide-autotune")
    return cache, runs


@pytest.mark.slow
def test_a_warm_run_says_where_its_compile_time_went(warm):
    _, runs = warm
    out = runs["warm"]
    s = out["summary"]
    assert s["counts"]["fxgraph"]["miss"] == 0 and s["counts"]["fxgraph"]["hit"] >= 2, s["counts"]
    assert "ChromiumEventLogger.log_event_start/end" in s["hooks"] and out["restored"]
    ct = s["compile_time"]
    assert set(ct["phases"]) == set(T.PHASE_NAMES) and ct["unavailable"] == []
    assert all(v >= 0 for v in ct["phases"].values())
    assert sum(ct["phases"].values()) <= ct["total_s"] + 1e-3
    assert ct["wall_s"] <= out["measured"] + 1e-3
    if ct["threads"] == 1:
        assert ct["total_s"] <= out["measured"] + 1e-3
    # a warm start does the tracing and loads what the cache holds; it generates no code
    assert ct["phases"]["dynamo tracing"] > 0 and ct["phases"]["kernel load"] > 0
    assert ct["phases"]["inductor codegen"] == 0 and ct["lookups"] == {"hit": 3, "miss": 0}
    cold = runs["cold"]["summary"]["compile_time"]
    assert cold["phases"]["inductor codegen"] > 0 and cold["total_s"] > ct["total_s"]


@pytest.mark.slow
def test_the_store_keeps_it_and_cache_explain_shows_it(warm):
    cache, _ = warm
    r = explain_run(cache, run="warm")
    assert len(r.compile_times) == 1
    ct = r.compile_times[0]
    assert ct.warm and ct.text.startswith("warm compile time: ")
    assert list(ct.phases)[-1] == "other" and list(ct.phases.values())[:-1] == sorted(list(ct.phases.values())[:-1],
                                                                                     reverse=True)
    cold = explain_run(cache, run="cold").compile_times[0]
    assert not cold.warm and cold.text.startswith("compile time: ")
    res = CliRunner().invoke(app, ["cache", "explain", "--dir", str(cache)])
    assert res.exit_code == 0, res.output
    assert "warm compile time: " in res.stdout and "torch's slowest steps: " in res.stdout
    assert "not available on torch" in res.stdout  # the last run is the one with autotune hidden
    res = CliRunner().invoke(app, ["cache", "explain", "--dir", str(cache), "--json"])
    out = json.loads(res.stdout)
    assert out["run"] == "hidden" and out["compile_times"][0]["unavailable"] == ["autotune"]
    assert "autotune" not in out["compile_times"][0]["phases"]


@pytest.mark.slow
def test_a_phase_hidden_from_a_real_run_is_not_available_not_zero(warm):
    _, runs = warm
    ct = runs["hidden"]["summary"]["compile_time"]
    assert ct["unavailable"] == ["autotune"] and "autotune" not in ct["phases"]
    assert sum(ct["phases"].values()) <= ct["total_s"] + 1e-3


@pytest.mark.slow
def test_compaction_keeps_the_timing_of_the_runs_it_keeps(warm, tmp_path):
    cache, _ = warm
    data = S.read(S.store_dir(cache))
    assert {t["run"] for t in data.timings} == {"cold", "warm", "hidden"}
    mine = tmp_path / "c"
    st = S.store_dir(mine)
    st.mkdir(mode=0o700)
    lines = [{"v": 1, "type": "group", "id": g, "parts": p} for g, p in data.groups.items()] + data.lookups + data.timings
    (st / S.FILE).write_text("".join(json.dumps(x) + "\n" for x in lines))
    os.chmod(st / S.FILE, 0o600)
    w = S.Writer(mine)
    assert w.compact_if_needed(max_lookups=1, keep=3)  # the newest 3 lookups: the `hidden` run's
    w.close()
    after = S.read(st)
    assert {t["run"] for t in after.timings} == {"hidden"} and after.skipped == 0


@pytest.mark.slow
def test_probe_threads_records_its_lookups_and_compile_time_and_leaves_no_store_behind():
    from tests.limits import cli

    o = cli("probe", "compile", "--threads", "2", "--timeout", "300", "--json", timeout=420, mem=None)
    assert o.rc == 0, o.stderr[-3000:]
    data = json.loads(o.stdout)
    (r,) = data["cache_explain"]
    assert r["lookups"] >= 3 and r["cache_dir"] == data["cache_dir"]
    (ct,) = r["compile_times"]
    assert ct["threads"] >= 2 and ct["wall_s"] <= ct["total_s"] + 1e-3 and ct["total_s"] > 0
    assert sum(ct["phases"].values()) <= ct["total_s"] + 1e-3
    assert not S.store_dir(data["cache_dir"]).exists()  # the probe's temp cache dir and its store: gone


@pytest.mark.slow
def test_run_prints_it_and_a_saved_report_explains_it(warm, tmp_path):
    """`compilewatch run --report FILE` on the warm cache: the run's own line, then `cache explain FILE`
    (the report's lines hold each event's detail flat, as the watcher writes them)."""
    from tests.limits import cli

    cache, _ = warm
    rep = tmp_path / "watch.jsonl"
    script = cache.parent / "child.py"
    o = cli("run", "--report", str(rep), "--", sys.executable, str(script), "ignored", "", timeout=420, mem=None,
            env={**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache)})
    assert o.rc == 0, o.stderr[-3000:]
    assert "cache lookups: 3 hit / 0 miss" in o.stderr and "warm compile time: " in o.stderr, o.stderr[-3000:]
    res = CliRunner().invoke(app, ["cache", "explain", str(rep), "--json"])
    assert res.exit_code == 0, res.output
    (r,) = json.loads(res.stdout)
    assert r["misses"] == 0 and r["compile_times"][0]["warm"] and r["compile_times"][0]["text"].startswith("warm")
    # the report's cache_lookups event of the process that compiled carries its compile time (a watched
    # process may write more than one cache_lookups event: torch 2.11's run here wrote one without it first)
    evs = [json.loads(line) for line in rep.read_text().splitlines() if '"cache_lookups"' in line]
    timed = [e for e in evs if "compile_time" in e]
    assert timed, evs
    assert timed[-1]["compile_time"]["lookups"] == {"hit": 3, "miss": 0}


@pytest.mark.slow
def test_doctors_line_names_the_warm_compile_time_and_its_worst_phase(warm):
    from compilewatch.explain.explain import last_run_line

    cache, _ = warm
    level, msg = last_run_line(cache)
    assert level == "info" and "3/3 cache lookups hit (100%)" in msg
    worst = next(iter(explain_run(cache).compile_times[0].phases))
    assert "; warm compile time " in msg and f", most in {worst} (" in msg
