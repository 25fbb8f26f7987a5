"""The frozen target's decoder linears in FP8 (`target.fp8`): about half the target forward's GEMM time.

The target is frozen and only run forward, so its linear layers can run as FP8 GEMMs
(`torch._scaled_mm`, e4m3 operands, fp32 scales, bf16 output) on GPUs that have them (compute capability
8.9 and up: Ada, Hopper, Blackwell). Each weight row (output feature) gets its own scale, computed once here;
each activation row (token) gets its own scale, computed at every call from the row's largest magnitude
(inside the compiled decoder layer, where inductor fuses it into the norm or the SwiGLU before it). This is
the "rowwise" FP8 scheme of torch's own float8 training (torchao `Float8LinearConfig.from_recipe_name("rowwise")`).

What it changes: the taps the drafter trains on are a quantized target's hidden states. e4m3 keeps 3
mantissa bits, so each operand carries ~2-4% relative rounding (on Gaussian data one GEMM's output is off by
~3.6%); over the layers the taps differ from bf16's by what `benchmarks/dflash_mixed.py --fp8-target` reports,
and `benchmarks/fp8_fidelity.py` sets that beside bf16's own rounding (on a random 8B, each layer's output
moved 1.6-1.7x as far from fp32 under FP8 as under bf16; docs/benchmarks.md). Greedy decoding with the quantized target (evals) is
still lossless against the same quantized target. It is off by default: a drafter trained this way is served
best beside a target served in FP8.

Only the decoder layers' linears are converted: the embedding, the norms, attention itself and the LM head
(which the drafter's loss also reads, and whose input gradient it needs) stay in the target's dtype.
"""

from __future__ import annotations

import torch
from torch import nn

E4M3 = torch.float8_e4m3fn
E4M3_MAX = float(torch.finfo(E4M3).max)  # 448
MIN_CAPABILITY = (8, 9)


class Fp8Linear(nn.Module):
    """y = x W^T + b with W in e4m3 (one fp32 scale per output row) and x quantized per row at each call."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        w = linear.weight.detach()
        scale = w.abs().amax(dim=1, keepdim=True).float().clamp(min=1e-12) / E4M3_MAX  # (N, 1)
        self.register_buffer("weight", (w.float() / scale).to(E4M3))  # (N, K) row-major: .t() is column-major
        self.register_buffer("weight_scale", scale.t().contiguous())  # (1, N)
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach())
        self.in_features, self.out_features = linear.in_features, linear.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        scale = x2.abs().amax(dim=1, keepdim=True).float().clamp(min=1e-12) / E4M3_MAX  # (M, 1)
        xq = (x2.float() / scale).to(E4M3)
        y = torch._scaled_mm(xq, self.weight.t(), scale_a=scale, scale_b=self.weight_scale, out_dtype=x.dtype)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, e4m3 rowwise"


def unsupported(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why `target.fp8` cannot run on `device` with the target in `dtype`, or None."""
    if device.type != "cuda":
        return f"FP8 GEMMs need a CUDA GPU of compute capability {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} or newer; the target is on {device.type}"
    cap = torch.cuda.get_device_capability(device)
    if cap < MIN_CAPABILITY:
        return (f"FP8 GEMMs need compute capability {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} or newer (Ada, Hopper, "
                f"Blackwell); {torch.cuda.get_device_name(device)} is {cap[0]}.{cap[1]}")
    if dtype != torch.bfloat16:
        return f"FP8 GEMMs give bf16 outputs here; the target is in {str(dtype).replace('torch.', '')} (set target.dtype to bf16 or auto)"
    return None


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder layers of a Hugging Face causal LM (`model.get_decoder().layers`)."""
    dec = model.get_decoder() if hasattr(model, "get_decoder") else getattr(model, "model", model)
    layers = getattr(dec, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise TypeError(f"{type(model).__name__}: no decoder layers found for target.fp8")
    return layers


def quantize_decoder(model: nn.Module) -> str:
    """Every nn.Linear inside `model`'s decoder layers becomes an Fp8Linear, in place; the bf16 weights they
    replace are freed (parameters left that view a larger allocation, as the direct safetensors read gives
    them, are copied out of it so that it is freed too). Returns a note for the start's notes."""
    before = _weight_bytes(model)
    n = 0
    for layer in decoder_layers(model):
        for parent in list(layer.modules()):
            for name, child in list(parent.named_children()):
                if isinstance(child, nn.Linear):
                    setattr(parent, name, Fp8Linear(child))
                    n += 1
    for p in model.parameters():  # the rest (embedding, norms, LM head) off the file-sized allocations
        if p.untyped_storage().nbytes() > p.numel() * p.element_size():
            p.data = p.data.clone()
    after = _weight_bytes(model)
    return (f"target.fp8: {n} decoder linears in FP8 (e4m3, a scale per weight row and per token); "
            f"weights {_size(before)} -> {_size(after)}")


def _size(n: int) -> str:
    return f"{n / 1e9:.1f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"


def _weight_bytes(model: nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
