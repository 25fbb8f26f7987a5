"""End to end on CPU: two torchrun ranks (gloo), separate empty local caches, one real Redis.

After a first job with the remote caches on, a second job's ranks (new empty local caches) compile
nothing the remote cache holds: torch counts only FX-graph and AOTAutograd hits, every one of them
from Redis. The job is benchmarks/remote_cache_job.py, run by benchmarks/remote_cache_cpu.py's
`run_job` (the benchmark reports the first-step times; this test asserts counters only).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _bench():
    spec = importlib.util.spec_from_file_location("cw_bench_remote", ROOT / "benchmarks" / "remote_cache_cpu.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_second_job_compiles_nothing_the_remote_cache_holds(tmp_path, redis_url, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CPP_CACHE_PRECOMPILE_HEADERS", "0")  # torch 2.15: 600 MB of headers per cache
    bench = _bench()
    first = bench.run_job(tmp_path / "out1", tmp_path / "cache1", redis_url, dim=32)
    assert sum(r["inductor"].get("fxgraph_cache_miss", 0) for r in first) >= 2  # forward + backward compiled and put
    second = bench.run_job(tmp_path / "out2", tmp_path / "cache2", redis_url, dim=32)
    for r in second:
        assert r["inductor"].get("fxgraph_cache_miss", 0) == 0 and r["inductor"].get("fxgraph_cache_hit", 0) >= 2, r
        assert r["aot_autograd"].get("autograd_cache_miss", 0) == 0 and r["aot_autograd"].get("autograd_cache_hit", 0) >= 1, r
        assert r["remote"]["RemoteFxGraphCache"]["miss"] == 0 and r["remote"]["RemoteFxGraphCache"]["hit"] >= 2, r
    s = bench.summary(second)
    assert s["fxgraph_miss"] == 0 and s["remote_fx_hit"] >= 4
