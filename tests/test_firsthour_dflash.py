"""A new user's first hour with `dflash`, red-teamed: data files as editors and other tools write them
(a UTF-8 BOM, turns that are not strings, JSON that is no chat), a data cache path that is a file, a
regen output that cannot be written or is the input, a learning rate that makes the loss non-finite.
Each was a traceback, silent garbage or lost work; each is now a clear message with its exit code."""

from __future__ import annotations

import codecs
import json
import shutil

import pytest

from cli.dflash_main import app
from dflash.data.dataset import normalize_record, read_jsonl
from tests.dflash_helpers import (chat_file, local_target_dir, tiny_target, write_jsonl,  # noqa: F401 (fixtures)
                                 write_word_chats)
from tests.helpers import invoke

COMMON = ["--set", "data.regenerate=false", "--set", "metrics.tensorboard=false", "--set", "eval.at_end=false"]
CHAT = {"messages": [{"role": "user", "content": "ba be"}, {"role": "assistant", "content": "bi bo ba be bi bo ba"}]}


def test_a_leading_utf8_bom_keeps_the_first_record(tmp_path):
    """Notepad and PowerShell write a BOM: json.loads refused the first line, which was skipped."""
    path = tmp_path / "bom.jsonl"
    path.write_bytes(codecs.BOM_UTF8 + (json.dumps(CHAT) + "\r\n" + json.dumps(CHAT) + "\r\n").encode())
    convs, warnings = read_jsonl(path)
    assert warnings == [] and len(convs) == 2 and convs[0] == CHAT["messages"]


@pytest.mark.parametrize("rec, got", [
    ({"messages": [{"role": "user", "content": "ba"}, {"role": "assistant", "content": None}]}, "got null"),
    ({"messages": [{"role": "user", "content": 5}, {"role": "assistant", "content": "bo"}]}, "got a number"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "ba"}]},
                   {"role": "assistant", "content": "bo"}]}, "got a list"),
    ({"messages": [{"role": 1, "content": "ba"}, {"role": "assistant", "content": "bo"}]}, '"role" must be a string'),
    ({"conversations": [{"from": "human", "value": "ba"}, {"from": "gpt", "value": {"x": 1}}]}, "got an object"),
])
def test_turns_that_are_not_strings_are_skipped_not_trained_as_their_repr(rec, got):
    """str() made None the answer 'None' and OpenAI-style content parts their Python repr: trained on."""
    with pytest.raises(ValueError, match="must be a string") as e:
        normalize_record(rec)
    assert got in str(e.value)


def test_data_that_is_no_chat_says_why_and_what_a_line_must_be(tmp_path):
    data = write_jsonl(tmp_path / "lists.jsonl", ["[1, 2, 3]", '{"messages": "hello"}'])
    out = tmp_path / "run"
    r = invoke(app, ["train", "--out", str(out), "--data", str(data), *COMMON])
    err = " ".join(r.stderr.split())
    assert r.exit_code == 2 and "Traceback" not in r.stderr and not out.exists()
    assert "no usable conversation" in err and "a line must be a JSON object" in err  # the first line's reason
    assert 'each line must be one JSON object: {"messages": [' in err


def test_a_data_cache_dir_that_is_a_file_is_bad_input_before_anything_runs(tmp_path):
    data = write_word_chats(tmp_path / "chat.jsonl")
    afile = tmp_path / "afile"
    afile.write_text("mine\n")
    r = invoke(app, ["prepare", str(data), "--cache-dir", str(afile)])  # was a FileExistsError traceback, exit 1
    assert r.exit_code == 2 and "Traceback" not in r.stderr
    assert f"cannot use the data cache directory {str(afile)!r}: it is not a directory" in " ".join(r.stderr.split())
    out = tmp_path / "run"
    r = invoke(app, ["train", "--out", str(out), "--data", str(data), *COMMON, "--set",
                     f"data.cache_dir={afile / 'sub'}"])
    assert r.exit_code == 2 and f"{str(afile)!r} is not a directory" in " ".join(r.stderr.split())
    assert not out.exists() and afile.read_text() == "mine\n"


def test_regen_checks_its_output_before_the_target_loads_and_never_overwrites_its_input(tmp_path, monkeypatch):
    import dflash.model.target as target_mod

    def no_target(*a, **k):
        raise AssertionError("the target was loaded before the output was checked")

    monkeypatch.setattr(target_mod, "load_target", no_target)
    src = write_jsonl(tmp_path / "in.jsonl", [CHAT])
    before = src.read_bytes()
    r = invoke(app, ["regen", str(src), str(src), "--max-new-tokens", "4"])  # was: regenerated in place, exit 0
    assert r.exit_code == 2 and "is the INPUT file" in r.stderr and "in.regen.jsonl" in r.stderr
    assert src.read_bytes() == before
    outdir = tmp_path / "adir"
    outdir.mkdir()
    r = invoke(app, ["regen", str(src), str(outdir), "--max-new-tokens", "4"])  # was: after the whole generation
    assert r.exit_code == 2 and "it is a directory" in r.stderr and "Traceback" not in r.stderr


def test_a_diverging_run_stops_with_exit_1_and_saves_no_non_finite_weights(tmp_path):
    """lr 1e30: step 1's update makes the weights non-finite, step 2's loss is nan. The run used to go on,
    exit 0, 'trained', and export nan weights that `dflash check` passed."""
    data = write_word_chats(tmp_path / "chat.jsonl")
    out = tmp_path / "run"
    r = invoke(app, ["train", "--out", str(out), "--data", str(data), *COMMON, "--max-steps", "4",
                     "--set", "optim.lr=1e30", "--set", "optim.warmup_ratio=0", "--set", "checkpoint.every=100"])
    err = " ".join(r.stderr.split())
    assert r.exit_code == 1 and "Traceback" not in r.stderr, r.stderr
    assert "training diverged at step 2: loss nan" in err and "no checkpoint of this run is on disk" in err
    assert not any((out / "checkpoints").glob("step_*"))
    events = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert events[-1]["event"] == "diverged" and events[-1]["step"] == 2
    assert not (out / ".lock").exists()  # the run directory is released: the next run there just works


@pytest.fixture
def small_run(tmp_path):
    """A finished 4-step run (checkpoints at steps 3 and 4) on word chats."""
    data = write_word_chats(tmp_path / "chat.jsonl")
    out = tmp_path / "run"
    r = invoke(app, ["train", "--out", str(out), "--data", str(data), *COMMON, "--max-steps", "4",
                     "--set", "checkpoint.every=3"])
    assert r.exit_code == 0, r.stderr
    return out


def test_resume_refuses_a_config_or_recipe_it_would_ignore(small_run):
    """--resume reads the run's config.toml: a --config or --recipe given with it was silently dropped."""
    other = small_run.parent / "other.toml"
    other.write_text("[optim]\nlr = 1e-5\n")
    for flags in (["--config", str(other)], ["--recipe", "qwen3_8b"]):
        r = invoke(app, ["train", "--out", str(small_run), "--resume", "--max-steps", "5", *flags])
        assert r.exit_code == 2 and "does not go with --resume" in r.stderr and "--set" in r.stderr, r.stderr
    assert not (small_run / "checkpoints" / "step_000005").exists()


def test_resume_without_config_toml_names_the_checkpoint_copy(small_run):
    """It said the run 'never started' and to start it again, which then refused: it holds checkpoints."""
    (small_run / "config.toml").unlink()
    r = invoke(app, ["train", "--out", str(small_run), "--resume", "--max-steps", "5"])
    err = " ".join(r.stderr.split())
    assert r.exit_code == 2 and "has checkpoints but no config.toml" in err and "never started" not in err
    assert f"cp {small_run / 'checkpoints' / 'step_000004' / 'train_config.toml'} {small_run / 'config.toml'}" in err


def test_a_run_resumed_from_an_older_checkpoint_keeps_it_over_the_newer_timeline(small_run):
    """The hints say: write an older checkpoint's name into checkpoints/latest to resume from it. The next
    save then pruned that very checkpoint (keep_last 2 counted the abandoned newer one): now the newer
    timeline's checkpoints are neither counted nor removed."""
    ckdir = small_run / "checkpoints"
    (ckdir / "latest").write_text("step_000003\n")
    r = invoke(app, ["train", "--out", str(small_run), "--resume", "--max-steps", "5"])
    assert r.exit_code == 0, r.stderr
    assert {p.name for p in ckdir.glob("step_*")} == {"step_000003", "step_000004", "step_000005"}
    assert (ckdir / "latest").read_text().strip() == "step_000005"


@pytest.mark.parametrize("edit, message", [
    ({"special_tokens": 5}, "dflash_training.tokenizer.special_tokens: expected a list of strings, got 5"),
    ({"chat_template": 5}, "dflash_training.tokenizer.chat_template: expected an object or null, got 5"),
    ({"chat_template": {"thinking": []}}, "tokenizer.chat_template.thinking: expected an object or null, got []"),
])
def test_check_of_an_export_with_a_malformed_training_record_is_bad_input(small_run, edit, message):
    """config.json's dflash_training record is read from a file from elsewhere: a wrong type was a
    TypeError/AttributeError traceback (exit 1) in the tokenizer checks."""
    ck = small_run / "checkpoints" / "step_000004"
    cfg = json.loads((ck / "config.json").read_text())
    cfg["dflash_training"]["tokenizer"].update(edit)
    (ck / "config.json").write_text(json.dumps(cfg))
    (ck / "manifest.json").unlink()  # an export copied without its manifest: nothing flags the edit first
    r = invoke(app, ["check", str(ck), "--static", "--target", "embedded:tiny"])
    assert r.exit_code == 2 and "Traceback" not in r.stderr, r.stderr
    assert message in " ".join(r.stderr.split()) and "restore it from the checkpoint" in r.stderr


def test_a_new_run_in_a_directory_with_its_own_config_toml_keeps_it(tmp_path):
    """`dflash train --out .` in a project holding a config.toml overwrote it without a trace."""
    data = write_word_chats(tmp_path / "chat.jsonl")
    out = tmp_path / "project"
    out.mkdir()
    (out / "config.toml").write_text("# my own config\n")
    r = invoke(app, ["train", "--out", str(out), "--data", str(data), *COMMON, "--max-steps", "1"])
    assert r.exit_code == 0, r.stderr
    kept = list(out.glob("config.toml.bak-*"))
    assert len(kept) == 1 and kept[0].read_text() == "# my own config\n" and f"kept as {kept[0].name}" in r.stderr
    assert (out / "config.toml").read_text().startswith('recipe = "tiny"')
    # a restart of a run killed before its first checkpoint (the same config) makes no backup of it
    for p in [*out.glob("checkpoints"), kept[0]]:
        shutil.rmtree(p) if p.is_dir() else p.unlink()
    r = invoke(app, ["train", "--out", str(out), "--data", str(data), *COMMON, "--max-steps", "1"])
    assert r.exit_code == 0 and not list(out.glob("config.toml.bak-*")), r.stderr


def test_check_names_a_block_size_edited_in_config_json(small_run):
    """The record keeps the block size as trained, but `dflash check` never compared it: config.json's
    block_size edited from 8 to 4 still said 'serves as trained' (exit 0)."""
    ck = small_run / "checkpoints" / "step_000004"
    cfg = json.loads((ck / "config.json").read_text())
    cfg["block_size"] = 4
    (ck / "config.json").write_text(json.dumps(cfg))
    (ck / "manifest.json").unlink()
    r = invoke(app, ["check", str(ck), "--static", "--target", "embedded:tiny"])
    out = " ".join(r.stdout.split())
    assert r.exit_code == 1 and "FAIL block_size (config.json vs training): config.json says 4" in out, r.stdout


@pytest.mark.parametrize("field, value", [("eval_prompts", ["abc", 5]), ("stats.dropped", "x")])
def test_a_data_cache_manifest_with_bad_prompts_or_stats_is_moved_aside_and_rebuilt(tmp_path, field, value):
    """A shared cache dir is data from elsewhere: eval_prompts of the wrong shape reached the chat template
    at the end-of-run eval (a TypeError traceback after the whole training); stats of the wrong type the
    skip summary."""
    data = write_word_chats(tmp_path / "chat.jsonl")
    cache = tmp_path / "cache"
    r = invoke(app, ["prepare", str(data), "--cache-dir", str(cache), "--json"])
    assert r.exit_code == 0, r.stderr
    key_dir = json.loads(r.stdout)["cache_dir"]
    man_path = tmp_path / "cache" / key_dir.rsplit("/", 1)[1] / "manifest.json"
    man = json.loads(man_path.read_text())
    *parents, last = field.split(".")
    holder = man
    for p in parents:
        holder = holder[p]
    holder[last] = value
    man_path.write_text(json.dumps(man))
    r = invoke(app, ["prepare", str(data), "--cache-dir", str(cache), "--json"])
    assert r.exit_code == 0 and "Traceback" not in r.stderr, r.stderr
    out = json.loads(r.stdout)
    assert out["hit"] is False and any("was unusable" in n and "moved to" in n for n in out["notes"]), out["notes"]
    assert len(list(cache.glob("*.corrupt-*"))) == 1


def test_resume_reads_past_damaged_metrics_rows_and_refuses_a_metrics_directory(small_run):
    """A metrics.jsonl with bytes that are not UTF-8 (a damaged disk or copy) was a UnicodeDecodeError
    traceback at --resume; a directory in its place an IsADirectoryError one."""
    metrics = small_run / "metrics.jsonl"
    with open(metrics, "ab") as fh:
        fh.write(b'\xff\xfe{"step": 3, "loss": 1}\n' + b"x" * (2 << 20) + b"\n")
    r = invoke(app, ["train", "--out", str(small_run), "--resume", "--max-steps", "5"])
    assert r.exit_code == 0 and "Traceback" not in r.stderr, r.stderr
    rows = metrics.read_bytes().splitlines()
    assert all(b"\xff" not in x and len(x) < 1 << 20 for x in rows)  # the damaged lines were dropped
    assert [json.loads(x)["step"] for x in rows if b'"event"' not in x] == [1, 4, 5]  # first, last, resumed
    metrics.unlink()
    metrics.mkdir()
    r = invoke(app, ["train", "--out", str(small_run), "--resume", "--max-steps", "6"])
    assert r.exit_code == 2 and "metrics.jsonl' is a directory" in r.stderr and "Traceback" not in r.stderr
    assert not (small_run / ".lock").exists()


def test_a_json_array_dataset_is_named_as_such_with_the_conversion(tmp_path):
    """ShareGPT dumps often come as one pretty-printed JSON array: every line was 'unreadable' with no
    word on why."""
    data = tmp_path / "sharegpt.json"
    data.write_text(json.dumps([CHAT, CHAT], indent=2))
    out = tmp_path / "run"
    r = invoke(app, ["train", "--out", str(out), "--data", str(data), *COMMON])
    err = " ".join(r.stderr.split())
    assert r.exit_code == 2 and "the file is one JSON array, not JSON Lines" in err and not out.exists()


def test_prepare_of_the_embedded_prompts_does_not_hint_at_a_setting_it_turns_off():
    """The hint was `set data.regenerate=true`, which `dflash prepare` overrides to false."""
    r = invoke(app, ["prepare", "embedded:tiny-chat", "--set", "data.regenerate=true"])
    assert r.exit_code == 2 and "does not regenerate" in r.stderr and "data.regenerate=true" not in r.stderr


def test_prepare_prints_a_train_command_that_pastes_back_with_spaces_in_paths(tmp_path):
    """'train with the same config: dflash train --data my dir/chat.jsonl ...' split at the spaces."""
    import shlex

    (tmp_path / "my dir").mkdir()
    data = write_word_chats(tmp_path / "my dir" / "chat data.jsonl")
    cache = tmp_path / "my cache"
    r = invoke(app, ["prepare", str(data), "--cache-dir", str(cache), "--set", "data.max_length=96", "--json"])
    assert r.exit_code == 0, r.stderr
    argv = shlex.split(json.loads(r.stdout)["train_with"])
    assert argv[:4] == ["dflash", "train", "--data", str(data)] and f"data.cache_dir={cache}" in argv
    assert "data.max_length=96" in argv and "data.regenerate=false" in argv


@pytest.mark.parametrize("config_json, says", [
    ("{bad", "is not a valid JSON file"),
    ('{"model_type": "qwen3", "num_hidden_layers": "x"}', "num_hidden_layers"),
])
@pytest.mark.parametrize("mode", [["--dry-run"], ["--max-steps", "1"]])
def test_a_target_with_a_broken_config_json_is_bad_input_naming_it(tmp_path, local_target_dir, config_json, says, mode):
    """--dry-run read config.json through AutoConfig unguarded (OSError/ValueError tracebacks), and a
    field of the wrong type was huggingface_hub's StrictDataclassFieldValidationError traceback in both;
    a config.json that is not JSON was blamed on the tokenizer files."""
    target = tmp_path / "target"
    shutil.copytree(local_target_dir, target)
    (target / "config.json").write_text(config_json)
    r = invoke(app, ["train", "--target", str(target), "--out", str(tmp_path / "run"), *COMMON, *mode])
    err = " ".join(r.stderr.split())
    assert r.exit_code == 2 and "Traceback" not in r.stderr, r.stderr
    assert "the target's config.json in" in err and says in err and "restore the model directory's config.json" in err


def test_a_target_without_tokenizer_files_still_names_the_tokenizer(tmp_path, local_target_dir):
    target = tmp_path / "target"
    shutil.copytree(local_target_dir, target)
    for f in target.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "vocab", "merges", "chat_template")):
            f.unlink()
    r = invoke(app, ["train", "--target", str(target), "--out", str(tmp_path / "run"), *COMMON, "--max-steps", "1"])
    assert r.exit_code == 2 and "the target's config.json" not in r.stderr, r.stderr
    assert "tokenizer" in r.stderr and "Traceback" not in r.stderr


class _Payload:
    """Unpickled, this would create the file its test checks for."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (str(self.path), "w"))


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")  # torch's, about the crafted file
def test_a_target_with_a_pickle_checkpoint_it_refuses_is_bad_input_and_runs_no_code(tmp_path, local_target_dir):
    """A target dir with pytorch_model.bin instead of safetensors: torch.load(weights_only=True) refuses a
    crafted pickle (nothing runs), but the UnpicklingError was a traceback (exit 1), and the text torch
    adds suggests weights_only=False."""
    import pickle

    target = tmp_path / "target"
    shutil.copytree(local_target_dir, target)
    (target / "model.safetensors").unlink()
    marker = tmp_path / "ran"
    (target / "pytorch_model.bin").write_bytes(pickle.dumps(_Payload(marker)))
    r = invoke(app, ["train", "--target", str(target), "--data", str(write_word_chats(tmp_path / "c.jsonl")),
                     "--out", str(tmp_path / "run"), *COMMON, "--max-steps", "1"])
    err = " ".join(r.stderr.split())
    assert r.exit_code == 2 and "Traceback" not in r.stderr, r.stderr
    assert "refused its pickle" in err and "weights_only set to `False`" not in err and not marker.exists()


def test_a_run_started_with_relative_paths_is_evaluated_and_resumed_from_elsewhere(tmp_path, chat_file, monkeypatch):
    """RUN/config.toml names the data (and a target directory) absolutely: `dflash eval RUN` and `--resume` read
    it again from wherever they run ("dataset 'chats.jsonl' does not exist" before)."""
    import shutil

    from dflash.checkpoint.resume import build_config_for_resume
    from dflash.config import load_toml
    from dflash.eval.evaluate import eval_checkpoint
    from dflash.training.trainer import Trainer
    from tests.dflash_helpers import small_config

    project, elsewhere, run = tmp_path / "project", tmp_path / "elsewhere", tmp_path / "run"
    project.mkdir()
    elsewhere.mkdir()
    shutil.copy(chat_file, project / "chats.jsonl")
    monkeypatch.chdir(project)
    t = Trainer.from_config(small_config(run, "chats.jsonl", **{"train.max_steps": 2, "checkpoint.every": 2}))
    try:
        t.train()
    finally:
        t.close()
    assert load_toml(run / "config.toml").data.path == str(project / "chats.jsonl")
    monkeypatch.chdir(elsewhere)
    assert eval_checkpoint(str(run), num_prompts=1, max_new_tokens=4).prompts == 1
    assert build_config_for_resume(run, {}).data.path == str(project / "chats.jsonl")
