"""dflash.data.dataset: formats, assistant loss mask, anchors (strict range, loss-masked, no replacement, per epoch)."""

from __future__ import annotations

import pytest
import torch

from compilewatch.errors import BadInput
from dflash.config import DataConfig
from dflash.data.dataset import build_dataset, normalize_record, read_jsonl, sample_anchors, tokenize_conversation
from tests.dflash_helpers import tiny_target, write_jsonl  # noqa: F401 (fixture)

MSGS = [{"role": "user", "content": "ba be bi"}, {"role": "assistant", "content": "bo bu da de di do"},
        {"role": "user", "content": "du fa"}, {"role": "assistant", "content": "fe fi fo fu"}]


def test_sharegpt_and_messages_normalize_the_same():
    share = {"conversations": [{"from": "human", "value": "ba be bi"}, {"from": "gpt", "value": "bo bu da de di do"},
                               {"from": "human", "value": "du fa"}, {"from": "gpt", "value": "fe fi fo fu"}]}
    assert normalize_record(share) == normalize_record({"messages": MSGS}) == MSGS
    for bad in [{"text": "x"}, [1], {"messages": [{"role": "user"}]}, {"conversations": [{"from": "alien", "value": "x"}]}]:
        with pytest.raises(ValueError):
            normalize_record(bad)


def test_bad_lines_become_warnings(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"messages": MSGS}, "{not json", {"text": "x"}])
    convs, warnings = read_jsonl(path)
    assert len(convs) == 1 and len(warnings) == 2 and "d.jsonl:2" in warnings[0]


def test_loss_mask_covers_assistant_turns_only(tiny_target):
    tok = tiny_target.tokenizer
    ids, mask = tokenize_conversation(tok, MSGS)
    trained = [tok.convert_ids_to_tokens(i) for i, m in zip(ids, mask) if m]
    # both answers and their end-of-turn tokens; nothing from the user turns or the role headers
    assert trained == ["bo", "bu", "da", "de", "di", "do", "<|im_end|>", "fe", "fi", "fo", "fu", "<|im_end|>"]


def test_anchors_strict_range_loss_masked_without_replacement():
    s, bs = 40, 8
    lm = torch.zeros(s, dtype=torch.bool)
    lm[10:38] = True  # assistant tokens 10..37; valid anchors: loss-masked and <= S-B = 32
    g = torch.Generator().manual_seed(0)
    anchors, valid = sample_anchors(lm, 12, bs, g)
    a = anchors[valid].tolist()
    assert len(a) == 12 and len(set(a)) == 12 and a == sorted(a)
    assert all(10 <= x <= s - bs for x in a)
    few, fvalid = sample_anchors(lm, 40, bs, torch.Generator().manual_seed(0))
    assert few[fvalid].tolist() == list(range(10, 33))  # fewer candidates than anchors: all of them, rest invalid
    assert int(fvalid.sum()) == 23


def test_anchors_of_a_sequence_shorter_than_a_block_are_none_as_the_packer_counts():
    # a 5-token sequence at block size 8: no position has a whole block after it. The slice stop S-B+1 is
    # negative there; it must not count from the end (that gave 3 anchors the packer's count, 0, left out,
    # and a packed micro-batch then ran over its block budget)
    from dflash.data.packing import candidate_counts

    lm = torch.ones(5, dtype=torch.bool)
    anchors, valid = sample_anchors(lm, 4, 8, torch.Generator().manual_seed(0))
    assert not valid.any()
    sample = type("S", (), {"loss_mask": lm})()
    assert candidate_counts([sample], 8).tolist() == [0]
    for n in range(1, 12):  # every length around the block size: the sampler and the packer agree
        lm = torch.ones(n, dtype=torch.bool)
        _, valid = sample_anchors(lm, 64, 8, torch.Generator().manual_seed(0))
        assert int(valid.sum()) == candidate_counts([type("S", (), {"loss_mask": lm})()], 8)[0] == max(0, n - 7)


def test_dataset_batches_anchors_resampled_per_epoch_and_deterministic(tiny_target, tmp_path):
    rows = [{"messages": [{"role": "user", "content": "ba " * (3 + i % 5)},
                          {"role": "assistant", "content": "bo da " * (8 + i % 7)}]} for i in range(20)]
    convs, _ = read_jsonl(write_jsonl(tmp_path / "d.jsonl", rows))
    cfg = DataConfig(path=str(tmp_path / "d.jsonl"), max_length=30, num_anchors=4, batch_size=4, buckets=(24,))
    ds = build_dataset(convs, tiny_target.tokenizer, cfg, block_size=4, seed=3)
    assert ds.stats.truncated > 0 and ds.batches_per_epoch() == 5
    plan0 = ds.epoch_plan(0)
    assert sorted(i for b in plan0 for i in b) == list(range(20))  # every sample once per epoch
    b0, b0_again, b1 = ds.make_batch(plan0[0], 0), ds.make_batch(plan0[0], 0), ds.make_batch(plan0[0], 1)
    assert torch.equal(b0.anchors, b0_again.anchors)  # deterministic in (seed, epoch, sample)
    assert not torch.equal(b0.anchors, b1.anchors)  # resampled next epoch
    assert b0.input_ids.shape[1] in (24, 30)  # padded to a bucket
    for r in range(4):
        L = int(b0.lengths[r])
        for a in b0.anchors[r][b0.anchor_valid[r]].tolist():
            assert a <= L - 4 and bool(b0.loss_mask[r, a])


def test_empty_dataset_is_bad_input(tiny_target, tmp_path):
    convs, _ = read_jsonl(write_jsonl(tmp_path / "d.jsonl", [{"messages": [{"role": "user", "content": "ba"}]}]))
    with pytest.raises(BadInput, match="no usable conversation"):
        build_dataset(convs, tiny_target.tokenizer, DataConfig(path="d.jsonl"), 4, 0)
    with pytest.raises(BadInput, match="does not exist"):
        read_jsonl(tmp_path / "missing.jsonl")


def test_skips_are_counted_by_reason_with_examples_and_strict_refuses_them(tiny_target, tmp_path):
    rows = [{"messages": MSGS}, "{not json", {"messages": [{"role": "user", "content": "ba"}]},
            {"messages": [{"role": "user", "content": "ba"}, {"role": "assistant", "content": "bo"}]}]
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    convs, warnings = read_jsonl(path)
    cfg = DataConfig(path=str(path), max_length=64)
    ds = build_dataset(convs, tiny_target.tokenizer, cfg, 4, 0, warnings)
    assert ds.stats.kept == 1 and ds.stats.skipped == 3
    assert set(ds.stats.dropped) == {"unreadable JSONL line", "no assistant turn",
                                     "no anchor position (too short, or no assistant token in [0, S-B])"}
    assert "d.jsonl:2" in ds.stats.examples["unreadable JSONL line"][0]
    assert ds.stats.examples["no assistant turn"] == ["record 2 ('ba')"]
    strict = DataConfig(path=str(path), max_length=64, strict=True)
    with pytest.raises(BadInput, match="data.strict: 3 of 4 records would be skipped"):
        build_dataset(convs, tiny_target.tokenizer, strict, 4, 0, warnings)
