"""Drafter replicas kept identical: one model per drafter device, the same parameters at every step.

How (data parallel inside one process, no torch.distributed):
1. At start, `broadcast_parameters` copies replica 0's parameters and buffers into every other
   replica, in place (optimizers built on those parameters keep their references).
2. Every step, after every replica ran forward and backward on its own micro-batch,
   `average_gradients` flattens each replica's gradients (one buffer per dtype), sums them in replica
   order on one device, divides once, and copies the *same* result back into every replica's
   `.grad`. Every replica then holds bit-identical gradients.
3. Each replica steps its own optimizer. Same parameters + same gradients + same optimizer state +
   the same deterministic elementwise update = the same parameters again, on every replica, every step.
   `max_parameter_difference` checks that claim (the engine runs it at the end, and every N steps
   when asked).

A parameter that got no gradient on any replica keeps `grad=None`; one that got a gradient on some
replicas only is averaged with zeros for the others (what DDP does with `find_unused_parameters`).
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
from torch import nn


def _check_same_structure(models: Sequence[nn.Module]) -> list[list[torch.nn.Parameter]]:
    params = [list(m.parameters()) for m in models]
    shapes0 = [(p.shape, p.dtype) for p in params[0]]
    for i, ps in enumerate(params[1:], start=1):
        if [(p.shape, p.dtype) for p in ps] != shapes0:
            raise ValueError(f"replica {i} has different parameters than replica 0 (shapes or dtypes differ)")
    return params


@torch.no_grad()
def broadcast_parameters(models: Sequence[nn.Module]) -> None:
    """Copy replica 0's parameters and buffers into every other replica, in place."""
    _check_same_structure(models)
    src = list(models[0].parameters()) + list(models[0].buffers())
    for m in models[1:]:
        for s, d in zip(src, list(m.parameters()) + list(m.buffers())):
            d.copy_(s.to(d.device))


@torch.no_grad()
def average_gradients(models: Sequence[nn.Module], *, divide_by: float | None = None,
                      reduce_device: torch.device | str | None = None,
                      reduce: Callable[[torch.Tensor], None] | None = None) -> int:
    """Sum the replicas' gradients, divide by `divide_by` (default: the number of replicas), and
    write that one result into every replica's `.grad`. Returns the number of elements averaged.

    The sum runs in replica order on `reduce_device` (default: replica 0's device), so the result
    does not depend on thread timing. Gradients are grouped by dtype into flat buffers: one copy per
    replica and dtype each way, instead of one per parameter. `reduce` (in place) runs on each flat
    sum before the division: a cross-process all-reduce (dflash.distributed.group) plugs in there, so
    every process divides the same global sum by the same global weight.
    """
    params = _check_same_structure(models)
    n = len(models)
    divide_by = divide_by or n
    if n == 1 and divide_by == 1.0 and reduce is None:
        return sum(p.grad.numel() for p in params[0] if p.grad is not None)
    # parameters that have a gradient on at least one replica; with a cross-process `reduce`, all of
    # them (every process must reduce buffers of the same size, whichever parameters it used)
    used = [j for j in range(len(params[0])) if reduce is not None or any(ps[j].grad is not None for ps in params)]
    dev = torch.device(reduce_device) if reduce_device is not None else params[0][0].device
    groups: dict[torch.dtype, list[int]] = {}
    for j in used:
        groups.setdefault(params[0][j].dtype, []).append(j)
    total_elems = 0
    def flat(ps: Sequence[torch.Tensor], idx: list[int]) -> torch.Tensor:  # (sum of numels,) on `dev`
        return torch.cat([(ps[j].grad if ps[j].grad is not None else torch.zeros_like(ps[j])).reshape(-1)
                          for j in idx]).to(dev)

    for dtype, idx in groups.items():
        total = flat(params[0], idx)
        for ps in params[1:]:
            total.add_(flat(ps, idx))
        if reduce is not None:
            reduce(total)
        total.div_(divide_by)
        total_elems += total.numel()
        for ps in params:
            local = total.to(ps[idx[0]].device)
            offset = 0
            for j in idx:
                p = ps[j]
                chunk = local[offset:offset + p.numel()].view_as(p)
                offset += p.numel()
                if p.grad is None:
                    p.grad = chunk.clone()
                else:
                    p.grad.copy_(chunk)
    return total_elems


@torch.no_grad()
def max_parameter_difference(models: Sequence[nn.Module]) -> float:
    """Largest absolute difference between any replica's parameter and replica 0's (0.0 = identical)."""
    params = _check_same_structure(models)
    worst = 0.0
    for ps in params[1:]:
        for a, b in zip(params[0], ps):
            if a.numel():
                worst = max(worst, float((a.detach().float() - b.detach().to(a.device).float()).abs().max()))
    return worst
