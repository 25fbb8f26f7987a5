"""target.fp8 (dflash.model.fp8): the target's decoder linears as rowwise-scaled FP8 GEMMs.

CPU: torch._scaled_mm runs there too (it is what the kernel computes: e4m3 operands, fp32 scales), so the
module, the conversion and the target's taps are checked against their bf16/fp32 originals; the GPU test
runs the real Hopper kernel, compiled, as training runs it.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from compilewatch import BadInput
from dflash.config import TargetConfig
from dflash.model import fp8
from dflash.model.target import EMBEDDED_TARGET, check_fp8, load_target
from tests.helpers import requires_cuda


def _scaled_mm_on_cpu() -> bool:
    try:
        a = torch.ones(16, 16).to(fp8.E4M3)
        torch._scaled_mm(a, a.t(), scale_a=torch.ones(16, 1), scale_b=torch.ones(1, 16), out_dtype=torch.float32)
        return True
    except (RuntimeError, NotImplementedError):
        return False


cpu_fp8 = pytest.mark.skipif(not _scaled_mm_on_cpu(), reason="this torch has no CPU torch._scaled_mm (rowwise)")


def _reference(lin: fp8.Fp8Linear, x: torch.Tensor) -> torch.Tensor:
    """What the FP8 GEMM computes, in fp32 from the same quantized operands."""
    x2 = x.reshape(-1, lin.in_features).float()
    sx = x2.abs().amax(1, keepdim=True).clamp(min=1e-12) / fp8.E4M3_MAX
    xq = (x2 / sx).to(fp8.E4M3).float() * sx
    w = lin.weight.float() * lin.weight_scale.t()
    return (xq @ w.t()).reshape(*x.shape[:-1], lin.out_features)


@cpu_fp8
def test_fp8_linear_is_the_quantized_product_and_near_the_exact_one():
    torch.manual_seed(0)
    lin = nn.Linear(256, 96, bias=True)
    x = torch.randn(3, 40, 256) * torch.linspace(0.01, 30, 40)[None, :, None]  # rows of very different sizes
    q = fp8.Fp8Linear(lin)
    y = q(x)
    assert y.shape == (3, 40, 96) and y.dtype == x.dtype
    assert q.weight.dtype == fp8.E4M3 and q.weight_scale.shape == (1, 96)
    # the kernel's product of the quantized operands (fp32 accumulation either way)
    torch.testing.assert_close(y - q.bias, _reference(q, x), rtol=1e-4, atol=1e-4)
    # and the exact product within e4m3's rounding: 3 mantissa bits, ~2^-4 relative per operand at worst;
    # per-row scales keep the small rows as precise as the large ones
    exact = lin(x)
    for row in range(40):
        err = (y[:, row] - exact[:, row]).norm() / exact[:, row].norm()
        assert err < 0.08, (row, float(err))


@cpu_fp8
def test_zero_rows_and_zero_weights_stay_zero():
    lin = nn.Linear(32, 16, bias=False)
    with torch.no_grad():
        lin.weight[3].zero_()
    q = fp8.Fp8Linear(lin)
    x = torch.randn(4, 32)
    x[1] = 0
    y = q(x)
    assert torch.isfinite(y).all() and (y[1] == 0).all() and (y[:, 3] == 0).all()


@cpu_fp8
def test_quantize_decoder_converts_the_layers_linears_only_and_taps_stay_close():
    cfg = TargetConfig(path=EMBEDDED_TARGET, dtype="fp32")
    plain = load_target(cfg, 2, torch.device("cpu"))
    ids = torch.randint(0, plain.vocab_size - 1, (2, 48), generator=torch.Generator().manual_seed(3))
    ref = plain.taps(ids)
    # load_target with target.fp8 refuses the CPU (a CUDA feature); the conversion itself is the same code
    model = plain.model
    note = fp8.quantize_decoder(model)
    n_layers = model.config.num_hidden_layers
    assert f"{7 * n_layers} decoder linears in FP8" in note
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert linears == [model.lm_head]  # the head (the loss reads it) and the embedding stay as they were
    assert all(isinstance(layer.mlp.down_proj, fp8.Fp8Linear) for layer in fp8.decoder_layers(model))
    assert not any(p.requires_grad for p in model.parameters())
    got = plain.taps(ids)
    assert got.shape == ref.shape
    rel = (got - ref).norm() / ref.norm()
    cos = torch.nn.functional.cosine_similarity(got, ref, dim=-1).mean()
    assert 0 < rel < 0.15 and cos > 0.99, (float(rel), float(cos))


def test_quantize_decoder_frees_the_allocation_the_weights_were_views_of():
    """Weights read straight from safetensors are views of one allocation per file: after the linears are
    replaced, what is left is copied out of it, so it is freed rather than kept alive by a norm."""
    model = load_target(TargetConfig(path=EMBEDDED_TARGET, dtype="fp32"), 2, torch.device("cpu")).model
    params = list(model.parameters())
    whole = torch.zeros(sum(p.numel() for p in params))
    at = 0
    with torch.no_grad():
        for p in params:
            whole[at: at + p.numel()].copy_(p.reshape(-1))
            p.data = whole[at: at + p.numel()].view_as(p)
            at += p.numel()
    if not _scaled_mm_on_cpu():
        pytest.skip("this torch has no CPU torch._scaled_mm (rowwise)")
    fp8.quantize_decoder(model)
    assert all(p.untyped_storage().nbytes() == p.numel() * p.element_size() for p in model.parameters())
    assert all(p.untyped_storage().data_ptr() != whole.untyped_storage().data_ptr() for p in model.parameters())


def test_fp8_is_refused_before_any_weight_is_read_where_it_cannot_run():
    cfg = TargetConfig(path="/nonexistent/never-read", fp8=True)
    with pytest.raises(BadInput, match="target.fp8 = true: FP8 GEMMs need a CUDA GPU .* on cpu"):
        check_fp8(cfg, torch.device("cpu"), torch.float32)
    with pytest.raises(BadInput, match="target.fp8 = true"):
        load_target(cfg, 2, torch.device("cpu"))  # refused before the (missing) directory is looked at
    check_fp8(TargetConfig(path="x", fp8=False), torch.device("cpu"), torch.float32)  # off: nothing asked


def test_the_memory_plan_counts_fp8_weights_at_one_byte():
    from transformers import Qwen3Config

    from dflash.training import memory_plan as mp

    c = Qwen3Config(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                    num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=False)
    linears = mp.decoder_linear_parameters(c)
    assert linears == 36 * (4096 * 4096 * 2 + 4096 * 1024 * 2 + 3 * 4096 * 12288)
    assert mp.target_parameters(c) - linears == 2 * 151936 * 4096 + 36 * (2 * 4096 + 2 * 128) + 4096


@requires_cuda(bf16=True)
def test_cuda_fp8_target_compiled_taps_match_the_eager_ones_and_stay_near_bf16():
    if torch.cuda.get_device_capability() < fp8.MIN_CAPABILITY:
        pytest.skip("FP8 GEMMs need compute capability 8.9+")
    dev = torch.device("cuda")
    cfg = TargetConfig(path=EMBEDDED_TARGET, dtype="bf16", fp8=True)
    plain = load_target(TargetConfig(path=EMBEDDED_TARGET, dtype="bf16"), 2, dev)
    quant = load_target(cfg, 2, dev)
    assert any("decoder linears in FP8" in n for n in quant.notes)
    ids = torch.randint(0, plain.vocab_size - 1, (2, 256), generator=torch.Generator().manual_seed(0)).to(dev)
    ref = plain.taps(ids).float()
    got = quant.taps(ids).float()  # compiled (target.compile): the quantization fused into the layer's graph
    with torch.compiler.set_stance("force_eager"):
        eager = quant.taps(ids).float()
    torch.testing.assert_close(got, eager, rtol=0.05, atol=0.05)  # one quantization, two kernels' rounding
    rel = (got - ref).norm() / ref.norm()
    assert 0 < rel < 0.15, float(rel)


def test_an_eval_where_fp8_cannot_run_uses_the_unquantized_target_and_says_so():
    from dflash.eval.evaluate import eval_target_config

    off = TargetConfig(path=EMBEDDED_TARGET)
    assert eval_target_config(off, torch.device("cpu")) == (off, None)
    on = TargetConfig(path=EMBEDDED_TARGET, fp8=True)
    cfg, note = eval_target_config(on, torch.device("cpu"))
    assert cfg.fp8 is False and cfg.path == on.path and "trained with target.fp8" in note and "unquantized" in note
