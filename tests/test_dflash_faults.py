"""Issue 31, dflash side: damaged checkpoints, exports and data under --resume, eval and training.

Each class of fault, through the library and the CLI: bad input exits 2 with one error line and no
traceback, releases RUN/.lock (the next --resume of a good checkpoint works), never silently resumes
an older checkpoint, never allocates what a damaged config claims, never opens a FIFO, and never
hands an oversized record to the tokenizer. Then Hypothesis properties for the loaders: a value or
BadInput, nothing else, each example inside a generous time limit (a hang or a blow-up fails).
"""

from __future__ import annotations

import json
import os
import shutil
import tracemalloc
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from cli.dflash_main import app
from compilewatch.errors import BadInput
from dflash.checkpoint import manifest, store as ckpt
from dflash.checkpoint.export_check import spec_problems
from dflash.checkpoint.state_check import check_training_state, load_optimizer_state
from tests.dflash_helpers import small_config, write_jsonl, write_word_chats
from tests.helpers import invoke, time_limit

PROPS = settings(max_examples=60, deadline=None, derandomize=True, database=None,
                 suppress_health_check=list(HealthCheck))
STEP = "step_000002"


def _exit_2(args, *words, limit: float = 60):
    with time_limit(limit):
        r = invoke(app, args)
    assert r.exit_code == 2, (r.exit_code, r.stdout[-500:], r.stderr[-2000:])
    assert "Traceback" not in r.stderr + r.stdout
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, r.stderr
    for w in words:
        assert w in errors[0], errors[0]
    return errors[0]


@pytest.fixture(scope="module")
def good_run(tmp_path_factory):
    """A 2-step run (a checkpoint at each step) on word chats, tokenized in memory."""
    from dflash.run import train

    d = tmp_path_factory.mktemp("faults")
    data = write_word_chats(d / "chat.jsonl")
    cfg = small_config(d / "run", data, **{"train.max_steps": 2, "checkpoint.every": 1, "data.cache_dir": "off",
                                           "data.batch_size": 2})
    train(cfg)
    return d / "run"


def _copy(good_run: Path, tmp_path: Path) -> Path:
    run = tmp_path / "run"
    shutil.copytree(good_run, run)
    return run


def _resume_args(run: Path) -> list[str]:
    return ["train", "--out", str(run), "--resume", "--max-steps", "3", "--json"]


def _resumes_after_repair(run: Path, good_run: Path) -> None:
    """The good checkpoint put back, --resume works: nothing (a lock) was left behind."""
    shutil.rmtree(run / "checkpoints" / STEP, ignore_errors=True)
    shutil.copytree(good_run / "checkpoints" / STEP, run / "checkpoints" / STEP)
    (run / "checkpoints" / "latest").write_text(STEP + "\n")
    with time_limit(60):
        r = invoke(app, _resume_args(run))
    assert r.exit_code == 0, r.stderr[-2000:]
    assert json.loads(r.stdout)["steps"] == 3 and (run / "checkpoints" / "step_000003" / manifest.MANIFEST).is_file()
    assert not (run / ".lock").exists()


# ---------------------------------------------------------------- --resume on a damaged training state
def _set(path: list, value):
    def mutate(state):
        d = state
        for k in path[:-1]:
            d = d[k]
        d[path[-1]] = value
    return mutate


def _del(path: list):
    def mutate(state):
        d = state
        for k in path[:-1]:
            d = d[k]
        del d[path[-1]]
    return mutate


def _short_group(state):
    state["optimizer"]["param_groups"][0]["params"].pop()


STATE_CASES = {
    "a tensor of the wrong shape": (_set(["model", "fc.weight"], torch.zeros(3, 3)), "fc.weight"),
    "a tensor of another dtype": (_set(["model", "norm.weight"], torch.zeros(64, dtype=torch.float16)), "norm.weight"),
    "a missing key": (_del(["model", "norm.weight"]), "lacks 1 tensors"),
    "a string for a tensor": (_set(["model", "norm.weight"], "weights"), "not a tensor"),
    "a moment of the wrong shape": (_set(["optimizer", "state", 0, "exp_avg"], torch.zeros(2)), "exp_avg"),
    "a moment missing": (_del(["optimizer", "state", 3, "exp_avg_sq"]), "exp_avg_sq"),
    "a group of another size": (_short_group, "lists 24 parameters"),
    "betas a string": (_set(["optimizer", "param_groups", 0, "betas"], "0.9"), "betas"),
    "no learning rate": (_del(["optimizer", "param_groups", 0, "lr"]), "'lr'"),
    "a negative step": (_set(["step"], -5), "-5"),
    "a step past the run": (_set(["step"], 10**6), "past this run's 3 steps"),
    "a negative AdamW step": (_set(["optimizer", "state", 1, "step"], torch.tensor(-3.0)), "step"),
    "a step that is a float": (_set(["step"], 2.0), "'step'"),
}


@pytest.mark.parametrize("case", sorted(STATE_CASES))
def test_resume_of_a_training_state_that_does_not_fit_exits_2_and_releases_the_lock(good_run, tmp_path, case):
    mutate, words = STATE_CASES[case]
    run = _copy(good_run, tmp_path)
    ck = run / "checkpoints" / STEP
    state = torch.load(ck / ckpt.STATE_FILE, weights_only=True)
    mutate(state)
    torch.save(state, ck / ckpt.STATE_FILE)
    manifest.record(ck, [*ckpt.EXPORT_FILES, ckpt.STATE_FILE, ckpt.CONFIG_FILE])  # checksums fine: the contents are not
    _exit_2(_resume_args(run), words, STEP)
    assert not (run / ".lock").exists()
    _resumes_after_repair(run, good_run)


def test_a_refused_state_changes_nothing_in_the_trainer(good_run, tmp_path):
    """Trainer.load_state_dict checks first: weights, optimizer and step are as they were."""
    from dflash.config import apply_overrides, load_toml
    from dflash.training.trainer import Trainer

    cfg = apply_overrides(load_toml(good_run / "config.toml"), {"checkpoint.out_dir": str(tmp_path / "fresh")})
    t = Trainer.from_config(cfg, lock=False)
    try:
        before = {k: v.clone() for k, v in t.drafter.state_dict().items()}
        opt_before = repr(t.optimizer.state_dict()["param_groups"])
        state = torch.load(good_run / "checkpoints" / STEP / ckpt.STATE_FILE, weights_only=True)
        state["optimizer"]["state"][5]["exp_avg"] = torch.zeros(1)  # the last thing a naive load would reach
        with pytest.raises(BadInput, match="exp_avg"):
            t.load_state_dict(state)
        assert t.step == 0 and repr(t.optimizer.state_dict()["param_groups"]) == opt_before
        assert not t.optimizer.state_dict()["state"]
        assert all(torch.equal(before[k], v) for k, v in t.drafter.state_dict().items())
    finally:
        t.close()


@pytest.mark.parametrize("damage, words", [
    (lambda f: (f.unlink(), os.mkfifo(f)), "not a regular file"),  # never opened: no hang
    (lambda f: (f.unlink(), f.mkdir()), "is a directory"),
    (lambda f: f.unlink(), "is missing"),
    (lambda f: shutil.rmtree(f.parent), "does not exist"),
])
def test_a_damaged_latest_checkpoint_is_named_not_replaced_by_an_older_one(good_run, tmp_path, damage, words):
    run = _copy(good_run, tmp_path)
    damage(run / "checkpoints" / STEP / ckpt.STATE_FILE)
    line = _exit_2(_resume_args(run), STEP, words, limit=30)
    assert "step_000001" not in line  # the older checkpoint is offered in the hint, never resumed
    assert not (run / ".lock").exists() and not (run / "checkpoints" / "step_000003").exists()
    _resumes_after_repair(run, good_run)


def test_without_the_latest_pointer_the_highest_step_is_checked_too(good_run, tmp_path):
    run = _copy(good_run, tmp_path)
    (run / "checkpoints" / "latest").unlink()
    (run / "checkpoints" / STEP / ckpt.STATE_FILE).unlink()
    with pytest.raises(BadInput, match=f"{STEP}.*is missing") as e:
        ckpt.latest_checkpoint(run)
    assert "step_000001" in e.value.hint


@pytest.mark.parametrize("name", [ckpt.STATE_FILE, "model.safetensors"])
def test_a_bit_flip_is_caught_by_the_checksum_at_resume(good_run, tmp_path, name):
    run = _copy(good_run, tmp_path)
    f = run / "checkpoints" / STEP / name
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0x10
    f.write_bytes(data)
    _exit_2(_resume_args(run), name, "checksum")
    assert not (run / ".lock").exists()
    _resumes_after_repair(run, good_run)


def test_a_checkpoint_without_a_manifest_resumes_with_a_note(good_run, tmp_path):
    run = _copy(good_run, tmp_path)
    (run / "checkpoints" / STEP / manifest.MANIFEST).unlink()
    with time_limit(60):
        r = invoke(app, _resume_args(run))
    assert r.exit_code == 0, r.stderr[-2000:]
    assert "not verified" in r.stderr and json.loads(r.stdout)["steps"] == 3


# ---------------------------------------------------------------- dflash eval on a damaged export
def _export(good_run: Path, tmp_path: Path, config=None, tensors=None, keep_manifest=False) -> Path:
    from safetensors.torch import load_file, save_file

    ck = tmp_path / "export"
    shutil.copytree(good_run / "checkpoints" / STEP, ck)
    if config is not None:
        cfg = json.loads((ck / "config.json").read_text())
        config(cfg)
        (ck / "config.json").write_text(json.dumps(cfg))
    if tensors is not None:
        t = load_file(ck / "model.safetensors")
        tensors(t)
        save_file(t, ck / "model.safetensors")
    if not keep_manifest:
        (ck / manifest.MANIFEST).unlink()  # an older export: the contents checks alone must hold
    return ck


def _dc(key, value):
    return lambda c: c["dflash_config"].__setitem__(key, value)


EXPORT_CASES = {
    "a tensor of the wrong shape": (dict(tensors=lambda t: t.__setitem__("fc.weight", torch.zeros(3, 3))), "fc.weight"),
    "a tensor missing": (dict(tensors=lambda t: t.pop("norm.weight")), "missing"),
    "an integer tensor": (dict(tensors=lambda t: t.__setitem__("norm.weight", torch.ones(64, dtype=torch.int32))), "I32"),
    "hidden_size changed": (dict(config=lambda c: c.__setitem__("hidden_size", 128)), "does not match its config.json"),
    "intermediate_size 1e9": (dict(config=lambda c: c.__setitem__("intermediate_size", 10**9)), "intermediate_size"),
    "a mask token id past the vocabulary": (dict(config=_dc("mask_token_id", 10**6)), "mask_token_id"),
    "a negative mask token id": (dict(config=_dc("mask_token_id", -1)), "mask_token_id"),
    "a tap past the target": (dict(config=_dc("target_layer_ids", [1, 99])), "target_layer_ids"),
    "a rope factor that is a string": (dict(config=lambda c: c.__setitem__(
        "rope_scaling", {"rope_type": "linear", "factor": "4"})), "rope_scaling.factor"),
    "rope_scaling a string": (dict(config=lambda c: c.__setitem__("rope_scaling", "linear")), "rope_scaling"),
    "an unknown rope type": (dict(config=lambda c: c.__setitem__("rope_scaling", {"rope_type": "wat"})), "wat"),
    "an unknown layer type": (dict(config=lambda c: c.__setitem__("layer_types", ["x", "full_attention"])), "layer_types"),
    "heads that do not divide": (dict(config=lambda c: c.__setitem__("num_key_value_heads", 3)), "num_key_value_heads"),
}


@pytest.mark.parametrize("case", sorted(EXPORT_CASES))
def test_eval_of_a_damaged_export_exits_2_before_allocating(good_run, tmp_path, monkeypatch, case):
    kwargs, words = EXPORT_CASES[case]
    ck = _export(good_run, tmp_path, **kwargs)

    def never(*a, **k):
        raise AssertionError("the drafter was built from a config that does not check out")

    monkeypatch.setattr(ckpt, "DFlashDrafter", never)  # load_export's build: must not be reached
    _exit_2(["eval", str(ck), "-n", "1", "--max-new-tokens", "4"], words)


def test_a_mask_token_past_the_targets_vocabulary_is_refused_against_the_target(good_run, tmp_path):
    ck = _export(good_run, tmp_path, config=lambda c: (c.__setitem__("vocab_size", 5000), _dc("mask_token_id", 4000)(c)))
    _exit_2(["eval", str(ck), "-n", "1", "--max-new-tokens", "4"], "mask token id 4000", "vocabulary")


def test_eval_checks_the_export_checksum_and_notes_a_missing_manifest(good_run, tmp_path):
    ck = _export(good_run, tmp_path, keep_manifest=True)
    f = ck / "model.safetensors"
    data = bytearray(f.read_bytes())
    data[-3] ^= 1
    f.write_bytes(data)
    _exit_2(["eval", str(ck), "-n", "1", "--max-new-tokens", "4"], "model.safetensors", "checksum")
    shutil.rmtree(ck)
    ck = _export(good_run, tmp_path)
    with time_limit(60):
        r = invoke(app, ["eval", str(ck), "-n", "1", "--max-new-tokens", "4", "--json"])
    assert r.exit_code == 0 and "not verified" in r.stderr


def test_eval_of_an_export_whose_weights_are_a_fifo_does_not_block(good_run, tmp_path):
    ck = _export(good_run, tmp_path)
    (ck / "model.safetensors").unlink()
    os.mkfifo(ck / "model.safetensors")
    with time_limit(30), pytest.raises(BadInput):
        ckpt.load_export(ck)
    _exit_2(["eval", str(ck), "-n", "1"], limit=30)


# ---------------------------------------------------------------- data: oversized and assistant-first records
def test_a_100_mb_line_is_skipped_unread_in_bounded_memory(tmp_path):
    """A sparse 100 MB line (no disk used) is read past in chunks: peak Python memory stays near the
    line cap (~3 MiB by default), nowhere near the line."""
    from dflash.data.dataset import OVERSIZED_LINE, read_jsonl, stats_with_warnings

    p = tmp_path / "big.jsonl"
    good = json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]})
    with open(p, "wb") as fh:
        fh.write(good.encode() + b"\n")
        fh.seek(100 << 20, os.SEEK_CUR)
        fh.write(b"\n" + good.encode() + b"\n")
    tracemalloc.start()
    try:
        with time_limit(30):
            convs, warnings = read_jsonl(p)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert len(convs) == 2 and len(warnings) == 1 and "big.jsonl:2" in warnings[0]
    assert peak < 32 << 20, peak
    assert stats_with_warnings(warnings).dropped == {OVERSIZED_LINE: 1}


def test_an_oversized_record_never_reaches_the_tokenizer(tmp_path, monkeypatch):
    from dflash.config import DataConfig
    from dflash.data import dataset

    rows = [{"messages": [{"role": "user", "content": "q " * 3000}, {"role": "assistant", "content": "a"}]},
            {"messages": [{"role": "user", "content": "ok"}, {"role": "assistant", "content": "fine"}]}]
    p = write_jsonl(tmp_path / "d.jsonl", rows)
    cfg = DataConfig(path=str(p), max_record_chars=1000)
    convs, warnings = dataset.load_conversations(cfg)
    assert len(convs) == 1 and dataset.warning_reason(warnings[0]) == dataset.OVERSIZED_RECORD
    stats = dataset.DataStats()

    def tokenizer_called(*a, **k):
        raise AssertionError("tokenized")

    monkeypatch.setattr(dataset, "tokenize_conversation", tokenizer_called)
    assert dataset.tokenize_record(None, dataset.normalize_record(rows[0]), 1, 96, 8, stats, 1000) is None
    assert stats.dropped == {dataset.OVERSIZED_RECORD: 1}


def _chat(*turns):
    return {"messages": [{"role": r, "content": c} for r, c in turns]}


def test_oversized_and_assistant_first_records_are_counted_or_strict_errors(tmp_path):
    from dflash.data.dataset import ASSISTANT_FIRST, OVERSIZED_LINE, OVERSIZED_RECORD
    from dflash.model.target import tiny_words

    words = tiny_words()
    answer = " ".join(words[i % len(words)] for i in range(40))
    rows = [_chat(("user", "ba be"), ("assistant", answer))] * 6 + [
        _chat(("system", "be"), ("assistant", answer), ("user", "ba"), ("assistant", answer)),  # assistant first
        _chat(("user", "ba " * 400), ("assistant", answer)),  # over 1000 characters
        "x" * 20000,  # under the line cap (16 x 1000 + 64 KiB bytes): read, and unreadable JSON
        json.dumps(_chat(("user", "b" * 90000), ("assistant", "a"))),  # over the line cap: never parsed
    ]
    data = write_jsonl(tmp_path / "d.jsonl", rows)
    base = ["train", "--data", str(data), "--set", "data.max_record_chars=1000", "--set", "data.cache_dir=off",
            "--set", "data.regenerate=false", "--set", "metrics.tensorboard=false", "--set", "eval.at_end=false",
            "--max-steps", "1"]
    with time_limit(60):
        r = invoke(app, [*base, "--out", str(tmp_path / "run"), "--json"])
    assert r.exit_code == 0, r.stderr[-2000:]
    from dflash.config import load_toml

    run = tmp_path / "run"
    start = next(json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if '"start"' in x)
    dropped = start["data"]["dropped"]
    assert dropped[ASSISTANT_FIRST] == 1 and dropped[OVERSIZED_RECORD] == 1 and dropped[OVERSIZED_LINE] == 1
    assert load_toml(run / "config.toml").data.max_record_chars == 1000
    _exit_2([*base, "--out", str(tmp_path / "strict"), "--strict"], "data.strict", ASSISTANT_FIRST, OVERSIZED_LINE)
    assert not (tmp_path / "strict").exists()


# ---------------------------------------------------------------- properties: a value or BadInput
_scalars = (st.none() | st.booleans() | st.integers(-(2**40), 2**40) | st.floats(allow_nan=True) | st.text(max_size=12))
_json = st.recursive(_scalars, lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=8), c, max_size=3),
                     max_leaves=8)


def _mutated(data, doc, leaves):
    """`doc` with one to three nodes below the top replaced by `leaves` values or dropped."""
    for _ in range(data.draw(st.integers(1, 3))):
        doc = _mutate_one(data, doc, leaves, top=True)
    return doc


def _near(v):
    """Values close to `v`: what a damaged or foreign file most likely holds in its place."""
    if isinstance(v, torch.Tensor):
        shape = tuple(v.shape)
        return st.sampled_from([torch.float32, torch.float16, torch.bfloat16, torch.int64]).flatmap(
            lambda dt: st.sampled_from([torch.zeros(shape, dtype=dt), torch.full(shape, float("nan")).to(dt),
                                        torch.zeros((*shape, 1), dtype=dt), torch.zeros(shape[1:], dtype=dt)]))
    if isinstance(v, bool):
        return st.booleans() | st.none()
    if isinstance(v, (int, float)):
        return st.sampled_from([0, 1, -1, 2, 3, 4, 0.5, -0.5, 1e30, float("nan"), float("inf"), 2**63])
    return st.nothing()


def _mutate_one(data, doc, leaves, top=False):
    if not isinstance(doc, (dict, list, tuple)) or not doc or (not top and data.draw(st.integers(0, 4)) == 0):
        return data.draw(leaves | _near(doc))
    if isinstance(doc, dict):
        key = data.draw(st.sampled_from(sorted(doc, key=str)))
        if data.draw(st.integers(0, 3)) == 0:
            return {k: v for k, v in doc.items() if k != key}
        return {**doc, key: _mutate_one(data, doc[key], leaves)}
    i = data.draw(st.integers(0, len(doc) - 1))
    items = list(doc)
    items[i] = _mutate_one(data, items[i], leaves)
    return type(doc)(items)


@PROPS
@given(data=st.data())
def test_property_export_config_json_gives_a_spec_or_bad_input(good_run, data):
    cfg = json.loads((good_run / "checkpoints" / STEP / "config.json").read_text())
    doc = _mutated(data, cfg, _json | st.integers(-3, 10**10))
    with time_limit(20):
        try:
            spec = ckpt.spec_from_config(doc)
        except BadInput:
            return
    assert spec_problems(spec) == []  # what passed is buildable within the bounds
    if spec.intermediate_size * spec.hidden_size < 1 << 24 and spec.hidden_size * spec.num_hidden_layers < 1 << 16:
        ckpt.DFlashDrafter(spec)  # small enough to build here: it builds


def _tensors():
    shapes = st.lists(st.integers(0, 4), max_size=3).map(tuple)
    dtypes = st.sampled_from([torch.float32, torch.float16, torch.int64, torch.bool])
    return st.builds(lambda s, d: torch.zeros(s, dtype=d), shapes, dtypes)


@pytest.fixture(scope="module")
def model_and_state(good_run):
    from dflash.model.drafter import DFlashDrafter, DrafterSpec

    state = torch.load(good_run / "checkpoints" / STEP / ckpt.STATE_FILE, weights_only=True)
    spec = DrafterSpec(**ckpt.load_training_state(good_run / "checkpoints" / STEP)["spec"])
    return spec, state


@PROPS
@given(data=st.data())
def test_property_a_training_state_fits_or_is_bad_input_and_a_fit_loads_and_steps(model_and_state, data):
    import copy

    from dflash.model.drafter import DFlashDrafter

    spec, good = model_and_state
    state = _mutated(data, copy.deepcopy(good), _json | _tensors())
    drafter = DFlashDrafter(spec)
    opt = torch.optim.AdamW(drafter.parameters(), lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
    with time_limit(20):
        if not isinstance(state, dict):
            return
        try:
            check_training_state(state, drafter, opt, 3, "state")
        except BadInput as e:
            assert "\n" not in e.message
            return
        drafter.load_state_dict(state["model"])  # what passed loads, and one optimizer step runs
        load_optimizer_state(opt, state["optimizer"])
        for p in drafter.parameters():
            p.grad = torch.ones_like(p)
        opt.step()


@PROPS
@given(lines=st.lists(_json.map(json.dumps) | st.binary(max_size=60).map(lambda b: b.decode("latin-1"))
                      | st.builds(lambda t, r: json.dumps(_chat(*zip(r, t))), st.lists(st.text(max_size=30), max_size=4),
                                  st.lists(st.sampled_from(["user", "assistant", "system", "tool"]), max_size=4)),
                      max_size=6),
       limit=st.integers(1, 200))
def test_property_jsonl_records_give_conversations_or_counted_skips(tmp_path_factory, lines, limit):
    from dflash.data.dataset import DataStats, read_jsonl, tokenize_record
    from dflash.model.target import build_tiny_tokenizer

    tok = _tokenizer(build_tiny_tokenizer)
    p = tmp_path_factory.mktemp("jsonl") / "d.jsonl"
    p.write_bytes("\n".join(lines).encode("utf-8", "surrogateescape"))
    with time_limit(20):
        convs, warnings = read_jsonl(p, max_chars=limit, max_line_bytes=16 * limit + 64)
        assert all(sum(len(m["content"]) + len(m["role"]) for m in c) <= limit for c in convs)
        stats = DataStats()
        for n, c in enumerate(convs, 1):
            out = tokenize_record(tok, c, n, 64, 4, stats, limit)
            assert out is None or len(out[0]) == len(out[1]) <= 64
        assert stats.records == len(convs) == stats.kept + stats.skipped


_TOK = {}


def _tokenizer(build):
    if "tok" not in _TOK:
        _TOK["tok"] = build()
    return _TOK["tok"]


def test_a_lock_that_cannot_be_written_is_not_left_behind(tmp_path, monkeypatch):
    """A full disk between creating RUN/.lock and writing it: bad input, and no lock that would make
    the next start refuse."""
    from dflash.checkpoint import runlock

    def full(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(runlock.json, "dump", full)
    with pytest.raises(BadInput, match="No space left"):
        runlock.RunLock(tmp_path).acquire()
    assert not (tmp_path / runlock.LOCK_NAME).exists()


@PROPS
@given(data=st.data())
def test_property_bit_flipped_checkpoint_files_load_or_are_bad_input(good_run, tmp_path_factory, data):
    """Real training_state.pt / model.safetensors bytes with a few flipped bits or cut short, and no
    manifest to catch them: each loader gives a value or BadInput (torch's zip reader, the pickle
    and safetensors' header parser all see damage)."""
    name = data.draw(st.sampled_from([ckpt.STATE_FILE, "model.safetensors"]))
    ck = tmp_path_factory.mktemp("flip") / "ck"
    shutil.copytree(good_run / "checkpoints" / STEP, ck)
    (ck / manifest.MANIFEST).unlink()
    raw = bytearray((ck / name).read_bytes())
    reach = len(raw) if name == ckpt.STATE_FILE else min(len(raw), 8 + int.from_bytes(raw[:8], "little") + 64)
    for pos in data.draw(st.lists(st.integers(0, reach - 1), min_size=1, max_size=6)):
        raw[pos] ^= 1 << data.draw(st.integers(0, 7))
    if data.draw(st.booleans()):
        raw = raw[: data.draw(st.integers(0, len(raw)))]
    (ck / name).write_bytes(raw)
    with time_limit(20):
        try:
            ckpt.load_training_state(ck) if name == ckpt.STATE_FILE else ckpt.load_export(ck)
        except BadInput as e:
            assert "\n" not in e.message
