"""A probe target that reproduces the cross-thread FX-flag race (docs/race.md) on CPU, every time.

    compilewatch probe docs/examples/race_target.py:run --threads 3

The other threads first compile and call a function (so no compile is in flight later); then
worker-0 runs torch.fx.symbolic_trace on a function that holds the trace open until each of them
has called the compiled function once more. While worker-0 traces it holds the FX tracing flag:
module-global up to torch 2.13, so those calls fail there; per thread from 2.14, so they pass.
Events decide the order, not timing. One run per process (the events are not reset).
"""

import threading

import torch

compiled = torch.compile(lambda x: x + 1, backend="eager")
WAIT = 60.0  # bound for every wait; a correct run never comes close
tracing = threading.Event()
progress = threading.Condition()
count = {"warm": 0, "called": 0}


others = None  # how many threads besides worker-0: counted once, by the first thread to start


def _count_others() -> None:
    """Count the other workers once, while every one is alive: the probe starts them all together (a
    Barrier), so none can have finished before the first thread gets here. Counting live threads at each
    wait instead let worker-0 end its trace early once a thread that had already called (and failed)
    exited, and a slower thread then called after the trace, and passed."""
    global others
    with progress:
        if others is None:
            others = sum(t.name.startswith("worker-") and t.name != "worker-0" for t in threading.enumerate())


def _bump(key: str) -> None:
    with progress:
        count[key] += 1
        progress.notify_all()


def _wait_for(key: str) -> None:
    with progress:
        progress.wait_for(lambda: count[key] >= others, timeout=WAIT)


def _hold(x):
    tracing.set()  # inside symbolic_trace: the FX tracing flag is set
    _wait_for("called")
    return x + 1


def run():
    _count_others()
    if threading.current_thread().name == "worker-0":
        _wait_for("warm")
        torch.fx.symbolic_trace(_hold)
        return
    try:
        try:
            compiled(torch.ones(2))  # compile (this thread's first call) and run: no trace is open yet
        finally:
            _bump("warm")
        tracing.wait(WAIT)
        compiled(torch.ones(2))  # while worker-0 traces: raises on torch <= 2.13
    finally:
        _bump("called")
