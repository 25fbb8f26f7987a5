"""dflash.model.fused_norm: the target's RMSNorms swapped for modules that run one fused kernel eagerly on a
GPU and transformers' formula everywhere else; only norms that provably compute that formula, and nothing
of the model's weights, state-dict keys, hooks or outputs changes on a CPU."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dflash.model.fused_norm import FusedRMSNorm, fuse_norms
from tests.helpers import requires_cuda


def tiny_model(seed: int = 3, dtype=torch.float32):
    from transformers import Qwen3ForCausalLM

    from dflash.model.target import build_tiny_tokenizer, tiny_target_config

    torch.manual_seed(seed)
    cfg = tiny_target_config(len(build_tiny_tokenizer()), hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                             head_dim=8)
    cfg._attn_implementation = "sdpa"
    return Qwen3ForCausalLM(cfg).to(dtype).eval()


IDS = torch.tensor([[1, 5, 9, 2, 7, 3], [4, 4, 8, 6, 1, 2]])


@torch.no_grad()
def _run(model):
    out = model(input_ids=IDS, output_hidden_states=True)
    return out.logits, out.hidden_states


def test_on_a_cpu_every_norm_is_swapped_and_nothing_else_changes():
    model = tiny_model()
    params = dict(model.named_parameters())
    logits, hidden = _run(model)
    assert fuse_norms(model) is None  # a CPU: nothing fused, nothing to tell
    swapped = [m for m in model.modules() if isinstance(m, FusedRMSNorm)]
    assert len(swapped) == 3 * 4 + 1 and not any(m.fused for m in swapped)  # input, post, q, k a layer; final
    assert all(m.replaced == "Qwen3RMSNorm" for m in swapped)
    assert dict(model.named_parameters()).keys() == params.keys()
    assert all(p is params[k] for k, p in model.named_parameters())  # the same Parameters, not copies
    logits2, hidden2 = _run(model)
    assert torch.equal(logits, logits2) and len(hidden) == len(hidden2)  # transformers' output capture still works
    assert all(torch.equal(a, b) for a, b in zip(hidden, hidden2))
    assert fuse_norms(model) is None and sum(isinstance(m, FusedRMSNorm) for m in model.modules()) == 13  # idempotent


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kernel_path_agrees_with_the_formula_within_rounding(dtype):
    """The kernel path forced on a CPU (torch.rms_norm's composite): within one unit in the last place."""
    model = tiny_model(dtype=dtype)
    logits, _ = _run(model)
    note = fuse_norms(model, fused=True)
    assert note == "target norms: 13 Qwen3RMSNorm modules run as one fused kernel each when eager"
    assert all(m.fused for m in model.modules() if isinstance(m, FusedRMSNorm))
    fused_logits, _ = _run(model)
    eps = torch.finfo(dtype).eps
    assert torch.allclose(logits.float(), fused_logits.float(), rtol=8 * eps, atol=8 * eps * logits.abs().max().item())


class GemmaLikeRMSNorm(nn.Module):
    """A norm of another formula (Gemma's: the weight is an offset from 1, the product taken in fp32)."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n) * 0.1)
        self.variance_epsilon = 1e-6

    def forward(self, x):
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return (x32 * (1.0 + self.weight.float())).to(x.dtype)


def test_a_norm_of_another_formula_or_with_hooks_is_left_alone():
    model = tiny_model()
    layer = model.model.layers[0]
    layer.input_layernorm = GemmaLikeRMSNorm(32)
    seen = []
    layer.post_attention_layernorm.register_forward_hook(lambda m, a, o: seen.append(o.shape))
    note = fuse_norms(model, fused=True)
    assert isinstance(layer.input_layernorm, GemmaLikeRMSNorm) and not isinstance(layer.post_attention_layernorm,
                                                                                      FusedRMSNorm)
    assert "GemmaLikeRMSNorm left as is" in note and "11 Qwen3RMSNorm modules" in note
    _run(model)
    assert seen  # its hook still runs


def test_a_kernel_that_differs_beyond_rounding_is_not_used(monkeypatch):
    monkeypatch.setattr(FusedRMSNorm, "kernel", lambda self, x: self.formula(x) * 1.01)
    model = tiny_model()
    logits, _ = _run(model)
    note = fuse_norms(model, fused=True)
    assert "differs from Qwen3RMSNorm's formula by more than rounding" in note
    assert not any(m.fused for m in model.modules() if isinstance(m, FusedRMSNorm))
    assert torch.equal(_run(model)[0], logits)


def test_compiled_code_traces_the_formula_not_the_kernel():
    """The training forward's compiled layers see transformers' ops, as before (and inductor fuses them)."""
    norm = FusedRMSNorm(tiny_model().model.norm, fused=True)
    graphs = []

    def backend(gm, inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    try:
        out = torch.compile(norm, backend=backend, fullgraph=True)(torch.randn(2, 5, 32))
    finally:
        torch._dynamo.reset()
    code = graphs[0].code
    assert out.shape == (2, 5, 32) and "rsqrt" in code and "rms_norm" not in code


def test_the_eval_baseline_identity_counts_fused_norms():
    from dflash.config import tiny
    from dflash.eval import baseline_store
    from dflash.model.target import load_target

    t = load_target(tiny().target, 1, torch.device("cpu"))
    assert baseline_store.identity(t)["fused_norms"] == 0  # on a CPU the norms keep the formula
    for m in t.model.modules():
        if isinstance(m, FusedRMSNorm):
            m.fused = True
    assert baseline_store.identity(t)["fused_norms"] == 25


# ----------------------------------------------------------------------------- GPU (run with -m gpu)
@pytest.mark.gpu
@requires_cuda()
def test_on_cuda_the_norms_fuse_and_a_decode_step_launches_fewer_kernels():
    from torch.profiler import ProfilerActivity, profile

    def kernels(model) -> int:
        ids = IDS.cuda()
        with torch.no_grad():
            model(input_ids=ids)  # first calls outside the count
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                model(input_ids=ids)
                torch.cuda.synchronize()
        return sum(e.count for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA)

    plain = tiny_model(dtype=torch.bfloat16).cuda()
    fused = tiny_model(dtype=torch.bfloat16).cuda()
    note = fuse_norms(fused)
    assert note == "target norms: 13 Qwen3RMSNorm modules run as one fused kernel each when eager"
    with torch.no_grad():
        a, b = plain(input_ids=IDS.cuda()).logits.float(), fused(input_ids=IDS.cuda()).logits.float()
    assert torch.allclose(a, b, rtol=0.05, atol=0.05 * a.abs().max().item())
    assert kernels(plain) - kernels(fused) >= 13 * 5  # each norm: 8 kernels -> 2 (the norm, the weight)


def test_on_a_cpu_a_norm_of_another_formula_costs_no_note():
    """Nothing is fused on a CPU either way: a start there says nothing about the norms."""
    model = tiny_model()
    model.model.layers[0].input_layernorm = GemmaLikeRMSNorm(32)
    assert fuse_norms(model) is None
    assert isinstance(model.model.layers[0].input_layernorm, GemmaLikeRMSNorm)
