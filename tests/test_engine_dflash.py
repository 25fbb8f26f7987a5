"""DFlash on the engine (CPU "devices"): the same training as the single-device trainer, and the CLI."""

from __future__ import annotations

import json

import pytest
import torch

from tests.dflash_helpers import token_positions, write_word_chats
from tests.numerics import reduction_tol

pytest.importorskip("dflash.training.trainer")

from dflash.config import TopologyConfig, apply_overrides, tiny  # noqa: E402
from dflash.engine.program import train_multi  # noqa: E402
from dflash.training.trainer import Trainer  # noqa: E402


@pytest.fixture(scope="module")
def chat_file(tmp_path_factory):
    """24 conversations written from the tiny tokenizer's words (no regeneration: fast)."""
    return write_word_chats(tmp_path_factory.mktemp("engine-data") / "chat.jsonl")


def config(out, data, **kw):
    base = {"data.path": str(data), "data.regenerate": False, "data.batch_size": 2, "train.max_steps": 3,
            "checkpoint.every": 2, "checkpoint.out_dir": str(out), "metrics.log_every": 1,
            "metrics.tensorboard": False, "eval.at_end": False, "topology.device": "cpu"}
    return apply_overrides(tiny(), {**base, **kw})


def test_engine_training_equals_the_single_device_trainer_with_the_same_global_batch(tmp_path, chat_file):
    single = Trainer.from_config(config(tmp_path / "single", chat_file, **{"train.grad_accum": 2}))
    steps_single = []
    single.on_event = lambda kind, d: steps_single.append(d["metrics"]) if kind == "step" else None
    terms = token_positions(single, single.micro_batches(0))
    single.train()
    single.close()

    multi = Trainer.from_config(config(tmp_path / "multi", chat_file))
    steps_multi = []
    multi.on_event = lambda kind, d: steps_multi.append(d["metrics"]) if kind == "step" else None
    result, report = train_multi(multi, TopologyConfig(target_devices=["cpu", "cpu"], drafter_devices=["cpu", "cpu"], stall_after=120))
    multi.close()
    assert report.ok, report.verdicts
    assert report.max_param_diff == 0.0 and report.prewarm.ok
    assert result.steps == 3 and len(steps_multi) == 3
    # step 1 starts from the same weights: its loss and gradient norm (before clipping and the
    # AdamW step) are equal in exact arithmetic and differ by summation order only (tests/numerics.py)
    first_single, first_multi = steps_single[0], steps_multi[0]
    assert first_multi.loss == pytest.approx(first_single.loss, rel=reduction_tol(terms))
    assert first_multi.grad_norm == pytest.approx(first_single.grad_norm, rel=reduction_tol(terms))
    # later steps follow AdamW, which turns rounding noise in near-zero gradients into lr-sized weight
    # differences: weights are not compared. Losses are: those weights barely move the loss (their
    # gradient is ~0); 1e-4 relative is >500x the 1.4e-7 measured (default/avx2/avx512, 1-2 threads)
    assert [m.loss for m in steps_multi] == pytest.approx([m.loss for m in steps_single], rel=1e-4)
    assert [p.rsplit("/", 1)[-1] for p in result.checkpoints] == [p.rsplit("/", 1)[-1] for p in single.checkpoints]
    rows = [json.loads(x) for x in (tmp_path / "multi" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == [1, 2, 3]


def test_an_engine_run_resumed_from_its_checkpoint_repeats_the_uninterrupted_run(tmp_path, chat_file):
    whole = Trainer.from_config(config(tmp_path / "whole", chat_file, **{"train.max_steps": 4}))
    train_multi(whole, TopologyConfig(target_devices=["cpu"], drafter_devices=["cpu", "cpu"]))
    whole.close()
    first = Trainer.from_config(config(tmp_path / "split", chat_file, **{"train.max_steps": 4}))
    _, rep1 = train_multi(first, TopologyConfig(target_devices=["cpu"], drafter_devices=["cpu", "cpu"]), until=2)
    first.close()
    assert rep1.ok and rep1.steps_done == 2
    second = Trainer.from_config(config(tmp_path / "split", chat_file, **{"train.max_steps": 4}), resume=True)
    assert second.step == 2
    _, rep2 = train_multi(second, TopologyConfig(target_devices=["cpu"], drafter_devices=["cpu", "cpu"]))
    second.close()
    assert rep2.ok and rep2.steps_done == 4 and rep2.start_step == 2 and rep2.max_param_diff == 0.0
    # bit-identical: one machine, the same kernels in the same order, the same data, weights and
    # optimizer state; only the process history differs (not a cross-machine claim)
    for a, b in zip(whole.drafter.parameters(), second.drafter.parameters()):
        assert torch.equal(a, b)


def test_dflash_train_cli_with_target_and_drafter_devices(tmp_path, chat_file):
    from cli.dflash_main import app
    from tests.helpers import invoke_json

    out = tmp_path / "run"
    data = invoke_json(app, ["train", "--target-devices", "cpu,cpu", "--drafter-devices", "cpu,cpu,cpu",
                             "--out", str(out), "--data", str(chat_file), "--max-steps", "2",
                             "--set", "data.regenerate=false", "--set", "data.batch_size=2", "--set", "eval.at_end=false",
                             "--set", "metrics.tensorboard=false"])
    eng = data["engine"]
    assert eng["outcome"] == "ok" and eng["steps_done"] == 2 and eng["max_param_diff"] == 0.0
    assert eng["target_devices"] == ["cpu", "cpu"] and len(eng["drafter_devices"]) == 3
    assert eng["prewarm"]["ok"] and eng["guard"] != "off"
    assert data["steps"] == 2 and data["checkpoints"]


def test_dflash_train_cli_rejects_half_an_engine_and_unknown_devices(tmp_path):
    from cli.dflash_main import app
    from tests.helpers import invoke

    r = invoke(app, ["train", "--target-devices", "cpu"])
    assert r.exit_code == 2 and "go together" in r.stderr
    r = invoke(app, ["train", "--target-devices", "cpu", "--drafter-devices", "tpu:0"])
    assert r.exit_code == 2 and "--drafter-devices" in r.stderr


ENGINE_SETS = ["--set", "data.regenerate=false", "--set", "data.batch_size=2", "--set", "eval.at_end=false",
               "--set", "metrics.tensorboard=false", "--set", "checkpoint.every=2"]


def _train(args):
    from cli.dflash_main import app
    from tests.helpers import invoke

    r = invoke(app, ["train", *args, *ENGINE_SETS, "--json"])
    assert r.exit_code == 0, (r.stdout, r.stderr[-3000:])
    assert "Traceback" not in r.stderr
    return json.loads(r.stdout), r.stderr


def test_resume_restores_the_topology_from_the_runs_config_and_flags_override(tmp_path, chat_file):
    out = tmp_path / "run"
    first, _ = _train(["--target-devices", "cpu", "--drafter-devices", "cpu,cpu", "--stall-after", "120",
                       "--set", "topology.queue_depth=3", "--out", str(out), "--data", str(chat_file), "--max-steps", "2"])
    assert first["config"]["topology"]["drafter_devices"] == ["cpu", "cpu"] and first["engine"]["steps_done"] == 2
    assert "drafter_devices = [\"cpu\", \"cpu\"]" in (out / "config.toml").read_text()

    # no device flags: the engine again, on the recorded devices, with the recorded watchdog and queue
    data, err = _train(["--out", str(out), "--resume", "--max-steps", "3"])
    eng = data["engine"]
    assert eng["start_step"] == 2 and eng["steps_done"] == 3 and eng["drafter_devices"] == ["cpu", "cpu"]
    topo = data["config"]["topology"]
    assert (topo["stall_after"], topo["queue_depth"], topo["target_devices"]) == (120.0, 3, ["cpu"])
    assert "resumed  devices and engine settings from" in err

    # an explicit --device means one device: the lists the run had are dropped, the summary says so
    data, err = _train(["--out", str(out), "--resume", "--max-steps", "4", "--device", "cpu"])
    assert "engine" not in data and data["steps"] == 4
    assert data["config"]["topology"]["drafter_devices"] == [] and data["config"]["topology"]["device"] == "cpu"
    assert "from the command line: device, drafter_devices, target_devices" in err


def test_resuming_a_finished_engine_run_trains_nothing_and_exits_0(tmp_path, chat_file):
    out = tmp_path / "run"
    _train(["--target-devices", "cpu", "--drafter-devices", "cpu,cpu", "--out", str(out), "--data", str(chat_file),
            "--max-steps", "2"])
    data, err = _train(["--out", str(out), "--resume"])  # at step 2 of 2: said at once, nothing built
    assert data == {"run_dir": str(out), "step": 2, "total_steps": 2}
    assert "ValueError" not in err


def test_target_home_keeps_the_full_target_off_drafter_only_devices():
    from dflash.engine.program import target_home

    assert target_home(["cuda:0", "cuda:1"], ["cuda:1", "cuda:2"]) is None  # a worker shares the trainer's device
    assert target_home(["cuda:0", "cuda:1", "cuda:2"], ["cuda:3", "cuda:4"]) == "cuda:0"  # 3+2 split
    assert target_home(["cpu"], ["cpu", "cpu"]) is None


def test_a_split_trainer_holds_only_embedding_and_head_and_trains_and_evaluates_the_same(tmp_path, chat_file,
                                                                                          monkeypatch):
    """The engine's split topology (target workers on other devices than the drafters): the Trainer keeps
    the full target where a worker runs it and only the embedding + LM head on its own device. On CPU
    every "device" is the CPU, so the split is asked for explicitly; the math is the same as unsplit
    (same weights, same kernels, same order on one machine): losses, weights and eval are bit-identical."""
    kw = {"eval.at_end": True, "eval.num_prompts": 2, "eval.max_new_tokens": 8}
    whole = Trainer.from_config(config(tmp_path / "whole", chat_file, **kw))
    result_w, rep_w = train_multi(whole, TopologyConfig(target_devices=["cpu"], drafter_devices=["cpu", "cpu"]))
    whole.close()
    split = Trainer.from_config(config(tmp_path / "split", chat_file, **kw), target_device="cpu")
    assert not split.target.has_body and split.full_target.has_body
    assert sum(p.numel() for p in split.target.model.parameters()) < sum(
        p.numel() for p in split.full_target.model.parameters())
    with pytest.raises(RuntimeError, match="no target body"):
        split.target.taps(torch.zeros(1, 4, dtype=torch.long))
    assert any("holds its embedding and LM head" in n for n in split.notes)
    import dflash.model.target

    loads = []
    real_load = dflash.model.target.load_target
    monkeypatch.setattr(dflash.model.target, "load_target", lambda *a, **k: loads.append(a) or real_load(*a, **k))
    result_s, rep_s = train_multi(split, TopologyConfig(target_devices=["cpu"], drafter_devices=["cpu", "cpu"]))
    assert loads == []  # the target worker on the target's device runs the Trainer's full target
    split.close()
    assert rep_s.ok and rep_w.ok and rep_s.max_param_diff == 0.0
    assert (result_s.first_loss, result_s.last_loss) == (result_w.first_loss, result_w.last_loss)
    for a, b in zip(whole.drafter.parameters(), split.drafter.parameters()):
        assert torch.equal(a, b)
    assert result_s.eval is not None and result_w.eval is not None
    assert result_s.eval.outputs_match and result_s.eval.tau == result_w.eval.tau
    assert result_s.eval.acceptance_histogram == result_w.eval.acceptance_histogram


# ----------------------------------------------------------------------------- GPU (run with -m gpu)
from tests.helpers import requires_cuda  # noqa: E402


@pytest.mark.gpu
@requires_cuda(min_gpus=2)
def test_a_split_run_on_two_gpus_keeps_the_target_body_off_the_drafter_gpu(tmp_path, chat_file):
    """`--target-devices cuda:0 --drafter-devices cuda:1` as dflash.run builds it: the target's body lives on
    cuda:0 only (loaded once, reused by the worker there); cuda:1 holds the drafter, its optimizer and the
    target's embedding + head; training and end-of-run eval complete."""
    from dflash.engine.program import target_home

    cfg = config(tmp_path / "split", chat_file, **{"topology.device": "auto", "eval.at_end": True,
                                                   "eval.num_prompts": 2, "eval.max_new_tokens": 8})
    home = target_home(["cuda:0"], ["cuda:1"])
    assert home == "cuda:0"
    trainer = Trainer.from_config(cfg, device="cuda:1", target_device=home)
    body = {p.device for p in trainer.full_target.model.parameters()}
    assert body == {torch.device("cuda:0")} and not trainer.target.has_body
    assert {p.device for p in trainer.target.model.parameters()} == {torch.device("cuda:1")}
    result, report = train_multi(trainer, TopologyConfig(target_devices=["cuda:0"], drafter_devices=["cuda:1"], stall_after=300))
    trainer.close()
    assert report.ok, report.verdicts
    assert result.steps == 3 and result.eval is not None and result.eval.outputs_match


def test_an_engine_with_a_compiled_target_prewarms_it_before_the_guard_freezes(tmp_path, chat_file):
    """`target.compile` on a GPU: the target's layers compile on their first forward. The engine's
    guard refuses any compile after prewarm, so prewarm must run each target device's forward at
    every bucket (Program.warm_producer); without it the target thread's first batch fails. CPU
    inductor stands in for the GPU here (load_target compiles on CUDA only)."""
    trainer = Trainer.from_config(config(tmp_path / "run", chat_file))
    trainer.target.compile_taps = True  # what load_target sets on CUDA
    try:
        result, report = train_multi(trainer, TopologyConfig(target_devices=["cpu"], drafter_devices=["cpu"], stall_after=300))
    finally:
        trainer.close()
    assert report.ok, report.verdicts
    assert report.guard.startswith("compilewatch") and report.prewarm.ok
    assert result.steps == 3
    assert trainer.target.tapper() is not None and trainer.target.compile_taps
