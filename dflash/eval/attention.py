"""The eval decodes without cuDNN's sdpa kernels.

torch picks cuDNN's attention for the masked sdpa calls of the eval's prefill, weighing forward and
decode steps on a Hopper GPU (torch 2.11+cu130 on an H200: `cudnn_generated_fort_native_sdpa_*` kernels),
and cuDNN builds them at their first calls. On a fresh H200 that building was most of what a first periodic
eval paid beyond the later ones: at 8B, 4 prompts × 256 new tokens, the first eval took 12.2 s with cuDNN
allowed and 7.9 s without (eager warm-up 2.66 → 0.53 s, plain pass 4.15 → 2.77 s, near-tie weighing 0.83 →
0.05 s); a later process on the same machine, cuDNN allowed, 8.7 s (some of the building is kept on the
machine); the later evals 4.4 s either way: the decode steps' attention is ~1.5% of their kernel time
(`python benchmarks/dflash_eval_batched.py --random-8b --device cuda --cases 4x256 --periodic 2
[--no-cudnn-sdpa]`, docs/benchmarks.md, session 15).

`decode_attention()` turns cuDNN's sdpa off for the eval's forwards, eager and captured (a CUDA graph keeps the
kernel its capture ran), and leaves the other backends as the process had them (flash, memory-efficient, math: a
user's own switches stand). torch keeps these switches per process, not per thread
(`torch.backends.cuda.enable_cudnn_sdp`). The eval runs between training steps (inside the step barrier on the
engine), so no drafter forward runs beside it; the engine's target workers may go on filling their queue
meanwhile: a compiled target forward calls the kernel its graph was traced with, and an eager one (`target.compile
= false`) picks among the other kernels for that while (the same results to within rounding; a graph traced in
that while keeps its pick). The switch is put back when the eval ends, raised or not. A CPU has no cuDNN sdpa, so
nothing changes there.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

NAME = "sdpa without cuDNN"  # part of a kept plain baseline's identity (dflash.eval.baseline_store)


@contextlib.contextmanager
def decode_attention() -> Iterator[None]:
    """cuDNN's sdpa off inside, as it was after (module docstring)."""
    was = torch.backends.cuda.cudnn_sdp_enabled()
    torch.backends.cuda.enable_cudnn_sdp(False)
    try:
        yield
    finally:
        torch.backends.cuda.enable_cudnn_sdp(was)
