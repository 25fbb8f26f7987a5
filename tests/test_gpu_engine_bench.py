"""benchmarks/gpu_engine.py runs on CPU with tiny shapes: each case in its own process, results to --out."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from dflash.engine import compile_safety

ROOT = Path(__file__).resolve().parent.parent


def test_gpu_engine_benchmark_runs_on_cpu(tmp_path):
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_engine.py"), "--device", "cpu", "--tiny",
                           "--steps", "3", "--cases", "prewarm,guard", "--timeout", "120", "--stall-after", "60",
                           "--out", str(out)], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads((out / "gpu_engine.json").read_text())
    rows = {r["case"]: r for r in data["cases"]}
    assert rows["prewarm"]["outcome"] == "ok" and rows["prewarm"]["steps_done"] == 3
    assert rows["prewarm"]["tokens_per_s"] > 0 and rows["prewarm"]["prewarm_s"] > 0
    # no prewarm, guard on: the first compile in a drafter thread is refused with a clear error
    assert rows["guard"]["outcome"] == "failed" and compile_safety.is_blocked_compile(rows["guard"]["error"])
    assert "| prewarm | 0 | ok |" in (out / "gpu_engine.md").read_text() and rows["prewarm"]["median_step_s"] > 0
    report = json.loads((out / rows["prewarm"]["result_file"]).read_text())["report"]
    assert report["max_param_diff"] == 0.0 and len(report["steps"]) == 3


def test_gpu_engine_benchmark_reports_a_stall_and_kills_a_hung_process(tmp_path):
    # --timeout: the stall case must finish inside it (import torch + prewarm + 1 step + the 2 s watchdog),
    # which took up to ~15 s on a loaded 2-core machine; the hang case is killed at it
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_engine.py"), "--device", "cpu", "--tiny",
                           "--steps", "3", "--cases", "selftest-stall,selftest-hang", "--timeout", "30",
                           "--stall-after", "2", "--out", str(out)], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]  # no prewarm case asked: nothing to fail
    rows = {r["case"]: r for r in json.loads((out / "gpu_engine.json").read_text())["cases"]}
    stall = rows["selftest-stall"]
    assert stall["outcome"] == "stalled" and stall["steps_done"] == 1 and not stall["timed_out"]
    assert any("drafter-0" in v and "cannot be killed" in v for v in stall["verdicts"])
    hang = rows["selftest-hang"]
    assert hang["timed_out"] and hang["outcome"] == "hang (killed at timeout)"
    assert "selftest-hang" not in (hang["faulthandler_stacks"] or "") and "run_case" in hang["faulthandler_stacks"]


def test_gpu_engine_benchmark_runs_the_real_dflash_trainer_on_cpu(tmp_path):
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_engine.py"), "--device", "cpu", "--program",
                           "dflash", "--steps", "2", "--cases", "prewarm", "--timeout", "120", "--out", str(out)],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (row,) = json.loads((out / "gpu_engine.json").read_text())["cases"]
    assert row["outcome"] == "ok" and row["steps_done"] == 2 and row["tokens_per_s"] > 0
