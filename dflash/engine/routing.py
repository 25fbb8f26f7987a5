"""Batches from target workers to drafter replicas: bounded queues, a fixed assignment, no races.

Every micro-batch has a global index `i` (step, accumulation slot and replica decide it; see
`item_index`). Target worker `w` of `W` produces the items with `i % W == w`, in increasing order,
into its own bounded queue (`depth` items: back-pressure keeps a fast target from running ahead).
The drafter that needs item `i` reads it from queue `i % W`. When several drafters read the same
queue in one step, the one holding the queue's read turn parks items meant for others in a small
stash (at most one step's worth) and wakes them. So which batch a replica trains on depends only on
its index, never on thread timing: the engine's result is reproducible and equals a single-device
run over the same items.

Every wait here gives up when the run's `stop` event is set (`Stopped`), so a dead or stalled
thread elsewhere never leaves a worker blocked on a queue forever.
"""

from __future__ import annotations

import queue
import threading
from typing import Any

_POLL_S = 0.05  # how often a blocked put/take looks at the stop event


class Stopped(Exception):
    """The run is stopping (a failure elsewhere, a stall, Ctrl-C): leave quietly."""


def item_index(step: int, accum: int, replica: int, *, grad_accum: int, replicas: int) -> int:
    """The global index of the micro-batch that `replica` trains on in accumulation slot `accum` of `step`."""
    return (step * grad_accum + accum) * replicas + replica


def first_item(worker: int, workers: int, start: int) -> int:
    """The first index >= start that target worker `worker` produces."""
    return start + ((worker - start) % workers)


class BatchRouter:
    def __init__(self, workers: int, depth: int, stop: threading.Event) -> None:
        if workers < 1 or depth < 1:
            raise ValueError("BatchRouter needs at least one worker and a depth >= 1")
        self.workers = workers
        self.stop = stop
        self._queues = [queue.Queue(maxsize=depth) for _ in range(workers)]
        self._cond = threading.Condition()
        self._stash: dict[int, Any] = {}
        self._reading = [False] * workers

    def put(self, index: int, batch: Any) -> None:
        """Target side: enqueue item `index` (blocks while the worker's queue is full)."""
        q = self._queues[index % self.workers]
        while True:
            if self.stop.is_set():
                raise Stopped
            try:
                q.put((index, batch), timeout=_POLL_S)
                return
            except queue.Full:
                continue

    def take(self, index: int) -> Any:
        """Drafter side: wait for item `index` and return it."""
        w = index % self.workers
        with self._cond:
            while True:
                if index in self._stash:
                    return self._stash.pop(index)
                if self.stop.is_set():
                    raise Stopped
                if not self._reading[w]:
                    self._reading[w] = True
                    break
                self._cond.wait(_POLL_S)
        try:
            q = self._queues[w]
            while True:
                if self.stop.is_set():
                    raise Stopped
                try:
                    got, batch = q.get(timeout=_POLL_S)
                except queue.Empty:
                    continue
                if got == index:
                    return batch
                with self._cond:  # an item for another replica of this step: park it, wake its reader
                    self._stash[got] = batch
                    self._cond.notify_all()
        finally:
            with self._cond:
                self._reading[w] = False
                self._cond.notify_all()

    def queued(self) -> list[int]:
        """Items waiting in each worker's queue (for progress reports)."""
        return [q.qsize() for q in self._queues]
