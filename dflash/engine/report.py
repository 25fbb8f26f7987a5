"""What an engine run reports: its steps, its threads' states, the failure, and the verdicts.

The engine (dflash.engine.engine) records a `StepRecord` per committed step, keeps each thread's
`ThreadState`, the first worker `Failure`, and, when the run ends, hands them to `build_report`,
which derives the rates (steps/s, tokens/s, the drafters' time waiting for targets) and the verdicts:
data, failures first (a worker's error, the cross-thread races named, a compile the guard blocked,
a stall with every thread's phase), then what was measured (prewarm, throughput, replicas identical,
a drafter device idle next to the others: compilewatch.low_outliers). The CLI only renders them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from compilewatch import Frame
from dflash.engine import compile_safety

Outcome = Literal["ok", "failed", "stalled", "interrupted", "prewarm_failed"]


@dataclass(frozen=True, slots=True)
class StepRecord:
    step: int
    loss: float  # over the global batch (weighted by each micro-batch's weight)
    wall_s: float  # since the previous step was committed (or since the workers started)
    wait_s: tuple[float, ...]  # per replica: waiting for target batches
    compute_s: tuple[float, ...]  # per replica: forward + backward
    barrier_s: tuple[float, ...]  # per replica: waiting for the slowest replica (previous step's barrier wait)
    reduce_s: float  # averaging gradients
    tokens: int | None
    samples: Any = None  # compile_safety.Samples every `sample_every` steps (memory, utilization)


@dataclass(frozen=True, slots=True)
class ThreadState:
    name: str
    role: Literal["target", "drafter"]
    device: str
    phase: str  # starting | producing | queue-full | waiting-for-batch | computing | at-barrier | stepping | done | stopped | failed
    step: int | None  # drafter: the step it is in; target: None
    item: int | None  # the batch index it is producing or waiting for
    since_s: float  # seconds in this phase when the report was made
    alive: bool
    busy_s: float  # target: producing; drafter: forward + backward
    waiting_s: float  # target: blocked on a full queue; drafter: waiting for batches


@dataclass(frozen=True, slots=True)
class Failure:
    thread: str
    device: str
    error: str  # "Type: message"
    traceback: str


@dataclass(frozen=True, slots=True)
class EngineReport:
    outcome: Outcome
    target_devices: tuple[str, ...]
    drafter_devices: tuple[str, ...]
    start_step: int
    steps_done: int  # committed steps, counting start_step (the next run resumes here)
    wall_s: float  # the worker phase
    setup_s: float  # building producers and replicas
    prewarm: compile_safety.PrewarmResult | None
    guard: str  # what enforced "no compiles" during the worker phase ("off" when disabled)
    steps: tuple[StepRecord, ...]
    tokens_per_s: float | None
    steps_per_s: float | None
    wait_fraction: float | None  # drafter time waiting for targets / (waiting + computing)
    failure: Failure | None
    threads: tuple[ThreadState, ...]
    stacks: dict[str, tuple[Frame, ...]]  # every thread's stack on a stall, or when threads did not stop
    max_param_diff: float | None  # between replicas at the end (0.0: identical; None: a thread never stopped)
    watch: Any  # compilewatch WatchSummary, or None when the watcher did not run
    saved: tuple[Any, ...]  # what the save hook returned, in order (periodic, final or Ctrl-C)
    verdicts: tuple[str, ...]

    @property
    def ok(self) -> bool:
        return self.outcome == "ok"


class EngineSettings(Protocol):
    """What the report reads of the engine's config (dflash.engine.engine.EngineConfig)."""

    @property
    def target_devices(self) -> tuple[str, ...]: ...

    @property
    def drafter_devices(self) -> tuple[str, ...]: ...

    @property
    def start_step(self) -> int: ...

    @property
    def stall_after(self) -> float: ...


def build_report(cfg: EngineSettings, outcome: Outcome, *, records: tuple[StepRecord, ...], steps_done: int,
                 threads_now: list[ThreadState], threads_at_stall: list[ThreadState] | None, wall: float,
                 setup_s: float, pre: compile_safety.PrewarmResult | None, guard: str, failure: Failure | None,
                 dumped: dict[str, tuple[Frame, ...]], max_param_diff: float | None, watch: Any,
                 saved: tuple[Any, ...]) -> EngineReport:
    """The report of a run that ended with `outcome` after `steps_done` committed steps (counting
    start_step), its rates and verdicts. `threads_at_stall`: each thread's state when a stall was seen."""
    # on a stall, each thread's phase when the stall was seen; whether it is still alive: now
    threads = (tuple(dataclasses.replace(t, alive=n.alive) for t, n in zip(threads_at_stall, threads_now))
               if threads_at_stall else tuple(threads_now))
    done = steps_done - cfg.start_step
    toks = [r.tokens for r in records]
    tokens_per_s = (sum(t for t in toks if t is not None) / wall) if records and wall > 0 and None not in toks else None
    steps_per_s = done / wall if wall > 0 and done else None
    waited = sum(t.waiting_s for t in threads if t.role == "drafter")
    busy = sum(t.busy_s for t in threads if t.role == "drafter")
    wait_fraction = waited / (waited + busy) if waited + busy > 0 else None
    report = EngineReport(
        outcome=outcome, target_devices=cfg.target_devices, drafter_devices=cfg.drafter_devices,
        start_step=cfg.start_step, steps_done=steps_done, wall_s=wall, setup_s=setup_s, prewarm=pre,
        guard=guard, steps=records, tokens_per_s=tokens_per_s, steps_per_s=steps_per_s, wait_fraction=wait_fraction,
        failure=failure, threads=threads, stacks=dumped, max_param_diff=max_param_diff, watch=watch,
        saved=saved,
        verdicts=(),
    )
    return dataclasses.replace(report, verdicts=tuple(_verdicts(report, cfg)))


_RACE = "symbolically trace a dynamo-optimized function"
_PATCHED_CALL = "module is not installed as a submodule"


def _verdicts(r: EngineReport, cfg: EngineSettings) -> list[str]:
    out: list[str] = []
    R, W = len(r.drafter_devices), len(r.target_devices)
    if r.outcome == "prewarm_failed":
        out += list(r.prewarm.verdicts) if r.prewarm is not None else ["prewarm failed (no prewarm report)."]
        out.append("no worker thread was started: fix the step on the failing device first.")
        return out
    if r.prewarm is not None:
        pre = r.prewarm
        frames = sum(w.frames_compiled for w in pre.per_replica)
        split = (f" ({pre.compiled} warmed, {frames} dynamo frame(s) compiled; {pre.replicas - pre.compiled} reused "
                 "that code: " + ", ".join(f"{s:.2f} s" for s in pre.replica_s) + ")") if pre.replicas > 1 and pre.per_replica else ""
        out.append(f"prewarm: {pre.replicas} replica(s){split} on {len(pre.devices)} device(s), one after another "
                   f"in the main thread, {pre.wall_s:.2f} s ({pre.via}); verify pass compiled nothing.")
    else:
        out.append("prewarm was off: the first step compiled inside the worker threads, concurrently.")
    done = r.steps_done - r.start_step
    rate = f", {r.steps_per_s:.2f} steps/s" if r.steps_per_s else ""
    rate += f", {r.tokens_per_s:,.0f} tokens/s" if r.tokens_per_s else ""
    out.append(f"{done} step(s) on {R} drafter replica(s) fed by {W} target worker(s) in {r.wall_s:.2f} s{rate}.")
    if r.wait_fraction is not None and done:
        pct = 100 * r.wait_fraction
        if pct >= 50:
            out.append(f"drafters spent {pct:.0f}% of their time waiting for target batches: the targets are the "
                       "bottleneck (more target workers, or a cheaper target step).")
        else:
            out.append(f"drafters spent {pct:.0f}% of their time waiting for target batches.")
    if r.failure is not None:
        f = r.failure
        out.append(f"{f.thread} ({f.device}) failed: {f.error.splitlines()[0]} (traceback in the report).")
        if _RACE in f.error:
            out.append("that is the cross-thread FX-flag race: another thread was tracing while this one called a "
                       "compiled function. Run with prewarm and the guard on.")
        elif _PATCHED_CALL in f.error or "module_call_wrapper" in f.traceback:
            out.append("that is the cross-thread trace race: another thread's FX trace had patched nn.Module.__call__ "
                       "for every thread, and this thread's module call went through it. Run with prewarm and the "
                       "guard on.")
        if compile_safety.is_blocked_compile(f.error):
            out.append("something compiled after prewarm (a shape or dtype the warm step did not cover): the guard "
                       "stopped it instead of letting it race. Warm every shape training uses (bucket lengths).")
    if r.outcome == "stalled":
        states = ", ".join(f"{t.name} {t.phase}" + (f" item {t.item}" if t.item is not None else "") for t in r.threads)
        out.append(f"stall: no step completed for {cfg.stall_after:g} s; every thread's stack is in the report. "
                   f"Threads: {states}.")
    if r.outcome == "interrupted":
        out.append(f"interrupted after {r.steps_done} step(s); " + ("saved." if r.saved else
                                                                   "nothing saved (no save hook, or replica 0 did not stop)."))
    alive = [t.name for t in r.threads if t.alive]
    if alive:
        out.append(f"still running after the stop (blocked inside torch, cannot be killed): {', '.join(alive)}.")
    if r.max_param_diff is not None and R > 1:
        out.append("replicas identical (max parameter difference 0)." if r.max_param_diff == 0.0 else
                   f"replicas differ: max parameter difference {r.max_param_diff:g}.")
    out += _imbalance(r)
    if r.watch is not None:
        out += [f"watch: {v}" for v in getattr(r.watch, "verdicts", ())]
    return out


def _imbalance(r: EngineReport) -> list[str]:
    """A drafter device far below the others in utilization or memory: idle, starved, or dead
    (compilewatch.low_outliers: below 60% of the other drafter devices' median)."""
    from compilewatch import low_outliers

    last = next((s.samples for s in reversed(r.steps) if s.samples is not None), None)
    rows = [d for d in getattr(last, "devices", ()) if d.device in r.drafter_devices]
    out = []
    for field_name, what in (("utilization_pct", "utilization"), ("allocated_bytes", "memory")):
        vals = {d.device: getattr(d, field_name) for d in rows if getattr(d, field_name) is not None}
        for d, med in low_outliers(vals).items():
            out.append(f"drafter device {d} is at {vals[d]:,.0f} {what} vs a median of {med:,.0f} on the other "
                       "drafter devices: idle, starved or dead (see the threads' phases).")
    return out
