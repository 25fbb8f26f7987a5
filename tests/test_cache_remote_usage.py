"""doctor and run report torch's remote caches: on, reachable, hits/misses per kind from torch's own
counters; configured but unreachable is a finding, never silence."""

from __future__ import annotations

import sys
from pathlib import Path

from compilewatch import doctor as doctor_mod
from compilewatch import remote_usage
from compilewatch.tracing import runner
from compilewatch.tracing.watch_events import WatchEvent, summarize
from tests.redis_helpers import free_port

PROG = Path(__file__).with_name("remote_compile_prog.py")


def test_doctor_calls_an_unreachable_remote_cache_a_problem(monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_FX_GRAPH_REMOTE_CACHE", "1")
    monkeypatch.setenv("TORCHINDUCTOR_REDIS_URL", f"redis://:hunter2@127.0.0.1:{free_port()}")
    r = doctor_mod.doctor()
    bad = [v for v in r.verdicts if v.level == "problem" and "remote caches" in v.message]
    assert bad and not r.ok and r.remote.down and "hunter2" not in bad[0].message and ":***@" in bad[0].message


def test_doctor_says_a_reachable_remote_cache_is_on(monkeypatch, redis_url):
    monkeypatch.setenv("TORCHINDUCTOR_AUTOGRAD_REMOTE_CACHE", "1")
    monkeypatch.setenv("TORCHINDUCTOR_REDIS_URL", redis_url)
    r = doctor_mod.doctor()
    assert r.remote.reachable and any(v.level == "ok" and "aotautograd" in v.message for v in r.verdicts)


def test_nothing_on_nothing_reported(monkeypatch):
    for k in ("TORCHINDUCTOR_FX_GRAPH_REMOTE_CACHE", "TORCHINDUCTOR_AUTOGRAD_REMOTE_CACHE"):
        monkeypatch.delenv(k, raising=False)
    assert remote_usage.usage(counts={}) is None
    assert remote_usage.counts_by_kind({"RemoteFxGraphCache": {"hit": 2, "miss": 1, "put": 0, "exception": 0},
                                        "LocalFxGraphCache": {"hit": 5, "miss": 0, "put": 0, "exception": 0},
                                        "RemoteAOTAutogradCache": {"hit": 0, "miss": 0, "put": 0, "exception": 0}}) \
        == {"fxgraph": {"hit": 2, "miss": 1, "put": 0, "exception": 0}}


def test_summary_sums_remote_counts_over_processes():
    def ev(pid, kind, counts):
        return WatchEvent.from_json({"schema_version": 1, "seq": 1, "kind": kind, "time": 0.0, "pid": pid,
                                     "thread": "MainThread", "thread_id": 1, "thread_start": 0.0,
                                     "url": "redis://h:1", "counts": counts})

    s = summarize([ev(1, "remote_cache", {"fxgraph": {"hit": 2, "miss": 0}}),
                   ev(2, "remote_cache", {"fxgraph": {"hit": 1, "miss": 1}})])
    assert s.remote_cache == {"fxgraph": {"hit": 3, "miss": 1}} and s.ok and s.problems == 0


def test_run_reports_a_dead_remote_cache_as_a_risk_and_the_program_goes_on(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_FX_GRAPH_REMOTE_CACHE", "1")
    monkeypatch.setenv("TORCHINDUCTOR_REDIS_URL", f"redis://127.0.0.1:{free_port()}")
    monkeypatch.setenv("PYTHONPATH", str(PROG.parent.parent))
    monkeypatch.setenv("TORCHINDUCTOR_CPP_CACHE_PRECOMPILE_HEADERS", "0")  # torch 2.15: 600 MB of headers
    r = runner.run_watched([sys.executable, str(PROG)])
    assert r.exit_code == 0 and r.summary.ok and r.summary.risks == 1
    assert r.summary.counts.get("remote_cache_down") == 1
    assert r.summary.remote_cache["fxgraph"]["hit"] == 0 and r.summary.remote_cache["fxgraph"]["miss"] >= 1
    assert any("does not answer" in v for v in r.summary.verdicts)
