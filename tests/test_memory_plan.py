"""data.pack_chunks "auto": the predicted peak of a packed step and the fewest chunks that fit
(dflash/training/memory_plan.py)."""

from __future__ import annotations

import pytest
import torch

from dflash.config import apply_overrides, load_toml, qwen3_8b, to_toml
from dflash.model.drafter import DFlashDrafter, DrafterSpec
from dflash.training import memory_plan as mp
from tests.test_packing import _dataset, _mixed_dataset
from tests.dflash_helpers import tiny_target  # noqa: F401 - fixture
from tests.helpers import requires_cuda

GIB = 2 ** 30
# Peaks allocated on one H200 (torch 2.11, Qwen3-8B-shaped target, the qwen3_8b recipe's rows, one timed run
# each; docs/benchmarks.md, sessions 9 and 10): (blocks a micro-batch, chunks) -> GiB
MEASURED_H200 = {(2048, 1): 53.58, (2048, 2): 46.7, (3664, 1): 71.2, (3664, 2): 55.8}


def _qwen3_8b_shapes(blocks: int) -> dict:
    from transformers import Qwen3Config

    from dflash.training.dryrun import QWEN3_8B

    spec = DrafterSpec(hidden_size=4096, num_hidden_layers=5, num_attention_heads=32, num_key_value_heads=8,
                       head_dim=128, intermediate_size=12288, vocab_size=151936)
    with torch.device("meta"):
        drafter = DFlashDrafter(spec)
    return dict(spec=spec, drafter_params=sum(p.numel() for p in drafter.parameters()),
                target_params=mp.target_parameters(Qwen3Config(**QWEN3_8B)), rows=4, row_len=3072, blocks=blocks,
                vocab=151936)


def test_target_parameters_of_qwen3_8b_from_its_config():
    from transformers import Qwen3Config

    from dflash.training.dryrun import QWEN3_8B

    cfg = Qwen3Config(**QWEN3_8B)
    with torch.device("meta"):
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_config(cfg)
    assert mp.target_parameters(cfg) == sum(p.numel() for p in model.parameters())  # 8.19 B, exactly


@pytest.mark.parametrize(("blocks", "chunks"), sorted(MEASURED_H200))
def test_the_prediction_bounds_every_measured_peak_from_above(blocks, chunks):
    predicted = mp.predicted_peak_bytes(chunks=chunks, **_qwen3_8b_shapes(blocks)) / GIB
    measured = MEASURED_H200[(blocks, chunks)]
    # an upper bound (every activation counted, plus slack), and not a loose one: within 25% of the peak
    assert measured < predicted < 1.25 * measured


def test_auto_picks_one_chunk_on_an_h200_and_more_where_memory_is_short():
    h200, gpu80 = int(139.8 * GIB), int(79.2 * GIB)
    uniform, mixed, short_answers = (_qwen3_8b_shapes(b) for b in (2048, 3664, 8192))
    assert mp.fewest_chunks(h200, **uniform).chunks == 1
    assert mp.fewest_chunks(h200, **mixed).chunks == 1
    assert mp.fewest_chunks(h200, **short_answers).chunks == 2  # 4 x the blocks: two chunks even there
    assert mp.fewest_chunks(gpu80, **uniform).chunks == 1
    assert mp.fewest_chunks(gpu80, **mixed).chunks == 2
    assert mp.fewest_chunks(gpu80, **short_answers).chunks == 4
    for shapes in (uniform, mixed, short_answers):  # more chunks never predict more memory
        peaks = [mp.predicted_peak_bytes(chunks=c, **shapes) for c in mp.CHOICES]
        assert peaks == sorted(peaks, reverse=True)


def test_auto_says_when_nothing_fits():
    plan = mp.fewest_chunks(int(40 * GIB), **_qwen3_8b_shapes(8192))
    assert plan.chunks == mp.CHOICES[-1] and not plan.fits
    assert "does not fit" in plan.note() and "data.pack_blocks" in plan.note()
    ok = mp.fewest_chunks(int(139.8 * GIB), **_qwen3_8b_shapes(2048))
    assert ok.fits and "auto: 1" in ok.note() and "139.8 GiB" in ok.note()


def test_an_integer_is_kept_and_auto_is_one_chunk_off_a_gpu():
    shapes = dict(spec=None, drafter_params=0, target_config=None, rows=4, row_len=16, blocks=64)
    assert mp.pack_chunks(2, packed=True, device=torch.device("cuda"), **shapes).chunks == 2
    assert mp.pack_chunks("auto", packed=True, device=torch.device("cpu"), **shapes).chunks == 1
    assert mp.pack_chunks("auto", packed=False, device=torch.device("cuda"), **shapes).chunks == 1


def test_the_recipe_is_auto_and_auto_round_trips_through_toml_and_set(tmp_path):
    cfg = qwen3_8b()
    assert cfg.data.pack_chunks == "auto"
    (tmp_path / "c.toml").write_text(to_toml(cfg))
    assert load_toml(tmp_path / "c.toml").data.pack_chunks == "auto"
    assert apply_overrides(cfg, {"data.pack_chunks": "2"}).data.pack_chunks == 2
    assert apply_overrides(cfg, {"data.pack_chunks": "auto"}).data.pack_chunks == "auto"
    for bad in ("0", "some", "-1"):
        with pytest.raises(ValueError, match="pack_chunks"):
            apply_overrides(cfg, {"data.pack_chunks": bad})
    with pytest.raises(ValueError, match="pack_chunks"):  # auto may pick 4: the blocks must split in 4
        apply_overrides(cfg, {"data.pack_blocks": 1030})
    assert apply_overrides(cfg, {"data.pack_blocks": 1028}).data.pack_blocks == 1028


def test_under_auto_the_block_budget_does_not_depend_on_the_gpu(tmp_path, tiny_target):
    """The budget is a multiple of 8 x 4 under auto, so every choice divides it and the plan (the batches)
    is the same whatever a GPU picks: a run resumed on another GPU trains on the same data."""
    auto = _dataset(_mixed_dataset(tmp_path / "a", True, **{"data.pack_chunks": "auto"}), tiny_target)
    four = _dataset(_mixed_dataset(tmp_path / "b", True, **{"data.pack_chunks": 4}), tiny_target)
    assert auto.block_budget % 32 == 0 and auto.block_budget == four.block_budget
    assert auto.epoch_plan(0) == four.epoch_plan(0)


def test_a_trainer_resolves_auto_and_says_so(tmp_path, tiny_target):
    from dflash.model.build import build_drafter, drafter_spec
    from dflash.training.trainer import Trainer

    cfg = _mixed_dataset(tmp_path, True, **{"data.pack_chunks": "auto"})
    ds = _dataset(cfg, tiny_target)
    tr = Trainer(cfg, tiny_target, ds, build_drafter(cfg, drafter_spec(cfg, tiny_target), torch.device("cpu")),
                 tmp_path / "run")
    assert tr.pack_chunks == 1  # the CPU: nothing to bound
    assert any("pack_chunks auto: 1" in n for n in tr.notes)
    tr.train_step(tr.micro_batches(0))  # and it trains


@requires_cuda()
def test_auto_on_a_gpu_given_without_an_index_reads_its_memory_and_the_process_cap():
    """"cuda" (no index, what a trainer on the default GPU holds) and a per-process cap, as
    torch.cuda.set_per_process_memory_fraction sets it: the cap is what the plan must fit."""
    dev = torch.device("cuda")
    full = mp.device_memory(dev)
    assert full == torch.cuda.get_device_properties(0).total_memory
    before = torch.cuda.get_per_process_memory_fraction(0) if hasattr(torch.cuda, "get_per_process_memory_fraction") else 1.0
    torch.cuda.set_per_process_memory_fraction(0.5, 0)
    try:
        if hasattr(torch.cuda, "get_per_process_memory_fraction"):
            assert mp.device_memory(dev) == int(full * 0.5)
    finally:
        torch.cuda.set_per_process_memory_fraction(before, 0)
    from transformers import Qwen3Config

    from dflash.training.dryrun import QWEN3_8B

    shapes = _qwen3_8b_shapes(2048)
    plan = mp.pack_chunks("auto", packed=True, device=dev, spec=shapes["spec"], drafter_params=shapes["drafter_params"],
                          target_config=Qwen3Config(**QWEN3_8B), rows=4, row_len=3072, blocks=2048)
    assert plan.device_bytes == full and plan.chunks == mp.fewest_chunks(full, **shapes).chunks
