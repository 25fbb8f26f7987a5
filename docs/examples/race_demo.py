"""The cross-thread FX-flag race in miniature, recorded as a watcher report and a timeline
(docs/timeline.md): a data-worker thread holds a make_fx trace open while two gpu-worker threads
call a warm compiled step, and gpu-worker-2 then changes the batch shape (a recompile after warm).

    python docs/examples/race_demo.py [OUT_DIR]    # writes OUT_DIR/race.jsonl and OUT_DIR/race.json

OUT_DIR defaults to a new temporary directory; the paths are printed at the end.
"""
import os
import sys
import tempfile
import threading
import torch
import compilewatch
from torch.fx.experimental.proxy_tensor import make_fx

out = sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp(prefix="race-demo-")
os.makedirs(out, exist_ok=True)
report, timeline = os.path.join(out, "race.jsonl"), os.path.join(out, "race.json")

step = torch.compile(lambda x, p: (x @ p).relu().sum(), backend="aot_eager")
x, p = torch.randn(64, 64), torch.randn(64, 64, requires_grad=True)
step(x, p).backward()                   # warm before watching, so the picture is about the race
w = compilewatch.watch(report=report, timeline=timeline, stall_after=0.4)
w.mark_warm()

tracing, release = threading.Event(), threading.Event()
workers_done = threading.Barrier(3)

def traced(a):
    tracing.set()
    release.wait()
    return a * 2

def data_worker():                      # a library runs make_fx in a thread
    make_fx(traced)(torch.ones(2))

def gpu_worker(i):
    for k in range(3):
        if k == 2:
            with w.span("wait for data-worker", cat="wait"):
                threads[0].join()
        with w.span(f"step {k}", cat="worker", worker=i):
            if k == 1:
                tracing.wait()
            try:
                xs = x if not (i == 2 and k == 2) else torch.randn(32, 64)   # worker 2 changes shape
                step(xs, p).backward()
            except RuntimeError:
                pass
        if k == 1:
            workers_done.wait()

threads = [threading.Thread(target=data_worker, name="data-worker")]
threads += [threading.Thread(target=gpu_worker, args=(i,), name=f"gpu-worker-{i}") for i in (1, 2)]
for t in threads:
    t.start()
workers_done.wait()
release.wait(0.6)                      # hold the trace long enough for the stall watchdog (0.4 s)
release.set()
for t in threads:
    t.join()
print(w.close().verdicts)
print(f"report: {report}\ntimeline: {timeline} (open it in https://ui.perfetto.dev)")
