"""benchmarks/watch_overhead.py runs on CPU with tiny settings and writes its results."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_watch_overhead_benchmark_writes_json_and_markdown(tmp_path):
    spec = importlib.util.spec_from_file_location("watch_overhead", ROOT / "benchmarks" / "watch_overhead.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    result = mod.main(["--backend", "eager", "--steps", "3", "--repeats", "1", "--width", "16", "--batch", "4", "--hook-calls", "1000",
                       "--out", str(tmp_path)])
    data = json.loads((tmp_path / "watch_overhead.json").read_text())
    assert set(data["best_step_s"]) == set(mod.CONFIGS) == set(result["overhead_pct"])
    assert data["overhead_pct"]["plain"] == 0.0 and all(v > 0 for v in data["best_step_s"].values())
    assert "_callback_from_stance guard" in data["hook_ns"]
    assert "| watcher+guard |" in (tmp_path / "watch_overhead.md").read_text()
