"""Snapshots and deltas of torch's own compile counters (`torch._dynamo.utils.counters`) and
guard-failure reasons (`torch._dynamo.utils.guard_failures`).

These counters are process-wide (not per thread): a delta covers everything that compiled in the
process between two snapshots.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, slots=True)
class CounterSnapshot:
    counters: dict[str, dict[str, int]]
    guard_failures: dict[str, int]  # "file:line:name" of a code object -> number of reasons so far
    _reasons: dict[str, list[str]] = field(repr=False, default_factory=dict)


@dataclass(frozen=True, slots=True)
class CompileCounters:
    """What compiled between two snapshots. Names follow torch's counters."""

    frames_total: int = 0  # dynamo frames it tried to compile (counters["frames"]["total"])
    frames_ok: int = 0
    graph_breaks: int = 0  # sum of counters["graph_break"]
    unique_graphs: int = 0
    fxgraph_cache_hit: int = 0  # inductor FX-graph cache (counters["inductor"])
    fxgraph_cache_miss: int = 0
    fxgraph_cache_bypass: int = 0
    autograd_cache_hit: int = 0  # AOTAutograd cache (counters["aot_autograd"])
    autograd_cache_miss: int = 0
    autograd_cache_bypass: int = 0
    recompile_reasons: tuple[str, ...] = ()  # new guard-failure reasons, "fn: reason"
    graph_break_reasons: tuple[str, ...] = ()  # first line of each new graph-break reason

    @property
    def recompiles(self) -> int:
        return len(self.recompile_reasons)


def _code_key(code: Any) -> str:
    name = getattr(code, "co_name", None)
    if name is None:
        return str(code)
    return f"{getattr(code, 'co_filename', '?')}:{getattr(code, 'co_firstlineno', 0)}:{name}"


def snapshot() -> CounterSnapshot:
    """Copy torch's counters and the guard-failure lists as they are now."""
    from torch._dynamo import utils

    counters = {k: dict(v) for k, v in utils.counters.items()}
    reasons = {_code_key(k): [str(r) for r in v] for k, v in list(utils.guard_failures.items())}
    return CounterSnapshot(counters, {k: len(v) for k, v in reasons.items()}, reasons)


def delta(before: CounterSnapshot, after: CounterSnapshot | None = None) -> CompileCounters:
    """What changed between `before` and `after` (now, if omitted)."""
    after = after or snapshot()

    def d(group: str, key: str) -> int:
        return int(after.counters.get(group, {}).get(key, 0)) - int(before.counters.get(group, {}).get(key, 0))

    gb_after = after.counters.get("graph_break", {})
    gb_before = before.counters.get("graph_break", {})
    gb_new = [k for k, v in gb_after.items() if v > gb_before.get(k, 0)]
    reasons: list[str] = []
    for code, lst in after._reasons.items():
        seen = before.guard_failures.get(code, 0)
        fn = code.rsplit(":", 1)[-1]
        reasons += [f"{fn}: {r}" for r in lst[seen:]]
    return CompileCounters(
        frames_total=d("frames", "total"),
        frames_ok=d("frames", "ok"),
        graph_breaks=sum(gb_after.values()) - sum(gb_before.values()),
        unique_graphs=d("stats", "unique_graphs"),
        fxgraph_cache_hit=d("inductor", "fxgraph_cache_hit"),
        fxgraph_cache_miss=d("inductor", "fxgraph_cache_miss"),
        fxgraph_cache_bypass=d("inductor", "fxgraph_cache_bypass"),
        autograd_cache_hit=d("aot_autograd", "autograd_cache_hit"),
        autograd_cache_miss=d("aot_autograd", "autograd_cache_miss"),
        autograd_cache_bypass=d("aot_autograd", "autograd_cache_bypass"),
        recompile_reasons=tuple(reasons),
        graph_break_reasons=tuple(k.strip().splitlines()[0] for k in gb_new),
    )


def reset_dynamo() -> None:
    """Forget every compiled frame and zero the counters (a cold in-memory state). Compile callbacks
    registered by instruments (a watcher) survive: torch's reset() clears them, we put them back."""
    import torch
    from torch._dynamo.callback import callback_handler

    start, end = list(callback_handler.start_callbacks), list(callback_handler.end_callbacks)
    torch._dynamo.reset()
    for cb in start:
        if cb not in callback_handler.start_callbacks:
            callback_handler.register_start_callback(cb)
    for cb in end:
        if cb not in callback_handler.end_callbacks:
            callback_handler.register_end_callback(cb)
    from torch._dynamo import utils

    utils.counters.clear()
    utils.guard_failures.clear()
