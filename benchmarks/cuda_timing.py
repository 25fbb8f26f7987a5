"""Timing shared by the kernel benchmarks: the median of back-to-back runs by CUDA events (wall clock on a CPU)."""

from __future__ import annotations

import statistics
import time

import torch


def median_ms(fn, iters: int, warmup: int) -> float:
    """Median ms of `iters` calls of `fn` after `warmup` untimed ones. On CUDA the calls are queued back to back
    with an event pair around each and one sync at the end: a launch's host time overlaps the previous kernel,
    as in a training step. Elsewhere: the wall clock around each call."""
    for _ in range(warmup):
        fn()
    if not torch.cuda.is_available():
        times = []
        for _ in range(iters):
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e3)
        return statistics.median(times)
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    for start, end in events:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(end) for start, end in events)
