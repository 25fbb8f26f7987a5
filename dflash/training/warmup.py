"""The drafter's compiled code brought in while the target's weights are still being read (issue 39).

A warm start's first step spent ~2.5 s of its ~3.7 s (one H200, torch 2.11: docs/benchmarks.md) with
dynamo tracing the drafter's compiled layers again and loading their cached kernels. That needs the
drafter and the step's shapes, not the target's weights, and a start from disk waits several seconds for
those weights after the drafter is built. So `warm_drafter` runs the drafter's loss and backward on the
first micro-batch of the step the run starts at (`ChatDataset.step_batches`) with stand-ins for what the
target gives (zero taps and embeddings, a zero LM head of the target's shape and dtype), then drops the
gradients. Those are the first step's own shapes: whatever is compiled here (from the cache, or cold) the
first step would compile anyway. (Warming every shape of `warm_batches` instead made a warm start from
disk slower on the H200: a shape the first step did not use compiled cold for 8 s while the target waited.)

Nothing the run computes changes: no parameter, optimizer state, data order or RNG stream is touched
(tests/test_warmup.py: the first steps' numbers are the same with and without it). It runs where it pays,
CUDA with compiled layers, and only while the weights are still being read: `until()` is asked before each
shape, so a start whose weights come from the page cache does not wait for it.
"""

from __future__ import annotations

from typing import Callable

import torch

from dflash.model import DFlashDrafter, detect_backend, loss_backward, loss_weights, resolve_dtype
from dflash.model.weights import BUILDING


class _Head:
    """The LM head's stand-in: what dflash.model.head_ce reads of an nn.Linear."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.weight, self.bias = weight, None


def pays(drafter: DFlashDrafter, device: torch.device) -> bool:
    """Whether there is compiled code to bring in: CUDA and compiled layers."""
    return device.type == "cuda" and drafter.layers_compiled


def warm_drafter(cfg, drafter: DFlashDrafter, batches: list, *, vocab_size: int, dtype: torch.dtype,
                 device: torch.device, chunks: int = 1, until: Callable[[], bool] = lambda: False) -> int:
    """Forward and backward of `drafter` on each of `batches` (micro-batches of the run's data) with the target
    stood in for (the module doc); the gradients are dropped. Stops before a batch once `until()` is
    true. `chunks`: the run's resolved data.pack_chunks (the trainer's, dflash.training.memory_plan). Returns how many batches ran. Each runs under BUILDING: transformers changes torch's default
    dtype while it builds the target, and dynamo would trace (and guard on) that."""
    hidden = drafter.spec.hidden_size
    taps_width = drafter.fc.in_features
    head = _Head(torch.zeros(vocab_size, hidden, dtype=dtype, device=device))

    def embed(ids: torch.Tensor) -> torch.Tensor:
        return torch.zeros(*ids.shape, hidden, dtype=dtype, device=device)

    kwargs = dict(chunks=chunks, mask_token_id=0,
                  weights=loss_weights(cfg.drafter.block_size, cfg.gamma, device=device),
                  denominator=torch.ones((), device=device), backend=detect_backend(device, cfg.train.attention),
                  compute_dtype=resolve_dtype(cfg.train.dtype, device))
    ran = 0
    try:
        for batch in batches:
            if until():
                break
            with BUILDING:
                b = batch.to(device)
                taps = torch.zeros(*b.input_ids.shape, taps_width, dtype=dtype, device=device)
                loss_backward(drafter, embed, head, taps, b, **kwargs)
            ran += 1
    finally:
        drafter.zero_grad(set_to_none=True)
    return ran
