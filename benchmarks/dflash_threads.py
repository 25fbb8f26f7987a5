"""Does a second thread slow the target forward? The engine's split runs every worker as a thread of one process.

Times the target's taps forward (a random Qwen3-8B-shaped target, one 3072-token sequence: what one
engine target worker does per micro-batch) in the main thread on --target-device, `--iters` times
under each condition, after a warm-up:

  alone     nothing else runs
  drafter   a thread runs the drafter's training step (dflash_step's drafter-compiled step, fwd + bwd)
            in a loop on --drafter-device: the engine's 1 target + 1 drafter split, without the queues
  python    (--spin, last, 1 forward) a thread spins in pure Python, no GPU work: the GIL alone. On the
            H200 host 10 such forwards did not finish in 190 s: a CPU-bound Python thread starves a
            thread that launches kernels (it waits a switch interval, 5 ms, for the GIL per hand-over)
  drafter, switch 0.1 ms   as `drafter` with `sys.setswitchinterval(1e-4)` (default 5 ms): does a
            shorter GIL hand-over interval help the thread that launches the target's kernels?

and the drafter step alone and beside the target loop (`drafter_alone` / `drafter_beside_target`).
Each forward is timed to its end (synchronize). Results: <out>/dflash_threads.json.

GPU (2 devices):  python benchmarks/dflash_threads.py --out $OUT
CPU smoke:        python benchmarks/dflash_threads.py --small --out /tmp/threads
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from dflash.model.drafter import default_layer_ids  # noqa: E402
from dflash_e2e import QWEN3_8B, SMALL, dtype_on, random_target  # noqa: E402
from dflash_step import SMALL as SMALL_STEP, Shape, make_step  # noqa: E402


def timed_loop(fn, sync, n: int) -> list[float]:
    out = []
    for _ in range(n):
        sync()
        t = time.perf_counter()
        fn()
        sync()
        out.append(time.perf_counter() - t)
    return out


def beside(background, foreground) -> tuple[list[float], int]:
    """Run `background()` in a thread in a loop while `foreground()` runs here; return foreground's
    result and how many background iterations ran."""
    stop = threading.Event()
    started = threading.Event()
    count = [0]

    def loop() -> None:
        while not stop.is_set():
            background()
            count[0] += 1
            started.set()

    t = threading.Thread(target=loop, name="background", daemon=True)
    t.start()
    started.wait()  # the background is in its loop before anything is timed
    try:
        return foreground(), count[0]
    finally:
        stop.set()
        t.join()


def spin() -> None:
    x = 0
    for i in range(20_000):  # pure Python: holds the GIL between the interpreter's switches
        x += i


def summary(xs: list[float]) -> dict:
    return {"median_ms": round(1e3 * statistics.median(xs), 2), "min_ms": round(1e3 * min(xs), 2), "n": len(xs)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=os.environ.get("OUT", "bench-out"))
    p.add_argument("--small", action="store_true", help="tiny shapes, runs on CPU (smoke test)")
    p.add_argument("--target-device", default="cuda:0" if torch.cuda.is_available() else "cpu")
    p.add_argument("--drafter-device", default="cuda:1" if torch.cuda.device_count() > 1 else "cpu")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--spin", action="store_true", help="also time 1 forward beside a pure-Python thread (slow)")
    p.add_argument("--dump-after", type=float, default=0, help="dump every thread's stack after this many s (0: never)")
    a = p.parse_args(argv)
    if a.dump_after:
        faulthandler.dump_traceback_later(a.dump_after, exit=True)
    tdev, ddev = torch.device(a.target_device), torch.device(a.drafter_device)
    fields = SMALL if a.small else QWEN3_8B
    shape = SMALL_STEP if a.small else Shape()
    seq = shape.seq

    def sync_on(dev: torch.device):
        return (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)

    tsync, dsync = sync_on(tdev), sync_on(ddev)
    target = random_target(fields, tdev, dtype_on(tdev), shape.layers)
    assert target.layer_ids == default_layer_ids(fields["num_hidden_layers"], shape.layers)
    ids = torch.randint(0, fields["vocab_size"] - 1, (1, seq)).to(tdev)

    def forward() -> None:
        with torch.no_grad():
            target.taps(ids)

    backend = "flex" if ddev.type == "cuda" else "sdpa"
    step, _ = make_step(shape, ddev, backend, compile_layers=ddev.type == "cuda")

    def drafter_step() -> None:
        if ddev.type == "cuda":
            torch.cuda.set_device(ddev)
        step()
        dsync()

    from dflash.engine.compile_safety import CompileBarrier

    log = lambda msg: print(f"[{time.perf_counter():.1f}] {msg}", file=sys.stderr, flush=True)  # noqa: E731
    barrier = CompileBarrier(True)  # as the engine: compile here, then freeze (a late compile raises, never races)
    timed_loop(forward, tsync, 2)
    timed_loop(drafter_step, dsync, 2)  # compiles here, in the main thread, before any thread starts
    barrier.freeze()
    log("warm")
    res: dict = {"device": torch.cuda.get_device_name(tdev) if tdev.type == "cuda" else "cpu",
                 "torch": torch.__version__, "target_device": str(tdev), "drafter_device": str(ddev), "seq": seq}
    res["target_alone"] = summary(timed_loop(forward, tsync, a.iters))
    log(f"target alone {res['target_alone']}")
    xs, n = beside(drafter_step, lambda: timed_loop(forward, tsync, a.iters))
    res["target_beside_drafter"] = {**summary(xs), "drafter_steps_meanwhile": n}
    log(f"target beside drafter {res['target_beside_drafter']}")
    default_switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-4)
    try:
        xs, n = beside(drafter_step, lambda: timed_loop(forward, tsync, a.iters))
    finally:
        sys.setswitchinterval(default_switch)
    res["target_beside_drafter_switch_0.1ms"] = {**summary(xs), "drafter_steps_meanwhile": n}
    res["drafter_alone"] = summary(timed_loop(drafter_step, dsync, max(3, a.iters // 2)))
    xs, n = beside(forward, lambda: timed_loop(drafter_step, dsync, max(3, a.iters // 2)))
    res["drafter_beside_target"] = {**summary(xs), "target_forwards_meanwhile": n}
    if a.spin:
        xs, n = beside(spin, lambda: timed_loop(forward, tsync, 1))
        res["target_beside_python_spin"] = {**summary(xs), "spins_meanwhile": n}
    barrier.close()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "dflash_threads.json").write_text(json.dumps(res, indent=2) + "\n")
    print(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
