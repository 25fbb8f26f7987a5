"""benchmarks/env_lock_diff.py runs end to end with a small environment (numbers are not asserted)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_env_benchmark_writes_json_and_markdown(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "env_lock_diff.py"), "--out", str(tmp_path),
                        "--dists", "80", "--repeat", "1", "--skip-cli"], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    data = json.loads((tmp_path / "env_lock_diff.json").read_text())
    assert data["distributions"] >= 80
    assert data["diff_freeze_changes"]["critical"] == 1  # the seeds' cu128 -> cu130
    assert "| lock in process, warm |" in (tmp_path / "env_lock_diff.md").read_text()
