"""A run whose numbers go non-finite stops before any checkpoint or export carries them, on one device and
on the multi-device engine (where the stop happens inside the step barrier, so no replica steps its
optimizer), and `dflash check` fails an export whose weights are not finite."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from cli.dflash_main import app
from dflash.model.finite import nonfinite_parameters, nonfinite_tensors
from dflash.training.trainer import Trainer
from tests.dflash_helpers import write_word_chats
from tests.helpers import invoke

COMMON = ["--set", "data.regenerate=false", "--set", "metrics.tensorboard=false", "--set", "eval.at_end=false"]
ENGINE = ["--target-devices", "cpu", "--drafter-devices", "cpu,cpu"]


@pytest.fixture(scope="module")
def chats(tmp_path_factory):
    return write_word_chats(tmp_path_factory.mktemp("diverge") / "chat.jsonl")


def events(out):
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def saved_steps(out):
    return sorted(p.name for p in (out / "checkpoints").glob("step_*")) if (out / "checkpoints").is_dir() else []


def all_finite(ck):
    return not nonfinite_tensors(load_file(str(ck / "model.safetensors")).items())


def test_nonfinite_tensors_names_the_float_tensors_with_nan_or_inf_in_order():
    t = {"a": torch.ones(3), "b": torch.tensor([1.0, float("inf")]), "i": torch.tensor([1, 2]),
         "c": torch.tensor([float("nan")], dtype=torch.bfloat16), "e": torch.empty(0)}
    assert nonfinite_tensors(t.items()) == ["b", "c"]
    assert nonfinite_tensors([]) == []
    m = torch.nn.Linear(2, 2)
    assert nonfinite_parameters(m) == []
    with torch.no_grad():
        m.bias[1] = float("-inf")
    assert nonfinite_parameters(m) == ["bias"]


def test_the_engine_stops_a_diverging_run_with_exit_1_inside_the_step(tmp_path, chats):
    """It trained on with a nan loss, saved and exported nan weights, exited 0 and its own check passed them."""
    out = tmp_path / "run"
    r = invoke(app, ["train", *ENGINE, "--out", str(out), "--data", str(chats), *COMMON, "--max-steps", "4",
                     "--set", "optim.lr=1e30", "--set", "optim.warmup_ratio=0", "--set", "checkpoint.every=1"])
    err = " ".join(r.stderr.split())
    assert r.exit_code == 1 and "Traceback" not in r.stderr, r.stderr
    assert "training diverged at step 2: loss nan" in err and "the newest checkpoint is" in err, err
    assert saved_steps(out) == ["step_000001"] and all_finite(out / "checkpoints" / "step_000001")
    ev = events(out)
    div = [e for e in ev if e.get("event") == "diverged"]
    eng = [e for e in ev if e.get("event") == "engine"]
    assert [d["step"] for d in div] == [2] and eng[-1]["report"]["outcome"] == "failed"
    assert "training diverged" in eng[-1]["report"]["failure"]["error"]
    assert not (out / ".lock").exists()


@pytest.mark.parametrize("engine", [False, True], ids=["single", "engine"])
def test_weights_an_update_made_non_finite_are_never_saved(tmp_path, chats, monkeypatch, engine):
    """Step 2's loss and gradient norm are finite, but its update leaves an infinity in a weight (an overflow
    the loss cannot show yet): the save of step 2 refuses, the run stops with exit 1 and names step 1's."""
    real = Trainer.optimizer_step

    def overflowing(self, step):
        res = real(self, step)
        if step == 1:  # the second step (0-based)
            with torch.no_grad():
                next(self.drafter.parameters()).view(-1)[0] = float("inf")
        return res

    monkeypatch.setattr(Trainer, "optimizer_step", overflowing)
    out = tmp_path / "run"
    r = invoke(app, ["train", *(ENGINE if engine else []), "--out", str(out), "--data", str(chats), *COMMON,
                     "--max-steps", "4", "--set", "checkpoint.every=1"])
    err = " ".join(r.stderr.split())
    assert r.exit_code == 1 and "Traceback" not in r.stderr, r.stderr
    assert "training diverged at step 2: the update left non-finite values in 1 parameter(s)" in err, err
    assert saved_steps(out) == ["step_000001"] and all_finite(out / "checkpoints" / "step_000001")
    div = [e for e in events(out) if e.get("event") == "diverged"]
    assert len(div) == 1 and div[0]["step"] == 2 and len(div[0]["nonfinite_parameters"]) == 1


def test_dflash_check_fails_an_export_with_non_finite_weights(tmp_path, chats):
    out = tmp_path / "run"
    assert invoke(app, ["train", "--out", str(out), "--data", str(chats), *COMMON, "--max-steps", "2"]).exit_code == 0
    ck = out / "checkpoints" / "step_000002"
    good = invoke(app, ["check", str(ck), "--static"])
    assert good.exit_code == 0 and "weights: " in good.stdout and "every value finite" in good.stdout, good.stdout
    tensors = load_file(str(ck / "model.safetensors"))
    name = sorted(tensors)[0]
    tensors[name].view(-1)[0] = float("nan")
    save_file(tensors, str(ck / "model.safetensors"), metadata={"format": "pt"})
    (ck / "manifest.json").unlink()  # else the changed bytes are refused as damaged (exit 2) before any check
    r = invoke(app, ["check", str(ck)])
    text = " ".join(r.stdout.split())
    assert r.exit_code == 1 and f"weights: 1 of {len(tensors)} tensors hold NaN or infinite values ({name})" in text
    assert "acceptance: not measured" in text
    r = invoke(app, ["eval", str(ck), "-n", "2"])  # it measured τ 1.0 (a drafter that never drafts)
    assert r.exit_code == 2 and "weights hold NaN or infinite values" in " ".join(r.stderr.split()), r.stderr


def test_resuming_from_a_checkpoint_with_non_finite_weights_is_refused(tmp_path, chats, monkeypatch):
    """A checkpoint saved after the run diverged (an older dflash saved them): --resume trained on from NaN
    weights (every step nan). Made here by turning the checks off for the first run."""
    out = tmp_path / "run"
    with monkeypatch.context() as m:
        m.setattr(Trainer, "check_step", lambda self, metrics: None)
        m.setattr(Trainer, "check_weights", lambda self: None)
        r = invoke(app, ["train", "--out", str(out), "--data", str(chats), *COMMON, "--max-steps", "3",
                         "--set", "optim.lr=1e30", "--set", "optim.warmup_ratio=0", "--set", "checkpoint.every=1"])
    assert r.exit_code == 0 and not all_finite(out / "checkpoints" / "step_000003"), r.stderr
    r = invoke(app, ["train", "--out", str(out), "--resume", "--max-steps", "4"])
    err = " ".join(r.stderr.split())
    assert r.exit_code == 2 and "Traceback" not in r.stderr, r.stderr
    assert "holds non-finite weights" in err and "checkpoints/latest" in err, err
    assert not (out / "checkpoints" / "step_000004").exists() and not (out / ".lock").exists()
