"""benchmarks/dflash_step.py and dflash_e2e.py run on CPU with --small and write their results (no timing asserted)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import torch

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "dflash_step.py"


def load():
    spec = importlib.util.spec_from_file_location("dflash_step", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def test_small_benchmark_writes_results(tmp_path):
    bench = load()
    assert bench.main(["--small", "--out", str(tmp_path), "--iters", "1", "--warmup", "1"]) == 0
    data = json.loads((tmp_path / "dflash_step.json").read_text())
    by_mode = {r["mode"]: r for r in data["results"]}
    assert set(by_mode) == set(bench.MODES)
    assert by_mode["sdpa-dense"]["status"] == "ok" and by_mode["sdpa-dense"]["tflop_per_step"] > 0
    assert by_mode["flex-compiled"]["status"] == ("ok" if torch.cuda.is_available() else "skipped")
    assert "| sdpa-dense |" in (tmp_path / "dflash_step.md").read_text()


def test_flops_at_qwen3_8b_shapes_match_facts():
    """≈73 TFLOP per fwd+bwd step at the paper's shapes (5 layers, B=16, 512 anchors, 3072, 151936 vocab)."""
    bench = load()
    s = bench.Shape()
    g = torch.Generator().manual_seed(0)
    anchors = torch.sort(torch.randperm(s.seq - s.block + 1, generator=g)[: s.anchors])[0][None]
    assert 68 < bench.step_flops(s, anchors) / 1e12 < 76


def test_e2e_small_runs_the_trainer_step(tmp_path):
    """benchmarks/dflash_e2e.py --small: a random Qwen3 target from a config, the trainer's steps, a
    time split that adds up to the step, finite losses (no timing asserted)."""
    mod = _e2e()
    assert mod.main(["--small", "--out", str(tmp_path), "--steps", "1", "--warmup", "1"]) == 0
    r = json.loads((tmp_path / "dflash_e2e.json").read_text())
    assert r["tokens_per_step"] == 4 * 64 and r["tokens_per_s"] > 0  # grad_accum 4 × one 64-token sequence
    split = r["split_s"]
    assert set(split) == {"data", "target", "drafter", "optimizer", "waiting"}
    assert abs(sum(split.values()) - r["step_s"]) < 1e-6  # one timed step: its parts plus waiting = the step
    assert all(x == x and x > 0 for x in r["losses"])  # finite, positive CE
    assert "| tokens/s |" in (tmp_path / "dflash_e2e.md").read_text()


def _e2e():
    path = SCRIPT.parent / "dflash_e2e.py"
    spec = importlib.util.spec_from_file_location("dflash_e2e", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def test_e2e_small_engine_mode_runs_train_multi_and_restores_the_loaders(tmp_path):
    """--mode engine: dflash.engine.program.train_multi with the random target and data swapped in for the
    loaders; the engine's steps are committed, replicas identical; the loaders are restored after."""
    import dflash.model.target
    import dflash.training.build
    import dflash.training.trainer

    before = (dflash.model.target.load_target, dflash.training.build.load_target, dflash.training.build.load_training_data,
              dflash.training.trainer.Trainer.save)
    mod = _e2e()
    assert mod.main(["--small", "--mode", "engine", "--target-devices", "cpu", "--drafter-devices", "cpu",
                     "--tag", "b", "--out", str(tmp_path), "--steps", "1", "--warmup", "1"]) == 0
    r = json.loads((tmp_path / "dflash_e2e_b.json").read_text())
    assert r["mode"] == "engine" and r["outcome"] == "ok" and r["failure"] is None
    assert r["steps_done"] == 2 and r["tokens_per_step"] == 4 * 64  # grad_accum 4 × one 64-token sequence
    assert r["max_param_diff"] == 0.0 and r["gpus"] == 1
    assert not (tmp_path / "dflash_e2e_b.md").exists()  # a tag writes JSON only
    assert (dflash.model.target.load_target, dflash.training.build.load_target, dflash.training.build.load_training_data,
            dflash.training.trainer.Trainer.save) == before


def test_e2e_small_overhead_and_counters(tmp_path):
    """--overhead: every configuration measured on the real step, each with its own step count."""
    mod = _e2e()
    assert mod.main(["--small", "--out", str(tmp_path), "--steps", "1", "--warmup", "1", "--overhead", "1",
                     "--overhead-steps", "1", "--tag", "o"]) == 0
    r = json.loads((tmp_path / "dflash_e2e_o.json").read_text())
    assert set(r["overhead"]) == {"plain", "watcher", "guard", "watcher+guard"}
    assert all(v["n"] == 1 and v["median_s"] > 0 for v in r["overhead"].values())
    assert r["overhead"]["plain"]["overhead_pct"] == 0.0
    assert r["process_to_first_step_s"] >= r["first_step_s"] > 0


def test_threads_small_times_every_condition(tmp_path):
    """benchmarks/dflash_threads.py --small: the target forward alone and beside each background thread,
    the drafter step alone and beside the target; the background ran while the foreground was timed."""
    path = SCRIPT.parent / "dflash_threads.py"
    spec = importlib.util.spec_from_file_location("dflash_threads", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    assert mod.main(["--small", "--iters", "2", "--spin", "--out", str(tmp_path)]) == 0
    r = json.loads((tmp_path / "dflash_threads.json").read_text())
    for key in ("target_alone", "target_beside_drafter", "target_beside_drafter_switch_0.1ms", "drafter_alone",
                "drafter_beside_target"):
        assert r[key]["n"] >= 2 and r[key]["median_ms"] > 0
    assert r["target_beside_python_spin"]["n"] == 1
    assert r["target_beside_drafter"]["drafter_steps_meanwhile"] >= 1
    assert r["drafter_beside_target"]["target_forwards_meanwhile"] >= 1


def test_startup_benchmark_reads_a_phase_that_ran_beside_others():
    """The --resume checkpoint read runs in a thread beside the target and the data: the CLI says so
    on its phase line, and the benchmark keeps it (its seconds are not to be added to theirs)."""
    from cli.dflash_progress import TrainProgress
    from rich.text import Text

    spec = importlib.util.spec_from_file_location("dflash_startup", SCRIPT.with_name("dflash_startup.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    printed = []
    progress = TrainProgress(enabled=False)
    progress.progress.print = lambda text, **kw: printed.append(Text.from_markup(text).plain)
    progress("phase-done", {"name": "resume state", "seconds": 5.25, "at": 12.0, "beside": ["target", "data"]})
    assert printed == ["· resume state: 5.2 s (at 12.0 s since process start), read beside target, data"]
    assert bench.phases_of({"all_lines": [(12.1, printed[0])]}) == {
        "resume state": {"seconds": 5.2, "at": 12.0, "stamp": 12.1, "beside": ["target", "data"]}}


def test_startup_benchmark_reads_what_the_cli_prints_and_the_trainer_writes():
    """benchmarks/dflash_startup.py parses the phase lines the CLI prints (cli/dflash_progress.py renders
    the library's phase-done events) and the checkpoint events of metrics.jsonl; a format drift breaks here,
    not in the lead's GPU run."""
    from cli.dflash_progress import TrainProgress

    spec = importlib.util.spec_from_file_location("dflash_startup", SCRIPT.with_name("dflash_startup.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    printed = []
    progress = TrainProgress(enabled=False)
    from rich.text import Text

    progress.progress.print = lambda text, **kw: printed.append(Text.from_markup(text).plain)  # as the terminal shows it
    progress("phase-done", {"name": "first step", "seconds": 2.125, "at": 14.3})
    phases = bench.phases_of({"all_lines": [(14.31, line) for line in printed]})
    assert phases == {"first step": {"seconds": 2.1, "at": 14.3, "stamp": 14.31}}
    rows = [{"step": s, "seconds": 1.0 + (s == 3)} for s in range(1, 7)]
    rows.insert(2, {"event": "checkpoint", "step": 2, "blocked_s": 0.4, "write_s": 15.0, "bytes": 10, "removed": []})
    st = bench.stall_summary(rows, every=2)
    assert st["median_step_s"] == 1.0 and st["saves"][0]["blocked_s"] == 0.4 and st["mean_step_s_after_each_save"] == [2.0]


def test_startup_benchmark_reads_the_engines_prewarm_per_replica():
    """What dflash_startup records of an engine run: the metrics.jsonl "engine" event's prewarm as
    written (PrewarmResult through to_jsonable and JSON), per replica compiled/reused with its frames,
    and TORCH_LOGS=recompiles lines counted per function."""
    import json

    import torch

    from compilewatch import to_jsonable
    from dflash.engine.engine import Engine, EngineConfig
    from dflash.engine.toy import ToySpec, toy_program

    spec = importlib.util.spec_from_file_location("dflash_startup", SCRIPT.with_name("dflash_startup.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    torch._dynamo.reset()
    cfg = EngineConfig(target_devices=("cpu",), drafter_devices=("cpu", "cpu", "cpu"), steps=1, sample_every=0,
                       join_timeout=5.0)
    report = Engine(toy_program(ToySpec(compile_backend="eager")), cfg).run()
    assert report.ok, report.verdicts
    pre = bench.prewarm_of(json.loads(json.dumps(to_jsonable(report.prewarm), default=str)))
    assert [w["mode"] for w in pre["per_replica"]] == ["compiled", "reused", "reused"]
    assert pre["compiled_replicas"] == 1 and pre["frames_compiled_total"] == pre["per_replica"][0]["frames_compiled"] >= 1
    assert len(pre["replica_s"]) == 3 and pre["ok"] is True
    lines = ["V1201 13:10:59.008000 28919 torch/_dynamo/guards.py:5396] [0/1] [__recompiles] Recompiling function "
             "forward in /w/dflash/model/drafter.py:190",
             "[__recompiles]     - 0/0: tensor 'x' size mismatch at index 0. expected 2, actual 3",
             "[0/2] [__recompiles] Recompiling function forward in /w/dflash/model/drafter.py:190"]
    assert bench.recompiles_by_function(lines) == {"forward (drafter.py:190)": 2}


def test_fp8_fidelity_small_compares_fp8_and_bf16_against_fp32(tmp_path):
    """benchmarks/fp8_fidelity.py --small: every layer's output under bf16 rounding and under target.fp8,
    against fp32. FP8 (3 mantissa bits) moves the states more than bf16 (7); both stay close on the tiny model."""
    spec = importlib.util.spec_from_file_location("fp8_fidelity", SCRIPT.parent / "fp8_fidelity.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    try:
        torch._scaled_mm(torch.ones(16, 16).to(torch.float8_e4m3fn), torch.ones(16, 16).to(torch.float8_e4m3fn).t(),
                         scale_a=torch.ones(16, 1), scale_b=torch.ones(1, 16), out_dtype=torch.bfloat16)
    except (RuntimeError, NotImplementedError):
        import pytest
        pytest.skip("this torch has no CPU torch._scaled_mm (rowwise)")
    assert mod.main(["--small", "--out", str(tmp_path), "--tokens", "32", "--device", "cpu"]) == 0
    data = json.loads((tmp_path / "fp8_fidelity_small.json").read_text())
    assert len(data["layers"]) == 6 and "42 decoder linears in FP8" in data["note"]
    for row in data["layers"]:
        assert 0 < row["bf16"]["rel_err"] < row["fp8"]["rel_err"] < 0.2
        assert row["fp8"]["cos_mean"] > 0.99
