"""`dflash check` (issue 40): an export against the target it will be served with. One tiny run is
trained for the module; each test damages a copy of its export, or builds a changed target (the
embedded tiny target saved as a model directory with another chat template or an added special
token), and checks the right line fails with the right exit code."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from cli.dflash_main import app
from tests.dflash_helpers import chat_file, tiny_target  # noqa: F401 (fixtures)
from tests.helpers import invoke, invoke_json


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """The tiny recipe, a few steps (the export records what check needs; train prints the verdict)."""
    out = tmp_path_factory.mktemp("check") / "run"
    r = invoke(app, ["train", "--out", str(out), "--set", "train.max_steps=12", "--set", "eval.at_end=false",
                     "--set", "metrics.tensorboard=false", "--set", "metrics.log_every=1"])
    assert r.exit_code == 0, (r.stdout, r.stderr)
    return out, r.stdout


def export_of(run_dir: Path) -> Path:
    ck = run_dir / "checkpoints"
    return ck / (ck / "latest").read_text().strip()


def copy_export(run_dir: Path, dest: Path) -> Path:
    """A copy of the run (so metrics.jsonl and train_config.toml come along)."""
    shutil.copytree(run_dir, dest)
    return export_of(dest)


def edit_config(ck: Path, **changes) -> None:
    cfg = json.loads((ck / "config.json").read_text())
    for k, v in changes.items():
        if k == "target_layer_ids":
            cfg["dflash_config"]["target_layer_ids"] = v
        else:
            cfg[k] = v
    (ck / "config.json").write_text(json.dumps(cfg))


def target_dir(tmp_path: Path, change=None) -> Path:
    """The embedded tiny target saved as a Hugging Face model directory, its tokenizer changed by `change`."""
    from dflash.model.target import build_tiny_target

    model, tok = build_tiny_target()
    if change is not None:
        change(tok)
    path = tmp_path / "target"
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def check(args, code):
    r = invoke(app, ["check", *args, "--json"])
    assert r.exit_code == code, (r.exit_code, r.stdout, r.stderr)
    return json.loads(r.stdout), r


def failed(data) -> dict[str, str]:
    return {f["check"]: f["found"] for f in data["findings"] if f["level"] == "fail"}


def test_export_records_what_check_needs(run):
    cfg = json.loads((export_of(run[0]) / "config.json").read_text())
    rec = cfg["dflash_training"]
    assert rec["trained"]["target_layer_ids"] == [1, 3] and rec["trained"]["mask_token_id"] == 307
    tok = rec["tokenizer"]
    assert tok["mask_token"] == "<|MASK|>" and tok["mask_token_shipped"] is False and tok["mask_token_id"] == 307
    ct = tok["chat_template"]
    assert ct["generation_prompt"] == "<|im_start|>assistant\n" and ct["thinking"] == {"switch": False}
    assert ct["sample"].startswith("<|im_start|>system\n") and len(ct["digest"]) == 32 and ct["text"]


def test_train_summary_prints_the_static_verdict(run):
    _, stdout = run
    assert "check: the export serves as trained against embedded:tiny" in stdout


def test_unchanged_target_serves_as_trained(run):
    data, r = check([str(run[0]), "--target", "embedded:tiny", "-n", "2", "--max-new-tokens", "16"], 0)
    assert data["verdict"] == "ok" and failed(data) == {}
    a = data["acceptance"]
    assert a["prompts"] == 2 and 1.0 <= a["tau"] <= a["max_tau"] == 8 and len(a["by_position"]) == 7
    assert len(a["per_prompt"]) == 2 and a["training_tau"] is not None  # metrics.jsonl of the run
    assert all(p["template_differs"] is False and p["overlap"] > 0.9 for p in a["per_prompt"])
    text = invoke(app, ["check", str(run[0]), "--target", "embedded:tiny", "--static"])
    assert text.exit_code == 0 and "verdict: serves as trained" in text.stdout
    assert "ok   chat template" in text.stdout and "acceptance: not measured" in text.stdout


def test_unchanged_target_directory_serves_as_trained(run, tmp_path):
    data, _ = check([str(run[0]), "--target", str(target_dir(tmp_path)), "--static"], 0)
    assert failed(data) == {}


def test_changed_chat_template_is_named(run, tmp_path):
    from dflash.model.target import TINY_CHAT_TEMPLATE

    def change(tok):
        tok.chat_template = TINY_CHAT_TEMPLATE.replace("<|im_start|>assistant\n{% endif %}",
                                                       "<|im_start|>assistant\n\n{% endif %}")

    data, r = check([str(run[0]), "--target", str(target_dir(tmp_path, change)), "-n", "2", "--max-new-tokens", "8"], 1)
    bad = failed(data)
    assert "chat template" in bad and "renders differently" in bad["chat template"]
    assert "generation prompt" in bad and "mask token" not in bad and "taps" not in bad
    assert all(p["template_differs"] for p in data["acceptance"]["per_prompt"])
    assert any("render differently with the chat template of training" in e for e in data["acceptance"]["explanations"])
    assert "failed" in r.stderr


def test_added_special_token_moves_the_mask_token_id(run, tmp_path):
    data, _ = check([str(run[0]), "--target", str(target_dir(tmp_path, lambda t: t.add_special_tokens(
        {"additional_special_tokens": ["<|im_start|>", "<|im_end|>", "<|tool|>"]}))), "--static"], 1)
    bad = failed(data)
    assert "mask token" in bad and "307" in bad["mask token"] and "308" in bad["mask token"]
    assert "special tokens" in bad and "<|tool|>" in bad["special tokens"]


def test_edited_taps_are_named(run, tmp_path):
    ck = copy_export(run[0], tmp_path / "run")
    edit_config(ck, target_layer_ids=[2, 4])
    data, _ = check([str(ck), "--target", "embedded:tiny", "--static"], 1)
    bad = failed(data)
    assert "target_layer_ids (config.json vs training)" in bad and "[1, 3]" in bad["target_layer_ids (config.json vs training)"]
    assert "config.json" in bad  # its checksum no longer matches manifest.json


def test_changed_rope_theta_is_named(run, tmp_path):
    ck = copy_export(run[0], tmp_path / "run")
    edit_config(ck, rope_theta=500000.0, rope_parameters={"rope_type": "default", "rope_theta": 500000.0})
    data, _ = check([str(ck), "--target", "embedded:tiny", "--static"], 1)
    bad = failed(data)
    assert "RoPE" in bad and "theta 500000 vs the target's 10000" in bad["RoPE"]
    assert "rope_theta (config.json vs training)" in bad


def test_truncated_weights_are_bad_input(run, tmp_path):
    ck = copy_export(run[0], tmp_path / "run")
    w = ck / "model.safetensors"
    w.write_bytes(w.read_bytes()[: w.stat().st_size // 2])
    r = invoke(app, ["check", str(ck), "--target", "embedded:tiny"])
    assert r.exit_code == 2 and "model.safetensors" in r.stderr and "Traceback" not in r.stderr + r.stdout
    (ck / "manifest.json").unlink()  # without checksums: the header check says it
    r = invoke(app, ["check", str(ck), "--target", "embedded:tiny"])
    assert r.exit_code == 2 and "model.safetensors" in r.stderr and "Traceback" not in r.stderr + r.stdout


def test_a_bare_export_without_prompts_says_so(run, tmp_path):
    src = export_of(run[0])
    bare = tmp_path / "bare"
    bare.mkdir()
    for f in ("config.json", "model.safetensors"):
        shutil.copy(src / f, bare / f)
    data, _ = check([str(bare), "--target", "embedded:tiny"], 0)
    assert data["acceptance"] is None and "pass --data" in data["acceptance_note"]
    r = invoke(app, ["check", str(bare)])
    assert r.exit_code == 2 and "--target" in r.stderr


def test_serving_fields_the_engines_read_otherwise():
    from dflash.check.serving import check_serving

    cfg = {"architectures": ["DFlashDraftModel"], "num_hidden_layers": 2, "num_target_layers": 6, "block_size": 8,
           "dflash_config": {"mask_token_id": 307, "target_layer_ids": [1, 3], "use_swa": True}, "is_neox_style": False,
           "my_field": 1}
    found = {f.check: f for f in check_serving(cfg, None, "<|MASK|>")}
    assert found["serving: RoPE theta"].level == "fail" and "1000000" in found["serving: RoPE theta"].todo
    assert found["serving: dflash_config.use_swa"].level == "fail" and found["serving: RoPE layout"].level == "fail"
    assert "my_field" in found["serving: ignored fields"].found
    del cfg["dflash_config"]["target_layer_ids"]
    found = {f.check: f for f in check_serving(cfg, {"target_layer_ids": [2, 4]}, "<|MASK|>")}
    assert found["serving: taps"].level == "fail" and "[1, 3]" in found["serving: taps"].found  # the default spread


@pytest.mark.parametrize("n", ["0", "-3"])
def test_eval_needs_at_least_one_prompt(run, n):
    r = invoke(app, ["eval", str(run[0]), "-n", n])
    assert r.exit_code == 2 and "must be >= 1" in r.stderr
    r = invoke(app, ["check", str(run[0]), "--target", "embedded:tiny", "-n", n])
    assert r.exit_code == 2 and "must be >= 1" in r.stderr


@pytest.mark.parametrize("flags, message", [
    (["--max-new-tokens", "0"], "--max-new-tokens is 0: it must be >= 1"),  # 0 once meant "the config's 128"
    (["--max-new-tokens", "-3"], "--max-new-tokens is -3: it must be >= 1"),  # once an IndexError traceback
    (["--temperature", "nan"], "--temperature is nan"),
])
def test_eval_and_check_refuse_bad_flags_before_loading(run, flags, message):
    for cmd in (["eval", str(run[0])], ["check", str(run[0]), "--target", "embedded:tiny"]):
        if flags[0] == "--temperature" and cmd[0] == "eval":
            continue  # eval decodes greedily: it has no --temperature
        r = invoke(app, [*cmd, *flags])
        assert r.exit_code == 2 and message in r.stderr and "Traceback" not in r.stderr, (cmd, r.stderr)


@pytest.mark.parametrize("flags, message", [
    (["--max-new-tokens", "0"], "--max-new-tokens is 0"), (["--max-new-tokens", "-1"], "--max-new-tokens is -1"),
    (["--batch-size", "0"], "--batch-size is 0"), (["--temperature", "-1"], "--temperature is -1.0"),
    (["--temperature", "inf"], "--temperature is inf"),
])
def test_regen_refuses_bad_flags_and_writes_nothing(tmp_path, chat_file, flags, message):
    out = tmp_path / "out.jsonl"
    r = invoke(app, ["regen", str(chat_file), str(out), "--target", "embedded:tiny", "--device", "cpu", *flags])
    assert r.exit_code == 2 and message in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert not out.exists()


def test_eval_reports_acceptance_by_position(run):
    data = invoke_json(app, ["eval", str(run[0]), "-n", "1", "--max-new-tokens", "12"])
    pos = data["acceptance_by_position"]
    assert len(pos) == 7 and all(p is None or 0.0 <= p <= 1.0 for p in pos)
    text = invoke(app, ["eval", str(run[0]), "-n", "1", "--max-new-tokens", "12"])
    assert "accepted by block position" in text.stdout


def test_sampled_acceptance_runs_at_a_temperature(run):
    data, _ = check([str(run[0]), "--target", "embedded:tiny", "-n", "1", "--max-new-tokens", "12",
                     "--temperature", "0.8"], 0)
    assert data["acceptance"]["temperature"] == 0.8 and 1.0 <= data["acceptance"]["tau"] <= 8


def test_a_tokenizer_that_cannot_load_is_one_clean_line(tmp_path, monkeypatch):
    """transformers' message carries literal "\\n" sequences; the error is one line, with a hint, for
    `dflash check` as for training (one loader: dflash.model.target.shipped_tokenizer)."""
    import transformers

    (tmp_path / "config.json").write_text("{}")

    def fails(*a, **k):
        raise ValueError("Couldn't instantiate the backend tokenizer from one of: \\n(1) a `tokenizers` file, \\n(2) ...")

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", fails)
    from compilewatch import BadInput
    from dflash.check.record import target_tokenizer

    with pytest.raises(BadInput) as e:
        target_tokenizer(str(tmp_path))
    assert "\\n" not in e.value.message and "\n" not in e.value.message
    assert "Couldn't instantiate the backend tokenizer from one of: (1) a `tokenizers` file, (2) ..." in e.value.message
    assert "tokenizer files" in e.value.hint
