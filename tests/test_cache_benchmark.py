"""The fingerprint benchmark script runs (tiny size) and writes its JSON and Markdown results."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_benchmark_smoke(tmp_path):
    spec = importlib.util.spec_from_file_location("cw_bench_fp", ROOT / "benchmarks" / "cache_fingerprint.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    r = mod.main(["--files", "120", "--bytes", "1M", "--repeat", "1", "--no-cli", "--out", str(tmp_path)])
    assert r["cache"]["files"] == 120
    assert r["fingerprint_after_1pct_changed"]["hashed"] == 1
    saved = json.loads((tmp_path / "cache_fingerprint.json").read_text())
    assert saved["fingerprint_cold"]["runs"] and "| what |" in (tmp_path / "cache_fingerprint.md").read_text()


@pytest.mark.slow
def test_roundtrip_script_on_cpu(tmp_path):
    """benchmarks/gpu_cache_roundtrip.py on CPU: the moved cache and the Mega-Cache both hit.

    Two cold inductor compiles (~1 min on 2 cores). It runs in every suite: skipped by default, it let the
    script rot (it imported `load_mega_cache` from where the cache package no longer keeps it)."""
    spec = importlib.util.spec_from_file_location("cw_rt", ROOT / "benchmarks" / "gpu_cache_roundtrip.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    r = mod.main(["--device", "cpu", "--out", str(tmp_path)])
    for step in ("warm_moved", "warm_mega"):
        assert r[step]["data"]["inductor"].get("fxgraph_cache_miss", 0) == 0, r[step]
        assert r[step]["data"]["aot_autograd"].get("autograd_cache_hit") == 1, r[step]
    assert (tmp_path / "cache_roundtrip.md").is_file()
