"""DFlash's training attention as a `compilewatch warm` workload (`--workload dflash`).

dflash registers it in the `compilewatch.workloads` entry-point group (pyproject.toml), so
compilewatch carries no DFlash code: `compilewatch warm --devices 5,6,7 --workload dflash` finds it
through the installed package's metadata and calls `make(options)`.

What it runs is what a training step runs, built from `dflash.model.mask`: the training mask
(`make_mask_mod`, built eagerly as a BlockMask by `build_masks`, padded to flex's block size) and
flex_attention with `enable_gqa=True`. With the inductor backend the compiled callable is the
trainer's own (`mask.compiled_kernels()`), so a warm handed off in-process (`-- -m dflash train`)
leaves the trainer's flex_attention compiled; other backends compile their own wrapper.

Shapes (`WorkloadOptions.shape`): `blocks` blocks of `block_size` query tokens over a `context`-token
context; KV = context + the blocks' own tokens; anchors drawn once with a fixed seed.
"""

from __future__ import annotations

from typing import Any

import torch

from compilewatch import BadInput, FlexAttentionWorkload, WorkloadOptions
from dflash.model.mask import build_masks, compiled_kernels


def anchors_for(context: int, blocks: int, block_size: int, batch: int, seed: int = 0) -> torch.Tensor:
    """(batch, blocks) sorted anchor positions in [0, context - block_size), drawn with `seed`; when
    there are more blocks than positions the last anchor repeats."""
    g = torch.Generator().manual_seed(seed)
    n = min(blocks, context - block_size)
    anchors = torch.sort(torch.randperm(context - block_size, generator=g)[:n])[0]
    if n < blocks:
        anchors = torch.cat([anchors, anchors[-1:].expand(blocks - n)])
    return anchors.expand(batch, blocks)


class DFlashAttention(FlexAttentionWorkload):
    """Compiled flex_attention under the DFlash training mask, forward (+ backward on CUDA)."""

    def __init__(self, options: WorkloadOptions, *, name: str = "dflash", trainer_kernel: bool = True) -> None:
        """trainer_kernel: with inductor, use the trainer's compiled flex_attention (one per process);
        False compiles a wrapper of this workload's own (benchmarks/gpu_warm.py: one per thread)."""
        sh = options.shape
        if sh.context <= sh.block_size:
            raise BadInput(f"context ({sh.context}) must be larger than block_size ({sh.block_size})",
                           hint="raise --seq or lower --block-size")
        super().__init__(options.backend, sh, name=name)
        self.trainer_kernel = trainer_kernel

    def _compile(self) -> Any:
        if self.backend == "inductor" and self.trainer_kernel:
            return compiled_kernels()["flex_attention"]  # the trainer's own compiled flex_attention
        from torch.nn.attention.flex_attention import flex_attention

        return torch.compile(flex_attention, backend=self.backend, dynamic=False)

    def block_mask(self, device: str) -> Any:
        sh = self.shape
        anchors = anchors_for(sh.context, sh.blocks, sh.block_size, sh.batch).to(device)
        return build_masks(anchors, sh.context, sh.block_size, "flex")["full"]

    def attend(self, compiled: Any, q: Any, k: Any, v: Any, mask: Any) -> Any:
        return compiled(q, k, v, block_mask=mask, enable_gqa=True)  # as dflash.model.mask.flex_attend calls it

    def describe(self) -> str:
        sh = self.shape
        q = sh.blocks * sh.block_size
        return (f"dflash mask, {sh.blocks} blocks x {sh.block_size} over {sh.context} context "
                f"(Q={q}, KV={sh.context + q}), {sh.heads} heads x {sh.head_dim}, dtype {sh.dtype}")


def make(options: WorkloadOptions) -> DFlashAttention:
    """The `compilewatch.workloads` entry point: DFlash's training attention (mask + flex_attention)."""
    return DFlashAttention(options)
