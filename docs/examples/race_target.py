"""A probe target that reproduces the seeds' race on CPU in seconds.

    compilewatch probe docs/examples/race_target.py:run --threads 3

worker-0 runs torch.fx.symbolic_trace in a loop (it holds the FX flag while it traces: module-global
up to torch 2.13, so the others fail there; per thread from 2.14, so they pass); the other threads call
an already-compiled function in a loop until worker-0 is done.
"""

import threading

import torch

compiled = torch.compile(lambda x: x + 1, backend="eager")
done = threading.Event()


def run():
    if threading.current_thread().name == "worker-0":
        done.clear()
        try:
            for _ in range(20):
                torch.fx.symbolic_trace(torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(50)]))
        finally:
            done.set()
    else:
        while not done.is_set():
            compiled(torch.ones(2))
