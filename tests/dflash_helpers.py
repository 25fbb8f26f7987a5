"""Shared pieces for the dflash tests: a small regenerated chat file, a local HF target dir, configs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dflash.config import Config, apply_overrides, tiny

SMALL_CONVS = 64  # conversations in the shared test dataset


@pytest.fixture(scope="session")
def tiny_target():
    """The embedded tiny target on CPU (built once per session), run with one torch thread like the
    tiny recipe (train.cpu_threads=1): two spinning threads on a busy 2-core machine are ~10x slower."""
    from dflash.model.target import load_target

    cfg = tiny()
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield load_target(cfg.target, cfg.drafter.num_layers, torch.device("cpu"))
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def chat_file(tmp_path_factory, tiny_target) -> Path:
    """64 embedded prompts answered by the tiny target (what `dflash regen` makes), as chat JSONL."""
    from dflash.data.dataset import embedded_prompts
    from dflash.data.regen import regenerate, write_jsonl

    convs, _ = regenerate(embedded_prompts(SMALL_CONVS, seed=7), tiny_target, max_new_tokens=40, batch_size=64)
    path = tmp_path_factory.mktemp("data") / "chat.jsonl"
    write_jsonl(convs, path)
    return path


@pytest.fixture(scope="session")
def local_target_dir(tmp_path_factory) -> Path:
    """A Hugging Face model directory (hidden 32, 4 layers) with the tiny tokenizer: a 'real' local target."""
    from transformers import Qwen3ForCausalLM

    from dflash.model.target import build_tiny_tokenizer, tiny_target_config

    tok = build_tiny_tokenizer()
    cfg = tiny_target_config(len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=4, head_dim=8)
    torch.manual_seed(5)
    model = Qwen3ForCausalLM(cfg)
    path = tmp_path_factory.mktemp("target") / "qwen3-mini"
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def small_config(out_dir: Path, data: Path, **overrides) -> Config:
    """tiny() on the shared data file: few steps, no regeneration, no end-of-run eval."""
    base = {
        "data.path": str(data), "data.regenerate": False, "train.max_steps": 6, "checkpoint.every": 3,
        "checkpoint.out_dir": str(out_dir), "metrics.log_every": 1, "metrics.tensorboard": False,
        "eval.at_end": False,
    }
    return apply_overrides(tiny(), {**base, **overrides})


def record_losses():
    """An on_event callback that records (step, loss), and the list it fills."""
    losses: list[tuple[int, float]] = []

    def on_event(kind, data):
        if kind == "step":
            losses.append((data["metrics"].step, data["metrics"].loss))

    return on_event, losses


def write_jsonl(path: Path, rows) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


__all__ = ["tiny_target", "chat_file", "local_target_dir", "small_config", "record_losses", "write_jsonl"]


def write_word_chats(path: Path, n: int = 24, seed: int = 3) -> Path:
    """`n` conversations made of the tiny tokenizer's words (no regeneration: fast)."""
    import random

    from dflash.model.target import tiny_words

    words = tiny_words()
    rng = random.Random(seed)
    with open(path, "w") as fh:
        for _ in range(n):
            q = " ".join(rng.choice(words) for _ in range(rng.randint(4, 10)))
            a = " ".join(rng.choice(words) for _ in range(rng.randint(20, 60)))
            fh.write(json.dumps({"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}) + "\n")
    return path


def token_positions(trainer, batches) -> int:
    """Context plus block positions in `batches`: how many token terms a drafter weight's gradient
    sums over (the reduction size for tests/numerics.py's float32 bounds)."""
    return sum(b.input_ids.numel() + trainer._blocks(b).ids.numel() for b in batches)


def signal_after_first_checkpoint(tmp_path: Path, sig: int) -> tuple[int, str, Path]:
    """`dflash train` in a process of its own (checkpoint.every=2, no end eval), `sig` sent once its first
    checkpoint is reported (read from its stderr: no sleeps). Returns (exit code, stderr, run dir)."""
    import os
    import signal
    import subprocess
    import sys

    data, out = write_word_chats(tmp_path / "chat.jsonl"), tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    env["COMPILEWATCH_PROGRESS_INTERVAL"] = "3600"
    cmd = [sys.executable, "-m", "dflash", "train", "--data", str(data), "--out", str(out), "--max-steps", "100000",
           "--set", "checkpoint.every=2", "--set", "eval.at_end=false", "--set", "data.regenerate=false",
           "--set", "metrics.log_every=1", "--set", "eval.max_new_tokens=4", "--set", "eval.num_prompts=2"]

    def defaults() -> None:  # what a shell gives a foreground job
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)

    p = subprocess.Popen(cmd, cwd=Path(__file__).resolve().parents[1], env=env, stdout=subprocess.DEVNULL,
                         stderr=subprocess.PIPE, text=True, preexec_fn=defaults)
    lines = []
    try:
        for line in p.stderr:
            lines.append(line)
            if line.startswith("· checkpoint ") and "step_000002" in line:
                p.send_signal(sig)
                break
        lines += p.stderr.readlines()
        code = p.wait(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    return code, "".join(lines), out
