"""dflash.config: recipes, validation naming the field, TOML round trip, --set overrides."""

from __future__ import annotations

import pytest

from dflash.config import (
    GAMMA_BY_BLOCK, RECIPES, Config, DataConfig, DrafterConfig, OptimConfig, TopologyConfig, apply_overrides,
    build_config, load_toml, parse_set, qwen3_8b, tiny, to_toml,
)


def test_recipes_build_and_differ():
    assert set(RECIPES) == {"tiny", "qwen3_8b"}
    t, q = tiny(), qwen3_8b()
    assert t.recipe == "tiny" and q.recipe == "qwen3_8b"
    # the DFlash paper's setup (and z-lab/dflash's defaults): 5 layers, B=16, 512 anchors, max length 3072, lr 6e-4, warmup 4%, clip 1
    assert (q.drafter.num_layers, q.drafter.block_size, q.data.num_anchors, q.data.max_length) == (5, 16, 512, 3072)
    assert (q.optim.lr, q.optim.warmup_ratio, q.optim.clip, q.train.epochs) == (6e-4, 0.04, 1.0, 6)
    assert q.data.batch_size * q.train.grad_accum == 4  # batch 4 per GPU, as exact accumulation
    assert q.gamma == 7.0 and t.gamma == GAMMA_BY_BLOCK[t.drafter.block_size]


@pytest.mark.parametrize("make, field", [
    (lambda: OptimConfig(lr=0), "optim.lr"),
    (lambda: DrafterConfig(block_size=1), "drafter.block_size"),
    (lambda: DataConfig(buckets=(128, 64)), "data.buckets"),
    (lambda: DrafterConfig(num_layers=2, sliding_layers=(3,)), "drafter.sliding_layers"),
    (lambda: Config(drafter=DrafterConfig(block_size=12)), "train.gamma"),
    (lambda: Config(recipe="nope"), "recipe"),
    (lambda: TopologyConfig(queue_depth=0), "topology.queue_depth"),
    (lambda: TopologyConfig(stall_after=0), "topology.stall_after"),
    (lambda: TopologyConfig(dist_timeout=-1), "topology.dist_timeout"),
    (lambda: TopologyConfig(device="tpu"), "topology.device"),
    (lambda: TopologyConfig(target_devices=("cpu",), drafter_devices=("gpu0",)), "topology.drafter_devices"),
    (lambda: TopologyConfig(target_devices=("cpu",)), "topology.target_devices"),
    (lambda: TopologyConfig(device="cpu", target_devices=("cpu",), drafter_devices=("cpu",)), "topology.device"),
])
def test_validation_names_the_field(make, field):
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        make()


def test_gamma_defaults_by_block_size():
    assert GAMMA_BY_BLOCK == {16: 7.0, 10: 5.0, 8: 4.0}
    assert apply_overrides(tiny(), {"drafter.block_size": "10"}).gamma == 5.0
    assert apply_overrides(tiny(), {"drafter.block_size": "12", "train.gamma": "3"}).gamma == 3.0


def test_overrides_coerce_types():
    cfg = apply_overrides(tiny(), parse_set(["optim.lr=1e-4", "target.layer_ids=[1, 3]", "train.max_steps=none",
                                             "data.regenerate=false", "train.attention=sdpa"]))
    assert cfg.optim.lr == 1e-4 and cfg.target.layer_ids == (1, 3) and cfg.train.max_steps is None
    assert cfg.data.regenerate is False and cfg.train.attention == "sdpa"
    for bad, field in [("train.attention=fast", "train.attention"), ("nope.x=1", "nope.x"),
                       ("optim.nope=1", "optim.nope"), ("train.epochs=two", "train.epochs")]:
        with pytest.raises(ValueError, match=field.replace(".", r"\.")):
            apply_overrides(tiny(), parse_set([bad]))
    with pytest.raises(ValueError, match="--set"):
        parse_set(["optim.lr"])


def test_toml_round_trip(tmp_path):
    cfg = apply_overrides(qwen3_8b(), {"target.layer_ids": "[1, 9]", "checkpoint.out_dir": "runs/x",
                                       "drafter.sliding_window": "64", "drafter.sliding_layers": "[0]"})
    path = tmp_path / "c.toml"
    path.write_text(to_toml(cfg))
    assert load_toml(path) == cfg
    assert build_config(toml_path=path, overrides={"optim.lr": "1e-3"}).optim.lr == 1e-3


def test_toml_applies_its_recipe_first(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('recipe = "qwen3_8b"\n[optim]\nlr = 1e-4\n')
    cfg = load_toml(path)
    assert cfg.drafter.num_layers == 5 and cfg.optim.lr == 1e-4


def test_topology_round_trips_through_toml_with_device_names_normalized(tmp_path):
    cfg = apply_overrides(tiny(), parse_set(["topology.target_devices=0,1,cpu", "topology.drafter_devices=[cuda, 3, 3]",
                                             "topology.stall_after=45", "topology.prewarm=false", "topology.guard=false",
                                             "topology.queue_depth=4", "topology.dist_backend=gloo",
                                             "topology.dist_timeout=90"]))
    topo = cfg.topology
    assert topo.target_devices == ("cuda:0", "cuda:1", "cpu") and topo.drafter_devices == ("cuda:0", "cuda:3", "cuda:3")
    assert (topo.stall_after, topo.prewarm, topo.guard, topo.queue_depth, topo.dist_backend, topo.dist_timeout) == (
        45.0, False, False, 4, "gloo", 90.0)
    path = tmp_path / "config.toml"
    path.write_text(to_toml(cfg))
    assert "[topology]" in path.read_text() and load_toml(path) == cfg
    # the engine's trainer (replica 0) runs on the first drafter device; one device otherwise
    assert topo.engine and topo.trainer_device == "cuda:0"
    single = apply_overrides(tiny(), {"topology.device": "7"}).topology
    assert not single.engine and single.device == single.trainer_device == "cuda:7"
    assert apply_overrides(tiny(), {"topology.device": "cuda"}).topology.device == "cuda"  # torchrun: the local rank's


def test_train_device_of_older_runs_is_read_as_topology_device(tmp_path):
    path = tmp_path / "config.toml"  # what runs saved before [topology] existed
    path.write_text('recipe = "tiny"\n[train]\ndevice = "cpu"\nepochs = 2\n')
    cfg = load_toml(path)
    assert cfg.topology.device == "cpu" and cfg.train.epochs == 2
    assert apply_overrides(tiny(), parse_set(["train.device=0"])).topology.device == "cuda:0"


@pytest.mark.parametrize("key, value, why", [
    ("optim.lr", "inf", "expected a finite number"), ("optim.lr", "nan", "expected a finite number"),
    ("optim.lr", "1e999", "expected a finite number"), ("optim.clip", "-inf", "expected a finite number"),
    ("topology.stall_after", "inf", "expected a finite number"),
    ("data.buckets", "[1,2", "unbalanced brackets"), ("data.buckets", "1,2]", "unbalanced brackets"),
    ("data.buckets", "[[1,2]]", "unbalanced brackets"),
])
def test_a_value_that_is_not_finite_or_a_list_that_is_not_closed_is_refused(key, value, why):
    """`optim.lr=inf` trained until the run diverged; `data.buckets=[1,2` was read as [1, 2]."""
    from dflash.config import apply_overrides, tiny

    with pytest.raises(ValueError, match=why):
        apply_overrides(tiny(), {key: value})
    assert apply_overrides(tiny(), {"data.buckets": "[256, 512]", "optim.lr": "3e-4"}).data.buckets == (256, 512)
