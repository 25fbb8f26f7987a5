"""The run.md demo with the guard (docs/guard.md): CompileGuard(), prewarm, freeze; a data-worker
thread symbolic-traces while gpu-worker-1 calls the warm step, and gpu-worker-2 calls it with a shape
nobody warmed (the guard refuses that compile with a GuardError instead of letting it race).

    compilewatch run -- python docs/examples/train_guarded.py
"""

import threading

import torch
import torch.fx

import compilewatch

step = torch.compile(lambda x: x.sin() + 1, backend="eager")
guard = compilewatch.CompileGuard()  # installed now: thread-local FX state where this torch allows it
report = compilewatch.prewarm(["cpu"], {"step": lambda dev: step(torch.randn(4, device=dev))})  # the one warm (docs/warm.md)
print("warm:", [(r.device, r.compile_windows) for r in report.warm], "verify pass compiles:",
      sum(r.compile_windows for r in report.verify))
guard.freeze()
tracing, called = threading.Event(), threading.Event()


def traced(a):
    tracing.set()
    called.wait(60)
    return a * 2


def data_worker():
    torch.fx.symbolic_trace(traced)


def gpu_worker_1():
    tracing.wait(60)
    try:
        step(torch.randn(4))  # warm: runs, the flag stays in data-worker's thread
    finally:
        called.set()


def gpu_worker_2():
    try:
        step(torch.randn(2, 3))  # a shape nobody warmed: the guard refuses to compile it here
    except compilewatch.GuardError as e:
        print(e)


threads = [threading.Thread(target=f, name=n) for f, n in
           ((data_worker, "data-worker"), (gpu_worker_1, "gpu-worker-1"), (gpu_worker_2, "gpu-worker-2"))]
for t in threads:
    t.start()
for t in threads:
    t.join()
guard.close()
