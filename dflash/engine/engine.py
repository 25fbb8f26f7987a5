"""The multi-device engine: target workers feed drafter replicas, one thread per device, no races.

    report = Engine(program, EngineConfig(target_devices=("cuda:0",) * 5, drafter_devices=(...), steps=1000)).run()

Layout (the 8-GPU trainer of docs/index.md, made safe by construction):
- **Target workers**, one thread per target device, run `produce(index)` (a target forward that
  returns the drafter's inputs) and put the batch into their own bounded queue (dflash.engine.routing).
- **Drafter replicas**, one thread per drafter device, each with its own copy of the model and its
  own optimizer. Step `s`: every replica takes its micro-batch(es), runs forward and backward, waits
  at the step barrier; the barrier's action (run by the last thread to arrive) averages the
  gradients into every replica (dflash.engine.replicas) and records the step; then every replica steps its
  optimizer. Same gradients, same optimizer, same parameters: the replicas stay identical.
- **Before any worker thread starts** (dflash.engine.compile_safety): producers and replicas are built in
  this thread, every replica runs its training step once here, one drafter device after another
  (prewarm, then a verify pass that must compile nothing), then compiling is frozen for the whole
  worker phase and the compilewatch watcher runs alongside.
- **This thread** watches: a worker that raises stops the run (its traceback and every other
  thread's state are in the report); no committed step for `stall_after` seconds dumps every
  thread's stack and stops; Ctrl-C stops at a step boundary, calls the program's `save` hook, and
  returns. Threads blocked in torch cannot be killed: they are daemons, named in the report.

Across processes (torchrun), a `Collective` (dflash.distributed.group.ProcessGroup) joins the step
barrier's averaging: the replicas' summed gradients, loss and weight are summed over every process
before the one division, so every replica of every process stays identical (docs/distributed.md).

The engine never prints; `on_step` (called from a worker thread at every committed step) is how a
caller shows progress. What a run reports (its step records, the threads' states, the failure, the
rates and the verdicts) is built by dflash.engine.report. The model side is a `Program`
(dflash.engine.program for DFlash, dflash.engine.toy for tests and benchmarks).
"""

from __future__ import annotations

import dataclasses
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Protocol

from compilewatch import Frame, all_thread_stacks
from dflash.config import DEFAULT_QUEUE_DEPTH, DEFAULT_STALL_AFTER_S, TopologyConfig, check_engine_settings
from dflash.engine import compile_safety
from dflash.engine import replicas as _replicas
from dflash.engine.report import EngineReport, Failure, Outcome, StepRecord, ThreadState, build_report
from dflash.engine.routing import BatchRouter, Stopped, first_item, item_index

_POLL_S = 0.05


@dataclass(eq=False)
class Replica:
    """One drafter copy: its device, model and optimizer, and whatever else its program keeps."""

    index: int
    device: str
    model: Any  # torch.nn.Module
    optimizer: Any = None
    state: dict[str, Any] = field(default_factory=dict)


def move_to(batch: Any, device: str) -> Any:
    """Move every tensor in a (nested) batch to `device`; other values pass through."""
    import torch

    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, dict):
        return {k: move_to(v, device) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)) and not hasattr(batch, "_fields"):
        return type(batch)(move_to(v, device) for v in batch)
    if dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        return dataclasses.replace(batch, **{f.name: move_to(getattr(batch, f.name), device)
                                             for f in dataclasses.fields(batch) if f.init})
    return batch


@dataclass(frozen=True, kw_only=True)
class Program:
    """What the engine runs. Every callable is the model side's; the engine owns threads and order."""

    make_producer: Callable[[str], Callable[[int], Any]]
    """Called once per target device, in the main thread: returns `produce(index) -> batch`."""
    make_replica: Callable[[int, str], Replica]
    """Called once per drafter device, in the main thread (parameters are then copied from replica 0)."""
    forward_backward: Callable[[Replica, Any], float | tuple[float, float]]
    """One micro-batch on one replica: forward, backward, and return the loss, or `(loss, weight)`.
    Plain float: `loss` is this micro-batch's mean and its gradient is what was backpropagated; the
    engine averages over the global batch. `(loss, weight)`: backward ran on `loss * weight`, the
    micro-batch's *sum* (e.g. Σ w·CE, weight Σ w); the engine divides the summed gradients by the
    global batch's total weight, so uneven micro-batches give exactly the global-batch gradient."""
    optimizer_step: Callable[[Replica, int], None]
    """After gradients were averaged: clip, step, schedule, zero_grad. Must be deterministic."""
    warm: Callable[[Replica], None] | None = None
    """Forward and backward at every shape training uses, without stepping (default: forward_backward
    on `produce(0)` of the first target device)."""
    warm_producer: Callable[[str], None] | None = None
    """Prewarm of a target device's producer (e.g. a compiled target forward at every shape), called
    once per target device in the main thread during prewarm, before that device's replicas."""
    save: Callable[[Replica, int], Any] | None = None
    """Checkpoint: called with replica 0 and the number of completed steps, every `save_every` steps
    (inside the step barrier, while no replica moves), at the end of a successful run, and on
    Ctrl-C. Its return values are in the report (`saved`)."""
    move: Callable[[Any, str], Any] = move_to
    """Moves a batch from the target device to a drafter device (in the drafter's thread)."""
    tokens: Callable[[Any], int] | None = None
    """Tokens (or samples) in a batch, for throughput."""


class Collective(Protocol):
    """Replicas in other processes (dflash.distributed.group.ProcessGroup implements it over torch.distributed).
    The engine calls it once per step, inside the step barrier, from one thread: every process must
    call it the same number of times in the same order, which the lockstep steps guarantee."""

    def sum_scalars(self, *values: float) -> tuple[float, ...]:
        """Each value summed over every process."""
        ...

    def sum_(self, tensor: Any) -> None:
        """Sum a tensor over every process, in place (identical result on every process)."""
        ...


@dataclass(frozen=True, kw_only=True, slots=True)
class EngineConfig:
    target_devices: tuple[str, ...]
    """One target worker thread per entry (a device may repeat: several workers on one GPU)."""
    drafter_devices: tuple[str, ...]
    """One drafter replica thread per entry (a device may repeat)."""
    steps: int
    """Run until this many optimizer steps are done (counting `start_step`)."""
    start_step: int = 0
    """Resume: the first step to run; item indices continue from it, so the data does too."""
    grad_accum: int = 1
    """Micro-batches per replica per step; the global batch is replicas x grad_accum micro-batches."""
    queue_depth: int = DEFAULT_QUEUE_DEPTH
    """Batches each target worker may hold ready (bounded: a fast target never runs far ahead)."""
    stall_after: float = DEFAULT_STALL_AFTER_S
    """No committed step for this many seconds = a stall: dump every stack and stop."""
    prewarm: bool = True
    """Run every replica's step once in the main thread, device by device, before threads start."""
    guard: bool = True
    """Forbid compiles during the worker phase (a late compile raises instead of racing)."""
    watch: bool = True
    """Run the compilewatch watcher during the worker phase (when compilewatch has it)."""
    watch_report: str | None = None
    """Where the watcher writes its JSONL events (None: kept in memory)."""
    sample_every: int = 10
    """Sample device memory/utilization every N steps (0: never)."""
    verify_every: int = 0
    """Check that replicas are identical every N steps (0: only at the end)."""
    save_every: int = 0
    """Call the program's `save` every N steps (0: only at the end and on Ctrl-C)."""
    join_timeout: float = 10.0
    """How long to wait for threads to leave once the run stops."""
    keep_steps: int = 10_000
    """Step records kept in the report (the latest ones)."""

    def __post_init__(self) -> None:
        if not self.target_devices:
            raise ValueError("target_devices: need at least one target device")
        if not self.drafter_devices:
            raise ValueError("drafter_devices: need at least one drafter device")
        if self.steps < 1 or self.start_step < 0 or self.start_step >= self.steps:
            raise ValueError(f"steps: need 0 <= start_step < steps, got start_step={self.start_step}, steps={self.steps}")
        if self.grad_accum < 1:
            raise ValueError("grad_accum: must be >= 1")
        check_engine_settings(self.stall_after, self.queue_depth)
        if self.save_every < 0:
            raise ValueError("save_every: must be >= 0")

    @classmethod
    def from_topology(cls, topo: TopologyConfig, **run: Any) -> "EngineConfig":
        """The engine a run's topology section asks for, the section taken as it is (its devices,
        stall watchdog, queue depth, prewarm, guard); `run` adds what the run decides (steps,
        start_step, grad_accum, save_every, watch, watch_report)."""
        return cls(target_devices=topo.target_devices, drafter_devices=topo.drafter_devices,
                   queue_depth=topo.queue_depth, stall_after=topo.stall_after, prewarm=topo.prewarm,
                   guard=topo.guard, **run)


@dataclass
class _Live:
    """A thread's mutable state (written by the thread, read by the monitor)."""

    name: str
    role: Literal["target", "drafter"]
    device: str
    phase: str = "starting"
    step: int | None = None
    item: int | None = None
    since: float = field(default_factory=time.monotonic)
    busy: float = 0.0
    waiting: float = 0.0
    thread: threading.Thread | None = None

    def set(self, phase: str, *, step: int | None = None, item: int | None = None) -> None:
        self.phase, self.since = phase, time.monotonic()
        if step is not None:
            self.step = step
        self.item = item

    def freeze(self) -> ThreadState:
        alive = self.thread is not None and self.thread.is_alive()
        return ThreadState(self.name, self.role, self.device, self.phase, self.step, self.item,
                           time.monotonic() - self.since, alive, self.busy, self.waiting)


class Engine:
    def __init__(self, program: Program, config: EngineConfig, *, on_step: Callable[[StepRecord], None] | None = None,
                 on_workers_start: Callable[[], None] | None = None,
                 sampler: Callable[[Any], Any] | None = None, collective: Collective | None = None) -> None:
        self.program = program
        self.config = config
        self.on_step = on_step
        self.on_workers_start = on_workers_start  # called right before the first worker thread starts
        self.collective = collective  # other processes' replicas (torch.distributed), or None
        self.sampler = sampler if sampler is not None else compile_safety.device_sampler()
        self.replicas: list[Replica] = []
        self._stop = threading.Event()
        self._failed = threading.Event()
        self._interrupted = threading.Event()  # interrupt(): the monitor stops the run as Ctrl-C would
        self._lock = threading.Lock()
        self._failure: Failure | None = None
        self._records: list[StepRecord] = []
        self._committed = config.start_step
        self._last_commit = time.monotonic()
        self._slots: list[tuple[float, float, float, float, int | None]] = []  # loss·w, w, wait, compute, tokens
        self._barrier_s: list[float] = []
        self._live: list[_Live] = []
        self._saved: list[Any] = []
        self._saved_at: int | None = None

    # ------------------------------------------------------------------ public
    def run(self) -> EngineReport:
        """Build, prewarm, freeze, run the workers, and report. Raises only for the program's
        build errors (make_producer / make_replica) and for bad configs."""
        cfg = self.config
        t0 = time.perf_counter()
        producers = [self.program.make_producer(d) for d in cfg.target_devices]
        self.replicas = [self.program.make_replica(i, d) for i, d in enumerate(cfg.drafter_devices)]
        if len(self.replicas) > 1:
            _replicas.broadcast_parameters([r.model for r in self.replicas])
        setup_s = time.perf_counter() - t0
        R = len(self.replicas)
        self._slots = [(0.0, 0.0, 0.0, 0.0, None)] * R
        self._barrier_s = [0.0] * R

        pre = None
        interrupted = False
        dumped: dict[str, tuple[Frame, ...]] = {}
        outcome: Outcome = "ok"
        with compile_safety.CompileBarrier(cfg.guard) as barrier:
            if cfg.prewarm:
                warm = self.program.warm or self._default_warm(producers[0])
                wp = self.program.warm_producer
                targets = {d: (lambda d=d: wp(d)) for d in cfg.target_devices} if wp is not None else None
                pre = compile_safety.prewarm_replicas(self.replicas, warm, targets=targets)
                if not pre.ok:
                    return self._report("prewarm_failed", producers=0, wall=0.0, setup_s=setup_s, pre=pre,
                                        guard=barrier.kind, watch=None, dumped={})
            barrier.freeze()
            with compile_safety.watching(cfg.watch, stall_after=cfg.stall_after, report=cfg.watch_report) as watcher:
                if watcher is not None and hasattr(watcher, "mark_warm"):
                    watcher.mark_warm()
                self._barrier = threading.Barrier(R, action=self._commit_step)
                self._router = BatchRouter(len(producers), cfg.queue_depth, self._stop)
                w0 = time.perf_counter()
                try:  # a Ctrl-C while the workers start stops the ones started, as one during the run does
                    self._start_threads(producers)
                    outcome, dumped = self._monitor()
                except KeyboardInterrupt:
                    interrupted, outcome = True, "interrupted"
                finally:
                    self._stop.set()
                    self._barrier.abort()
                    still = self._join()
                    if still and not dumped:
                        dumped = {k: tuple(v) for k, v in all_thread_stacks().items()}
                wall = time.perf_counter() - w0
        guard_kind = barrier.kind
        watch = compile_safety.watch_summary(watcher)
        if self.program.save is not None and (outcome == "ok" or interrupted):
            self._save_at_end()
        return self._report(outcome, producers=len(producers), wall=wall, setup_s=setup_s, pre=pre, guard=guard_kind,
                            watch=watch, dumped=dumped)

    def interrupt(self) -> None:
        """Ask the run to stop as if Ctrl-C was pressed (from any thread).

        An event the monitor polls, not `_thread.interrupt_main()`: a simulated SIGINT is raised wherever the main
        thread happens to be and can be swallowed there (a destructor or weakref callback prints it and moves on),
        and then the run never stops."""
        self._interrupted.set()

    # ------------------------------------------------------------------ threads
    def _default_warm(self, produce: Callable[[int], Any]) -> Callable[[Replica], None]:
        batch = produce(0)

        def warm(rep: Replica) -> None:
            self.program.forward_backward(rep, self.program.move(batch, rep.device))
        return warm

    def _start_threads(self, producers: list[Callable[[int], Any]]) -> None:
        cfg = self.config
        self._live = [_Live(f"target-{w}", "target", d) for w, d in enumerate(cfg.target_devices)]
        self._live += [_Live(f"drafter-{r}", "drafter", d) for r, d in enumerate(cfg.drafter_devices)]
        if self.on_workers_start is not None:
            self.on_workers_start()
        self._last_commit = time.monotonic()
        for w, produce in enumerate(producers):
            self._spawn(self._live[w], self._target_loop, w, produce)
        for r in range(len(self.replicas)):
            self._spawn(self._live[len(producers) + r], self._drafter_loop, r)

    def _spawn(self, live: _Live, fn: Callable[..., None], *args: Any) -> None:
        def body() -> None:
            try:
                fn(live, *args)
                live.set("done", step=None, item=None)
            except (Stopped, threading.BrokenBarrierError):
                live.set("stopped", item=live.item)
            except BaseException as e:  # noqa: BLE001 - every worker failure stops the run, with its traceback
                live.set("failed", item=live.item)
                with self._lock:
                    if self._failure is None:
                        self._failure = Failure(live.name, live.device, f"{type(e).__name__}: {e}".strip()[:2000],
                                                traceback.format_exc())
                self._failed.set()
                self._stop.set()
                self._barrier.abort()

        t = threading.Thread(target=body, name=f"dflash-{live.name}", daemon=True)
        live.thread = t
        t.start()

    def _target_loop(self, live: _Live, w: int, produce: Callable[[int], Any]) -> None:
        cfg = self.config
        R, W = len(self.replicas), len(cfg.target_devices)
        _set_device(live.device)
        start = cfg.start_step * cfg.grad_accum * R
        end = cfg.steps * cfg.grad_accum * R
        for i in range(first_item(w, W, start), end, W):
            if self._stop.is_set():
                raise Stopped
            live.set("producing", item=i)
            t0 = time.perf_counter()
            batch = produce(i)
            _sync(live.device)
            t1 = time.perf_counter()
            live.set("queue-full", item=i)
            self._router.put(i, batch)
            live.busy += t1 - t0
            live.waiting += time.perf_counter() - t1

    def _drafter_loop(self, live: _Live, r: int) -> None:
        cfg = self.config
        rep = self.replicas[r]
        R = len(self.replicas)
        _set_device(rep.device)
        for step in range(cfg.start_step, cfg.steps):
            if self._stop.is_set():
                raise Stopped
            wait = compute = 0.0
            loss_sum = weight = 0.0
            tokens: int | None = 0 if self.program.tokens is not None else None
            for a in range(cfg.grad_accum):
                i = item_index(step, a, r, grad_accum=cfg.grad_accum, replicas=R)
                live.set("waiting-for-batch", step=step, item=i)
                t0 = time.perf_counter()
                batch = self.program.move(self._router.take(i), rep.device)
                t1 = time.perf_counter()
                live.set("computing", step=step, item=i)
                loss, w = _loss_weight(self.program.forward_backward(rep, batch))
                loss_sum += loss * w
                weight += w
                if tokens is not None:
                    tokens += int(self.program.tokens(batch))  # type: ignore[misc]
                t2 = time.perf_counter()
                wait += t1 - t0
                compute += t2 - t1
            live.busy += compute
            live.waiting += wait
            self._slots[r] = (loss_sum, weight, wait, compute, tokens)
            live.set("at-barrier", step=step)
            tb = time.perf_counter()
            try:
                self._barrier.wait()
            except threading.BrokenBarrierError:
                if self._committed <= step:  # the step was not averaged: leave without stepping
                    raise
                # the step was committed before the run stopped: finish it, so replicas stay identical
            self._barrier_s[r] = time.perf_counter() - tb
            live.set("stepping", step=step)
            self.program.optimizer_step(rep, step)

    def _commit_step(self) -> None:
        """The barrier's action (in the last thread to arrive): average gradients, record the step."""
        cfg = self.config
        step = self._committed
        if cfg.save_every and step > cfg.start_step and step % cfg.save_every == 0 and self.program.save is not None:
            # every replica waits in the barrier and has applied steps < `step`: a consistent state
            self._saved.append(self.program.save(self.replicas[0], step))
            self._saved_at = step
        t0 = time.perf_counter()
        models = [r.model for r in self.replicas]
        slots = list(self._slots)
        loss_sum, weight = sum(s[0] for s in slots), sum(s[1] for s in slots)
        reduce = None
        if self.collective is not None:  # the global batch spans every process: sum across them too
            loss_sum, weight = self.collective.sum_scalars(loss_sum, weight)
            reduce = self.collective.sum_
        total_weight = max(weight, 1e-6)  # a global batch without labels: zero gradient
        _replicas.average_gradients(models, divide_by=total_weight, reduce=reduce)
        reduce_s = time.perf_counter() - t0
        now = time.monotonic()
        tokens = None if any(s[4] is None for s in slots) else sum(s[4] for s in slots)  # type: ignore[misc]
        samples: Any = None
        done = step + 1
        if cfg.sample_every and (done % cfg.sample_every == 0 or done == cfg.steps):
            try:
                samples = self.sampler(self._all_devices())
            except Exception:  # noqa: BLE001 - sampling is best effort
                samples = None
        rec = StepRecord(step, loss_sum / total_weight, now - self._last_commit,
                         tuple(s[2] for s in slots), tuple(s[3] for s in slots), tuple(self._barrier_s), reduce_s,
                         tokens, samples)
        self._records.append(rec)
        if len(self._records) > cfg.keep_steps:
            del self._records[: len(self._records) - cfg.keep_steps]
        if cfg.verify_every and done % cfg.verify_every == 0:
            diff = _replicas.max_parameter_difference(models)
            if diff != 0.0:
                raise RuntimeError(f"replicas diverged before step {step}: max parameter difference {diff:g}")
        if self.on_step is not None:
            self.on_step(rec)
        # committed last: if anything above raised, no replica steps its optimizer (they stay identical)
        self._last_commit = now
        self._committed = done

    def _all_devices(self) -> list[str]:
        return list(self.config.target_devices) + list(self.config.drafter_devices)

    # ------------------------------------------------------------------ monitor and shutdown
    def _monitor(self) -> tuple[Outcome, dict[str, tuple[Frame, ...]]]:
        drafters = [lv for lv in self._live if lv.role == "drafter"]
        while True:
            if self._failed.wait(_POLL_S):
                return "failed", {}
            if self._interrupted.is_set():
                raise KeyboardInterrupt
            if all(lv.thread is not None and not lv.thread.is_alive() for lv in drafters):
                return ("failed" if self._failure else "ok"), {}
            if time.monotonic() - self._last_commit > self.config.stall_after:
                dumped = {k: tuple(v) for k, v in all_thread_stacks().items()}
                self._stall_states = [lv.freeze() for lv in self._live]
                return "stalled", dumped

    def _join(self) -> list[str]:
        deadline = time.monotonic() + self.config.join_timeout
        for lv in self._live:
            if lv.thread is not None:
                lv.thread.join(max(0.0, deadline - time.monotonic()))
        return [lv.name for lv in self._live if lv.thread is not None and lv.thread.is_alive()]

    def _save_at_end(self) -> None:
        rep0 = next(lv for lv in self._live if lv.name == "drafter-0")
        if rep0.thread is not None and rep0.thread.is_alive():
            return  # replica 0 did not stop (blocked inside torch): its state may be half updated
        if self._saved_at == self._committed:
            return  # already saved at this step
        self._saved.append(self.program.save(self.replicas[0], self._committed))  # type: ignore[misc]
        self._saved_at = self._committed

    # ------------------------------------------------------------------ report
    def _report(self, outcome: Outcome, *, producers: int, wall: float, setup_s: float,
                pre: compile_safety.PrewarmResult | None, guard: str, watch: Any,
                dumped: dict[str, tuple[Frame, ...]]) -> EngineReport:
        """Compare the replicas (unless a thread is still inside torch), then the report
        (dflash.engine.report.build_report: rates and verdicts)."""
        cfg = self.config
        now = [lv.freeze() for lv in self._live]
        if any(t.alive for t in now):
            diff = None  # a thread is stuck inside torch: parameters may be mid-update, and the device may not answer
        else:
            diff = _replicas.max_parameter_difference([r.model for r in self.replicas]) if len(self.replicas) > 1 else 0.0
            if diff and outcome == "ok":  # a bug, not noise: every replica should hold the same bits
                outcome = "failed"
                self._failure = self._failure or Failure(
                    "engine", ",".join(cfg.drafter_devices),
                    f"RuntimeError: replicas diverged: max parameter difference {diff:g} after {self._committed} steps",
                    "(found by comparing the replicas' parameters after the run; set verify_every=1 to find the step)")
        return build_report(cfg, outcome, records=tuple(self._records), steps_done=self._committed, threads_now=now,
                            threads_at_stall=getattr(self, "_stall_states", None), wall=wall, setup_s=setup_s,
                            pre=pre, guard=guard, failure=self._failure, dumped=dumped, max_param_diff=diff,
                            watch=watch, saved=tuple(self._saved))


def _loss_weight(out: float | tuple[float, float]) -> tuple[float, float]:
    if isinstance(out, tuple):
        return float(out[0]), float(out[1])
    return float(out), 1.0


def _set_device(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.set_device(device)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize(device)
