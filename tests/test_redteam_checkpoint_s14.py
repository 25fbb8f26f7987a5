"""Red-team of checkpoints, resume and exports as files from elsewhere (session 14): a training state
whose zip inflates without bound, numbers past float's range in a training state or a config.json,
retention reaching through a linked checkpoint or blessing a damaged file, and a resume whose config
differs from its checkpoint's without saying so."""

from __future__ import annotations

import io
import os
import zipfile
from pathlib import Path

import pytest
import torch

from compilewatch import BadInput
from dflash.checkpoint import manifest, retention, store

COMMON = ["--set", "data.regenerate=false", "--set", "eval.at_end=false", "--set", "metrics.tensorboard=false"]


def _deflated(src: bytes, pad: int = 0) -> bytes:
    """`src` (a torch.save zip) with every record deflated; `pad` zero bytes after data.pkl's pickle
    (past its STOP: the pickle still reads, the record inflates to that much more)."""
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(src)) as zin, zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as zout:
        for info in zin.infolist():
            data = zin.read(info) + (b"\0" * pad if info.filename.endswith("/data.pkl") else b"")
            zout.writestr(info.filename, data)
    return out.getvalue()


def _saved(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def test_a_training_state_with_compressed_records_is_refused_before_torch_load(tmp_path, monkeypatch):
    (tmp_path / store.STATE_FILE).write_bytes(_deflated(_saved({"step": 1, "w": torch.zeros(4)}), pad=1 << 20))
    monkeypatch.setattr(torch, "load", lambda *a, **k: pytest.fail("torch.load read an unchecked archive"))
    with pytest.raises(BadInput, match="compressed record .*archive/data.pkl") as e:
        store.load_training_state(tmp_path)
    assert "resume from another checkpoint" in e.value.hint


def test_a_training_state_that_is_no_zip_or_has_a_huge_pickle_is_refused(tmp_path, monkeypatch):
    (tmp_path / store.STATE_FILE).write_bytes(b"not a zip at all")
    with pytest.raises(BadInput, match="not a zip archive"):
        store.load_training_state(tmp_path)
    good = _saved({"step": 1, "w": torch.zeros(4)})
    with io.BytesIO(good) as fh:
        store._check_state_archive(fh, len(good), "ok")  # what torch.save writes passes
    (tmp_path / store.STATE_FILE).write_bytes(good)
    monkeypatch.setattr(store, "MAX_STATE_PICKLE", 16)
    with pytest.raises(BadInput, match="its pickle .*data.pkl"):
        store.load_training_state(tmp_path)


def test_numbers_past_float_range_are_bad_input_not_overflow_tracebacks():
    from dflash.check.static import _same
    from dflash.checkpoint.state_check import check_optimizer

    p = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.AdamW([p], lr=1e-3)
    p.grad = torch.ones(2)
    opt.step()
    for edit in ({"lr": 10 ** 400}, {"betas": (0.9, 10 ** 400)}):
        st = opt.state_dict()
        st["param_groups"][0].update(edit)
        assert check_optimizer(st, opt), edit
    st = opt.state_dict()
    st["state"][0]["step"] = 10 ** 400
    assert any("'step'" in x for x in check_optimizer(st, opt))
    cfg = store.export_config(_spec(), torch.float32)
    for edit in ({"rope_theta": 10 ** 400}, {"rms_norm_eps": 10 ** 400},
                 {"rope_scaling": {"rope_type": "linear", "factor": 10 ** 400}}):
        with pytest.raises(BadInput) as e:
            store.spec_from_config({**cfg, **edit})
        assert e.value.hint and ("expected a finite number" in e.value.message or "factor is" in e.value.message), \
            e.value.message
    assert not _same(10 ** 400, 1.0)  # dflash check: an edited training record fails a check, no traceback


def _spec():
    from dflash.model.drafter import DrafterSpec

    return DrafterSpec(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                       intermediate_size=32, vocab_size=64, rms_norm_eps=1e-6, rope_theta=10000.0,
                       max_position_embeddings=128, block_size=4, num_target_layers=2, target_layer_ids=(0, 1),
                       mask_token_id=63, layer_types=("full_attention",))


def _checkpoint(d: Path, step: int, state: bytes = b"state") -> Path:
    ck = d / f"step_{step:06d}"
    ck.mkdir(parents=True)
    for name, data in (("config.json", b"{}"), ("model.safetensors", b"weights" * 10), (store.STATE_FILE, state),
                       (store.CONFIG_FILE, b"recipe = 'tiny'\n")):
        (ck / name).write_bytes(data)
    manifest.record(ck, [*store.EXPORT_FILES, store.STATE_FILE, store.CONFIG_FILE])
    return ck


def test_retention_never_reaches_through_a_linked_checkpoint(tmp_path):
    run = tmp_path / "run"
    outside = _checkpoint(tmp_path / "elsewhere", 1)
    (run / "checkpoints").mkdir(parents=True)
    os.symlink(outside, run / "checkpoints" / "step_000001")
    _checkpoint(run / "checkpoints", 2)
    _checkpoint(run / "checkpoints", 3)
    before = {p.name: p.read_bytes() for p in outside.iterdir()}
    pruned = retention.prune(run, keep_last=1, export_every=1)
    assert pruned.stripped == ("step_000002",) and pruned.removed == ()
    assert {p.name: p.read_bytes() for p in outside.iterdir()} == before  # its state and manifest untouched
    pruned = retention.prune(run, keep_last=1, export_every=0)
    assert (run / "checkpoints" / "step_000001").is_symlink() and (outside / store.STATE_FILE).is_file()
    # a staging name that is a link: the link goes, what it points at stays
    os.symlink(outside, run / "checkpoints" / ".step_000009.partial-1")
    assert retention.clean_leftovers(run) == [".step_000009.partial-1"]
    assert not os.path.lexists(run / "checkpoints" / ".step_000009.partial-1") and (outside / "config.json").is_file()


def test_stripping_a_checkpoint_keeps_the_digests_of_its_save(tmp_path):
    run = tmp_path / "run"
    old = _checkpoint(run / "checkpoints", 2)
    _checkpoint(run / "checkpoints", 3)
    with open(old / "model.safetensors", "r+b") as fh:  # damaged on disk after its save
        fh.write(b"X")
    assert retention.prune(run, keep_last=1, export_every=1).stripped == ("step_000002",)
    assert not (old / store.STATE_FILE).exists()
    assert sorted(manifest.read(old)) == ["config.json", "model.safetensors", "train_config.toml"]
    with pytest.raises(BadInput, match="model.safetensors.*checksum"):
        manifest.check(old)  # still seen: the strip did not hash the damaged file again


def test_resume_states_what_differs_from_the_checkpoints_config_and_refuses_a_bomb(tmp_path):
    from cli.dflash_main import app
    from tests.dflash_helpers import write_word_chats
    from tests.helpers import invoke

    data = write_word_chats(tmp_path / "chats.jsonl")
    out = tmp_path / "run"
    r = invoke(app, ["train", "--out", str(out), "--data", str(data), "--max-steps", "2",
                     "--set", "checkpoint.every=2", *COMMON, "--json"])
    assert r.exit_code == 0, r.stderr
    ck = out / "checkpoints" / "step_000002"
    state = ck / store.STATE_FILE
    state.write_bytes(_deflated(state.read_bytes(), pad=4 << 20))  # and its manifest forged to match
    manifest.record(ck, [*store.EXPORT_FILES, store.STATE_FILE, store.CONFIG_FILE])
    r = invoke(app, ["train", "--out", str(out), "--resume", "--max-steps", "4", "--set", "optim.lr=0.01"])
    assert r.exit_code == 2, r.stderr
    assert "changed  since the checkpoint's train_config.toml: optim.lr 0.003 -> 0.01; train.max_steps 2 -> 4" \
        in r.stderr
    assert "holds a compressed record" in r.stderr and "Traceback" not in r.stdout + r.stderr
    assert not (out / ".lock").exists() and state.is_file()  # the lock released, nothing of the run removed


def test_a_train_config_that_is_a_fifo_or_edited_is_named_by_eval_and_check(tmp_path):
    """A train_config.toml that is a FIFO read as 'has no train_config.toml; say which target'; `dflash check`
    read the target and prompts from an edited one without a word (`dflash eval` checked it)."""
    from cli.dflash_main import app
    from tests.dflash_helpers import write_word_chats
    from tests.helpers import invoke

    data = write_word_chats(tmp_path / "chat.jsonl")
    out = tmp_path / "run"
    assert invoke(app, ["train", "--out", str(out), "--data", str(data), *COMMON, "--max-steps", "2"]).exit_code == 0
    ck = out / "checkpoints" / "step_000002"
    toml = ck / store.CONFIG_FILE
    toml.write_text(toml.read_text().replace("max_length = 96", "max_length = 95"))
    r = invoke(app, ["check", str(ck), "--static"])
    text = " ".join(r.stdout.split())
    assert r.exit_code == 1 and f"FAIL {store.CONFIG_FILE}: changed after the save" in text, r.stdout
    toml.unlink()
    os.mkfifo(toml)
    for args in (["check", str(ck), "--static"], ["eval", str(ck), "-n", "1"]):
        r = invoke(app, args)
        err = " ".join(r.stderr.split())
        assert r.exit_code == 2 and "Traceback" not in r.stderr, r.stderr
        assert "is not a regular file" in err and "has no train_config.toml" not in err, err
