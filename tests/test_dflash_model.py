"""dflash.model.drafter: taps formula, reference parameter names, KV injection, strict context."""

from __future__ import annotations

import pytest
import torch

from dflash.model.mask import build_masks
from dflash.model.drafter import DFlashDrafter, DrafterSpec, default_layer_ids
from tests.helpers import requires_cuda


def small_spec(**kw) -> DrafterSpec:
    base = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                intermediate_size=48, vocab_size=50, rope_theta=10000.0, block_size=4, num_target_layers=6,
                target_layer_ids=(1, 3), mask_token_id=49)
    return DrafterSpec(**{**base, **kw})


def make_drafter(seed=0, **kw) -> DFlashDrafter:
    d = DFlashDrafter(small_spec(**kw))
    d.init_weights(torch.Generator().manual_seed(seed), std=0.2)
    return d.eval()


@pytest.mark.parametrize("layers, draft, expected", [
    (36, 5, (1, 9, 17, 25, 33)),  # Qwen3-8B (z-lab/dflash: 5 layers tapped evenly from 1 to L-3)
    (36, 1, (18,)),  # one draft layer: L // 2
    (6, 2, (1, 3)),  # the embedded tiny target
    (28, 3, (1, 13, 25)),
    (40, 4, (1, 13, 25, 37)),
])
def test_default_taps(layers, draft, expected):
    assert default_layer_ids(layers, draft) == expected


def test_default_taps_are_distinct_and_spread_for_any_depth():
    for layers in range(1, 65):
        for draft in range(1, layers + 1):
            ids = default_layer_ids(layers, draft)
            assert len(ids) == draft and list(ids) == sorted(set(ids)) and all(0 <= i < layers for i in ids), (layers, draft)
            if draft > 1:  # spread: from the first layers to the last ones (the formula's 1 .. L-3)
                assert ids[0] <= 1 and ids[-1] >= layers - 3, (layers, draft, ids)
    assert default_layer_ids(4, 4) == (0, 1, 2, 3)  # was [1, 1, 1, 1]
    with pytest.raises(ValueError, match="5 taps cannot be distinct layers of a 4-layer target"):
        default_layer_ids(4, 5)


def test_impossible_or_repeated_taps_are_bad_input():
    from compilewatch.errors import BadInput
    from dflash.model.target import choose_taps

    with pytest.raises(BadInput, match="5 draft layers need 5 distinct target layers"):
        choose_taps(None, 4, 5)
    with pytest.raises(BadInput, match="repeats a layer"):
        choose_taps((1, 1), 6, 2)
    with pytest.raises(BadInput, match="out of range"):
        choose_taps((1, 6), 6, 2)
    assert choose_taps((0, 5), 6, 5) == (0, 5)


def test_parameter_names_are_the_reference_format():
    names = set(make_drafter().state_dict())
    expected = {"fc.weight", "hidden_norm.weight", "norm.weight"}
    for i in range(2):
        expected |= {f"layers.{i}.self_attn.{p}.weight" for p in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")}
        expected |= {f"layers.{i}.mlp.{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")}
        expected |= {f"layers.{i}.{p}.weight" for p in ("input_layernorm", "post_attention_layernorm")}
    assert names == expected  # no embedding, no LM head: the target's are used, frozen
    d = make_drafter()
    assert d.fc.weight.shape == (32, 2 * 32) and d.fc.bias is None  # Linear(k·H -> H, bias=False)


def run(d, anchors, ctx, blocks, seq, masks=None):
    b, n = anchors.shape
    bs = d.spec.block_size
    pos = (anchors[:, :, None] + torch.arange(bs)).view(b, n * bs)
    ctx_pos = torch.arange(seq).expand(b, seq)
    if masks is None:
        masks = build_masks(anchors, seq, bs, "sdpa")
    return d(blocks, ctx, pos, ctx_pos, masks=masks)


def test_strict_context_and_block_isolation():
    """Block j's output depends on context positions < anchor_j only, and on no other block."""
    torch.manual_seed(0)
    d = make_drafter()
    seq, bs = 20, 4
    anchors = torch.tensor([[5, 12]])
    ctx = torch.randn(1, seq, 64)
    blocks = torch.randn(1, 2 * bs, 32)
    ref = run(d, anchors, ctx, blocks, seq)
    ctx2 = ctx.clone()
    ctx2[:, 5] += 10.0  # the anchor position of block 0: must not be visible to block 0 (strict)
    out = run(d, anchors, ctx2, blocks, seq)
    torch.testing.assert_close(out[:, :bs], ref[:, :bs])
    assert not torch.allclose(out[:, bs:], ref[:, bs:])  # block 1 (anchor 12) sees position 5
    blocks2 = blocks.clone()
    blocks2[:, bs:] += 1.0  # change block 1's tokens: block 0 is unaffected
    torch.testing.assert_close(run(d, anchors, ctx, blocks2, seq)[:, :bs], ref[:, :bs])
    ctx3 = ctx.clone()
    ctx3[:, 4] += 10.0  # the position before anchor 0 is visible
    assert not torch.allclose(run(d, anchors, ctx3, blocks, seq)[:, :bs], ref[:, :bs])


def test_block_is_bidirectional_in_full_layers_and_causal_in_sliding_layers():
    torch.manual_seed(1)
    seq, bs = 12, 4
    anchors = torch.tensor([[6]])
    ctx, blocks = torch.randn(1, seq, 64), torch.randn(1, bs, 32)
    blocks2 = blocks.clone()
    blocks2[:, 3] += 1.0  # change the last slot
    full = make_drafter()
    assert not torch.allclose(run(full, anchors, ctx, blocks, seq)[:, 0], run(full, anchors, ctx, blocks2, seq)[:, 0])
    sl = make_drafter(layer_types=("sliding_attention", "sliding_attention"), sliding_window=4)
    masks = build_masks(anchors, seq, bs, "sdpa", sliding_window=4, need_sliding=True)
    a = run(sl, anchors, ctx, blocks, seq, masks)
    b = run(sl, anchors, ctx, blocks2, seq, masks)
    torch.testing.assert_close(a[:, :3], b[:, :3])  # causal: earlier slots do not see slot 3
    ctx2 = ctx.clone()
    ctx2[:, 1] += 10.0  # outside the window of slot 0 (6 - 1 >= 4)
    torch.testing.assert_close(run(sl, anchors, ctx2, blocks, seq, masks)[:, 0], a[:, 0])


def test_context_cache_matches_full_context():
    """Inference: feeding the context in pieces through the cache gives the same block output."""
    from dflash.model.drafter import ContextCache

    torch.manual_seed(2)
    d = make_drafter()
    ctx, blocks = torch.randn(1, 10, 64), torch.randn(1, 4, 32)
    pos = torch.arange(10, 14)[None]
    ref = d(blocks, ctx, pos, torch.arange(10)[None])
    cache = ContextCache(2)
    d(blocks, ctx[:, :6], torch.arange(6, 10)[None], torch.arange(6)[None], cache=cache)
    out = d(blocks, ctx[:, 6:], pos, torch.arange(6, 10)[None], cache=cache)
    torch.testing.assert_close(out, ref)


def test_drafter_compiles_as_one_graph():
    """fullgraph=True: no graph break anywhere in the drafter (what `torch.compile` of layers relies on)."""
    import torch._dynamo

    torch.manual_seed(4)
    d = make_drafter()
    anchors, seq = torch.tensor([[3, 9]]), 16
    ctx, blocks = torch.randn(1, seq, 64), torch.randn(1, 8, 32)
    pos = (anchors[:, :, None] + torch.arange(4)).view(1, 8)
    masks = build_masks(anchors, seq, 4, "sdpa")
    ref = d(blocks, ctx, pos, torch.arange(seq)[None], masks=masks)
    torch._dynamo.reset()
    compiled = torch.compile(d, backend="eager", fullgraph=True)
    torch.testing.assert_close(compiled(blocks, ctx, pos, torch.arange(seq)[None], masks=masks), ref)
    with torch.no_grad():  # the flex path too (forward only: no flex backward on CPU)
        flex_masks = build_masks(anchors, seq, 4, "flex")
        torch.testing.assert_close(compiled(blocks, ctx, pos, torch.arange(seq)[None], masks=flex_masks), ref,
                                   atol=1e-5, rtol=1e-4)
    torch._dynamo.reset()


YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256}


@pytest.mark.parametrize("scaling", [None, YARN, {"rope_type": "linear", "factor": 2.0}])
def test_rope_follows_the_targets_scaling_as_transformers_computes_it(scaling):
    """cos/sin equal transformers' Qwen3RotaryEmbedding for the same config (YaRN's attention factor included)."""
    from transformers import Qwen3Config
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

    from dflash.model.drafter import rope_cos_sin, rope_frequencies

    spec = small_spec(rope_scaling=scaling, max_position_embeddings=1024)
    pos = torch.arange(0, 900, 7)[None]  # (1, T), past the original 256 positions
    cos, sin = rope_cos_sin(pos, *rope_frequencies(spec))
    cfg = Qwen3Config(hidden_size=32, num_attention_heads=4, head_dim=8, max_position_embeddings=1024,
                      rope_theta=10000.0, rope_scaling=scaling)
    ref_cos, ref_sin = Qwen3RotaryEmbedding(cfg)(torch.zeros(1, pos.shape[1], 8), pos)
    # same fp32 formula on both sides; tolerance for the order of the position * frequency product
    torch.testing.assert_close(cos, ref_cos, rtol=0, atol=2e-5)
    torch.testing.assert_close(sin, ref_sin, rtol=0, atol=2e-5)
    if scaling == YARN:
        assert float(cos[0, 0, 0]) > 1.0  # YaRN's attention factor scales cos/sin (cos 0 = 1 * factor)


def test_attention_bias_gives_reference_named_biases():
    d = make_drafter(attention_bias=True)
    names = set(d.state_dict())
    for p in ("q_proj", "k_proj", "v_proj", "o_proj"):
        assert f"layers.0.self_attn.{p}.bias" in names  # the reference/vLLM put it on all four
        assert torch.count_nonzero(d.layers[1].self_attn.__getattr__(p).bias) == 0  # zero at init
    assert not any(n.endswith(".bias") and "self_attn" not in n for n in names)  # MLP, fc: no bias
    assert not any(n.endswith(".bias") for n in make_drafter().state_dict())


def test_export_says_rope_scaling_and_bias_in_the_fields_loaders_read(tmp_path):
    from transformers import Qwen3Config

    from dflash.checkpoint import store as ckpt

    spec = small_spec(rope_scaling=YARN, attention_bias=True, max_position_embeddings=1024, rope_theta=5e5)
    cfg = ckpt.export_config(spec, torch.float32)
    assert cfg["attention_bias"] is True and cfg["rope_theta"] == 5e5
    assert cfg["rope_scaling"] == YARN  # transformers 4.x and SGLang's get_rope_config
    assert cfg["rope_parameters"] == {**YARN, "rope_theta": 5e5}  # transformers 5 and vLLM
    assert ckpt.spec_from_config(cfg) == spec
    hf = Qwen3Config(**{k: v for k, v in cfg.items() if k not in ("dflash_config", "architectures")})
    assert hf.rope_parameters["rope_type"] == "yarn" and hf.rope_parameters["factor"] == 4.0 and hf.attention_bias
    d = DFlashDrafter(spec)
    d.init_weights(torch.Generator().manual_seed(0))
    ckpt.write_export(tmp_path, d, torch.float32)
    back = ckpt.load_export(tmp_path)  # strict: the biases round-trip under their reference names
    assert back.spec == spec and torch.equal(back.layers[0].self_attn.q_proj.bias, d.layers[0].self_attn.q_proj.bias)


def test_drafter_spec_follows_the_targets_config():
    from types import SimpleNamespace

    from dflash.model.build import target_rope_scaling

    v5 = SimpleNamespace(rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6,
                                          "original_max_position_embeddings": 32768})
    assert target_rope_scaling(v5) == {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
    v4 = SimpleNamespace(rope_scaling={"type": "linear", "factor": 2.0}, rope_theta=1e4)
    assert target_rope_scaling(v4) == {"type": "linear", "factor": 2.0, "rope_type": "linear"}
    assert target_rope_scaling(SimpleNamespace(rope_parameters={"rope_type": "default", "rope_theta": 1e6})) is None
    per_layer = SimpleNamespace(rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                                                 "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})
    assert target_rope_scaling(per_layer) == {"rope_type": "linear", "factor": 8.0}


def test_trainer_builds_the_drafter_from_a_yarn_biased_target():
    from types import SimpleNamespace

    from dflash.config import tiny
    from dflash.model.target import tiny_target_config
    from dflash.model.build import drafter_spec

    tc = tiny_target_config(320, attention_bias=True, rope_theta=5e5, max_position_embeddings=4096,
                            rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024})
    target = SimpleNamespace(config=tc, hidden_size=64, vocab_size=320, num_layers=6, layer_ids=(1, 3), mask_token_id=5)
    spec = drafter_spec(tiny(), target)
    assert spec.attention_bias is True and spec.rope_theta == 5e5
    assert spec.rope_scaling == {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024}


def test_the_model_rooms_entry_resolves_each_name_to_its_module_lazily():
    """dflash/model/__init__.py names what the other rooms use; each name is the module's own object,
    and importing the room's package alone loads none of its modules (a subprocess: a clean import)."""
    import importlib
    import subprocess
    import sys

    import dflash.model as room

    for name, module in room._LAZY.items():
        assert getattr(room, name) is getattr(importlib.import_module(module), name)
    with pytest.raises(AttributeError):
        room.no_such_name  # noqa: B018
    code = ("import sys, dflash.model; print(sorted(m for m in sys.modules if m.startswith('dflash.model.')), "
            "'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["[]", "False"]


def _rms_formula(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen3RMSNorm's own formula in fp32, cast back to the input dtype (what compiled layers trace)."""
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)


def test_rmsnorm_is_qwen3s_formula_on_the_cpu():
    from dflash.model.drafter import RMSNorm

    torch.manual_seed(0)
    norm = RMSNorm(64, 1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(64) + 0.5)
    x = torch.randn(3, 7, 64)
    assert torch.equal(norm(x), _rms_formula(x, norm.weight, 1e-6))


@requires_cuda()
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rmsnorm_eager_on_cuda_is_the_formula_in_fp32(dtype):
    """Eager on a GPU, RMSNorm runs ATen's fused kernel over fp32 (torch.rms_norm): the formula's values and
    gradients to fp32 rounding before the cast to `dtype`, also under bf16 autocast (the training step's).
    Tolerances: bf16, one rounding step (2^-7 relative) for values, two for input gradients (rounded after
    a reduction over 4,096 terms done in another order); fp32, 1e-5 (those reductions' rounding)."""
    from dflash.model.drafter import RMSNorm

    torch.manual_seed(0)
    norm = RMSNorm(4096, 1e-6).cuda()
    with torch.no_grad():
        norm.weight.copy_(torch.rand(4096, device="cuda") + 0.5)
    x = (torch.randn(2, 300, 4096, device="cuda") * 3).to(dtype).requires_grad_()
    g = torch.randn(2, 300, 4096, device="cuda").to(dtype)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y = norm(x)
    y.backward(g)
    got = (y.detach(), x.grad.clone(), norm.weight.grad.clone())
    x.grad, norm.weight.grad = None, None
    want_y = _rms_formula(x, norm.weight, 1e-6)
    want_y.backward(g)
    step = {torch.bfloat16: 2 ** -7, torch.float32: 1e-5}[dtype]
    assert y.dtype == dtype
    torch.testing.assert_close(got[0].float(), want_y.detach().float(), rtol=step, atol=step)
    torch.testing.assert_close(got[1].float(), x.grad.float(), rtol=2 * step, atol=2 * step)
    torch.testing.assert_close(got[2], norm.weight.grad, rtol=1e-3, atol=1e-3)
