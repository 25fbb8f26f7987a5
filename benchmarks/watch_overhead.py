"""Watcher and guard overhead on the steady-state step time of a small compiled model.

    python benchmarks/watch_overhead.py --out results/          # CPU: aot_eager, small shapes
    python benchmarks/watch_overhead.py --device cuda:0 --backend inductor --out $OUT

A compiled MLP block (fwd + bwd + SGD update) is warmed once; then for each repeat every
configuration is measured in turn (interleaved, so drift hits all equally): plain, watcher,
guard (thread-local flag + frozen), watcher + guard, guard in serialize mode with the step inside
`guard.shared()`. Reported: the best (minimum) over repeats of the mean step time, which filters out
other processes' contention on a shared machine, and the overhead vs plain; plus the same for one
call of a tiny compiled function (the per-call cost the guard's hook adds, in microseconds).
Writes watch_overhead.json and watch_overhead.md into --out (default $OUT, else ./bench-out).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def build(device: str, backend: str, width: int, batch: int):
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(width, 4 * width), torch.nn.GELU(), torch.nn.Linear(4 * width, width),
                                torch.nn.LayerNorm(width)).to(device)
    cmodel = torch.compile(model, backend=backend)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(batch, width, device=device)

    def step():
        loss = cmodel(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    return step


def sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def measure(step, device: str, steps: int) -> float:
    # CPU: process CPU time (all our threads, the watchdog included), which other processes on a
    # shared machine disturb far less than wall time; CUDA: wall time after a synchronize.
    clock = time.perf_counter if device.startswith("cuda") else time.process_time
    sync(device)
    t0 = clock()
    for _ in range(steps):
        step()
    sync(device)
    return (clock() - t0) / steps


def hook_costs(number: int = 200_000) -> dict[str, float]:
    """Nanoseconds per call of the two functions every compiled call runs that the instruments
    replace: the FX flag reader and dynamo's callback choice, plain vs instrumented."""
    import timeit

    import torch
    import torch._dynamo.eval_frame as ef
    import torch.fx._symbolic_trace as st

    from compilewatch.tracing.guard import CompileGuard
    from compilewatch.tracing.watcher import Watcher

    cb = torch._dynamo.optimize("eager").callback  # what compile_wrapper passes in

    def ns(stmt) -> float:
        return min(timeit.repeat(stmt, number=number, repeat=7)) / number * 1e9

    out = {"is_fx_symbolic_tracing plain": ns(st.is_fx_symbolic_tracing),
           "_callback_from_stance plain": ns(lambda: ef._callback_from_stance(cb))}
    with Watcher():
        out["is_fx_symbolic_tracing watched"] = ns(st.is_fx_symbolic_tracing)
    with CompileGuard() as g:
        g.freeze()
        out["guard thread-local flag on"] = float(g.thread_local)
        out["is_fx_symbolic_tracing guard (thread-local)"] = ns(st.is_fx_symbolic_tracing)
        out["_callback_from_stance guard"] = ns(lambda: ef._callback_from_stance(cb))
    return out


@contextlib.contextmanager
def config(name: str, refs: list[list]):
    """Install the configuration's instruments; in serialize mode wrap each ref[0] in guard.shared()."""
    from compilewatch.tracing.guard import CompileGuard
    from compilewatch.tracing.watcher import Watcher

    stack = contextlib.ExitStack()
    bases = [r[0] for r in refs]
    try:
        if name in ("watcher", "watcher+guard"):
            stack.enter_context(Watcher(stall_after=300))
        if name in ("guard", "watcher+guard", "guard serialize"):
            g = stack.enter_context(CompileGuard(serialize=name == "guard serialize"))  # thread-local where supported
            g.freeze()
            if g.serialize:
                for r in refs:
                    r[0] = g.wrap(r[0])
        yield
    finally:
        for r, b in zip(refs, bases):
            r[0] = b
        stack.close()


CONFIGS = ("plain", "watcher", "guard", "watcher+guard", "guard serialize")


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--backend", default=None, help="torch.compile backend (default: inductor on CUDA, aot_eager on CPU)")
    ap.add_argument("--width", type=int, default=None, help="hidden size (default 1024 on CUDA, 128 on CPU)")
    ap.add_argument("--batch", type=int, default=None, help="batch (default 4096 on CUDA, 32 on CPU)")
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--hook-calls", type=int, default=200_000, help="timeit calls per repeat for the hook costs")
    ap.add_argument("--threads", type=int, default=1, help="CPU: torch intra-op threads")
    ap.add_argument("--out", default=os.environ.get("OUT") or "bench-out")
    a = ap.parse_args(argv)
    import torch

    cuda = a.device.startswith("cuda")
    if not cuda:
        torch.set_num_threads(a.threads)  # a shared CPU box: oversubscribed intra-op threads swamp the signal
    backend = a.backend or ("inductor" if cuda else "aot_eager")
    width = a.width or (1024 if cuda else 128)
    batch = a.batch or (4096 if cuda else 32)
    step = build(a.device, backend, width, batch)
    t0 = time.perf_counter()
    step()
    compile_s = time.perf_counter() - t0
    for _ in range(max(3, a.steps // 10)):
        step()
    tiny_fn = torch.compile(lambda t: t + 1, backend="eager")
    t_in = torch.ones(1, device=a.device)
    tiny_fn(t_in)
    ref, tiny = [step], [lambda: tiny_fn(t_in)]
    times: dict[str, list[float]] = {c: [] for c in CONFIGS}
    call_times: dict[str, list[float]] = {c: [] for c in CONFIGS}
    for _ in range(a.repeats):
        for c in CONFIGS:
            with config(c, [ref, tiny]):
                ref[0]()  # one unmeasured step under the configuration
                times[c].append(measure(ref[0], a.device, a.steps))
                call_times[c].append(measure(tiny[0], a.device, 20 * a.steps))
    med = {c: min(v) for c, v in times.items()}
    hooks = hook_costs(a.hook_calls)
    call = {c: min(v) for c, v in call_times.items()}
    result = {
        "machine": {"python": platform.python_version(), "torch": torch.__version__, "device": a.device,
                    "device_name": torch.cuda.get_device_name(a.device) if cuda else platform.processor() or "cpu",
                    "cpus": os.cpu_count()},
        "model": {"backend": backend, "width": width, "batch": batch, "steps": a.steps, "repeats": a.repeats,
                  "first_step_s": compile_s},
        "best_step_s": med,
        "overhead_pct": {c: 100.0 * (med[c] / med["plain"] - 1.0) for c in CONFIGS},
        "best_tiny_call_us": {c: call[c] * 1e6 for c in CONFIGS},
        "tiny_call_overhead_us": {c: (call[c] - call["plain"]) * 1e6 for c in CONFIGS},
        "hook_ns": hooks,
        "all_step_s": times,
        "command": " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]),
    }
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "watch_overhead.json").write_text(json.dumps(result, indent=2) + "\n")
    lines = [f"torch {torch.__version__}, {a.device} ({result['machine']['device_name']}), backend {backend}, "
             f"width {width}, batch {batch}, {a.steps} steps x {a.repeats} repeats (best)", "",
             "| configuration | step time | overhead vs plain | one tiny compiled call | added per call |",
             "|---|---|---|---|---|"]
    for c in CONFIGS:
        lines.append(f"| {c} | {med[c] * 1e3:.3f} ms | {result['overhead_pct'][c]:+.2f}% | "
                     f"{call[c] * 1e6:.2f} us | {(call[c] - call['plain']) * 1e6:+.2f} us |")
    lines += ["", "| hooked function (per compiled call) | ns per call |", "|---|---|"]
    lines += [f"| {k} | {v:.0f} |" for k, v in hooks.items()]
    (out / "watch_overhead.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return result


if __name__ == "__main__":
    main()
