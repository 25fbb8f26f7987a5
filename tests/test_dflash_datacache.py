"""dflash.data.cache: the memory-mapped tokenized-data cache equals in-memory tokenization, is keyed,
atomic, checked, and shared by ranks without overlap."""

from __future__ import annotations

import json
import types

import numpy as np
import pytest
import torch

from compilewatch.errors import BadInput
from dflash.data import cache as datacache
from dflash.config import DataConfig
from dflash.data.dataset import ChatDataset, build_dataset, read_jsonl
from tests.dflash_helpers import tiny_target, write_jsonl, write_word_chats  # noqa: F401 (fixture)
from tests.test_dflash_chat_mask import PLAIN, THINK, byte_tokenizer

BS = 4


def _cfg(path, **kw) -> DataConfig:
    return DataConfig(path=str(path), max_length=kw.pop("max_length", 48), num_anchors=4, batch_size=4, **kw)


def _same(ds_a, ds_b) -> None:
    assert len(ds_a) == len(ds_b)
    for a, b in zip(ds_a, ds_b):
        assert torch.equal(a.input_ids, b.input_ids) and a.input_ids.dtype == b.input_ids.dtype == torch.long
        assert torch.equal(a.loss_mask, b.loss_mask) and b.loss_mask.dtype == torch.bool


def _mixed_file(tmp_path):
    """Word chats plus every skip reason: an unreadable line, no assistant turn, a too-short answer."""
    path = write_word_chats(tmp_path / "d.jsonl", n=40)
    with open(path, "a") as fh:
        fh.write("{not json\n")
        fh.write(json.dumps({"messages": [{"role": "user", "content": "ba"}]}) + "\n")
        fh.write(json.dumps({"messages": [{"role": "user", "content": "ba"}, {"role": "assistant", "content": "x"}]}) + "\n")
    return path


def test_cache_equals_in_memory_tokenization_and_stats(tiny_target, tmp_path):
    path = _mixed_file(tmp_path)
    cfg = _cfg(path)
    tok = tiny_target.tokenizer
    convs, warnings = read_jsonl(path)
    mem = build_dataset(convs, tok, cfg, BS, 0, warnings)
    before = datacache.BUILDS["count"]
    built = datacache.prepare(cfg, tok, BS, root=tmp_path / "c")
    assert not built.hit and datacache.BUILDS["count"] == before + 1
    assert isinstance(built.samples, datacache.MappedSamples)
    _same(mem.samples, built.samples)
    assert built.stats == mem.stats  # kept, truncated, skipped by reason with the same examples
    assert mem.stats.truncated > 0 and len(mem.stats.dropped) == 3
    again = datacache.prepare(cfg, tok, BS, root=tmp_path / "c")
    assert again.hit and datacache.BUILDS["count"] == before + 1  # a hit: nothing tokenized
    assert again.stats == mem.stats and again.cache_dir == built.cache_dir
    _same(mem.samples, again.samples)
    ds = ChatDataset(again.samples, cfg, BS, 0, again.stats)
    for e in (0, 1):  # the same plan and batches as the in-memory dataset
        assert ds.epoch_plan(e) == mem.epoch_plan(e)
        for ix in ds.epoch_plan(e)[:2]:
            a, b = ds.make_batch(ix, e), mem.make_batch(ix, e)
            for f in a.__dataclass_fields__:
                assert torch.equal(getattr(a, f), getattr(b, f))


@pytest.mark.parametrize("name", ["qwen3", "llama3.2", "mistral_nemo"])
def test_multi_turn_chat_templates_cached_token_for_token(name, tmp_path):
    tok = byte_tokenizer(name)
    rows = [{"messages": m} for m in (THINK, PLAIN) for _ in range(3)]
    path = write_jsonl(tmp_path / "x.jsonl", rows)
    cfg = _cfg(path, max_length=4096)
    mem = build_dataset(read_jsonl(path)[0], tok, cfg, BS, 0)
    cached = datacache.prepare(cfg, tok, BS, root=tmp_path / "c")
    assert len(cached.samples) == 6 and not cached.stats.dropped
    _same(mem.samples, cached.samples)


def test_parallel_build_equals_inline(tiny_target, tmp_path, monkeypatch):
    monkeypatch.setattr(datacache, "SHARD_RECORDS", (8, 8))  # 6 shards over 2 spawned workers
    path = _mixed_file(tmp_path)
    cfg = _cfg(path)
    inline = datacache.prepare(cfg, tiny_target.tokenizer, BS, root=tmp_path / "a", workers=1)
    par = datacache.prepare(cfg, tiny_target.tokenizer, BS, root=tmp_path / "b", workers=2)
    assert par.workers == 2 and par.shards == 6 and inline.shards == 6
    _same(inline.samples, par.samples)
    assert par.stats == inline.stats


def test_a_changed_key_rebuilds(tiny_target, tmp_path):
    path = write_word_chats(tmp_path / "d.jsonl", n=12)
    tok, root = tiny_target.tokenizer, tmp_path / "c"
    first = datacache.prepare(_cfg(path), tok, BS, root=root)
    dirs = {first.cache_dir}
    changes = [
        lambda: datacache.prepare(_cfg(path, max_length=40), tok, BS, root=root),  # max length
        lambda: datacache.prepare(_cfg(path), tok, BS + 1, root=root),  # block size (the no-anchor rule)
        lambda: datacache.prepare(_cfg(path), tok, BS, root=root, n_eval=2),  # eval prompts held out
    ]
    other_tok = byte_tokenizer("qwen3")  # another tokenizer and template
    changes.append(lambda: datacache.prepare(_cfg(path), other_tok, BS, root=root))
    for change in changes:
        p = change()
        assert not p.hit and p.cache_dir not in dirs
        dirs.add(p.cache_dir)
    with open(path, "a") as fh:  # the file's content
        fh.write(json.dumps({"messages": [{"role": "user", "content": "ba"}, {"role": "assistant", "content": "bo " * 9}]}) + "\n")
    edited = datacache.prepare(_cfg(path), tok, BS, root=root)
    assert not edited.hit and edited.cache_dir not in dirs and len(edited.samples) == len(first.samples) + 1
    tok2 = byte_tokenizer("qwen3")
    tok2.chat_template = tok2.chat_template.replace("<|im_start|>", "<|im_start|> ")  # the template alone
    assert datacache.tokenizer_fingerprint(tok2) != datacache.tokenizer_fingerprint(other_tok)
    assert datacache.prepare(_cfg(path), tok, BS, root=root).hit  # and the unchanged key still hits


def test_a_torn_build_is_never_used(tiny_target, tmp_path, monkeypatch):
    path = write_word_chats(tmp_path / "d.jsonl", n=12)
    cfg, tok, root = _cfg(path), tiny_target.tokenizer, tmp_path / "c"
    real = datacache._write_synced

    def crash_on_manifest(p, data):
        if p.name == datacache.MANIFEST:
            raise KeyboardInterrupt("killed while writing the manifest")
        real(p, data)

    monkeypatch.setattr(datacache, "_write_synced", crash_on_manifest)
    with pytest.raises(KeyboardInterrupt):
        datacache.prepare(cfg, tok, BS, root=root)
    assert [p.name for p in root.iterdir() if not p.name.endswith(".lock")] == []  # no key dir, no temp left
    monkeypatch.setattr(datacache, "_write_synced", real)
    # a crash the cleanup never saw (SIGKILL): a directory without its manifest under the key's name
    good = datacache.prepare(cfg, tok, BS, root=root)
    key_dir = root / good.key
    (key_dir / datacache.MANIFEST).unlink()
    before = datacache.BUILDS["count"]
    again = datacache.prepare(cfg, tok, BS, root=root)
    assert not again.hit and datacache.BUILDS["count"] == before + 1
    assert any("no manifest.json" in n for n in again.notes)
    assert len(list(root.glob(f"{good.key}.corrupt-*"))) == 1  # moved aside, not deleted


@pytest.mark.parametrize("damage", ["manifest", "fields", "shard", "index", "bounds"])
def test_corrupted_cache_files_are_rebuilt_not_a_traceback(damage, tiny_target, tmp_path):
    path = write_word_chats(tmp_path / "d.jsonl", n=12)
    cfg, tok, root = _cfg(path), tiny_target.tokenizer, tmp_path / "c"
    good = datacache.prepare(cfg, tok, BS, root=root)
    d = root / good.key
    ref = [(s.input_ids.clone(), s.loss_mask.clone()) for s in good.samples]
    del good
    if damage == "manifest":
        (d / datacache.MANIFEST).write_text("{half a manif")
    elif damage == "fields":
        man = json.loads((d / datacache.MANIFEST).read_text())
        man["stats"]["surprise"] = 1
        del man["shards"][0]["mask"]
        (d / datacache.MANIFEST).write_text(json.dumps(man))
    elif damage == "shard":
        with open(d / "shard-00000.tokens", "r+b") as fh:
            fh.truncate(8)
    elif damage == "index":
        (d / datacache.INDEX).write_bytes(b"\x93NUMPY garbage")
    else:
        idx = np.load(d / datacache.INDEX)
        idx[0, 1] = 10**9
        np.save(d / datacache.INDEX, idx)
    with pytest.raises(datacache.CorruptCache):
        datacache.open_cache(d)
    again = datacache.prepare(cfg, tok, BS, root=root)
    assert not again.hit and "moved to" in again.notes[0]
    assert len(again.samples) == len(ref) and all(
        torch.equal(a[0], b.input_ids) and torch.equal(a[1], b.loss_mask) for a, b in zip(ref, again.samples))


def test_strict_and_empty_data_are_bad_input_on_a_hit_too(tiny_target, tmp_path):
    path = _mixed_file(tmp_path)
    root = tmp_path / "c"
    datacache.prepare(_cfg(path), tiny_target.tokenizer, BS, root=root)
    with pytest.raises(BadInput, match="data.strict: 3 of 43 records would be skipped"):
        datacache.prepare(_cfg(path, strict=True), tiny_target.tokenizer, BS, root=root)  # same key: a hit
    empty = write_jsonl(tmp_path / "e.jsonl", [{"messages": [{"role": "user", "content": "ba"}]}])
    with pytest.raises(BadInput, match="no usable conversation"):
        datacache.prepare(_cfg(empty), tiny_target.tokenizer, BS, root=root)
    assert len([p for p in root.iterdir() if not p.name.startswith(".")]) == 1  # nothing cached for it


def test_rank_shares_are_disjoint_cover_the_epoch_and_read_only_their_samples(tiny_target, tmp_path):
    from dflash.engine.program import Plan

    path = write_word_chats(tmp_path / "d.jsonl", n=48)  # 12 batches: 3 steps of 2 ranks x 2 micro-batches
    cfg = _cfg(path)
    world, per_step = 2, 2
    seen = []
    for rank in range(world):
        p = datacache.prepare(cfg, tiny_target.tokenizer, BS, root=tmp_path / "c")  # each rank maps the cache
        ds = ChatDataset(p.samples, cfg, BS, 0, p.stats)
        plan = Plan(types.SimpleNamespace(dataset=ds), per_step, rank, world)
        for i in range(plan.steps_per_epoch * per_step):
            plan.batch(i)
        whole = ds.epoch_plan(0)
        ix = [whole[plan.global_index(i)] for i in range(plan.steps_per_epoch * per_step)]
        seen.append({s for batch in ix for s in batch})
        assert p.samples.reads == sum(len(b) for b in ix)  # the map was read for this rank's samples only
    assert not seen[0] & seen[1]
    per_epoch = plan.steps_per_epoch * per_step * world * cfg.batch_size
    assert len(seen[0] | seen[1]) == per_epoch == 48  # together: every sample of the epoch once


def test_trainer_second_start_is_a_cache_hit(tiny_target, tmp_path):
    from dflash.training.trainer import Trainer
    from tests.dflash_helpers import small_config

    chat_file = write_word_chats(tmp_path / "d.jsonl", n=24)

    cfg = small_config(tmp_path / "run", chat_file, **{"train.max_steps": 1})
    t = Trainer.from_config(cfg)
    try:
        assert any(n.startswith("data cache built") for n in t.notes)
        first = [(s.input_ids, s.loss_mask) for s in t.dataset.samples]
        t.train()  # one step and its checkpoint (resumed below)
    finally:
        t.close()
    before = datacache.BUILDS["count"]
    t2 = Trainer.from_config(small_config(tmp_path / "run2", chat_file, **{"train.max_steps": 1}))
    try:
        assert datacache.BUILDS["count"] == before and any(n.startswith("data cache hit") for n in t2.notes)
        assert all(torch.equal(a[0], b.input_ids) and torch.equal(a[1], b.loss_mask)
                   for a, b in zip(first, t2.dataset.samples))
    finally:
        t2.close()
    from dflash.checkpoint.resume import build_config_for_resume

    before = datacache.BUILDS["count"]
    r = Trainer.from_config(build_config_for_resume(tmp_path / "run", {"train.max_steps": 2}), resume=True)
    try:
        assert r.step == 1 and datacache.BUILDS["count"] == before and any(n.startswith("data cache hit") for n in r.notes)
    finally:
        r.close()
    off = Trainer.from_config(small_config(tmp_path / "run3", chat_file, **{"data.cache_dir": "off"}))
    try:
        assert isinstance(off.dataset.samples, list) and not any("data cache" in n for n in off.notes)
    finally:
        off.close()


def test_benchmark_script_runs_small(tmp_path):
    """benchmarks/dflash_data.py end to end at a tiny size (its numbers are not asserted)."""
    import importlib.util
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "dflash_data.py"
    spec = importlib.util.spec_from_file_location("dflash_data_bench", script)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.main(["--conversations", "64", "--words", "60", "--workers", "1", "--out", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "dflash_data.json").read_text())
    assert res["builds"]["1"]["kept"] == 64 and res["reader_rank0"]["hit"] and res["reader_all"]["samples_read"] == 64
    assert res["reader_rank0"]["samples_read"] == res["reader_rank0"]["batches"] * 4 < 64  # its share only


def test_ranks_starting_together_build_once(tiny_target, tmp_path):
    import threading

    path = write_word_chats(tmp_path / "d.jsonl", n=12)
    cfg, root = _cfg(path), tmp_path / "c"
    start = threading.Barrier(2)
    got: list = [None, None]

    def rank(i: int) -> None:
        start.wait()
        got[i] = datacache.prepare(cfg, tiny_target.tokenizer, BS, root=root)

    before = datacache.BUILDS["count"]
    threads = [threading.Thread(target=rank, args=(i,)) for i in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert datacache.BUILDS["count"] == before + 1  # the file lock: one built, the other read its result
    assert sorted(p.hit for p in got) == [False, True] and got[0].cache_dir == got[1].cache_dir
