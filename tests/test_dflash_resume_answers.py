"""What `dflash train --resume` answers before it loads anything: a finished run is done (exit 0, how to
extend it), a run that never started, a path that is no run, a config.toml that is not a file; and the
tiny recipe's dry run describes the tiny target."""

from __future__ import annotations

import json
import os

import pytest

from cli.dflash_main import app
from tests.dflash_helpers import chat_file, tiny_target  # noqa: F401 (fixtures)
from tests.helpers import invoke

COMMON = ["--set", "data.regenerate=false", "--set", "eval.at_end=false", "--set", "metrics.tensorboard=false"]


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory, chat_file):
    out = tmp_path_factory.mktemp("resume") / "run"
    r = invoke(app, ["train", "--out", str(out), "--data", str(chat_file), "--max-steps", "2",
                     "--set", "checkpoint.every=2", *COMMON, "--json"])
    assert r.exit_code == 0, r.stderr
    return out


def _no_trainer(monkeypatch):
    """Building a Trainer (target, data, regeneration) on this path is the bug: fail if it happens."""
    from dflash.training import trainer

    def refuse(*a, **k):
        raise AssertionError("--resume on a finished run built a Trainer")

    monkeypatch.setattr(trainer.Trainer, "from_config", classmethod(lambda cls, *a, **k: refuse()))


def test_resume_of_a_finished_run_says_so_at_once(finished_run, monkeypatch):
    _no_trainer(monkeypatch)
    r = invoke(app, ["train", "--out", str(finished_run), "--resume"])
    assert r.exit_code == 0, r.stderr
    assert f"run complete at step 2 (2 steps scheduled): nothing to resume in {finished_run}" in r.stdout
    assert "--resume --max-steps 4" in r.stderr and "no checkpoint was written" not in r.stdout + r.stderr
    data = json.loads(invoke(app, ["train", "--out", str(finished_run), "--resume", "--json"]).stdout)
    assert data == {"run_dir": str(finished_run), "step": 2, "total_steps": 2}


def test_resume_with_a_max_steps_at_or_below_the_step_is_still_complete(finished_run, monkeypatch):
    _no_trainer(monkeypatch)
    r = invoke(app, ["train", "--out", str(finished_run), "--resume", "--max-steps", "2"])
    assert r.exit_code == 0 and "run complete at step 2" in r.stdout, r.stderr


def test_resume_with_a_larger_max_steps_trains_on(finished_run, tmp_path):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    cfg = (run / "config.toml").read_text().replace(str(finished_run), str(run))
    (run / "config.toml").write_text(cfg)
    r = invoke(app, ["train", "--out", str(run), "--resume", "--max-steps", "3", "--json"])
    assert r.exit_code == 0, r.stderr
    assert json.loads(r.stdout)["steps"] == 3


def test_resume_of_a_run_that_never_started(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / ".lock").write_text("")  # what a run killed before it wrote config.toml leaves
    r = invoke(app, ["train", "--out", str(run), "--resume"])
    assert r.exit_code == 2
    assert "never started" in r.stderr and f"dflash train --out {run}" in r.stderr
    assert "point --out at the run directory" not in r.stderr


def test_resume_of_something_that_is_no_run(tmp_path):
    r = invoke(app, ["train", "--out", str(tmp_path / "nope"), "--resume"])
    assert r.exit_code == 2 and "does not exist" in r.stderr
    (tmp_path / "empty").mkdir()
    r = invoke(app, ["train", "--out", str(tmp_path / "empty"), "--resume"])
    assert r.exit_code == 2 and "is not a dflash run directory" in r.stderr


@pytest.mark.parametrize("kind", ["dev-zero", "fifo", "dir"])
def test_a_config_toml_that_is_not_a_file_is_named(tmp_path, kind):
    run = tmp_path / "run"
    run.mkdir()
    cfg = run / "config.toml"
    if kind == "dev-zero":
        cfg.symlink_to("/dev/zero")
    elif kind == "fifo":
        os.mkfifo(cfg)
    else:
        cfg.mkdir()
    r = invoke(app, ["train", "--out", str(run), "--resume"])
    assert r.exit_code == 2 and "not found" not in r.stderr
    assert ("is a directory" if kind == "dir" else "not a regular file") in r.stderr, r.stderr


def test_the_tiny_dry_run_describes_the_tiny_target():
    r = invoke(app, ["train", "--dry-run", "--json"])
    assert r.exit_code == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["target_source"] == "embedded:tiny (built in)" and d["target_hidden"] == 64 and d["target_layers"] == 6
    assert d["drafter_params"] < 1_000_000
