"""A decode step run eagerly, or replayed as a CUDA graph where the device allows.

Batched decoding repeats the same few steps (the target's verify forward, the drafter's block, a
plain decode token) at fixed shapes over preallocated slots (dflash.eval.slots): every round is the
same kernels on the same addresses, which is what a CUDA graph replays without the Python and launch
overhead of an eager transformers forward (tens of milliseconds per forward at 8B).

- A step is `fn(kv_len, *tensors) -> tuple of tensors`. Eager calls pass the slots it needs to read
  (`kv_len`, the longest row so far); a graph reads all of them (fixed shapes).
- One graph per batch size, captured the first time that size is run: a warm-up call on a side stream
  (it runs the step for real: writing the same K/V to the same slots twice is harmless), the capture
  (`thread_local` errors: another thread's CUDA work, a background checkpoint copy, is not this
  capture's business), one replay. The replay is checked against the warm-up, and the next call's
  replay (new inputs: nothing of the first call's may be baked in) against an eager run of it; a
  capture that fails or a replay that disagrees turns graphs off for this step (`note` says why) and
  the eager result is used from then on.
- A runner can outlive one decode (dflash.eval.reuse: a run's periodic evals share one): `begin()`
  starts the next decode, and each graph kept from an earlier one is checked again against an eager
  run at its first replay in this decode (a graph reads tensors by address: parameters updated in
  place, as the optimizer does, are seen; a parameter replaced by a new tensor would not be). One
  that disagrees is dropped and captured again (the note says so); the eager result is used.
- `captures`, `reused` and `setup_s` are this decode's: graphs captured, graphs from an earlier
  decode replayed, and the seconds of warm-ups, captures and eager checks (work a decode with every
  graph at hand would not do).
- Replays return the graph's own output tensors: read them before the step runs again.
"""

from __future__ import annotations

import contextlib
import time
from typing import Callable

import torch

from dflash.eval.generation import sync

GRAPH_RTOL = 2e-2  # replay vs eager (over all slots vs the rows' own, masked): bf16 rounding, relative to the output's scale (_gap)
GRAPH_ATOL = 2e-2


def graphs_available(device: torch.device) -> bool:
    """CUDA graphs need a CUDA device; everything else runs eagerly."""
    return device.type == "cuda" and torch.cuda.is_available()


def _gap(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    """(largest |a − b|, largest |b|) of a replay's output and the eager one, in fp32. The replay passes
    when the gap is within GRAPH_ATOL + GRAPH_RTOL × the eager output's scale: bf16 rounding of a GEMM
    or an attention sum grows with its inputs' magnitude, not with the one output element's (logits
    near 0 beside logits of 30 get the error of the 30s), so an element-wise rtol fails healthy replays
    (seen on an 8B target: the plain step), while a replay that read stale inputs is off by the scale."""
    d = (a.float() - b.float()).abs().max().item() if a.numel() else 0.0
    return d, (b.float().abs().max().item() if b.numel() else 0.0)


def _gaps_text(gaps: dict[int, tuple[float, float]], bad: list[int]) -> str:
    return ", ".join(f"max |replay − eager| {gaps[i][0]:.3g} at scale {gaps[i][1]:.3g}" for i in bad)


class StepRunner:
    """`fn` run eagerly or as CUDA graphs captured per batch size (module docstring)."""

    def __init__(self, name: str, fn: Callable[..., tuple[torch.Tensor, ...]], full_len: int,
                 use_graphs: bool) -> None:
        self.name, self.fn, self.full_len = name, fn, full_len
        self.use_graphs = use_graphs
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, list[torch.Tensor], tuple[torch.Tensor, ...]]] = {}
        self.checked: set[int] = set()  # batch sizes whose graph replayed this decode's inputs correctly
        self.earlier: set[int] = set()  # batch sizes whose graph was captured in an earlier decode
        self.note: str | None = None  # why graphs were turned off (or a graph captured again)
        self.replays = 0
        self.captures = 0  # this decode's
        self.reused: set[int] = set()  # this decode's: batch sizes replayed from an earlier decode's graph
        self.setup_s = 0.0  # this decode's warm-ups, captures and eager checks

    def begin(self) -> None:
        """Start another decode over the same buffers: every kept graph is checked again at its first
        replay; this decode's counts start at 0. Graphs turned off stay off (and their note stays)."""
        self.earlier = set(self.graphs)
        self.checked.clear()
        self.captures, self.reused, self.setup_s = 0, set(), 0.0
        if self.use_graphs:
            self.note = None

    def reset(self) -> None:
        """Forget captured graphs (the slots they read were reallocated: rows left the batch)."""
        self.graphs.clear()
        self.checked.clear()
        self.earlier.clear()

    def __call__(self, kv_len: int, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if not self.use_graphs:
            return self.fn(kv_len, *inputs)
        key = int(inputs[0].shape[0])
        dev = inputs[0].device  # the graph's device, whatever this thread's current one is
        with torch.cuda.device(dev) if dev.type == "cuda" else contextlib.nullcontext():
            entry = self.graphs.get(key)
            if entry is None:
                t0 = time.perf_counter()
                try:
                    out = self._capture(key, inputs)
                finally:
                    sync(dev)
                    self.setup_s += time.perf_counter() - t0
                self.captures += key in self.graphs
                return out
            graph, static, outputs = entry
            for s, x in zip(static, inputs):
                s.copy_(x)
            graph.replay()
            self.replays += 1
            if key in self.checked:
                return outputs
            self.checked.add(key)
            earlier = key in self.earlier
            if earlier:
                self.reused.add(key)
            sync(dev)
            t0 = time.perf_counter()
            ref = self.fn(self.full_len, *inputs)  # the same step eagerly (its writes repeat the replay's)
            sync(dev)
            self.setup_s += time.perf_counter() - t0
        if earlier:
            if not self._agree(outputs, ref, "an earlier decode's graph", recapture=True):
                return ref
        elif not self._agree(outputs, ref, "a second call"):
            return ref
        return outputs

    def _agree(self, outputs: tuple[torch.Tensor, ...], ref: tuple[torch.Tensor, ...], what: str,
               recapture: bool = False) -> bool:
        """Whether a replay's floating outputs match the eager ones; else graphs off (`recapture`: the
        graphs dropped, to be captured again at their next call), with a note."""
        gaps = {i: _gap(a, b) for i, (a, b) in enumerate(zip(outputs, ref)) if a.is_floating_point()}
        bad = [i for i, (diff, scale) in gaps.items() if diff > GRAPH_ATOL + GRAPH_RTOL * scale]
        if not bad:
            return True
        if recapture:
            self.reset()
        else:
            self.use_graphs = False
            self.graphs.clear()
        self.note = (f"{self.name}: CUDA graph replay of {what} differed from the eager step (outputs {bad}: "
                     f"{_gaps_text(gaps, bad)}); {'captured again' if recapture else 'ran eagerly'}")
        return False

    def _capture(self, key: int, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        dev = inputs[0].device
        static = [x.clone() for x in inputs]
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            ref = self.fn(self.full_len, *static)  # the warm-up: a real step
        torch.cuda.current_stream(dev).wait_stream(side)
        try:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                outputs = self.fn(self.full_len, *static)
            graph.replay()
        except Exception as e:  # noqa: BLE001 - anything the capture cannot take: run this step eagerly
            self.use_graphs = False
            self.note = f"{self.name}: CUDA graph capture failed ({type(e).__name__}: {str(e)[:200]}); ran eagerly"
            torch.cuda.synchronize(dev)
            return ref
        if not self._agree(outputs, ref, "its capture's inputs"):
            return ref
        self.graphs[key] = (graph, static, outputs)
        return outputs
