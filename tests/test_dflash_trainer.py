"""dflash.training.trainer + dflash.checkpoint.store: export format, resume exactness, atomic checkpoints, schedules."""

from __future__ import annotations

import json

import pytest
import torch

from compilewatch.errors import BadInput
from dflash.checkpoint import store as ckpt
from dflash.config import OptimConfig
from dflash.training.schedule import lr_at
from dflash.training.trainer import Trainer
from tests.dflash_helpers import (chat_file, local_target_dir, record_losses, small_config,  # noqa: F401
                                  tiny_target, token_positions)
from tests.numerics import assert_same_grads, assert_same_sum, grads_of, reduction_tol


class Killed(Exception):
    """Stands in for SIGKILL: raised from inside the loop, after a step, before its checkpoint."""


def test_kill_and_resume_gives_the_same_losses(tmp_path, chat_file):
    on_a, full = record_losses()
    a = Trainer.from_config(small_config(tmp_path / "a", chat_file), on_event=on_a)
    try:
        a.train()
    finally:
        a.close()
    assert [s for s, _ in full] == [1, 2, 3, 4, 5, 6]

    seen = []

    def killer(kind, data):
        if kind == "step":
            seen.append((data["metrics"].step, data["metrics"].loss))
            if data["metrics"].step == 5:  # steps 4 and 5 are lost; the checkpoint at 3 survives
                raise Killed

    b = Trainer.from_config(small_config(tmp_path / "b", chat_file), on_event=killer)
    with pytest.raises(Killed):
        b.train()
    b.close()
    assert ckpt.latest_checkpoint(tmp_path / "b").name == "step_000003"
    on_c, resumed = record_losses()
    c = Trainer.from_config(small_config(tmp_path / "b", chat_file), resume=True, on_event=on_c)
    assert c.step == 3
    try:
        c.train()
    finally:
        c.close()
    assert seen[:5] == full[:5]
    # bit-identical: same data order, anchors, weights and optimizer state, and (one machine, one thread
    # layout) the same kernels in the same order; a claim about resume, not about other CPUs
    assert resumed == full[3:]
    assert ckpt.latest_checkpoint(tmp_path / "b").name == "step_000006"
    rows = [json.loads(x) for x in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in rows if "event" not in r]
    assert steps == [1, 2, 3, 4, 5, 6]  # the killed segment's rows for steps 4-5 were replaced, not duplicated
    assert [r["loss"] for r in rows if "event" not in r] == [loss for _, loss in full]
    assert not (tmp_path / "b" / ".lock").exists()  # released by close()


def test_one_trainer_per_run_dir_and_a_stale_lock_is_reported(tmp_path, chat_file):
    import subprocess
    import sys

    from dflash.checkpoint.runlock import RunLock

    a = Trainer.from_config(small_config(tmp_path, chat_file))
    try:
        lock = json.loads((tmp_path / ".lock").read_text())
        assert lock["pid"] == __import__("os").getpid() and lock["host"]
        with pytest.raises(BadInput, match="in use by another trainer: pid"):
            Trainer.from_config(small_config(tmp_path, chat_file))
    finally:
        a.close()
    assert not (tmp_path / ".lock").exists()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = {"pid": int(dead.stdout), "host": __import__("socket").gethostname(), "started": "then"}
    (tmp_path / ".lock").write_text(json.dumps(stale))
    with pytest.raises(BadInput, match="stale lock: process") as e:
        RunLock(tmp_path).acquire()
    assert "delete" in e.value.hint and "--resume" in e.value.hint
    assert json.loads((tmp_path / ".lock").read_text()) == stale  # reported, not taken over


def test_bad_input_leaves_no_run_dir_and_no_lock(tmp_path, chat_file):
    with pytest.raises(BadInput, match="distinct target layers"):
        Trainer.from_config(small_config(tmp_path / "run", chat_file, **{"drafter.num_layers": 7}))
    assert not (tmp_path / "run").exists()


def test_eval_accepts_the_latest_pointer_and_the_checkpoints_dir(tmp_path, chat_file):
    t = Trainer.from_config(small_config(tmp_path, chat_file, **{"train.max_steps": 1}))
    t.train()
    t.close()
    want = tmp_path / "checkpoints" / "step_000001"
    for p in (tmp_path, tmp_path / "checkpoints", tmp_path / "checkpoints" / "latest", want):
        assert ckpt.resolve_checkpoint(p) == want
    (tmp_path / "checkpoints" / "latest").write_text("../../elsewhere\n")  # never followed out of checkpoints/
    with pytest.raises(BadInput, match="does not name a checkpoint") as e:  # nor silently replaced (issue 31)
        ckpt.latest_checkpoint(tmp_path)
    assert "step_000001" in e.value.hint


def test_tensorboard_is_off_by_default_and_a_clear_error_when_missing():
    from dflash.config import MetricsConfig
    from dflash.training.metrics import check_tensorboard, tensorboard_available

    assert MetricsConfig().tensorboard is False
    check_tensorboard(MetricsConfig())
    if tensorboard_available():
        pytest.skip("tensorboard is installed here")
    with pytest.raises(BadInput, match="tensorboard package is not installed") as e:
        check_tensorboard(MetricsConfig(tensorboard=True))
    assert "pip install tensorboard" in e.value.hint


def test_export_config_and_safetensors_names(tmp_path, chat_file):
    from safetensors import safe_open

    t = Trainer.from_config(small_config(tmp_path, chat_file, **{"train.max_steps": 1}))
    try:
        t.train()
    finally:
        t.close()
    ck = ckpt.latest_checkpoint(tmp_path)
    assert {p.name for p in ck.iterdir()} == {"config.json", "model.safetensors", "training_state.pt", "train_config.toml",
                                              "manifest.json"}  # sizes + checksums (issue 31)
    cfg = json.loads((ck / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["model_type"] == "qwen3"
    assert cfg["block_size"] == 8 and cfg["num_target_layers"] == 6 and cfg["num_hidden_layers"] == 2
    assert cfg["dflash_config"] == {"mask_token_id": t.target.mask_token_id, "target_layer_ids": [1, 3]}
    assert cfg["tie_word_embeddings"] is False and cfg["layer_types"] == ["full_attention"] * 2
    assert cfg["sliding_window"] is None and cfg["attention_bias"] is False
    for key in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size",
                "rms_norm_eps", "rope_theta", "vocab_size", "max_position_embeddings"):
        assert key in cfg, key
    with safe_open(str(ck / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert names == set(t.drafter.state_dict())
    assert {"fc.weight", "hidden_norm.weight", "norm.weight", "layers.1.self_attn.q_norm.weight",
            "layers.0.mlp.gate_proj.weight", "layers.0.input_layernorm.weight"} <= names
    assert not any("embed" in n or "lm_head" in n for n in names)
    loaded = ckpt.load_export(ck)
    for k, v in t.drafter.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[k], v)


def test_checkpoint_write_is_atomic(tmp_path, chat_file, monkeypatch):
    t = Trainer.from_config(small_config(tmp_path, chat_file, **{"train.max_steps": 1}))
    boom = RuntimeError("disk full")

    def fail(*a, **k):
        raise boom

    monkeypatch.setattr(ckpt, "atomic_write_text", fail)  # fails after the weights were written
    with pytest.raises(RuntimeError):
        t.train()
    t.close()
    ckdir = tmp_path / "checkpoints"
    assert list(ckdir.iterdir()) == []  # no step dir, no staging dir, no `latest`
    assert ckpt.latest_checkpoint(tmp_path) is None


def test_existing_run_needs_resume_and_mismatched_checkpoint_is_refused(tmp_path, chat_file):
    t = Trainer.from_config(small_config(tmp_path, chat_file, **{"train.max_steps": 1}))
    t.train()
    t.close()
    with pytest.raises(BadInput, match="already holds checkpoints"):
        Trainer.from_config(small_config(tmp_path, chat_file))
    with pytest.raises(BadInput, match="does not match the target"):  # other taps than the checkpoint's
        Trainer.from_config(small_config(tmp_path, chat_file, **{"target.layer_ids": "[2, 4]"}), resume=True)
    with pytest.raises(BadInput, match="differs"):
        Trainer.from_config(small_config(tmp_path, chat_file, **{"drafter.intermediate_size": "32"}), resume=True)
    with pytest.raises(BadInput, match="no checkpoint"):
        Trainer.from_config(small_config(tmp_path / "empty", chat_file), resume=True)


def test_train_on_a_local_hf_target_dir(tmp_path, chat_file, local_target_dir):
    """A transformers model directory (hidden 32, 4 layers) works as a target: taps and export follow it."""
    t = Trainer.from_config(small_config(tmp_path, chat_file, **{"target.path": str(local_target_dir), "train.max_steps": 2}))
    try:
        r = t.train()
    finally:
        t.close()
    assert r.steps == 2 and t.drafter.spec.hidden_size == 32
    cfg = json.loads((ckpt.latest_checkpoint(tmp_path) / "config.json").read_text())
    assert cfg["hidden_size"] == 32 and cfg["num_target_layers"] == 4
    assert cfg["dflash_config"]["target_layer_ids"] == [0, 3]  # the formula would repeat layer 1: spread instead


def test_lr_schedules():
    cos = OptimConfig(lr=1.0, warmup_ratio=0.1, min_lr_ratio=0.1)
    lrs = [lr_at(s, 100, cos) for s in range(100)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)  # linear warmup over 10 steps
    assert lrs[-1] == pytest.approx(0.1) and all(a >= b for a, b in zip(lrs[10:], lrs[11:]))
    wsd = OptimConfig(lr=1.0, schedule="wsd", warmup_ratio=0.1, decay_ratio=0.2)
    w = [lr_at(s, 100, wsd) for s in range(100)]
    assert w[10:80] == [1.0] * 70 and w[-1] == pytest.approx(0.0) and w[85] < 1.0


def test_split_global_batch_gives_the_same_gradient(tmp_path, chat_file):
    """A global batch split into micro-batches (accumulation, or replicas summing gradients) gives the
    gradient of the whole batch at once: the loss denominator Σw is global. Compared before the
    optimizer step (see tests/numerics.py: after an AdamW step, rounding noise in a near-zero gradient
    is an lr-sized weight difference); the same trainer runs both, from the same initial weights."""
    from dflash.data.dataset import Batch

    t = Trainer.from_config(small_config(tmp_path, chat_file, **{"data.batch_size": 8}))
    try:
        whole = t.micro_batches(0)[0]
        halves = [Batch(**{k: getattr(whole, k)[sl] for k in whole.__dataclass_fields__})
                  for sl in (slice(0, 3), slice(3, 8))]
        runs = []
        for batches in ([whole], halves):
            denom = t.denominator(batches)
            outs = [t.forward_backward(b, denom) for b in batches]
            runs.append((denom, sum(float(o.weighted_ce) for o in outs), grads_of(t.drafter)))
            t.optimizer.zero_grad(set_to_none=True)
        (d_whole, wce_whole, g_whole), (d_split, wce_split, g_split) = runs
        labels = int(t._blocks(whole).label_mask.sum())  # the addends of Σw and Σ w·CE
        assert labels > 0 and sum(b.tokens for b in halves) == whole.tokens
        assert_same_sum(d_split, d_whole, terms=labels)  # Σw: data only, summed per micro-batch
        assert wce_split == pytest.approx(wce_whole, rel=reduction_tol(labels))
        assert_same_grads(g_split, g_whole, terms=token_positions(t, [whole]))
    finally:
        t.close()


def test_warm_batches_cover_every_bucket_length_at_training_shapes(tmp_path, chat_file):
    """What dflash.engine.program's engine prewarm runs per replica (compilewatch.prewarm): one
    micro-batch per bucket length, at the configured batch size and anchor count."""
    t = Trainer.from_config(small_config(tmp_path, chat_file))
    try:
        batches = t.warm_batches()
        assert [b.input_ids.shape[1] for b in batches] == list(t.dataset.buckets)
        assert {tuple(b.anchors.shape) for b in batches} == {(t.cfg.data.batch_size, t.cfg.data.num_anchors)}
    finally:
        t.close()


def test_multi_turn_think_data_on_a_target_with_qwen3s_real_template_drops_nothing(tmp_path):
    """The issue's case: a random Qwen3 whose tokenizer carries Qwen3's real chat template, ShareGPT
    multi-turn records with <think> blocks. The old prefix check dropped every multi-turn record (96 of
    192); now all train (data.strict would refuse any skip), the last turn's think block included."""
    import random
    from pathlib import Path

    from transformers import Qwen3ForCausalLM

    from dflash.model.target import build_tiny_tokenizer, tiny_target_config, tiny_words
    from tests.dflash_helpers import write_jsonl

    tok = build_tiny_tokenizer()
    tok.chat_template = (Path(__file__).parent / "fixtures" / "chat_templates" / "qwen3.jinja").read_text()
    target_dir = tmp_path / "qwen3-real-template"
    Qwen3ForCausalLM(tiny_target_config(len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                        head_dim=8)).save_pretrained(target_dir)
    tok.save_pretrained(target_dir)
    rng, words = random.Random(0), tiny_words()

    def say(n):
        return " ".join(rng.choice(words) for _ in range(n))

    rows = []
    for i in range(192):
        turns = [{"from": "human", "value": say(5)}, {"from": "gpt", "value": f"<think>\n{say(6)}\n</think>\n\n{say(12)}"}]
        if i % 2:  # half multi-turn, as in the issue
            turns += [{"from": "human", "value": say(4)}, {"from": "gpt", "value": f"<think>\n{say(5)}\n</think>\n\n{say(10)}"}]
        rows.append({"conversations": turns})
    data = write_jsonl(tmp_path / "sharegpt.jsonl", rows)
    t = Trainer.from_config(small_config(tmp_path / "run", data, **{"target.path": str(target_dir), "data.strict": True,
                                                                  "train.max_steps": 1}))
    try:
        stats = t.dataset.stats
        assert stats.records == 192 and stats.kept == 192 and stats.dropped == {}
        sample = next(s for s in t.dataset.samples if (s.input_ids == tok.convert_tokens_to_ids("<|im_end|>")).sum() >= 4)
        trained = tok.convert_ids_to_tokens(sample.input_ids[sample.loss_mask].tolist())
        assert trained.count("<|im_end|>") == 2  # both answers end with their end-of-turn token
        assert trained.count("[UNK]") == 2  # only the last turn's <think> ... </think> (not in this vocabulary)
        assert t.train().steps == 1
    finally:
        t.close()


def test_open_metrics_is_the_trainers_log_in_the_directory_asked(tmp_path, chat_file):
    """The engine path (dflash/engine/program.py) opens a rank's metrics log through this public method."""
    t = Trainer.from_config(small_config(tmp_path / "run", chat_file))
    try:
        first = t.open_metrics(tmp_path / "rank1")
        assert first.path == tmp_path / "rank1" / "metrics.jsonl"
        second = t.open_metrics()  # replaces (and closes) the first
        assert first._fh.closed and second.path == t.run_dir / "metrics.jsonl"
        second.write_event("start", {"step": 0})
    finally:
        t.close()
    assert second._fh.closed
    assert [json.loads(line)["event"] for line in second.path.read_text().splitlines()] == ["start"]
