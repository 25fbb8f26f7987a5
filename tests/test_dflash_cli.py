"""The dflash CLI: --json schemas and the command list frozen, bad input exits 2 and leaves nothing behind."""

from __future__ import annotations

import json

import pytest

from cli.dflash_main import app
from tests.dflash_helpers import chat_file, local_target_dir, tiny_target, write_jsonl, write_word_chats  # noqa: F401 (fixtures)
from tests.helpers import invoke, invoke_json

COMMON = ["--set", "data.regenerate=false", "--set", "metrics.tensorboard=false", "--set", "checkpoint.every=100",
          "--set", "metrics.log_every=1"]
TRAIN_KEYS = {"run_dir", "steps", "total_steps", "first_loss", "last_loss", "first_epoch_loss", "last_epoch_loss",
              "last_epoch_tau_estimate", "last_epoch_accuracy", "last", "checkpoints", "seconds", "eval", "notes", "config"}
STEP_KEYS = {"step", "epoch", "loss", "lr", "grad_norm", "accuracy", "tau_estimate", "tokens", "blocks", "seconds",
             "tokens_per_s", "time_split", "memory_bytes", "block_slots", "valid_block_share", "valid_blocks_per_s",
             "token_slots", "target_fill"}
EVAL_KEYS = {"prompts", "rounds", "tau", "max_tau", "acceptance_histogram", "generated_tokens", "plain_seconds",
             "spec_seconds", "speedup", "plain_tokens_per_s", "spec_tokens_per_s", "outputs_match", "mismatched_prompts",
             "acceptance_by_position", "near_tie_prompts", "divergences"}


def test_command_list_is_frozen():
    names = {c.name or c.callback.__name__ for c in app.registered_commands}
    assert names == {"train", "eval", "regen", "prepare", "check"}


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory, chat_file):
    out = tmp_path_factory.mktemp("cli") / "run"
    data = invoke_json(app, ["train", "--out", str(out), "--data", str(chat_file), "--max-steps", "3", *COMMON,
                             "--set", "eval.num_prompts=2", "--set", "eval.max_new_tokens=9"])
    return out, data


def test_train_json_schema(trained_run):
    out, data = trained_run
    assert set(data) == TRAIN_KEYS and set(data["last"]) == STEP_KEYS and set(data["eval"]) == EVAL_KEYS
    assert data["steps"] == 3 and len(data["last"]["accuracy"]) == len(data["last_epoch_accuracy"]) == 7  # slots 1..B-1
    assert set(data["last"]["time_split"]) == {"data", "target", "drafter", "optim"}
    assert data["eval"]["outputs_match"] is True and data["eval"]["prompts"] == 2
    assert data["config"]["drafter"]["block_size"] == 8
    assert (out / "checkpoints" / "step_000003" / "config.json").is_file()
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "step" in r and "event" not in r] == [1, 2, 3]
    assert any(n.startswith("added <|MASK|>") for n in data["notes"])  # the tiny tokenizer has no mask token


def test_eval_json(trained_run):
    out, _ = trained_run
    data = invoke_json(app, ["eval", str(out), "-n", "1", "--max-new-tokens", "9"])
    assert set(data) == EVAL_KEYS and data["outputs_match"] is True and data["prompts"] == 1
    assert 1.0 <= data["tau"] <= data["max_tau"] == 8
    r = invoke(app, ["eval", str(out), "-n", "1", "--max-new-tokens", "9"])  # the rich rendering: 0 too
    assert r.exit_code == 0 and "outputs match plain greedy decoding" in r.stdout and "error" not in r.stderr


def test_eval_exits_1_when_outputs_differ(trained_run, monkeypatch):
    """Speculative decoding must be lossless: outputs that differ from plain greedy decoding are a failed check.
    The real eval runs; its result is then marked as mismatched on one prompt (fault injection)."""
    import dataclasses

    import dflash

    real = dflash.evaluate

    from dflash.eval.generation import Divergence

    wide = Divergence(0, 2, 5, 7, (11, 12), logit_gap=3.0, tolerance=1e-5, near_tie=False)

    def mismatched(*args, **kwargs):
        return dataclasses.replace(real(*args, **kwargs), outputs_match=False, mismatched_prompts=1,
                                   divergences=(wide,))

    monkeypatch.setattr(dflash, "evaluate", mismatched)
    out, _ = trained_run
    args = ["eval", str(out), "-n", "2", "--max-new-tokens", "5"]
    data = invoke_json(app, args, expect_code=1)  # the JSON still printed in full
    assert set(data) == EVAL_KEYS and data["outputs_match"] is False and data["mismatched_prompts"] == 1
    assert data["divergences"][0]["position"] == 2 and data["divergences"][0]["near_tie"] is False
    r = invoke(app, args)
    assert r.exit_code == 1 and "outputs differ from plain greedy decoding on 1 prompt\n" in r.stdout
    said = " ".join(r.stderr.split())
    assert "error: speculative decoding's outputs differ from plain greedy decoding beyond rounding on 1 prompt of 2" in said
    assert "first: prompt 0, new token 2: plain 5, speculative 7, logit gap 3 > 1e-05" in said
    assert "must be lossless" in said and "Traceback" not in said


def test_eval_exits_0_when_outputs_part_only_at_near_ties(trained_run, monkeypatch):
    """bf16 rounding: where the target's two best logits are within what its dtype rounds, either token can
    win in either decoding. Reported, not failed (fault injection of the divergence, as above)."""
    import dataclasses

    import dflash
    from dflash.eval.generation import Divergence

    real = dflash.evaluate
    tie = Divergence(1, 3, 5, 7, (11, 12, 13), logit_gap=0.05, tolerance=0.3, near_tie=True)
    monkeypatch.setattr(dflash, "evaluate", lambda *a, **k: dataclasses.replace(
        real(*a, **k), outputs_match=False, mismatched_prompts=1, near_tie_prompts=1, divergences=(tie,)))
    out, _ = trained_run
    args = ["eval", str(out), "-n", "2", "--max-new-tokens", "5"]
    data = invoke_json(app, args)
    assert data["near_tie_prompts"] == 1 and data["divergences"][0]["near_tie"] is True
    r = invoke(app, args)
    assert r.exit_code == 0, r.stderr
    assert ("outputs match plain greedy decoding up to rounding: they part on 1 prompt at near-ties of the "
            "target's logits (rounding, not a failure)") in " ".join(r.stdout.split())


def test_regen_json(tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", [{"conversations": [{"from": "human", "value": "ba be"},
                                                                 {"from": "gpt", "value": "old answer"}]}])
    data = invoke_json(app, ["regen", str(src), str(tmp_path / "out.jsonl"), "--max-new-tokens", "5", "--device", "cpu"])
    assert data["conversations"] == 1 and data["turns"] == 1
    row = json.loads((tmp_path / "out.jsonl").read_text())
    assert row["messages"][0] == {"role": "user", "content": "ba be"}
    assert row["messages"][1]["role"] == "assistant" and row["messages"][1]["content"] != "old answer"


def test_print_config_json():
    data = invoke_json(app, ["train", "--recipe", "qwen3_8b", "--print-config", "--set", "optim.lr=1e-4"])
    assert data["recipe"] == "qwen3_8b" and data["optim"]["lr"] == 1e-4 and data["drafter"]["num_layers"] == 5


@pytest.mark.parametrize("args, message", [
    (["--target", "/nonexistent/model"], "does not exist"),
    (["--device", "tpu"], "unknown device"),
    (["--device", "cuda:7"], "not visible"),
    (["--set", "optim.lr=-1"], "optim.lr"),
    (["--set", "nope.x=1"], "nope.x"),
    (["--set", "train.attention=flex"], "flex"),
    (["--resume"], "--resume"),
    (["--stall-after", "0"], "topology.stall_after"),
    (["--set", "topology.queue_depth=0"], "topology.queue_depth"),
    (["--dist-backend", "mpi"], "topology.dist_backend"),
    (["--set", "topology.target_devices=cpu"], "go together"),
    (["--target-devices", "cpu", "--drafter-devices", "cuda:7"], "not visible"),
    (["--device", "cpu", "--target-devices", "cpu", "--drafter-devices", "cpu"], "--device does not go with"),
    (["--device", "cpu", "--set", "target.fp8=true"], "target.fp8 = true: FP8 GEMMs need a CUDA GPU"),
])
def test_bad_input_exits_2_and_writes_nothing(tmp_path, chat_file, args, message):
    out = tmp_path / "run"
    r = invoke(app, ["train", "--out", str(out), "--data", str(chat_file), *COMMON, *args])
    assert r.exit_code == 2, (r.stdout, r.stderr)
    assert message in r.stderr and "Traceback" not in r.stderr
    assert not out.exists()  # no run dir, no partial checkpoint


def test_empty_dataset_exits_2(tmp_path):
    data = write_jsonl(tmp_path / "empty.jsonl", [{"messages": [{"role": "user", "content": "ba"}]}])
    out = tmp_path / "run"
    r = invoke(app, ["train", "--out", str(out), "--data", str(data), *COMMON])
    assert r.exit_code == 2 and "no usable conversation" in r.stderr and not out.exists()


def test_a_length_cap_that_cuts_every_answer_off_says_to_raise_it(tmp_path, chat_file):
    out = tmp_path / "run"
    r = invoke(app, ["train", "--out", str(out), "--data", str(chat_file), *COMMON, "--set", "data.max_length=16",
                     "--set", "data.buckets=[16]"])
    err = " ".join(r.stderr.split())
    assert r.exit_code == 2 and "no anchor position" in err and "raise data.max_length" in err and not out.exists()


def test_skipped_records_are_counted_on_the_console_and_strict_exits_2(tmp_path, chat_file):
    lines = chat_file.read_text().splitlines()
    data = tmp_path / "mixed.jsonl"
    data.write_text("\n".join(lines + ["{broken", '{"messages": [{"role": "user", "content": "ba"}]}']) + "\n")
    out = tmp_path / "run"
    r = invoke(app, ["train", "--out", str(out), "--data", str(data), "--max-steps", "1", *COMMON,
                     "--set", "eval.at_end=false"])
    assert r.exit_code == 0, r.stderr
    assert "2 of " in r.stderr and "records skipped" in r.stderr
    assert "1 × unreadable JSONL line" in r.stderr and "mixed.jsonl:" in r.stderr
    assert "1 × no assistant turn" in r.stderr and "e.g. record" in r.stderr
    strict = invoke(app, ["train", "--out", str(tmp_path / "strict"), "--data", str(data), "--strict", *COMMON,
                          "--set", "eval.at_end=false"])
    said = " ".join(strict.stderr.split())  # rich wraps long lines
    assert strict.exit_code == 2 and "data.strict: 2 of" in said and "Traceback" not in said
    assert not (tmp_path / "strict").exists()


def test_eval_accepts_the_latest_pointer(trained_run):
    out, _ = trained_run
    data = invoke_json(app, ["eval", str(out / "checkpoints" / "latest"), "-n", "1", "--max-new-tokens", "5"])
    assert data["prompts"] == 1


def test_eval_refuses_a_mismatched_target(trained_run, local_target_dir):
    out, _ = trained_run
    r = invoke(app, ["eval", str(out), "--target", str(local_target_dir)])
    assert r.exit_code == 2 and "does not match the target" in r.stderr and "hidden size 64" in r.stderr
    r = invoke(app, ["eval", str(out.parent / "missing")])
    assert r.exit_code == 2 and "not a dflash checkpoint" in r.stderr


def test_qwen3_8b_dry_run_on_the_meta_device(tmp_path):
    """The full-scale recipe end to end without weights: taps, spec, masks, loss and backward at Qwen3-8B
    shapes (the recipe's micro-batch: 4 rows × 3072 tokens, 512 anchors × 16 a row), an export config
    that reads back; nothing written."""
    data = invoke_json(app, ["train", "--recipe", "qwen3_8b", "--dry-run", "--out", str(tmp_path / "run")])
    assert data["target_source"] == "Qwen3-8B shape (built in)" and data["layer_ids"] == [1, 9, 17, 25, 33]
    h, ffn, layers = 4096, 12288, 5
    per_layer = 2 * h * h + 2 * h * 1024 + 2 * 128 + 3 * h * ffn + 2 * h  # q,o + k,v + qk-norm + MLP + norms
    assert data["drafter_params"] == layers * per_layer + 5 * h * h + 2 * h  # + fc (5 taps) + hidden_norm, norm
    assert data["grads"] == 5 * 11 + 3  # every parameter got a gradient
    assert data["taps_shape"] == [4, 3072, 5 * h] and data["hidden_shape"] == [4, 512 * 16, h]
    assert data["export_config"]["dflash_config"]["target_layer_ids"] == [1, 9, 17, 25, 33]
    assert data["notes"] == [] and not (tmp_path / "run").exists()


PREPARE_KEYS = {"cache_dir", "key", "hit", "seconds", "workers", "shards", "bytes", "records", "kept", "truncated",
                "skipped", "skipped_by_reason", "examples", "tokens", "loss_tokens", "max_length", "block_size",
                "eval_prompts", "eval_held_out", "notes", "train_with"}


def test_prepare_then_train_starts_from_the_cache(tmp_path, local_target_dir):
    data = write_word_chats(tmp_path / "d.jsonl", n=30)
    with open(data, "a") as fh:
        fh.write('{"messages": [{"role": "user", "content": "ba"}]}\n')
    cache = tmp_path / "cache"
    args = ["--target", str(local_target_dir), "--set", "data.max_length=40", "--set", "eval.at_end=false"]
    p = invoke_json(app, ["prepare", str(data), "--cache-dir", str(cache), *args])
    assert set(p) == PREPARE_KEYS and not p["hit"] and p["kept"] == 30 and p["records"] == 31
    assert p["skipped_by_reason"] == {"no assistant turn": 1} and p["examples"]["no assistant turn"] == ["record 31 ('ba')"]
    assert p["truncated"] > 0 and p["cache_dir"].startswith(str(cache))
    again = invoke_json(app, ["prepare", str(data), "--cache-dir", str(cache), *args])
    assert again["hit"] and {k: v for k, v in again.items() if k not in ("hit", "seconds", "workers")} == \
        {k: v for k, v in p.items() if k not in ("hit", "seconds", "workers")}
    run = invoke_json(app, ["train", "--data", str(data), "--out", str(tmp_path / "run"), "--max-steps", "1", *args,
                            *COMMON, "--set", f"data.cache_dir={cache}"])
    assert f"data cache hit: {p['cache_dir']}" in run["notes"]
    with open(f"{p['cache_dir']}/shard-00000.tokens", "r+b") as fh:  # a damaged cache: rebuilt, with a note
        fh.truncate(4)
    fixed = invoke_json(app, ["prepare", str(data), "--cache-dir", str(cache), *args])
    assert not fixed["hit"] and "moved to" in fixed["notes"][0] and fixed["tokens"] == p["tokens"]


def test_prepare_bad_input_exits_2(tmp_path):
    r = invoke(app, ["prepare", str(tmp_path / "missing.jsonl"), "--cache-dir", str(tmp_path / "c")])
    assert r.exit_code == 2 and "does not exist" in r.stderr and "Traceback" not in r.stderr
    r = invoke(app, ["prepare", str(tmp_path / "x.jsonl"), "--target", str(tmp_path / "nope")])
    assert r.exit_code == 2 and "does not exist" in r.stderr


@pytest.mark.parametrize("error", ["cpu", "cuda"])
def test_a_step_out_of_memory_is_bad_input_and_keeps_the_checkpoints(tmp_path, chat_file, monkeypatch, error):
    """Fault injection: the second step runs out of memory (the CPU allocator's RuntimeError, or CUDA's
    OutOfMemoryError). Exit 2 with the step, the allocator's words and what to lower; step 1's
    checkpoint stays."""
    import torch

    from dflash.training.trainer import Trainer

    real, calls = Trainer.train_step, []

    def step(self, batches):
        calls.append(1)
        if len(calls) == 2:
            raise (RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate "
                                "memory: you tried to allocate 5121638400000 bytes. Error code 12")
                   if error == "cpu" else torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 80.00 GiB."))
        return real(self, batches)

    monkeypatch.setattr(Trainer, "train_step", step)
    out = tmp_path / "run"
    r = invoke(app, ["train", "--out", str(out), "--data", str(chat_file), *COMMON, "--max-steps", "3",
                     "--set", "checkpoint.every=1"])
    assert r.exit_code == 2, (r.stdout, r.stderr)
    err = " ".join(r.stderr.split())
    assert "training ran out of memory on cpu at step 2" in err and "Traceback" not in r.stderr
    assert ("you tried to allocate 5121638400000 bytes" if error == "cpu" else "Tried to allocate 80.00 GiB") in err
    assert "lower data.batch_size" in err
    assert (out / "checkpoints" / "step_000001").is_dir()
