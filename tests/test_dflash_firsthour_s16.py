"""Session 16's first hour with dflash on a CPU, each finding pinned: what a new user following README.md and
docs/dflash.md with their own chat data ran into."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from cli.dflash_main import app
from tests.dflash_helpers import signal_after_first_checkpoint, write_word_chats
from tests.helpers import invoke

ROOT = Path(__file__).resolve().parents[1]
FAST = ["--set", "data.regenerate=false", "--set", "metrics.log_every=1", "--set", "eval.max_new_tokens=4",
        "--set", "eval.num_prompts=2"]


def _stop_at(monkeypatch, step: int):
    """Make `dflash train` see a Ctrl-C right after `step` (KeyboardInterrupt raised from its progress
    callback, in the training loop's thread: where SIGINT's handler raises it)."""
    import dflash

    real = dflash.train

    def train(cfg, **kw):
        inner = kw["on_event"]

        def on_event(kind, data):
            inner(kind, data)
            if kind == "step" and data["metrics"].step == step:
                raise KeyboardInterrupt

        return real(cfg, **{**kw, "on_event": on_event})

    monkeypatch.setattr(dflash, "train", train)
    return real


def test_ctrl_c_names_the_newest_checkpoint_and_the_resume_command(tmp_path, monkeypatch):
    """Ctrl-C used to print a bare `interrupted`: nothing on what was saved or how to go on."""
    import dflash

    data, out = write_word_chats(tmp_path / "chat.jsonl"), tmp_path / "run"
    real = _stop_at(monkeypatch, 3)
    args = ["train", "--data", str(data), "--out", str(out), "--max-steps", "6", "--set", "checkpoint.every=2", *FAST]
    r = invoke(app, args)
    assert r.exit_code == 130, r.stderr
    line = r.stderr.strip().splitlines()[-1]
    assert line == (f"interrupted at step 3 of 6: the newest checkpoint is {out}/checkpoints/step_000002 "
                    f"(1 step(s) behind); continue with `dflash train --out {out} --resume`"), r.stderr
    assert "Traceback" not in r.stderr and not (out / ".lock").exists()
    monkeypatch.setattr(dflash, "train", real)
    r = invoke(app, ["train", "--out", str(out), "--resume", "--json"])  # what the message says to run
    assert r.exit_code == 0, r.stderr
    assert json.loads(r.stdout)["steps"] == 6


def test_ctrl_c_before_the_first_checkpoint_says_nothing_is_saved(tmp_path, monkeypatch):
    data, out = write_word_chats(tmp_path / "chat.jsonl"), tmp_path / "run"
    _stop_at(monkeypatch, 1)
    r = invoke(app, ["train", "--data", str(data), "--out", str(out), "--max-steps", "6", *FAST])
    assert r.exit_code == 130
    assert r.stderr.strip().splitlines()[-1] == (
        f"interrupted at step 1 of 6, before the run's first checkpoint (checkpoint.every = 100): nothing in "
        f"{out} to resume from; run the command again to start over")


def test_the_library_raises_a_keyboard_interrupt_that_says_where_the_run_stands(tmp_path):
    """dflash.train from a program: still a KeyboardInterrupt, with the step and the newest checkpoint."""
    import dflash

    data = write_word_chats(tmp_path / "chat.jsonl")
    cfg = dflash.build_config("tiny", None, {"data.path": str(data), "data.regenerate": False, "train.max_steps": 4,
                                             "checkpoint.every": 2, "checkpoint.out_dir": str(tmp_path / "run"),
                                             "eval.at_end": False})

    def on_event(kind, d):
        if kind == "step" and d["metrics"].step == 4:
            raise KeyboardInterrupt  # after the last step, before its save: step 2 is the newest

    with pytest.raises(KeyboardInterrupt) as e:
        dflash.train(cfg, on_event=on_event)
    assert (e.value.step, e.value.total_steps, e.value.newest_step) == (4, 4, 2)
    assert "--resume" in e.value.message and str(e.value) == e.value.message


def test_sigint_from_another_process_stops_the_run_with_130_and_the_resume_command(tmp_path):
    """The real thing: `dflash train` in a process of its own, SIGINT sent once its first checkpoint is
    reported (read from its stderr: no sleeps), then `--resume` from that checkpoint."""
    code, text, out = signal_after_first_checkpoint(tmp_path, signal.SIGINT)
    assert code == 130, text
    last = text.strip().splitlines()[-1]
    assert last.startswith("interrupted at step ") and f"continue with `dflash train --out {out} --resume`" in last, text
    assert "Traceback" not in text
    r = invoke(app, ["train", "--out", str(out), "--resume", "--max-steps", "4", "--json"])
    assert r.exit_code == 0, r.stderr
    assert json.loads(r.stdout)["steps"] == 4


@pytest.fixture(scope="module")
def held_out_run(tmp_path_factory):
    """24 conversations, the last 2 prompts held out (eval.num_prompts = 2)."""
    base = tmp_path_factory.mktemp("heldout")
    data, out = write_word_chats(base / "chat.jsonl"), base / "run"
    r = invoke(app, ["train", "--data", str(data), "--out", str(out), "--max-steps", "2", *FAST])
    assert r.exit_code == 0, r.stderr
    return out


def test_eval_of_more_prompts_than_the_run_held_out_says_some_were_trained_on(held_out_run):
    """`dflash eval RUN -n 64` (the command `dflash train` suggests) decoded the data's last 64 prompts, all but
    the held-out ones trained on, or fewer when the data had fewer, and said nothing of either."""
    r = invoke(app, ["eval", str(held_out_run), "-n", "5", "--max-new-tokens", "4"])
    assert r.exit_code == 0, r.stderr
    assert ("note: 3 of these 5 prompt(s) were trained on: the run held out only its last 2 (eval.num_prompts), "
            "so τ measured on them is optimistic (-n 2 decodes only the held-out ones") in " ".join(r.stderr.split())
    r = invoke(app, ["eval", str(held_out_run), "-n", "64", "--max-new-tokens", "4"])
    assert "the run's data has 24 distinct prompt(s): decoding 24, not 64" in " ".join(r.stderr.split())
    r = invoke(app, ["eval", str(held_out_run), "-n", "2", "--max-new-tokens", "4"])
    assert r.exit_code == 0 and "trained on" not in r.stderr, r.stderr
    r = invoke(app, ["eval", str(held_out_run), "-n", "1", "--max-new-tokens", "4"])  # `1 prompts` before
    assert " rounds, 1 prompt\n" in r.stdout and "speculative decoding on 1 prompt\n" in r.stderr, (r.stdout, r.stderr)


def test_check_does_not_call_trained_prompts_held_out(held_out_run):
    r = invoke(app, ["check", str(held_out_run), "-n", "5", "--max-new-tokens", "4", "--json"])
    assert r.exit_code == 0, r.stderr
    rep = json.loads(r.stdout)
    assert any("3 of these 5 prompt(s) were trained on" in n for n in rep["notes"]), rep["notes"]
    assert rep["acceptance"]["source"].startswith("the run's eval prompts (") and "see the note" in rep["acceptance"]["source"]


def test_data_the_targets_tokenizer_does_not_cover_is_named_at_the_start(tmp_path):
    """English chats on the embedded tiny target (the docs' default, with one's own --data): every word is
    its word-level tokenizer's [UNK], so the drafter trained to predict [UNK], and nothing said so."""
    english = tmp_path / "english.jsonl"
    english.write_text("".join(json.dumps({"messages": [
        {"role": "user", "content": f"please tell me about item number {i} today"},
        {"role": "assistant", "content": "sure, here is a long and careful answer about that item " * 2}]}) + "\n"
        for i in range(12)))
    args = ["--max-steps", "1", "--set", "eval.at_end=false", *FAST]
    r = invoke(app, ["train", "--data", str(english), "--out", str(tmp_path / "en"), *args])
    assert r.exit_code == 0, r.stderr
    text = " ".join(r.stderr.split())
    assert "of the trained tokens" in text and "are the tokenizer's unknown token '[UNK]'" in text, text
    assert "--target DIR" in text
    p = invoke(app, ["prepare", str(english), "--set", "data.regenerate=false", "--json"])  # and before training
    assert p.exit_code == 0 and any("unknown token '[UNK]'" in n for n in json.loads(p.stdout)["notes"]), p.stdout
    words = write_word_chats(tmp_path / "words.jsonl")  # the tiny tokenizer's own words: nothing to say
    r = invoke(app, ["train", "--data", str(words), "--out", str(tmp_path / "w"), *args])
    assert r.exit_code == 0 and "unknown token" not in r.stderr, r.stderr


def test_train_suggests_the_runs_held_out_prompts_not_64_it_may_have_trained_on():
    from cli.dflash_next import next_steps

    def first(data: str) -> str:
        r = {"run_dir": "runs/a", "checkpoints": ["runs/a/checkpoints/step_000010"],
             "config": {"target": {"path": "embedded:tiny"}, "data": {"path": data}}}
        return next_steps(r)[0][0]

    assert first("/data/chat.jsonl") == "dflash eval runs/a"
    assert first("embedded:tiny-chat") == "dflash eval runs/a -n 64"  # its eval prompts are never trained on


@pytest.mark.parametrize("lines, why", [
    (['{"instruction": "a", "output": "b"}'], 'none of its 1 line(s) is a chat record: e.g. bad.jsonl:1: skipped '
                                             '(ValueError: expected a "messages" or a "conversations" key)'),
    (["", ""], "it holds no records"),
    (['{"messages": [{"role": "assistant", "content": "ba"}]}'],
     "none of its 1 conversation(s) has a user turn before its first assistant turn"),
])
@pytest.mark.parametrize("command", ["eval", "check"])
def test_eval_data_without_prompts_says_why(held_out_run, tmp_path, lines, why, command):
    """`dflash eval RUN --data alpaca.jsonl` said only `no prompts found in ...`, where training says what a
    line must be and what was wrong with the first."""
    bad = tmp_path / "bad.jsonl"
    bad.write_text("\n".join(lines) + "\n")
    r = invoke(app, [command, str(held_out_run), "--data", str(bad), "--max-new-tokens", "4"])
    assert r.exit_code == 2, r.stderr
    assert f"error: no prompts found in {str(bad)!r}: {why}" in " ".join(r.stderr.split()), r.stderr
    assert '{"messages": [...]}' in r.stderr and "Traceback" not in r.stderr


def test_regen_of_multi_turn_chats_counts_answers_not_conversations(tmp_path):
    """`· regenerating 2 answers` then a bar that ended at 3/3: the phase counted conversations, the bar answers."""
    chats = tmp_path / "multi.jsonl"
    turns = [{"role": "user", "content": "ba be"}, {"role": "assistant", "content": "bi"},
             {"role": "user", "content": "bo"}, {"role": "assistant", "content": "bu"}]
    chats.write_text(json.dumps({"messages": turns}) + "\n" + json.dumps({"messages": turns[:2]}) + "\n")
    r = invoke(app, ["regen", str(chats), str(tmp_path / "out.jsonl"), "--max-new-tokens", "3", "--device", "cpu"])
    assert r.exit_code == 0, r.stderr
    assert "· regenerating 3 answers in 2 conversations with the target" in r.stderr, r.stderr
    assert "started 0/3 " in r.stderr and "0/2 " not in r.stderr, r.stderr
    assert "regenerated 3 answers in 2 conversations" in r.stdout


def test_the_8b_recipes_default_data_path_missing_says_to_pass_data(tmp_path, monkeypatch):
    """`dflash train --recipe qwen3_8b` (README) without --data: `training data 'data/train.jsonl' is missing`,
    and no hint of what to pass."""
    monkeypatch.chdir(tmp_path)
    r = invoke(app, ["train", "--recipe", "qwen3_8b", "--out", "run"])
    assert r.exit_code == 2
    assert "error: training data 'data/train.jsonl' is missing (no such file)" in r.stderr
    assert "hint: pass --data FILE: chat JSONL" in r.stderr and not (tmp_path / "run").exists()


def test_prepare_keys_the_cache_as_train_does_with_periodic_evals_only(tmp_path):
    """`dflash prepare` held out no eval prompts when eval.at_end was off, where `dflash train` holds out
    eval.every_prompts for its periodic evals (the qwen3_8b recipe with the docs' `--set eval.every=500`): the
    prepared cache never hit, and train tokenized everything again."""
    data = write_word_chats(tmp_path / "chat.jsonl")
    sets = ["--set", "eval.at_end=false", "--set", "eval.every=2", "--set", "data.regenerate=false"]
    p = invoke(app, ["prepare", str(data), *sets, "--json"])
    assert p.exit_code == 0, p.stderr
    prepared = json.loads(p.stdout)
    assert prepared["eval_prompts"] == 4  # eval.every_prompts
    r = invoke(app, ["train", "--data", str(data), "--out", str(tmp_path / "run"), "--max-steps", "1", *sets])
    assert r.exit_code == 0, r.stderr
    assert f"note: data cache hit: {prepared['cache_dir']}" in " ".join(r.stderr.split()), r.stderr


def test_sigint_on_the_engine_says_where_it_saved_and_how_to_resume(tmp_path):
    """The multi-device engine (here on CPU threads) saves where Ctrl-C stopped it; it said `interrupted after N
    step(s); saved.` with no resume command."""
    data, out = write_word_chats(tmp_path / "chat.jsonl"), tmp_path / "run"
    env = {**os.environ, "COMPILEWATCH_PROGRESS_INTERVAL": "3600"}
    cmd = [sys.executable, "-m", "dflash", "train", "--target-devices", "cpu", "--drafter-devices", "cpu",
           "--data", str(data), "--out", str(out), "--max-steps", "100000", "--set", "checkpoint.every=2", *FAST]
    p = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        for line in p.stderr:
            if line.startswith("· checkpoint ") and "step_000002" in line:
                p.send_signal(signal.SIGINT)
                break
        stdout, stderr = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode == 130, stderr
    last = stderr.strip().splitlines()[-1]
    assert last.startswith("interrupted at step ") and f"saved {out}/checkpoints/step_" in last, stderr
    assert last.endswith(f"continue with `dflash train --out {out} --resume`") and "Traceback" not in stderr


def test_answers_under_another_role_are_named_with_what_to_rename(tmp_path):
    """Gemini-style `"role": "model"` answers: `no assistant turn` with the record's prompt only, and a hint about
    token counts; the roles the record has, and the one answers must have, say what to fix."""
    data = tmp_path / "model_role.jsonl"
    data.write_text("".join(json.dumps({"messages": [{"role": "user", "content": "ba be bi"},
                                                     {"role": "model", "content": "bo bu da de di do du fa"}]}) + "\n"
                            for _ in range(6)))
    r = invoke(app, ["train", "--data", str(data), "--out", str(tmp_path / "run"), *FAST])
    assert r.exit_code == 2
    err = " ".join(r.stderr.split())
    assert "(no assistant turn: 6); e.g. record 1 ('ba be bi', roles user, model))" in err, err
    assert 'hint: each line needs an answer: a turn with "role": "assistant"' in err
    assert not (tmp_path / "run").exists()


def test_ctrl_c_during_the_end_of_run_eval_says_the_final_checkpoint_is_saved(tmp_path, monkeypatch):
    import dflash

    data, out = write_word_chats(tmp_path / "chat.jsonl"), tmp_path / "run"
    real = dflash.train

    def train(cfg, **kw):
        inner = kw["on_event"]

        def on_event(kind, d):
            inner(kind, d)
            if kind == "phase" and d.get("name") == "eval":
                raise KeyboardInterrupt

        return real(cfg, **{**kw, "on_event": on_event})

    monkeypatch.setattr(dflash, "train", train)
    r = invoke(app, ["train", "--data", str(data), "--out", str(out), "--max-steps", "2", *FAST])
    assert r.exit_code == 130
    assert r.stderr.strip().splitlines()[-1] == (
        f"interrupted after the last step (2): the final checkpoint {out}/checkpoints/step_000002 is saved; the "
        f"end-of-run evaluation did not finish: `dflash eval {out}` measures it")


def test_a_metrics_jsonl_of_the_users_in_out_is_kept_not_cut(tmp_path):
    """`--out` a directory that holds a metrics.jsonl of one's own: its rows with a "step" past 0 were dropped
    (as a killed segment's), silently; config.toml beside it was already kept as a backup."""
    data, out = write_word_chats(tmp_path / "chat.jsonl"), tmp_path / "proj"
    out.mkdir()
    mine = '{"step": 5, "loss": 1.0, "experiment": "mine"}\n{"note": "kept"}\n'
    (out / "metrics.jsonl").write_text(mine)
    r = invoke(app, ["train", "--data", str(data), "--out", str(out), "--max-steps", "1", "--set", "eval.at_end=false",
                     *FAST])
    assert r.exit_code == 0, r.stderr
    (backup,) = out.glob("metrics.jsonl.bak-*")
    assert backup.read_text() == mine
    assert f"{out}/metrics.jsonl was already there (not this run's log): kept as {backup.name}" in \
        " ".join(r.stderr.split())
    assert "experiment" not in (out / "metrics.jsonl").read_text()


def test_a_restart_of_the_same_config_still_drops_its_killed_rows(tmp_path):
    """What the metrics.jsonl truncation is for: a run stopped before its first checkpoint, started again with
    the same command, keeps one row per step (no backup: the log is its own)."""
    data, out = write_word_chats(tmp_path / "chat.jsonl"), tmp_path / "run"
    args = ["train", "--data", str(data), "--out", str(out), "--max-steps", "2", "--set", "eval.at_end=false", *FAST]
    assert invoke(app, args).exit_code == 0
    import shutil

    shutil.rmtree(out / "checkpoints")  # as if killed before its first save
    r = invoke(app, args)
    assert r.exit_code == 0, r.stderr
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in rows if "event" not in x] == [1, 2] and not list(out.glob("*.bak-*"))


@pytest.mark.parametrize("command", ["eval", "check"])
def test_eval_of_a_run_whose_data_is_gone_says_where_its_prompts_come_from(tmp_path, command):
    """`dataset '...' does not exist`, hint `give a JSONL file ...`: nothing said that the run's eval prompts come
    from its training data, or that --data takes prompts of one's own."""
    data, out = write_word_chats(tmp_path / "chat.jsonl"), tmp_path / "run"
    r = invoke(app, ["train", "--data", str(data), "--out", str(out), "--max-steps", "1", "--set", "eval.at_end=false",
                     *FAST])
    assert r.exit_code == 0, r.stderr
    data.unlink()
    r = invoke(app, [command, str(out), "--max-new-tokens", "4"])
    assert r.exit_code == 2
    assert f"error: the run's training data {str(data)!r} is gone: its eval prompts are read from it" in r.stderr
    assert "--data FILE" in r.stderr and "Traceback" not in r.stderr
