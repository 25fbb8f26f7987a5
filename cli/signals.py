"""How `dflash train` stops on a signal: Ctrl-C (SIGINT) and SIGTERM (a scheduler's stop: Slurm, Kubernetes,
`kill PID`) end a run the same way, and only the first one counts.

SIGTERM's default action kills the process at once: a checkpoint being written is left half-staged (the
next run cleans it up), the run lock stale (the next run takes it over) and nothing says where the run
stands. Raised as a KeyboardInterrupt in the main thread instead, it goes the way Ctrl-C goes: the
trainer is closed (a checkpoint being written is finished first), the lock released, and the step
reached, the newest checkpoint and the resume command are said; exit 143 (128 + SIGTERM), 130 for Ctrl-C.

Once: after the first SIGINT or SIGTERM the run is closing, and a second one (an impatient Ctrl-C, a
scheduler's repeated SIGTERM) is held off until the command ends: raised inside the wait for the
checkpoint writer, it used to leave that checkpoint half-staged, the lock stale and the message
wrong, or abort the process in the writer's C++ code ("terminate called without an active
exception"). A second Ctrl-C says, once, that the run is closing and how to end it at once (SIGKILL:
`kill -9`, safe at any point: --resume takes the newest complete checkpoint).

Not under torchrun: its agent stops every rank with SIGTERM and expects them to go; a rank closing on its
own there would wait on collectives the others have left. A signal whose handler is not Python's
default (SIGINT ignored in a background job, a program's own handler) is left alone.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from typing import Iterator

EXIT_SIGTERM = 128 + signal.SIGTERM
CLOSING = ("the run is closing (a checkpoint being written is finished first, the run's lock released); a second "
           "signal does not cut it. To end it at once: kill -9 {pid} (the resume then takes the newest complete "
           "checkpoint)")


@contextlib.contextmanager
def sigterm_as_interrupt(*, distributed: bool, closing: str = CLOSING) -> Iterator[dict[str, bool]]:
    """While the block runs, the first SIGTERM (or SIGINT) raises KeyboardInterrupt in the main thread and
    later ones are held off (the module doc); the dict it yields says whether SIGTERM came first
    (`terminated`). Nothing is changed off the main thread or under torchrun; a signal with a handler
    of the program's own (or SIGINT ignored) is left alone. `closing`: what a second Ctrl-C is told ({pid}:
    this process)."""
    state = {"terminated": False}
    torchrun = distributed or all(k in os.environ for k in ("RANK", "WORLD_SIZE"))
    if threading.current_thread() is not threading.main_thread() or torchrun:
        yield state
        return
    ours = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    ours = {s: h for s, h in ours.items() if h in (signal.SIG_DFL, signal.default_int_handler)}
    said = []

    def held_off(signum, frame):  # noqa: ARG001 - signal's signature
        if signum == signal.SIGINT and not said:  # a person pressing Ctrl-C again: say why nothing happens
            said.append(True)
            os.write(2, f"\n· stopping: {closing.format(pid=os.getpid())}\n".encode())

    def first(signum, frame):  # noqa: ARG001 - signal's signature
        state["terminated"] = signum == signal.SIGTERM
        for s in ours:  # the run is closing: a second signal must not cut it
            signal.signal(s, signal.SIG_IGN if s == signal.SIGTERM else held_off)
        raise KeyboardInterrupt

    for s in ours:
        signal.signal(s, first)
    try:
        yield state
    finally:
        for s, h in ours.items():
            signal.signal(s, h)
