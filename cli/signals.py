"""SIGTERM, as a scheduler (Slurm, Kubernetes) or `kill PID` sends it, ends a `dflash train` the way Ctrl-C does.

Its default action kills the process at once: a checkpoint being written is left half-staged (the next
run cleans it up), the run lock stale (the next run takes it over) and nothing says where the run stands.
Raised as a KeyboardInterrupt in the main thread instead, it goes the way Ctrl-C goes: the trainer is
closed (a checkpoint being written is finished first), the lock released, and the step reached, the newest
checkpoint and the resume command are said; exit 143 (128 + SIGTERM). Only once: a second SIGTERM while the
run closes is ignored, so it cannot cut that checkpoint (a SIGKILL after the scheduler's grace time still
ends the process, and a run is safe against that: resume takes the last complete checkpoint).

Not under torchrun: its agent stops every rank with SIGTERM and expects them to go; a rank closing on its
own there would wait on collectives the others have left.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from typing import Iterator

EXIT_SIGTERM = 128 + signal.SIGTERM


@contextlib.contextmanager
def sigterm_as_interrupt(*, distributed: bool) -> Iterator[dict[str, bool]]:
    """While the block runs, the first SIGTERM raises KeyboardInterrupt in the main thread; the dict it
    yields says whether it came (`terminated`). Nothing is changed off the main thread, under torchrun, or
    where SIGTERM already has a handler of the program's own."""
    state = {"terminated": False}
    torchrun = distributed or all(k in os.environ for k in ("RANK", "WORLD_SIZE"))
    if (threading.current_thread() is not threading.main_thread() or torchrun
            or signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL):
        yield state
        return

    def on_sigterm(signum, frame):  # noqa: ARG001 - signal's signature
        state["terminated"] = True
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the run is closing: a second one must not cut it
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_sigterm)
    try:
        yield state
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
