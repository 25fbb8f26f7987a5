"""Session 15: `dflash train --resume` and the data it resumes on, red-teamed as a first-hour user.

- Data edited in place between a save and `--resume` (records reordered, added): the resume trained on
  silently (a new cache key, another epoch order, other held-out prompts; the checkpoint recorded the
  path only). Checkpoints now record the data's digest and counts; a resume compares them: the same
  data is silent, data edited under the same path is refused (exit 2) unless accepted for that resume
  (`data.accept_changed`), other data named on purpose (`--data`) is said; an older checkpoint says
  "not recorded".
- A conversation repeated in the data stayed in training while its last copy was held out as an eval
  prompt: eval prompts are now held out by content, and the repeats are counted.
- Config values of the wrong type: a TOML bool as a path (`cache_dir = false` made a directory named
  "False"), integral floats accepted from TOML but not from --set.
- A first hour of resumes: a config.toml edited into a bad value (the hint now names the checkpoint's
  copy), a drafter setting edited in it (blamed on the target's taps), the data file gone (no hint), a
  read-only data cache prepared elsewhere (refused though it held this very data).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from cli.dflash_main import app
from tests.dflash_helpers import write_jsonl, write_word_chats
from tests.helpers import invoke

COMMON = ["--set", "data.regenerate=false", "--set", "metrics.tensorboard=false", "--set", "eval.at_end=false",
          "--set", "checkpoint.every=2"]


def _train(out: Path, data: Path, *extra: str):
    return invoke(app, ["train", "--out", str(out), "--data", str(data), *COMMON, *extra])


def _resume(out: Path, *extra: str):
    return invoke(app, ["train", "--out", str(out), "--resume", *extra])


def _events(run: Path, kind: str) -> list[dict]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [r for r in rows if r.get("event") == kind]


def _flat(text: str) -> str:
    return " ".join(text.split())


@pytest.fixture
def run2(tmp_path):
    """A run of 2 steps (checkpoint step_000002) on 40 word chats; the data file's lines."""
    data = write_word_chats(tmp_path / "chat.jsonl", n=40)
    out = tmp_path / "run"
    r = _train(out, data, "--max-steps", "2")
    assert r.exit_code == 0, r.stderr
    return out, data, data.read_text().splitlines(keepends=True)


# ---------------------------------------------------------------- 1. data edited in place
def test_a_checkpoint_records_the_data_it_trained_on(run2):
    out, data, lines = run2
    man = json.loads((out / "checkpoints" / "step_000002" / "manifest.json").read_text())
    rec = man["data"]
    assert rec["path"] == str(data) and rec["records"] == 40 and rec["kept"] == 40
    assert rec["digest"].startswith("file:") and len(rec["digest"]) == len("file:") + 32


def test_data_reordered_in_place_is_refused_at_resume_and_nothing_is_lost(run2):
    """Before: exit 0, no word of it (a new cache key, another epoch order and other held-out prompts)."""
    out, data, lines = run2
    data.write_text("".join(reversed(lines)))
    ck = out / "checkpoints" / "step_000002"
    before = {p.name: p.read_bytes() for p in ck.iterdir()}
    metrics = (out / "metrics.jsonl").read_bytes()
    r = _resume(out, "--max-steps", "4")
    err = _flat(r.stderr)
    assert r.exit_code == 2 and "Traceback" not in r.stderr, r.stderr
    assert "changed  data since step_000002" in r.stderr and "edited in place" in err  # the summary line
    assert "the training data changed since step_000002 was saved" in err and "40 records then" in err
    assert "--set data.accept_changed=true" in err and "put back the data" in err
    assert {p.name: p.read_bytes() for p in ck.iterdir()} == before and (out / "metrics.jsonl").read_bytes() == metrics
    assert not (out / "checkpoints" / "step_000004").exists() and not (out / ".lock").exists()
    r = _resume(out, "--max-steps", "4")  # the lock was released: the same answer, not "in use"
    assert r.exit_code == 2 and "the training data changed" in _flat(r.stderr)


def test_accepting_the_edit_goes_on_for_that_resume_and_records_the_new_data(run2):
    out, data, lines = run2
    data.write_text("".join(lines) + lines[0])  # one record appended
    r = _resume(out, "--max-steps", "4", "--set", "data.accept_changed=true")
    assert r.exit_code == 0, r.stderr
    assert "changed  data since step_000002" in r.stderr
    [ev] = _events(out, "data_check")
    assert ev["status"] == "changed" and ev["accepted"] is True
    assert ev["saved"]["records"] == 40 and ev["now"]["records"] == 41 and ev["saved"]["digest"] != ev["now"]["digest"]
    assert json.loads((out / "checkpoints" / "step_000004" / "manifest.json").read_text())["data"]["records"] == 41
    assert "accept_changed = false" in (out / "config.toml").read_text()  # one resume's: asked again next time
    r = _resume(out, "--max-steps", "6")  # the data the checkpoint recorded: nothing said
    assert r.exit_code == 0, r.stderr
    assert "data since" not in r.stderr and len(_events(out, "data_check")) == 1
    data.write_text("".join(lines))  # edited again: asked again
    r = _resume(out, "--max-steps", "8")
    assert r.exit_code == 2 and "the training data changed since step_000006" in _flat(r.stderr)


def test_the_same_data_resumes_without_a_word_about_it(run2):
    out, data, lines = run2
    os.utime(data)  # touched, not changed: the contents decide
    r = _resume(out, "--max-steps", "4")
    assert r.exit_code == 0, r.stderr
    assert "data since" not in r.stderr and "not recorded" not in r.stderr and _events(out, "data_check") == []


def test_other_data_named_on_purpose_is_said_not_refused(run2, tmp_path):
    out, data, lines = run2
    other = write_word_chats(tmp_path / "other.jsonl", n=40, seed=9)
    r = _resume(out, "--max-steps", "4", "--data", str(other))
    assert r.exit_code == 0, r.stderr
    assert f"changed  data since step_000002: {str(other)!r}" in r.stderr and f"instead of {str(data)!r}" in r.stderr
    [ev] = _events(out, "data_check")
    assert ev["status"] == "replaced" and ev["now"]["path"] == str(other) and ev["saved"]["path"] == str(data)


def test_a_checkpoint_saved_before_the_record_resumes_and_says_not_recorded(run2):
    out, data, lines = run2
    path = out / "checkpoints" / "step_000002" / "manifest.json"
    man = json.loads(path.read_text())
    del man["data"]
    path.write_text(json.dumps(man))
    r = _resume(out, "--max-steps", "4")
    assert r.exit_code == 0, r.stderr
    assert "  data     not recorded in step_000002 (saved before dflash recorded" in r.stderr and "not compared" in r.stderr
    [ev] = _events(out, "data_check")
    assert ev["status"] == "not recorded" and ev["saved"] is None


@pytest.mark.parametrize("bad", [[], {"path": 5, "digest": "x", "records": 1, "kept": 1},
                                 {"path": "p", "digest": "file:ab", "records": -1, "kept": 1}, "x" * 10])
def test_a_data_record_that_does_not_read_is_not_recorded_not_a_crash(tmp_path, bad):
    from dflash.checkpoint import manifest

    (tmp_path / "f").write_text("x")
    manifest.record(tmp_path, ["f"], data={"path": "p", "digest": "file:ab", "records": 1, "kept": 1})
    assert manifest.read_data(tmp_path) == {"path": "p", "digest": "file:ab", "records": 1, "kept": 1}
    man = json.loads((tmp_path / "manifest.json").read_text())
    man["data"] = bad
    (tmp_path / "manifest.json").write_text(json.dumps(man))
    assert manifest.read_data(tmp_path) is None and manifest.check(tmp_path) is None


def test_retention_keeps_the_data_record_of_a_stripped_checkpoint(tmp_path):
    from dflash.checkpoint import manifest

    for name in ("config.json", "training_state.pt"):
        (tmp_path / name).write_text(name)
    rec = {"path": "/d.jsonl", "digest": "file:" + "a" * 32, "records": 3, "kept": 2}
    manifest.record(tmp_path, ["config.json", "training_state.pt"], data=rec)
    manifest.keep(tmp_path, ["config.json"])
    assert manifest.read_data(tmp_path) == rec and list(manifest.read(tmp_path)) == ["config.json"]


def test_the_data_is_hashed_once_for_the_check_and_the_cache_key(tmp_path, monkeypatch):
    from dflash.config import DataConfig
    from dflash.data import digest as cache

    data = write_word_chats(tmp_path / "chat.jsonl", n=5)
    calls = []
    real = cache.file_digest
    monkeypatch.setattr(cache, "file_digest", lambda p: calls.append(p) or real(p))
    cfg = DataConfig(path=str(data))
    first = cache.source_digest(cfg)
    assert cache.source_digest(cfg) == first and len(calls) == 1
    data.write_text(data.read_text() + data.read_text().splitlines(keepends=True)[0])
    assert cache.source_digest(cfg)[0] != first[0] and len(calls) == 2
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(OSError):  # never opened: it would wait for a writer
        cache.source_digest(DataConfig(path=str(fifo)))


# ---------------------------------------------------------------- 2. repeated records and the held-out prompts
def _chat(q: str, a: str = "bo ba bi be bu ba bo bi be bu ba bo bi") -> dict:
    return {"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}


def _leaky_file(tmp_path: Path) -> tuple[Path, list[dict]]:
    """30 distinct chats, then copies of the last 2 placed earlier (a shard appended twice, a retry)."""
    rows = [_chat(f"ba {i}") for i in range(30)]
    rows = rows[:5] + [rows[-1], rows[-2], rows[-1]] + rows[5:]
    return write_jsonl(tmp_path / "dup.jsonl", rows), rows


def test_held_out_eval_prompts_are_held_out_by_content(tmp_path):
    """Before: the last n records were cut off, and their copies earlier in the file were trained on."""
    from dflash.config import DataConfig
    from dflash.data.dataset import eval_prompts, hold_out_eval, load_conversations
    from dflash.data.holdout import prompt_of

    path, rows = _leaky_file(tmp_path)
    cfg = DataConfig(path=str(path))
    convs, _ = load_conversations(cfg)
    cut = hold_out_eval(cfg, convs, 4)
    prompts = [json.dumps(p) for p in cut.prompts]
    assert len(cut.prompts) == 4 and len(set(prompts)) == 4
    assert not any(json.dumps(prompt_of(c)) in prompts for c in cut.train)  # no eval prompt is trained on
    assert cut.held_out == 4 and cut.repeats_held_out == 3 and len(cut.train) == len(convs) - 7
    assert eval_prompts(cfg, 4) == cut.prompts  # `dflash eval RUN` decodes the prompts training held out


def test_repeats_of_eval_prompts_keep_none_in_training_when_the_last_records_repeat(tmp_path):
    from dflash.config import DataConfig
    from dflash.data.dataset import eval_prompts, hold_out_eval, load_conversations

    rows = [_chat(f"ba {i}") for i in range(20)] + [_chat("ba 19")] * 3  # the last record, 4 times
    cfg = DataConfig(path=str(write_jsonl(tmp_path / "d.jsonl", rows)))
    convs, _ = load_conversations(cfg)
    cut = hold_out_eval(cfg, convs, 3)
    assert [p[0]["content"] for p in cut.prompts] == ["ba 19", "ba 18", "ba 17"]  # distinct: not "ba 19" 3 times
    assert len(cut.train) == 23 - 6 and cut.repeats_held_out == 3
    assert [p[0]["content"] for p in eval_prompts(cfg, 3)] == ["ba 19", "ba 18", "ba 17"]


def test_prepare_says_how_many_repeats_it_found_built_or_from_the_cache(tmp_path):
    from dflash.config import DataConfig
    from dflash.data.cache import prepare
    from dflash.model.target import build_tiny_tokenizer

    path, rows = _leaky_file(tmp_path)
    tok = build_tiny_tokenizer()
    cfg = DataConfig(path=str(path), max_length=96, cache_dir=str(tmp_path / "cache"))
    built = prepare(cfg, tok, 8, n_eval=4)
    hit = prepare(cfg, tok, 8, n_eval=4)
    assert not built.hit and hit.hit and built.notes == hit.notes and built.records == hit.records == 33
    notes = " ".join(built.notes)
    assert "3 more conversation(s) begin with a held-out eval prompt" in notes
    assert "the training data repeats" not in notes  # every repeat was of a held-out prompt
    assert built.stats.kept == 33 - 7 and built.eval_held_out == 4
    more = write_jsonl(tmp_path / "more.jsonl", [*rows[:3], *rows])  # 3 training chats twice
    p = prepare(DataConfig(path=str(more), max_length=96, cache_dir="off"), tok, 8, n_eval=4)
    assert "the training data repeats 3 conversation(s) (3 extra copies)" in " ".join(p.notes)


# ---------------------------------------------------------------- 3. config values of the wrong type
@pytest.mark.parametrize("line, accepted", [
    ("[train]\nmax_steps = 3.0", 3), ("[train]\nmax_steps = 1e3", 1000), ("[train]\nmax_steps = 3.5", None),
    ("[train]\nmax_steps = 1e30", None), ("[train]\nmax_steps = true", None), ('[train]\nmax_steps = "3.5"', None),
])
def test_an_int_field_takes_a_whole_number_only(tmp_path, line, accepted):
    cfg = tmp_path / "c.toml"
    cfg.write_text(line + "\n")
    r = invoke(app, ["train", "--config", str(cfg), "--print-config"])
    if accepted is None:
        assert r.exit_code == 2 and "Traceback" not in r.stderr
        assert "bad config: train.max_steps: expected an integer" in r.stderr
    else:
        assert r.exit_code == 0 and f"max_steps = {accepted}\n" in r.stdout


@pytest.mark.parametrize("value, accepted", [("3.0", 3), ("1e3", 1000), ("1_000", 1000), ("3.5", None),
                                             ("1e30", None), ("true", None), ("nan", None)])
def test_set_takes_the_same_whole_numbers_as_toml(value, accepted):
    """Before: TOML's 3.0 was 3, --set's 3.0 was refused."""
    r = invoke(app, ["train", "--set", f"train.max_steps={value}", "--print-config"])
    if accepted is None:
        assert r.exit_code == 2 and "Traceback" not in r.stderr and "expected an integer" in r.stderr
    else:
        assert r.exit_code == 0 and f"max_steps = {accepted}\n" in r.stdout


@pytest.mark.parametrize("line", ["[data]\ncache_dir = false", '[data]\npath = ["a.jsonl", "b.jsonl"]',
                                  "[target]\npath = 1.5", "[data]\npath = {a = 1}"])
def test_a_string_field_refuses_a_toml_bool_number_or_table(tmp_path, monkeypatch, line):
    """Before: `cache_dir = false` was the string "False": a directory of that name, made in the current one."""
    monkeypatch.chdir(tmp_path)
    cfg = tmp_path / "c.toml"
    cfg.write_text(line + "\n")
    r = invoke(app, ["train", "--config", str(cfg), "--print-config"])
    assert r.exit_code == 2 and "Traceback" not in r.stderr and "expected a string (in quotes)" in r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.toml"]


def test_a_cache_dir_of_false_says_how_to_turn_the_cache_off():
    r = invoke(app, ["train", "--set", "data.cache_dir=false", "--print-config"])
    assert r.exit_code == 2 and '"off" (tokenize in memory)' in r.stderr


def test_an_integer_where_a_device_name_goes_is_that_device(tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text("[topology]\ndevice = 0\n")
    r = invoke(app, ["train", "--config", str(cfg), "--print-config"])
    assert r.exit_code == 0 and 'device = "cuda:0"' in r.stdout


# ---------------------------------------------------------------- 4. a first hour of resumes
def test_a_config_toml_edited_into_a_bad_value_says_where_a_good_one_is(run2):
    out, data, lines = run2
    cfg = out / "config.toml"
    cfg.write_text(cfg.read_text().replace("max_steps = 2", "max_steps = 3.5"))
    r = _resume(out)
    err = _flat(r.stderr)
    assert r.exit_code == 2 and "Traceback" not in r.stderr
    assert "config.toml: bad config: train.max_steps: expected an integer, got 3.5" in err
    assert f"cp {out / 'checkpoints' / 'step_000002' / 'train_config.toml'} {cfg}" in err  # was: see --print-config


def test_a_drafter_setting_edited_in_config_toml_is_named_not_blamed_on_the_target(run2):
    """Before: `does not match the target: taps [1, 3] vs [1, 2, 3]`, hint `use the target ... trained with`."""
    out, data, lines = run2
    cfg = out / "config.toml"
    text = cfg.read_text()
    head, _, rest = text.partition("[drafter]\n")
    cfg.write_text(head + "[drafter]\n" + rest.replace("num_layers = 2", "num_layers = 3", 1))
    r = _resume(out, "--max-steps", "4")
    err = _flat(r.stderr)
    assert r.exit_code == 2 and "Traceback" not in r.stderr
    assert "differs from this config's drafter (checkpoint vs config): num_hidden_layers 2 vs 3" in err
    assert "does not match the target" not in err and "changed  since the checkpoint's train_config.toml: " \
           "drafter.num_layers 2 -> 3" in r.stderr


def test_resume_with_the_data_file_gone_says_what_it_was_and_how_to_go_on(run2, tmp_path):
    """Before: `training data '...' is missing (no such file)`, no hint."""
    out, data, lines = run2
    moved = data.rename(tmp_path / "elsewhere.jsonl")
    r = _resume(out, "--max-steps", "4")
    err = _flat(r.stderr)
    assert r.exit_code == 2 and "Traceback" not in r.stderr and not (out / ".lock").exists()
    assert f"the training data {str(data)!r} is missing (no such file) (step_000002 recorded 40 records" in err
    assert "pass --data FILE: a copy of the same data resumes exactly" in err
    r = _resume(out, "--max-steps", "4", "--data", str(moved))  # the same contents elsewhere: exact, nothing to say
    assert r.exit_code == 0, r.stderr
    assert "data since" not in r.stderr and _events(out, "data_check") == []
    moved.unlink()
    r = _resume(out, "--max-steps", "4")  # a finished run says so, data or not
    assert r.exit_code == 0 and "run complete at step 4" in r.stdout


@pytest.fixture
def read_only(monkeypatch):
    """Make directories read-only to this process the way a non-root user sees them (the tests run as any
    user, root included, whom chmod does not stop): os.access says no to writing them."""
    real = os.access
    denied: list[Path] = []

    def access(path, mode, *a, **k):
        if mode & os.W_OK and any(Path(path).absolute() == d for d in denied):
            return False
        return real(path, mode, *a, **k)

    monkeypatch.setattr(os, "access", access)
    return lambda d: denied.append(Path(d).absolute())


def _tree(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): p.stat().st_mtime_ns for p in sorted(root.rglob("*"))}


def test_a_read_only_data_cache_prepared_elsewhere_is_read_not_refused(tmp_path, read_only):
    """Before: `cannot use the data cache directory ...: '...' is not writable` (exit 2) though it held this
    very data, tokenized by `dflash prepare` (a shared cache: prepared once, read by every user)."""
    data = write_word_chats(tmp_path / "chat.jsonl", n=40)
    shared = tmp_path / "shared"
    r = invoke(app, ["prepare", str(data), "--cache-dir", str(shared), "--set", "eval.at_end=false"])
    assert r.exit_code == 0, r.stderr
    before = _tree(shared)
    read_only(shared)
    out = tmp_path / "run"
    r = _train(out, data, "--max-steps", "2", "--set", f"data.cache_dir={shared}")
    assert r.exit_code == 0, r.stderr
    assert "data cache hit" in r.stderr and _tree(shared) == before  # read as it is: no lock file, nothing moved
    r = _train(tmp_path / "run2", data, "--max-steps", "2", "--set", f"data.cache_dir={shared}",
               "--set", "eval.at_end=true")  # 8 eval prompts held out: another key
    err = _flat(r.stderr)
    assert r.exit_code == 2 and "Traceback" not in r.stderr and not (tmp_path / "run2").exists()
    assert f"the data cache directory {str(shared)!r} is read-only here and holds no cache of this data" in err
    assert "the closest one there differs in the eval prompts held out (eval.num_prompts when eval.at_end): " \
           "0 there, 8 here" in err
    assert "run `dflash prepare` with this run's config where that directory is writable" in err
    [key] = [p for p in shared.iterdir() if not p.name.startswith(".")]
    (key / "index.npy").write_bytes(b"damaged")
    r = _train(tmp_path / "run3", data, "--max-steps", "2", "--set", f"data.cache_dir={shared}")
    assert r.exit_code == 2 and "Traceback" not in r.stderr and "its directory is read-only here" in _flat(r.stderr)
    assert key.exists()  # never moved aside in a directory that is not ours


def test_an_empty_read_only_data_cache_dir_is_still_refused_before_anything_runs(tmp_path, read_only):
    data = write_word_chats(tmp_path / "chat.jsonl", n=40)
    empty = tmp_path / "ro"
    empty.mkdir()
    read_only(empty)
    r = _train(tmp_path / "run", data, "--max-steps", "2", "--set", f"data.cache_dir={empty}")
    assert r.exit_code == 2 and f"{str(empty)!r} is not writable" in _flat(r.stderr)
