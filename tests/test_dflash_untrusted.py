"""Issue 18, dflash side: bad configs, data, run dirs and checkpoints exit 2 with a message; a crafted
training_state.pt never runs code (it is loaded with weights_only=True)."""

from __future__ import annotations

import os

import pytest
import torch

from cli.dflash_main import app
from compilewatch.errors import BadInput
from dflash.checkpoint import store as ckpt
from dflash.config import load_toml
from tests.cache_helpers import noise
from tests.dflash_helpers import chat_file, tiny_target  # noqa: F401 (fixtures)
from tests.helpers import invoke

COMMON = ["--set", "data.regenerate=false", "--set", "metrics.tensorboard=false", "--max-steps", "1"]


def _exit_2(args, *words):
    r = invoke(app, args)
    assert r.exit_code == 2, (r.exit_code, r.stdout, r.stderr)
    assert "Traceback" not in r.stderr
    for w in words:
        assert w in r.stderr, r.stderr
    return r


def test_train_config_that_does_not_exist_exits_2(tmp_path):
    _exit_2(["train", "--config", str(tmp_path / "nope.toml")], "nope.toml", "no such file")


def test_train_config_binary_or_huge_is_bad_input(tmp_path):
    (tmp_path / "bin.toml").write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(BadInput, match="not UTF-8"):
        load_toml(tmp_path / "bin.toml")
    with pytest.raises(BadInput, match="too large"):
        load_toml("/dev/zero")
    (tmp_path / "bad.toml").write_text("[train]\nmax_steps = [[[[1]]]]\n")
    with pytest.raises(BadInput, match="bad config"):
        load_toml(tmp_path / "bad.toml")


def test_train_data_binary_file_exits_2(tmp_path):
    data = tmp_path / "data.bin"
    data.write_bytes(noise(4096, seed=31))
    _exit_2(["train", "--data", str(data), "--out", str(tmp_path / "run"), *COMMON])


def test_train_out_an_existing_file_exits_2(tmp_path):
    out = tmp_path / "file"
    out.write_text("mine")
    _exit_2(["train", "--out", str(out), *COMMON], "not a directory")
    assert out.read_text() == "mine"


class _RunsCode:
    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_s5_crafted_training_state_never_runs_code(tmp_path):
    """S5: --resume of a training_state.pt that runs os.system when unpickled."""
    marker = tmp_path / "ran"
    (tmp_path / ckpt.STATE_FILE).write_bytes(b"")
    torch.save({"step": 1, "spec": {}, "model": {}, "optimizer": {}, "evil": _RunsCode(marker)},
               tmp_path / ckpt.STATE_FILE)
    with pytest.raises(BadInput, match="cannot read the training state"):
        ckpt.load_training_state(tmp_path)
    assert not marker.exists()


@pytest.mark.parametrize("content, words", [
    (b"garbage, not a torch file", "cannot read the training state"),
    (None, "'spec' missing"),
])
def test_resume_with_garbage_or_specless_training_state_is_bad_input(tmp_path, content, words):
    if content is None:
        torch.save({"step": 3, "model": {}, "optimizer": {}}, tmp_path / ckpt.STATE_FILE)
    else:
        (tmp_path / ckpt.STATE_FILE).write_bytes(content)
    with pytest.raises(BadInput, match=words):
        ckpt.load_training_state(tmp_path)


def test_training_state_with_a_bad_spec_is_bad_input(tmp_path):
    torch.save({"step": 3, "model": {}, "optimizer": {}, "spec": {"hidden_size": 1, "nonsense": 2}},
               tmp_path / ckpt.STATE_FILE)
    with pytest.raises(BadInput, match="not a drafter spec"):
        ckpt.load_training_state(tmp_path)


def test_cli_resume_with_a_garbage_training_state_exits_2(tmp_path, chat_file):
    from dflash.config import apply_overrides, tiny, to_toml

    run = tmp_path / "run"
    step = run / "checkpoints" / "step_000001"
    step.mkdir(parents=True)
    cfg = apply_overrides(tiny(), {"data.regenerate": "false", "metrics.tensorboard": "false", "checkpoint.out_dir": str(run)})
    (run / "config.toml").write_text(to_toml(cfg))
    (step / ckpt.STATE_FILE).write_bytes(b"PK\x03\x04 not a checkpoint")
    (run / "checkpoints" / "latest").write_text("step_000001\n")
    _exit_2(["train", "--out", str(run), "--resume", "--data", str(chat_file)], "cannot read the training state")


def test_export_with_damaged_weights_or_config_is_bad_input(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    (tmp_path / "model.safetensors").write_bytes(b"garbage")
    with pytest.raises(BadInput, match="invalid JSON"):
        ckpt.load_export(tmp_path)
    (tmp_path / "config.json").write_text('{"hidden_size": "big"}')
    with pytest.raises(BadInput, match="not a DFlash drafter config"):
        ckpt.load_export(tmp_path)
