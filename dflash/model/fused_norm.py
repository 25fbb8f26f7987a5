"""The target's RMSNorms as one ATen kernel each when they run eagerly on a GPU (eval, regen).

transformers' Qwen3/Qwen2/Llama RMSNorm is five lines of tensor ops (transformers
models/qwen3/modeling_qwen3.py, `Qwen3RMSNorm.forward`): cast to fp32, square, mean, add eps, rsqrt,
multiply, cast back, multiply by the weight: eight CUDA kernels per norm when run eagerly, four norms per
Qwen3 decoder layer (input, post-attention, q and k). A batched eval decode step at 8B runs ~72 kernels
per layer and is bound by their count, not by reading the weights (docs/benchmarks.md, session 11).
`torch.rms_norm` on CUDA is one kernel (`_fused_rms_norm`, fp32 accumulation for bf16 input: the
drafter's own norms use it, dflash.model.drafter.RMSNorm), so a norm becomes two (the norm, the weight's
multiply, kept separate to round where transformers rounds).

`fuse_norms(model)` replaces each such norm module of the model in place with a `FusedRMSNorm` holding the
same weight Parameter (state-dict keys unchanged), only where it is provably the same computation:
- compiled (the training forward's tapped layers, dflash.model.target) and on a CPU it runs transformers'
  formula op for op, so compiled graphs and CPU results are what they were;
- a module is replaced only when its own forward and that formula agree bit for bit on a probe input (a
  norm that computes anything else, such as Gemma's `1 + weight`, stays), and when it has no hooks;
- the fused kernel is used only where, on this device and dtype, it agrees with the formula on a probe to
  within one unit in the last place of the dtype; otherwise the modules keep the formula and the note says so.
"""

from __future__ import annotations

import torch
from torch import nn


class FusedRMSNorm(nn.Module):
    """One RMSNorm (module docstring): `weight` and `variance_epsilon` are the replaced module's."""

    def __init__(self, norm: nn.Module, fused: bool) -> None:
        super().__init__()
        self.weight = norm.weight  # the same Parameter
        self.variance_epsilon = float(norm.variance_epsilon)
        self.fused = fused
        self.replaced = type(norm).__name__

    def formula(self, x: torch.Tensor) -> torch.Tensor:
        """transformers' RMSNorm, op for op (what compiled graphs trace)."""
        dtype = x.dtype
        x = x.to(torch.float32)
        variance = x.pow(2).mean(-1, keepdim=True)
        x = x * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * x.to(dtype)

    def kernel(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * torch.rms_norm(x, (x.shape[-1],), None, self.variance_epsilon)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused and not torch.compiler.is_compiling():
            return self.kernel(x)
        return self.formula(x)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}, fused={self.fused} (was {self.replaced})"


def _probe(norm: nn.Module) -> torch.Tensor:
    w = norm.weight
    g = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn((3, w.shape[0]), generator=g) * torch.tensor([[0.02], [1.0], [40.0]])  # small, unit, large rows
    return x.to(device=w.device, dtype=w.dtype)


def _candidate(m: nn.Module) -> bool:
    w, eps = getattr(m, "weight", None), getattr(m, "variance_epsilon", None)
    return (type(m).__name__.endswith("RMSNorm") and not isinstance(m, FusedRMSNorm)
            and isinstance(w, nn.Parameter) and w.dim() == 1 and isinstance(eps, (int, float))
            and not (m._forward_hooks or m._forward_pre_hooks or m._backward_hooks))


@torch.no_grad()
def kernel_agrees(norm: FusedRMSNorm) -> bool:
    """Whether the fused kernel gives the formula's result to within one unit in the last place here."""
    x = _probe(norm)
    a, b = norm.formula(x).float(), norm.kernel(x).float()
    return bool(torch.allclose(a, b, rtol=torch.finfo(x.dtype).eps, atol=torch.finfo(x.dtype).tiny))


@torch.no_grad()
def fuse_norms(model: nn.Module, *, fused: bool | None = None) -> str | None:
    """Replace `model`'s RMSNorm modules that compute transformers' formula with FusedRMSNorm (module
    docstring). `fused`: use the kernel eagerly (None: on CUDA, where the kernel agrees with the formula).
    Returns a note for the start's notes (None: nothing replaced)."""
    checked, skipped = {}, set()
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if not _candidate(child):
                continue
            new = FusedRMSNorm(child, fused=False)
            key = (type(child), child.weight.device, child.weight.dtype)
            if key not in checked:
                x = _probe(child)
                same = torch.equal(child(x), new.formula(x))
                use = fused if fused is not None else child.weight.is_cuda
                checked[key] = (same, same and use and kernel_agrees(new))
            same, use = checked[key]
            if not same:
                skipped.add(type(child).__name__)
                continue
            new.fused = use
            setattr(parent, name, new)
    wanted = {k[0].__name__ for k, (s, _) in checked.items() if s and (fused or (fused is None and k[1].type == "cuda"))}
    used = {k[0].__name__ for k, (s, u) in checked.items() if s and u}
    on_gpu = fused if fused is not None else any(k[1].type == "cuda" for k in checked)
    notes = [f"{', '.join(sorted(skipped))} left as is (computes something else than transformers' RMSNorm)"
             ] if skipped and on_gpu else []  # on a CPU nothing is fused either way: nothing to say
    if used:
        n = sum(isinstance(m, FusedRMSNorm) and m.fused for m in model.modules())
        notes.append(f"{n} {'/'.join(sorted(used))} modules run as one fused kernel each when eager")
    if wanted - used:
        notes.append(f"the fused RMSNorm kernel differs from {'/'.join(sorted(wanted - used))}'s formula by more "
                     "than rounding here: those norms keep the formula")
    return "target norms: " + "; ".join(notes) if notes else None
