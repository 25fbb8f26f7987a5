"""Packed micro-batches (dflash/data/packing.py): the plan, the drafter's packed mask, and the same
numbers as the padded layout on the same conversations and anchors.

Tolerances: both layouts compute the same sums over the same keys in fp32, in another order (other
lengths, masked entries in other places), so values agree to fp32 rounding over a few hundred terms:
|Δ| <= 1e-5 absolute / 1e-4 relative is ~100 x the rounding of one such sum and far below any real
difference (one token's key more or less changes the hidden states by ~1e-2 here).
"""

from __future__ import annotations

import dataclasses
import json
import random

import numpy as np
import pytest
import torch

from dflash.data.packing import Pack, PackedBatch, candidate_counts, make_packed_batch, pack, warm_packed_batches
from tests.dflash_helpers import chat_file, small_config, tiny_target  # noqa: F401 - fixtures
from tests.helpers import requires_cuda

ATOL, RTOL = 1e-5, 1e-4


# ---------------------------------------------------------------- the plan
def test_pack_places_every_sample_once_within_both_budgets():
    rng = np.random.default_rng(0)
    n = 500
    lengths = rng.integers(20, 400, n)
    blocks = np.minimum(rng.integers(1, 200, n), lengths // 2)
    order = rng.permutation(n).tolist()
    budget = int(blocks.sum() / lengths.sum() * 1600)  # the data's blocks per token: as the dataset sets it
    packs = pack(order, lengths, blocks, rows=4, row_len=400, block_budget=budget)
    placed = [i for p in packs for i in p.samples]
    assert sorted(placed) == list(range(n))
    for p in packs:
        assert 1 <= len(p.rows) <= 4
        assert all(lengths[list(r)].sum() <= 400 for r in p.rows)
        assert blocks[p.samples].sum() <= budget
    # all but the last few packs are nearly full in both budgets
    tokens = [sum(lengths[list(r)].sum() for r in p.rows) / 1600 for p in packs]
    blks = [blocks[p.samples].sum() / budget for p in packs]
    assert np.mean(tokens[:-3]) > 0.93 and np.mean(blks[:-3]) > 0.93, (np.mean(tokens[:-3]), np.mean(blks[:-3]))
    # a budget that binds first (fewer blocks than the tokens bring) is still filled
    tight_budget = max(int(blocks.max()), budget // 3)
    tight = pack(order, lengths, blocks, rows=4, row_len=400, block_budget=tight_budget)
    assert np.mean([blocks[p.samples].sum() / tight_budget for p in tight][:-3]) > 0.9
    assert pack(order, lengths, blocks, rows=4, row_len=400, block_budget=budget) == packs  # deterministic


def test_pack_refuses_a_sample_that_fits_no_micro_batch():
    with pytest.raises(ValueError, match="does not fit"):
        pack([0], np.array([500]), np.array([1]), rows=2, row_len=400, block_budget=64)


# ---------------------------------------------------------------- the packed mask
def _layout(seed: int, rows: int, row_len: int, n_blocks: int, block_size: int):
    """Random conversations in rows and their blocks, as the packer lays them out (valid blocks first)."""
    rng = random.Random(seed)
    arow, acol, start = [], [], []
    for r in range(rows):
        off = 0
        while off < row_len - block_size:
            n = rng.randint(block_size, min(row_len - off, 3 * block_size + 7))
            for a in sorted(rng.sample(range(n - block_size + 1), k=min(3, n - block_size + 1))):
                arow.append(r), acol.append(off + a), start.append(off)
            off += n
    keep = min(n_blocks, len(arow))
    pad = n_blocks - keep
    t = lambda xs: torch.tensor(xs[:keep] + [0] * pad, dtype=torch.long)  # noqa: E731
    return t(arow), t(start), t(acol)


@pytest.mark.parametrize("window", [None, 21])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_packed_block_mask_has_the_tiles_of_the_evaluated_mask(seed, window):
    from dflash.model.mask import block_mask_eager, flex_len, make_packed_mask_mod, packed_block_mask, pad_mask_mod

    bs, rows, row_len, n_blocks = 16, 3, 200, 40  # lengths not multiples of 128: the padded grid too
    arow, start, acol = _layout(seed, rows, row_len, n_blocks, bs)
    ctx = rows * row_len
    got = packed_block_mask(arow, start, acol, row_len, ctx, bs, window)
    mod = make_packed_mask_mod(arow, start, acol, row_len, ctx, bs, window)
    q_len, kv_len = n_blocks * bs, ctx + n_blocks * bs
    want = block_mask_eager(pad_mask_mod(mod, q_len, kv_len), 1, flex_len(q_len), flex_len(kv_len), "cpu")
    for name in ("kv_num_blocks", "full_kv_num_blocks"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    for num, idx in (("kv_num_blocks", "kv_indices"), ("full_kv_num_blocks", "full_kv_indices")):
        counts = getattr(want, num)[0, 0]
        for t, c in enumerate(counts.tolist()):  # the visible tiles of each query tile, in the same order
            assert torch.equal(getattr(got, idx)[0, 0, t, :c], getattr(want, idx)[0, 0, t, :c])
    # the BlockMask's own mask_mod (per-row key intervals, what flex evaluates in partial tiles) is the
    # padded row formula at every entry of the padded grid
    q = torch.arange(flex_len(q_len))[:, None]
    kv = torch.arange(flex_len(kv_len))[None]
    zero = torch.zeros((), dtype=torch.long)
    assert torch.equal(got.mask_mod(zero, zero, q, kv), pad_mask_mod(mod, q_len, kv_len)(zero, zero, q, kv))


def test_packed_mask_sees_own_conversation_before_the_anchor_and_own_block_only():
    from dflash.model.mask import dense_mask, make_packed_mask_mod

    bs, L = 4, 12
    # row 0: conversation [0, 7), [7, 12); row 1: [0, 12). Blocks: (row 0, anchor 5), (row 0, anchor 9), (row 1, anchor 2)
    arow, start, acol = torch.tensor([0, 0, 1]), torch.tensor([0, 7, 0]), torch.tensor([5, 9, 2])
    m = dense_mask(make_packed_mask_mod(arow, start, acol, L, 2 * L, bs), 1, 3 * bs, 2 * L + 3 * bs, "cpu")[0, 0]
    ctx = m[:, : 2 * L]
    assert ctx[0].nonzero().flatten().tolist() == [0, 1, 2, 3, 4]  # row 0, columns 0..4
    assert ctx[bs].nonzero().flatten().tolist() == [7, 8]  # its own conversation from 7, before 9
    assert ctx[2 * bs].nonzero().flatten().tolist() == [L, L + 1]  # row 1's columns 0, 1
    own = m[:, 2 * L:]
    for j in range(3):
        assert own[j * bs: (j + 1) * bs].any(0).nonzero().flatten().tolist() == list(range(j * bs, (j + 1) * bs))


# ---------------------------------------------------------------- the same numbers as padded batches
def _mixed_dataset(tmp_path, pack_on: bool, **over):
    """The tiny recipe's data, answers of mixed lengths (a few tokens to the whole max length)."""
    from dflash.model.target import tiny_words

    words = tiny_words()
    rng = random.Random(3)
    rows = []
    for _ in range(40):
        a = rng.choice([4, 10, 25, 40, 70])
        rows.append({"messages": [{"role": "user", "content": " ".join(rng.choices(words, k=rng.randint(3, 12)))},
                                  {"role": "assistant", "content": " ".join(rng.choices(words, k=a))}]})
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / "mixed.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return small_config(tmp_path / "runs", path, **{"data.pack": pack_on, "data.cache_dir": "off", **over})


def _dataset(cfg, target):
    from dflash.data.dataset import build_dataset, load_conversations

    convs, warnings = load_conversations(cfg.data)
    return build_dataset(convs, target.tokenizer, cfg.data, cfg.drafter.block_size, cfg.train.seed, warnings)


def _padded_twin(ds_padded, pk: Pack, epoch: int):
    """The padded batch of the pack's conversations, in the pack's order."""
    return ds_padded.make_batch(pk.samples, epoch)


def test_packed_taps_equal_each_conversation_alone(tmp_path, tiny_target):
    cfg = _mixed_dataset(tmp_path, True)
    ds = _dataset(cfg, tiny_target)
    pk = ds.epoch_plan(0)[0]
    b = ds.make_batch(pk, 0)
    packed = tiny_target.taps(b.input_ids, b.position_ids)
    for r, row in enumerate(pk.rows):
        off = 0
        for i in row:
            ids = ds.samples[i].input_ids[None]
            alone = tiny_target.taps(ids)[0]
            torch.testing.assert_close(packed[r, off: off + ids.shape[1]], alone, atol=ATOL, rtol=RTOL)
            off += ids.shape[1]


def test_packed_taps_through_flash_varlen_wiring_equal_the_dense_mask(tmp_path, tiny_target, monkeypatch):
    """The packed target's attention within each conversation (dflash.model.packed_attention; on a GPU
    flash varlen, here its per-conversation SDPA reference) gives the taps of transformers' dense
    block-diagonal mask, through every layer the taps run; unmarked calls keep transformers' path."""
    from dflash.model import packed_attention

    cfg = _mixed_dataset(tmp_path, True)
    ds = _dataset(cfg, tiny_target)
    b = ds.make_batch(ds.epoch_plan(0)[0], 0)
    assert b.lengths.numel() > b.input_ids.shape[0]  # rows that hold several conversations
    tapper = tiny_target.tapper()
    assert not tapper.varlen  # a CPU target: the dense mask, unless asked
    dense = tiny_target.taps(b.input_ids, b.position_ids)
    calls = []
    attend = packed_attention._attend_documents
    monkeypatch.setattr(packed_attention, "_attend_documents", lambda *a: calls.append(a[0].shape) or attend(*a))
    monkeypatch.setattr(tapper, "varlen", True)
    varlen = tiny_target.taps(b.input_ids, b.position_ids)
    assert len(calls) == tapper.depth  # every layer the taps run
    torch.testing.assert_close(varlen, dense, atol=ATOL, rtol=RTOL)
    calls.clear()
    assert torch.equal(tiny_target.taps(b.input_ids, b.position_ids, b.run_bounds), varlen)  # the batch's own runs
    assert len(calls) == tapper.depth
    calls.clear()
    tiny_target.taps(b.input_ids)  # no positions: one sequence a row, transformers' causal path
    full = torch.arange(b.input_ids.shape[1]).repeat(b.input_ids.shape[0], 1)
    tiny_target.taps(b.input_ids, full)  # one run a row (a conversation fills it): the causal path too
    assert not calls
    with pytest.raises(RuntimeError, match="outside"):
        q = torch.zeros(1, 2, 4, 8)
        packed_attention._attend_documents(q, q, q, None)


def test_run_bounds_split_rows_at_each_conversation_and_padding_tail():
    from dflash.data.packing import run_bounds

    pos = torch.tensor([[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 4, 5]])  # row 0: 3 + 2 tokens, then a 1-token tail
    cu, longest = run_bounds(pos)
    assert cu.tolist() == [0, 3, 5, 6, 12] and cu.dtype == torch.int32 and longest == 6


@pytest.mark.parametrize("sliding", [False, True])
def test_packed_step_gives_the_padded_steps_losses_accuracy_and_gradients(tmp_path, tiny_target, sliding):
    from dflash.model import build_drafter, drafter_loss, loss_weights
    from dflash.model.build import drafter_spec

    over = {"drafter.sliding_layers": [0], "drafter.sliding_window": 21} if sliding else {}
    cfg_p = _mixed_dataset(tmp_path, True, **over)
    cfg_u = _mixed_dataset(tmp_path, False, **over)
    ds_p, ds_u = _dataset(cfg_p, tiny_target), _dataset(cfg_u, tiny_target)
    spec = drafter_spec(cfg_p, tiny_target)
    w = loss_weights(cfg_p.drafter.block_size, cfg_p.gamma)
    for pk in ds_p.epoch_plan(1)[:2]:
        bp, bu = ds_p.make_batch(pk, 1), ds_u.make_batch(pk.samples, 1)
        assert int(bp.anchor_valid.sum()) == int(bu.anchor_valid.sum())
        outs, grads = [], []
        for b in (bp, bu):
            torch.manual_seed(0)
            d = build_drafter(cfg_p, spec, torch.device("cpu"))
            taps = tiny_target.taps(b.input_ids, getattr(b, "position_ids", None))
            o = drafter_loss(d, tiny_target.embed, tiny_target.head, taps, b, mask_token_id=tiny_target.mask_token_id,
                             weights=w, denominator=1.0, backend="sdpa", compute_dtype=torch.float32)
            o.loss.backward()
            outs.append(o)
            grads.append({k: p.grad.clone() for k, p in d.named_parameters() if p.grad is not None})
        p_out, u_out = outs
        torch.testing.assert_close(p_out.weighted_ce, u_out.weighted_ce, atol=ATOL, rtol=RTOL)
        assert float(p_out.weight) == pytest.approx(float(u_out.weight), rel=1e-6)
        assert torch.equal(p_out.correct, u_out.correct) and torch.equal(p_out.count, u_out.count)
        assert float(p_out.accepted) == float(u_out.accepted) and float(p_out.full_blocks) == float(u_out.full_blocks)
        assert grads[0].keys() == grads[1].keys()
        for k in grads[0]:
            torch.testing.assert_close(grads[0][k], grads[1][k], atol=ATOL, rtol=RTOL, msg=k)


def test_packed_training_computes_fewer_padding_blocks_and_logs_it(tmp_path, tiny_target):
    from dflash.training.trainer import Trainer

    shares = {}
    for on in (True, False):
        cfg = _mixed_dataset(tmp_path / str(on), on, **{"train.max_steps": 3, "data.pack_blocks": 96})
        tr = Trainer.from_config(cfg)
        try:
            res = tr.train()
        finally:
            tr.close()
        rows = [json.loads(x) for x in open(f"{res.run_dir}/metrics.jsonl") if '"event"' not in x]
        assert rows and all(0 < r["valid_block_share"] <= 1 and 0 < r["target_fill"] <= 1 for r in rows)
        assert all(r["blocks"] <= r["block_slots"] and r["tokens"] <= r["token_slots"] for r in rows)
        shares[on] = sum(r["blocks"] for r in rows) / sum(r["block_slots"] for r in rows)
    # packed: every micro-batch but an epoch's last (its remainder) computes only valid blocks here
    assert shares[True] >= 0.9 and shares[True] > shares[False] + 0.05, shares


def test_every_epoch_has_the_same_number_of_packs_and_a_resume_sees_the_same_ones(tmp_path, tiny_target):
    cfg = _mixed_dataset(tmp_path, True)
    ds = _dataset(cfg, tiny_target)
    k = ds.batches_per_epoch()
    assert all(len(ds.epoch_plan(e)) == k for e in range(4))
    again = _dataset(cfg, tiny_target)
    assert again.epoch_plan(2) == ds.epoch_plan(2)
    b1, b2 = ds.make_batch(ds.epoch_plan(2)[0], 2), again.make_batch(again.epoch_plan(2)[0], 2)
    assert all(torch.equal(getattr(b1, f), getattr(b2, f)) for f in ("input_ids", "anchor_col", "anchor_valid"))


def test_candidate_counts_of_the_mapped_cache_match_the_samples(tmp_path, tiny_target):
    from dflash.data.cache import prepare

    cfg = _mixed_dataset(tmp_path, True, **{"data.cache_dir": str(tmp_path / "cache")})
    mapped = prepare(cfg.data, tiny_target.tokenizer, 16).samples
    assert hasattr(mapped, "candidate_counts")  # the memory-mapped cache, not a list
    want = [int(s.loss_mask[: max(0, s.loss_mask.numel() - 15)].sum()) for s in mapped]
    assert candidate_counts(mapped, 16).tolist() == want
    assert candidate_counts(list(mapped), 16).tolist() == want


def test_warm_batches_cover_each_row_count_with_and_without_a_document_boundary(tiny_target):
    from dflash.data.dataset import Sample

    s = Sample(torch.arange(40) % 50 + 10, torch.ones(40, dtype=torch.bool))
    ws = warm_packed_batches(s, rows_total=3, row_len=32, block_budget=24)
    assert sorted((w.input_ids.shape[0], bool((w.position_ids.diff(dim=1) != 1).any())) for w in ws) == [
        (r, boundary) for r in (1, 2, 3) for boundary in (False, True)]
    assert all(isinstance(w, PackedBatch) and w.block_slots == 24 and w.rows_total == 3 for w in ws)
    for w in ws:  # every shape runs through the target
        tiny_target.taps(w.input_ids, w.position_ids)


def test_make_packed_batch_refuses_blocks_over_the_budget():
    from dflash.data.dataset import Sample

    s = Sample(torch.arange(30), torch.ones(30, dtype=torch.bool))

    def anchors(i, sample):
        return torch.arange(10), torch.ones(10, dtype=torch.bool)

    with pytest.raises(ValueError, match="over the budget"):
        make_packed_batch([s, s], Pack(rows=((0, 1),)), anchors, rows_total=1, row_len=64, block_budget=12)


@requires_cuda()
@pytest.mark.parametrize("compiled", [False, True])
def test_packed_step_on_cuda_flex_matches_the_padded_step(tmp_path, compiled):
    """The GPU path: compiled flex_attention with the interval-built BlockMask (and compiled draft
    layers), bf16 autocast. Tolerance: bf16 keeps 8 bits of mantissa (~0.4% a value), and the two
    layouts round in other places; the loss sums over ~100 blocks: 2e-2 relative."""
    from dflash.model import build_drafter, drafter_loss, loss_weights
    from dflash.model.build import drafter_spec
    from dflash.model.target import load_target

    cfg_p = _mixed_dataset(tmp_path, True, **{"target.compile": compiled, "train.compile_layers": compiled})
    cfg_u = _mixed_dataset(tmp_path, False)
    dev = torch.device("cuda")
    target = load_target(cfg_p.target, cfg_p.drafter.num_layers, dev)
    ds_p, ds_u = _dataset(cfg_p, target), _dataset(cfg_u, target)
    spec = drafter_spec(cfg_p, target)
    w = loss_weights(cfg_p.drafter.block_size, cfg_p.gamma, device=dev)
    pk = ds_p.epoch_plan(0)[0]
    outs = []
    for b, cfg in ((ds_p.make_batch(pk, 0), cfg_p), (ds_u.make_batch(pk.samples, 0), cfg_u)):
        b = b.to(dev)
        torch.manual_seed(0)
        d = build_drafter(cfg, spec, dev)
        taps = target.taps(b.input_ids, getattr(b, "position_ids", None))
        o = drafter_loss(d, target.embed, target.head, taps, b, mask_token_id=target.mask_token_id, weights=w,
                         denominator=1.0, backend="flex", compute_dtype=torch.bfloat16)
        o.loss.backward()
        outs.append(o)
    p, u = outs
    assert float(p.weight) == pytest.approx(float(u.weight), rel=1e-6)
    assert float(p.weighted_ce) == pytest.approx(float(u.weighted_ce), rel=2e-2)


@requires_cuda()
def test_cuda_packed_taps_run_flash_varlen_and_compile_once_for_every_conversation_count(tmp_path):
    """On a GPU the packed target attends through flash varlen (no dense mask): each conversation's taps
    are its taps alone, and compiled target layers compile for the first micro-batch only, whatever the
    number of conversations in the next ones (the lengths never enter a compiled graph). Tolerance:
    bf16 (8 mantissa bits) through the tiny target's layers, the two paths rounding in other places."""
    from compilewatch.tracing import counters
    from dflash.model.target import load_target

    cfg = _mixed_dataset(tmp_path, True, **{"target.compile": True})
    dev = torch.device("cuda")
    target = load_target(cfg.target, cfg.drafter.num_layers, dev)
    assert target.tapper().varlen
    ds = _dataset(cfg, target)
    plan = ds.epoch_plan(0)
    batches = [(pk, ds.make_batch(pk, 0)) for pk in plan]
    R = batches[0][1].input_ids.shape[0]
    by_count = {b.lengths.numel(): (pk, b) for pk, b in batches if b.input_ids.shape[0] == R}
    same_rows = list(by_count.values())  # R rows each, a different number of conversations each
    assert len(same_rows) >= 2, "need micro-batches with other conversation counts"
    eager = dataclasses.replace(target, compile_taps=False)  # its own tapper: the references compile nothing
    for i, (pk, b) in enumerate(same_rows[:3]):
        before = counters.snapshot()
        b = b.to(dev)
        packed = target.taps(b.input_ids, b.position_ids, b.run_bounds).float()
        d = counters.delta(before)
        if i:
            assert d.frames_ok == 0 and not d.recompile_reasons, d.recompile_reasons
        off_of = {}
        for r, row in enumerate(pk.rows):
            off = 0
            for j in row:
                off_of[j] = (r, off)
                off += ds.samples[j].input_ids.numel()
        for j, (r, off) in off_of.items():
            ids = ds.samples[j].input_ids[None].to(dev)
            alone = eager.taps(ids)[0].float()
            torch.testing.assert_close(packed[r, off: off + ids.shape[1]], alone, atol=3e-2, rtol=3e-2)


def test_chunked_drafter_pass_gives_the_whole_micro_batchs_numbers(tmp_path, tiny_target):
    """data.pack_chunks: the blocks in chunks, a backward after each: the same outputs and gradients."""
    from dflash.model import build_drafter, loss_backward, loss_weights
    from dflash.model.build import drafter_spec

    cfg = _mixed_dataset(tmp_path, True, **{"data.pack_blocks": 96, "data.pack_chunks": 4})
    ds = _dataset(cfg, tiny_target)
    assert ds.block_budget == 96
    b = ds.make_batch(ds.epoch_plan(0)[0], 0)
    windows = [b.chunk(c, 4)[0].rows_total for c in range(4)]
    assert min(windows) == b.chunk_rows(4) < 8  # chunks read a window of rows (here 3 of 8), not all of them
    spec = drafter_spec(cfg, tiny_target)
    w = loss_weights(cfg.drafter.block_size, cfg.gamma)
    taps = tiny_target.taps(b.input_ids, b.position_ids)
    res = []
    for chunks in (1, 4):
        torch.manual_seed(0)
        d = build_drafter(cfg, spec, torch.device("cpu"))
        o = loss_backward(d, tiny_target.embed, tiny_target.head, taps, b, chunks=chunks,
                          mask_token_id=tiny_target.mask_token_id, weights=w, denominator=1.0, backend="sdpa",
                          compute_dtype=torch.float32)
        res.append((o, {k: p.grad.clone() for k, p in d.named_parameters() if p.grad is not None}))
    (o1, g1), (o4, g4) = res
    torch.testing.assert_close(o4.weighted_ce, o1.weighted_ce, atol=ATOL, rtol=RTOL)
    assert torch.equal(o4.correct, o1.correct) and float(o4.weight) == pytest.approx(float(o1.weight), rel=1e-6)
    for k in g1:
        torch.testing.assert_close(g4[k], g1[k], atol=ATOL, rtol=RTOL, msg=k)


def test_block_budget_follows_the_data_and_pack_chunks_must_divide_it(tmp_path, tiny_target):
    from compilewatch import BadInput

    cfg = _mixed_dataset(tmp_path, True, **{"data.pack_chunks": 3})
    ds = _dataset(cfg, tiny_target)
    base = -(-8 * 12 // 24) * 24  # batch_size x num_anchors, rounded to 8 x pack_chunks
    density = ds.sample_blocks().sum() / ds.lengths.sum()
    assert ds.block_budget % 24 == 0 and base <= ds.block_budget <= 4 * base
    assert ds.block_budget >= min(4 * base, density * 8 * 96)  # dense data: more blocks than a padded batch
    with pytest.raises((BadInput, ValueError), match="pack_chunks"):
        _mixed_dataset(tmp_path, True, **{"data.pack_blocks": 100, "data.pack_chunks": 3})


def test_the_engine_trains_packed_batches_as_the_single_device_trainer_does(tmp_path):
    """Packed micro-batches on the engine (CPU "devices": 2 target workers, 2 drafter replicas, chunks):
    prewarm covers the packed shapes, and step 1 gives the single-device trainer's loss on the same
    global batch (2 packs: grad_accum 2 there, one per replica here)."""
    from dflash.config import TopologyConfig
    from dflash.engine.program import train_multi
    from dflash.training.trainer import Trainer

    over = {"data.pack_blocks": 96, "data.pack_chunks": 2, "train.max_steps": 2, "topology.device": "cpu"}
    single = Trainer.from_config(_mixed_dataset(tmp_path / "single", True, **{**over, "train.grad_accum": 2}))
    losses_single = []
    single.on_event = lambda kind, d: losses_single.append(d["metrics"].loss) if kind == "step" else None
    single.train()
    single.close()
    multi = Trainer.from_config(_mixed_dataset(tmp_path / "multi", True, **over))
    losses_multi = []
    multi.on_event = lambda kind, d: losses_multi.append(d["metrics"].loss) if kind == "step" else None
    result, report = train_multi(multi, TopologyConfig(target_devices=["cpu", "cpu"], drafter_devices=["cpu", "cpu"],
                                                       stall_after=120))
    multi.close()
    assert report.ok, report.verdicts
    assert report.prewarm.ok and result.steps == 2
    # step 1: the same weights, the same blocks; only the summation order differs (fp32)
    assert losses_multi[0] == pytest.approx(losses_single[0], rel=1e-4)


def test_a_chunk_of_a_moved_batch_carries_its_cpu_copy_and_the_mask_built_there_is_the_same(tmp_path, tiny_target):
    """The training step builds each chunk's drafter mask on the chunk's CPU copy (`PackedBatch.host`) and
    moves it: the copy holds the chunk's very block tensors, and the mask built there, moved, has the tiles
    and the per-row intervals of the one built from the moved tensors (here "moved" is CPU to CPU: the
    GPU case is test_cuda_packed_step_makes_no_host_sync_before_its_end)."""
    from dflash.model.mask import build_packed_masks

    cfg = _mixed_dataset(tmp_path, True, **{"data.pack_blocks": 96, "data.pack_chunks": 4})
    ds = _dataset(cfg, tiny_target)
    b = ds.make_batch(ds.epoch_plan(0)[0], 0)
    moved = b.to("cpu")
    assert moved.host is b
    for c in range(4):
        part, rows = moved.chunk(c, 4)
        want, want_rows = b.chunk(c, 4)
        assert part.host is not None and rows == want_rows and part.rows_total == want.rows_total
        for f in ("anchor_row", "anchor_col", "doc_start", "doc_end", "anchor_valid", "input_ids"):
            assert torch.equal(getattr(part.host, f), getattr(want, f)), f
        L = part.input_ids.shape[1]
        args = (L, part.rows_total * L, cfg.drafter.block_size, "flex")
        a = build_packed_masks(part.host.anchor_row, part.host.doc_start, part.host.anchor_col, *args, device="cpu")["full"]
        m = build_packed_masks(part.anchor_row, part.doc_start, part.anchor_col, *args)["full"]
        assert a.seq_lengths == m.seq_lengths
        for f in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices"):
            assert torch.equal(getattr(a, f), getattr(m, f)), f
        q = torch.arange(a.seq_lengths[0])[:, None]
        kv = torch.arange(a.seq_lengths[1])[None, :]
        assert torch.equal(a.mask_mod(0, 0, q, kv), m.mask_mod(0, 0, q, kv))


@requires_cuda()
def test_cuda_packed_step_makes_no_host_sync_before_its_end(tmp_path):
    """A packed, chunked training step on a GPU queues its whole drafter pass without waiting for the GPU:
    the chunks' masks are built on the batch's CPU copy (before: six host syncs a mask, in the tile counts'
    boolean indexing), so the host runs ahead and the GPU never idles between chunks. CUDA's sync debug
    mode turns any sync inside `loss_backward` into an error."""
    from dflash.model import build_drafter, loss_backward, loss_weights
    from dflash.model.build import drafter_spec
    from dflash.model.mask import build_packed_masks
    from dflash.model.target import load_target

    cfg = _mixed_dataset(tmp_path, True, **{"data.pack_blocks": 96, "data.pack_chunks": 2})
    dev = torch.device("cuda")
    target = load_target(cfg.target, cfg.drafter.num_layers, dev)
    ds = _dataset(cfg, target)
    b = ds.make_batch(ds.epoch_plan(0)[0], 0).to(dev)
    spec = drafter_spec(cfg, target)
    d = build_drafter(cfg, spec, dev)
    w = loss_weights(cfg.drafter.block_size, cfg.gamma, device=dev)
    taps = target.taps(b.input_ids, b.position_ids, b.run_bounds)
    part, _rows = b.chunk(0, 2)
    L = part.input_ids.shape[1]
    args = (L, part.rows_total * L, cfg.drafter.block_size, "flex")
    on_host = build_packed_masks(part.host.anchor_row, part.host.doc_start, part.host.anchor_col, *args, device=dev)["full"]
    on_gpu = build_packed_masks(part.anchor_row, part.doc_start, part.anchor_col, *args)["full"]
    for f in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices"):
        assert getattr(on_host, f).device.type == "cuda" and torch.equal(getattr(on_host, f), getattr(on_gpu, f)), f
    kwargs = dict(chunks=2, mask_token_id=target.mask_token_id, weights=w, denominator=1.0, backend="flex",
                  compute_dtype=torch.bfloat16)
    loss_backward(d, target.embed, target.head, taps, b, **kwargs)  # compiles: outside the checked region
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        loss_backward(d, target.embed, target.head, taps, b, **kwargs)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
