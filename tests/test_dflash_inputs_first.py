"""Cheap checks before expensive work: a missing data file is said before the target loads (or
regenerates anything), and eval prompts that are also training prompts are said to be."""

from __future__ import annotations

import json

import pytest

from cli.dflash_main import app
from tests.dflash_helpers import tiny_target, write_word_chats  # noqa: F401 (fixtures)
from tests.helpers import invoke


@pytest.fixture
def no_target(monkeypatch):
    """Loading a target on these paths is the bug."""
    import dflash.model.target as target

    def refuse(*a, **k):
        raise AssertionError("the target was loaded before the inputs were checked")

    monkeypatch.setattr(target, "load_target", refuse)


def test_train_with_a_missing_data_file_fails_before_the_target_loads(tmp_path, no_target):
    r = invoke(app, ["train", "--data", str(tmp_path / "nope.jsonl"), "--out", str(tmp_path / "run")])
    assert r.exit_code == 2 and "is missing" in r.stderr and "nope.jsonl" in r.stderr
    assert "dflash train: recipe" not in r.stderr  # not even the summary: nothing was started
    assert not (tmp_path / "run").exists()


def test_train_with_a_directory_as_data_is_named(tmp_path, no_target):
    r = invoke(app, ["train", "--data", str(tmp_path), "--out", str(tmp_path / "run")])
    assert r.exit_code == 2 and "is a directory" in r.stderr


def test_regen_with_a_missing_input_fails_before_the_target_loads(tmp_path, monkeypatch):
    import dflash.data.regen as regen

    monkeypatch.setattr(regen, "load_target", lambda *a, **k: pytest.fail("target loaded first"), raising=False)
    import dflash.model.target as target

    monkeypatch.setattr(target, "load_target", lambda *a, **k: pytest.fail("target loaded first"))
    r = invoke(app, ["regen", str(tmp_path / "missing.jsonl"), str(tmp_path / "out.jsonl")])
    assert r.exit_code == 2 and "missing.jsonl" in r.stderr and "[progress]" not in r.stderr
    assert not (tmp_path / "out.jsonl").exists()


def test_prepare_says_when_eval_prompts_are_training_prompts(tmp_path):
    data = write_word_chats(tmp_path / "few.jsonl", n=13)
    r = invoke(app, ["prepare", str(data), "--cache-dir", str(tmp_path / "cache"), "--json"])
    assert r.exit_code == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["eval_prompts"] == 8 and d["eval_held_out"] == 0
    assert any("eval prompts are training prompts too" in n for n in d["notes"])
    text = invoke(app, ["prepare", str(data), "--cache-dir", str(tmp_path / "cache")])  # a cache hit: the same answer
    assert "8 eval prompts, not held out (too few records)" in text.stdout
    many = write_word_chats(tmp_path / "many.jsonl", n=40)
    d = json.loads(invoke(app, ["prepare", str(many), "--cache-dir", str(tmp_path / "cache"), "--json"]).stdout)
    assert d["eval_held_out"] == 8 and not any("training prompts too" in n for n in d["notes"])
