"""How much the watcher slows a *failing* loop (the issue-17 question: does watching change the race?).

    python benchmarks/watch_perturbation.py [--calls 2000] [--repeats 5] [--out DIR]

One thread holds `torch.fx.symbolic_trace` open (an Event, no sleeps) while a victim thread makes
`--calls` calls that fail the way the race fails, each caught:
- `compiled`: a warm compiled function -> RuntimeError "Detected that you are using FX ..."
- `eager module`: a plain nn.Linear -> NameError "module is not installed as a submodule"
Each is measured without and with a Watcher, interleaved, `--repeats` times; reported: the victim
thread's CPU time per call (time.thread_time, the best of the repeats) and the slowdown factor. The
watcher reports the first failure of each (setter, victim) pair with stacks and only counts the
rest, so its cost per repeated detection should stay near the cost of the failure itself.
CPU numbers on a shared machine are noisy: compare ratios from one run, not runs.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import threading
import time
from pathlib import Path


def failing_loop(kind: str, calls: int, watch: bool) -> float:
    import torch
    import torch.fx

    from compilewatch.tracing.watcher import Watcher

    step = torch.compile(lambda t: t.sin() + 1, backend="eager")
    lin = torch.nn.Linear(4, 4)
    x = torch.randn(4)
    step(x)
    call = (lambda: step(x)) if kind == "compiled" else (lambda: lin(x))
    inside, done = threading.Event(), threading.Event()
    out: list[float] = []

    def traced(a):
        inside.set()
        done.wait(600)
        return a

    def victim():
        inside.wait(600)
        failed = 0
        t0 = time.thread_time()
        for _ in range(calls):
            try:
                call()
            except (RuntimeError, NameError):
                failed += 1
        out.append((time.thread_time() - t0) / calls)
        assert failed == calls, f"only {failed} of {calls} calls failed: not the race"
        done.set()

    w = Watcher().install() if watch else None
    try:
        threads = [threading.Thread(target=lambda: torch.fx.symbolic_trace(traced), name="tracer"),
                   threading.Thread(target=victim, name="victim")]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        if w is not None:
            w.close()
    return out[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=os.environ.get("OUT", "bench-out"))
    a = ap.parse_args()
    import torch

    import compilewatch

    rows = []
    for kind in ("compiled", "eager module"):
        best = {False: float("inf"), True: float("inf")}
        for _ in range(a.repeats):
            for watch in (False, True):
                best[watch] = min(best[watch], failing_loop(kind, a.calls, watch))
        rows.append({"loop": kind, "plain_us": best[False] * 1e6, "watched_us": best[True] * 1e6,
                     "slowdown": best[True] / best[False]})
    meta = {"torch": torch.__version__, "python": platform.python_version(), "cpu_count": os.cpu_count(),
            "compilewatch": str(Path(compilewatch.__file__).parent), "calls": a.calls, "repeats": a.repeats}
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "watch_perturbation.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    lines = ["| failing loop | plain (CPU us/call) | watched | slowdown |", "|---|---|---|---|"]
    lines += [f"| {r['loop']} | {r['plain_us']:.1f} | {r['watched_us']:.1f} | {r['slowdown']:.2f}x |" for r in rows]
    (out / "watch_perturbation.md").write_text("\n".join(lines) + "\n")
    print(json.dumps(meta))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
