"""benchmarks/gpu_engine.py runs on CPU with tiny shapes: each case in its own process, results to --out."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from dflash.engine import compile_safety

ROOT = Path(__file__).resolve().parent.parent


def _own_tmpdir(tmp_path: Path) -> tuple[dict, Path]:
    """An environment whose TMPDIR is a fresh directory of this test's: what the benchmark leaves in its temp
    dir is seen there, whatever other tests do meanwhile."""
    tmp = tmp_path / "tmpdir"
    tmp.mkdir()
    return {**os.environ, "PYTHONPATH": str(ROOT), "TMPDIR": str(tmp)}, tmp


def _left_behind(tmp: Path) -> list[str]:
    return sorted(p.name for p in tmp.glob("gpu-engine-*"))


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
    env, tmp = _own_tmpdir(tmp_path)
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
    assert _left_behind(tmp) == []  # the killed case's scratch too: the parent removes it


def test_gpu_engine_benchmark_runs_the_real_dflash_trainer_on_cpu(tmp_path):
    out = tmp_path / "out"
    env, tmp = _own_tmpdir(tmp_path)
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_engine.py"), "--device", "cpu", "--program",
                           "dflash", "--steps", "2", "--cases", "prewarm", "--timeout", "120", "--out", str(out)],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (row,) = json.loads((out / "gpu_engine.json").read_text())["cases"]
    assert row["outcome"] == "ok" and row["steps_done"] == 2 and row["tokens_per_s"] > 0
    assert _left_behind(tmp) == []  # the case's data, run dir and compile caches are gone


@pytest.fixture
def gpu_engine(tmp_path, monkeypatch):
    """benchmarks/gpu_engine.py imported in this process, its temp dir this test's."""
    spec = importlib.util.spec_from_file_location("gpu_engine_bench", ROOT / "benchmarks" / "gpu_engine.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    return mod


def _case_args(**kw) -> argparse.Namespace:
    return argparse.Namespace(steps=1, targets=1, drafters=1, stall_after=60.0, **kw)


@pytest.mark.parametrize("fails", [False, True], ids=["returns", "raises"])
def test_dflash_case_run_alone_removes_its_work_dir(gpu_engine, tmp_path, monkeypatch, fails):
    """run_dflash_case without --work (not launched by the parent) makes its own work dir and removes it when the
    case ends, returned or raised. The trainer and engine are stand-ins: only the directory's life is tested."""
    from dflash.engine import program
    from dflash.training.trainer import Trainer

    seen = []

    class FakeTrainer:
        def close(self):
            pass

    def from_config(cfg):
        seen.append(Path(cfg.data.path))
        assert Path(cfg.data.path).is_file() and Path(cfg.data.path).parent.name.startswith("gpu-engine-dflash-")
        if fails:
            raise RuntimeError("trainer failed to build")
        return FakeTrainer()

    monkeypatch.setattr(Trainer, "from_config", from_config)
    monkeypatch.setattr(program, "train_multi", lambda trainer, topo: (None, "the report"))
    if fails:
        with pytest.raises(RuntimeError, match="failed to build"):
            gpu_engine.run_dflash_case(_case_args(work=None), "cpu", gpu_engine.CASES["prewarm"])
    else:
        assert gpu_engine.run_dflash_case(_case_args(work=None), "cpu", gpu_engine.CASES["prewarm"]) == "the report"
    assert len(seen) == 1 and not seen[0].parent.exists() and _left_behind(tmp_path) == []


def test_dflash_case_leaves_a_given_work_dir_to_its_owner(gpu_engine, tmp_path, monkeypatch):
    """With --work (the parent's scratch) the case writes there and leaves removing it to the parent."""
    from dflash.engine import program
    from dflash.training.trainer import Trainer

    class FakeTrainer:
        def close(self):
            pass

    monkeypatch.setattr(Trainer, "from_config", lambda cfg: FakeTrainer())
    monkeypatch.setattr(program, "train_multi", lambda trainer, topo: (None, "the report"))
    work = tmp_path / "scratch" / "work"
    assert gpu_engine.run_dflash_case(_case_args(work=str(work)), "cpu", gpu_engine.CASES["prewarm"]) == "the report"
    assert (work / "chat.jsonl").is_file() and _left_behind(tmp_path) == []
