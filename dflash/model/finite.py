"""Which tensors hold a NaN or an infinity: the trainer's check before every save (a diverged run saves
nothing) and `dflash check`'s look at an export's weights."""

from __future__ import annotations

from typing import Iterable

import torch


def nonfinite_tensors(named: Iterable[tuple[str, torch.Tensor]]) -> list[str]:
    """The names of the floating-point tensors in `named` with a non-finite value, in order. One
    host sync per device for all of them (the flags are stacked there before they are read)."""
    order: list[str] = []
    flags: dict[torch.device, list[tuple[str, torch.Tensor]]] = {}
    for name, t in named:
        if t.is_floating_point() and t.numel():
            order.append(name)
            flags.setdefault(t.device, []).append((name, torch.isfinite(t).all()))
    bad = {n for pairs in flags.values()
           for (n, _), good in zip(pairs, torch.stack([f for _, f in pairs]).tolist()) if not good}
    return [n for n in order if n in bad]


def nonfinite_parameters(model: torch.nn.Module) -> list[str]:
    """`nonfinite_tensors` of the model's parameters."""
    with torch.no_grad():
        return nonfinite_tensors(model.named_parameters())
