"""The engine on one GPU, cold compile cache: 1 target worker + 3 drafter threads on the same device.

Each case runs in its own subprocess with an empty inductor/triton cache, under a wall-clock
timeout, so a hang cannot block the benchmark:

  prewarm   the engine as shipped: every replica's step compiled in the main thread, one after
            another, verify pass, guard frozen, then the threads (throughput recorded)
  none      prewarm and guard off: the drafter threads hit their first compile together (the seeds)
  guard     prewarm off, guard on: the first compile in a worker thread fails fast with a clear error

The drafter is the toy attention model (dflash.engine.toy, `variant="attention"`): on CUDA a compiled
`flex_attention` with a causal block mask, forward and backward, in bf16 autocast — the piece that
hung the seeds' drafter threads. `--program dflash` runs the real DFlash trainer instead (tiny recipe: embedded target, synthetic chat
data, compiled flex_attention on CUDA) through `dflash.engine.program.train_multi`.

    python benchmarks/gpu_engine.py --out results/engine                 # H200 defaults (~3 min)
    python benchmarks/gpu_engine.py --device cpu --tiny --out /tmp/eng   # CPU smoke run (~30 s)

Writes <out>/gpu_engine.json (every case: outcome, rc, wall, timed_out, the engine report) and
<out>/gpu_engine.md (a table). Exit 0 when the prewarm case completed, else 1.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CASES = {
    "prewarm": {"prewarm": True, "guard": True},
    "none": {"prewarm": False, "guard": False},
    "guard": {"prewarm": False, "guard": True},
    # self-tests of the harness (tests/test_gpu_engine_bench.py): a drafter that never returns, seen by
    # the engine's stall watchdog; a process that never returns, killed at --timeout
    "selftest-stall": {"prewarm": True, "guard": True},
    "selftest-hang": {"prewarm": True, "guard": True},
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.environ.get("OUT", "results/gpu_engine"), help="results directory (default $OUT)")
    p.add_argument("--device", default=None, help="device for every worker (default cuda:0 if available, else cpu)")
    p.add_argument("--targets", type=int, default=1, help="target workers (all on --device)")
    p.add_argument("--drafters", type=int, default=3, help="drafter threads (all on --device)")
    p.add_argument("--cases", default="prewarm,none,guard", help=f"comma list of {', '.join(CASES)}")
    p.add_argument("--trials", type=int, default=1, help="runs per case (each a fresh process, cold cache)")
    p.add_argument("--steps", type=int, default=60, help="optimizer steps per run")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds before a case's process is killed")
    p.add_argument("--stall-after", type=float, default=60.0, help="engine stall watchdog (s), < --timeout")
    p.add_argument("--program", choices=("toy", "dflash"), default="toy")
    p.add_argument("--tiny", action="store_true", help="tiny shapes (CPU smoke run)")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--dim", type=int, default=1024)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--backend", default=None, help="attention compile backend (default inductor on CUDA, aot_eager on CPU)")
    p.add_argument("--case", default=None, help=argparse.SUPPRESS)  # child mode
    p.add_argument("--result", default=None, help=argparse.SUPPRESS)  # child mode: where to write JSON
    p.add_argument("--work", default=None, help=argparse.SUPPRESS)  # child mode: scratch dir the parent removes
    a = p.parse_args(argv)
    if a.tiny:
        a.seq, a.dim, a.heads, a.batch = 32, 16, 2, 2
    return a


# ----------------------------------------------------------------------------- child: one case
def _chat_file(path: Path, n: int = 64) -> Path:
    """Synthetic chat JSONL from the tiny tokenizer's words (no regeneration, no download)."""
    import random

    from dflash.model.target import tiny_words

    words, rng = tiny_words(), random.Random(0)
    with open(path, "w") as fh:
        for _ in range(n):
            q = " ".join(rng.choice(words) for _ in range(rng.randint(4, 12)))
            ans = " ".join(rng.choice(words) for _ in range(rng.randint(30, 80)))
            fh.write(json.dumps({"messages": [{"role": "user", "content": q},
                                              {"role": "assistant", "content": ans}]}) + "\n")
    return path


@contextlib.contextmanager
def _work_dir(given: str | None):
    """The dflash case's data and run directory. Given (`--work`: the parent made it and removes it once this
    process has exited, also when it had to kill it): used as is. Otherwise a temporary directory removed
    when the case ends, returned or raised."""
    if given:
        Path(given).mkdir(parents=True, exist_ok=True)
        yield Path(given)
        return
    work = tempfile.mkdtemp(prefix="gpu-engine-dflash-")
    try:
        yield Path(work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def run_dflash_case(a: argparse.Namespace, device: str, flags: dict):
    """The real trainer (tiny recipe: embedded target, DFlash drafter, compiled flex on CUDA) on the engine."""
    from dflash.config import TopologyConfig, apply_overrides, tiny
    from dflash.engine.program import train_multi
    from dflash.training.trainer import Trainer

    with _work_dir(getattr(a, "work", None)) as work:
        cfg = apply_overrides(tiny(), {
            "data.path": str(_chat_file(work / "chat.jsonl")), "data.regenerate": False, "topology.device": device,
            "train.max_steps": a.steps, "checkpoint.every": 10 ** 6, "checkpoint.out_dir": str(work / "run"),
            "metrics.tensorboard": False, "eval.at_end": False})
        trainer = Trainer.from_config(cfg)
        try:
            topo = TopologyConfig(target_devices=(device,) * a.targets, drafter_devices=(device,) * a.drafters,
                                  stall_after=a.stall_after, prewarm=flags["prewarm"], guard=flags["guard"])
            _, report = train_multi(trainer, topo)
        finally:
            trainer.close()
    return report


def _program(a: argparse.Namespace, device: str):
    from dflash.engine.toy import ToySpec, toy_program

    backend = a.backend or ("inductor" if device.startswith("cuda") else "aot_eager")
    return toy_program(ToySpec(variant="attention", dim=a.dim, heads=a.heads, seq=a.seq, batch=a.batch,
                               attention_backend=backend, autocast=device.startswith("cuda"), lr=1e-4))


def _never_returns_on_step(program, step: int):
    import dataclasses
    import threading

    def forward_backward(rep, batch):
        calls = rep.state["selftest_calls"] = rep.state.get("selftest_calls", 0) + 1
        if rep.index == 0 and calls == 2 + 1 + step:  # after the warm and verify passes and `step` steps
            threading.Event().wait()
        return program.forward_backward(rep, batch)
    return dataclasses.replace(program, forward_backward=forward_backward)


STACKS_SIGNAL = signal.SIGUSR1  # the parent asks a case it is about to kill for every thread's stack


def run_case(a: argparse.Namespace) -> int:
    import faulthandler

    # a last resort if even the engine's own stall report never comes: every stack, dumped when the parent
    # times the case out (it sends STACKS_SIGNAL, waits for the dump, then kills). Registered before torch is
    # imported, so a case that is slow to start is covered too.
    stacks_fh = open(a.result + ".stacks.txt", "w")
    faulthandler.register(STACKS_SIGNAL, file=stacks_fh, all_threads=True)

    import torch

    from compilewatch.serialize import to_jsonable
    from dflash.engine.engine import Engine, EngineConfig

    if a.case == "selftest-hang":
        import threading

        threading.Event().wait()
    device = a.device
    flags = CASES[a.case]
    cfg = EngineConfig(target_devices=(device,) * a.targets, drafter_devices=(device,) * a.drafters, steps=a.steps,
                       prewarm=flags["prewarm"], guard=flags["guard"], stall_after=a.stall_after, sample_every=10,
                       join_timeout=2.0)
    t0 = time.perf_counter()
    if a.program == "dflash":
        report = run_dflash_case(a, device, flags)
    else:
        program = _program(a, device)
        if a.case == "selftest-stall":
            program = _never_returns_on_step(program, 1)
        report = Engine(program, cfg).run()
    data = {"case": a.case, "device": device, "torch": torch.__version__, "total_s": time.perf_counter() - t0,
            "gpu": torch.cuda.get_device_name(device) if device.startswith("cuda") else None,
            "report": to_jsonable(report)}
    if device.startswith("cuda"):
        data["peak_memory_bytes"] = torch.cuda.max_memory_allocated(device)
    tmp = a.result + ".tmp"
    with open(tmp, "w") as fh:
        json.dump(data, fh, indent=1)
    os.replace(tmp, a.result)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0 if report.ok else 1)  # threads stuck inside torch must not keep the process alive


# ----------------------------------------------------------------------------- parent
def _ask_for_stacks(proc: subprocess.Popen, stacks_file: Path, wait_s: float = 10.0) -> None:
    """Before killing a timed-out case: signal it to dump every thread's stack (faulthandler, registered
    first thing in `run_case`) and wait until the dump ends (its size stops growing), `wait_s` at most.
    A case that has not registered yet (still starting Python) just dies of the signal: nothing to read."""
    if stacks_file.exists() and stacks_file.stat().st_size:
        return  # dumped already
    try:
        proc.send_signal(STACKS_SIGNAL)
    except ProcessLookupError:
        return
    deadline, size = time.monotonic() + wait_s, -1
    while time.monotonic() < deadline and proc.poll() is None:
        now = stacks_file.stat().st_size if stacks_file.exists() else 0
        if now and now == size:
            return
        size = now
        time.sleep(0.2)


def _child(a: argparse.Namespace, case: str, trial: int, out: Path) -> dict:
    """One case in its own process. Its scratch directory (the empty compile caches, the dflash case's data and
    run) is made here and removed here once the process has exited, whatever happened: a case killed at the
    timeout cannot clean up after itself."""
    scratch = tempfile.mkdtemp(prefix=f"gpu-engine-{case}-")
    try:
        return _run_child(a, case, trial, out, scratch)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _run_child(a: argparse.Namespace, case: str, trial: int, out: Path, scratch: str) -> dict:
    result = out / f"case-{case}-{trial}.json"
    result.unlink(missing_ok=True)
    cache = os.path.join(scratch, "inductor")
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache, "TRITON_CACHE_DIR": os.path.join(cache, "triton"),
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    argv = [sys.executable, str(Path(__file__).resolve()), "--case", case, "--result", str(result),
            "--work", os.path.join(scratch, "work"),
            "--device", a.device, "--targets", str(a.targets), "--drafters", str(a.drafters), "--steps", str(a.steps),
            "--stall-after", str(a.stall_after), "--timeout", str(a.timeout), "--program", a.program, "--seq", str(a.seq), "--dim", str(a.dim),
            "--heads", str(a.heads), "--batch", str(a.batch)] + (["--backend", a.backend] if a.backend else []) \
        + (["--tiny"] if a.tiny else [])
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    timed_out = False
    try:
        log, _ = proc.communicate(timeout=a.timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
        _ask_for_stacks(proc, Path(str(result) + ".stacks.txt"))
        os.killpg(proc.pid, signal.SIGKILL)
        log, _ = proc.communicate()
    except BaseException:  # Ctrl-C here: the case runs in its own session, it would outlive us and its scratch
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise
    wall = time.perf_counter() - t0
    data = json.loads(result.read_text()) if result.exists() else None
    stacks_file = Path(str(result) + ".stacks.txt")
    faulthandler_stacks = stacks_file.read_text() if stacks_file.exists() else ""
    rep = (data or {}).get("report") or {}
    outcome = "hang (killed at timeout)" if timed_out and not rep else rep.get("outcome", f"exit {proc.returncode}")
    failure = rep.get("failure") or {}
    walls = sorted(st["wall_s"] for st in rep.get("steps") or [])
    median_step = walls[len(walls) // 2] if walls else None
    row = {"case": case, "trial": trial, "outcome": outcome, "rc": proc.returncode, "timed_out": timed_out,
           "wall_s": round(wall, 2), "steps_done": rep.get("steps_done"), "tokens_per_s": rep.get("tokens_per_s"),
           "steps_per_s": rep.get("steps_per_s"), "median_step_s": median_step,
           "prewarm_s": (rep.get("prewarm") or {}).get("wall_s"),
           "wait_fraction": rep.get("wait_fraction"), "peak_memory_bytes": (data or {}).get("peak_memory_bytes"),
           "error": failure.get("error"), "failed_thread": failure.get("thread"),
           "verdicts": rep.get("verdicts"), "log_tail": (log or "")[-4000:], "result_file": result.name,
           "faulthandler_stacks": faulthandler_stacks[-20000:] or None}
    return row


def _markdown(rows: list[dict], a: argparse.Namespace, meta: dict) -> str:
    lines = [f"# engine on one device: {a.targets} target worker + {a.drafters} drafter threads, cold cache", "",
             f"device {meta['device']} ({meta.get('gpu') or 'cpu'}), torch {meta['torch']}, program {a.program} "
             + (f"(seq={a.seq} dim={a.dim} heads={a.heads} batch={a.batch})" if a.program == "toy" else "(tiny recipe)")
             + f", {a.steps} steps, timeout {a.timeout:g} s", "",
             "| case | trial | outcome | wall | steps | tokens/s | median step | prewarm | wait % | error |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        tps = f"{r['tokens_per_s']:,.0f}" if r["tokens_per_s"] else "-"
        pw = f"{r['prewarm_s']:.1f} s" if r["prewarm_s"] else "-"
        wf = f"{100 * r['wait_fraction']:.0f}" if r["wait_fraction"] is not None else "-"
        err = (r["error"] or "").splitlines()[0][:120] if r["error"] else ""
        med = f"{1000 * r['median_step_s']:.1f} ms" if r["median_step_s"] else "-"
        lines.append(f"| {r['case']} | {r['trial']} | {r['outcome']} | {r['wall_s']:.1f} s | {r['steps_done']} | {tps} | "
                     f"{med} | {pw} | {wf} | {err} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    if a.device is None:
        import torch

        a.device = "cuda:0" if torch.cuda.is_available() else "cpu"
    if a.case:
        return run_case(a)
    import torch

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    cases = [c.strip() for c in a.cases.split(",") if c.strip()]
    bad = [c for c in cases if c not in CASES]
    if bad:
        print(f"unknown case(s) {bad}; choose from {list(CASES)}", file=sys.stderr)
        return 2
    meta = {"device": a.device, "torch": torch.__version__,
            "gpu": torch.cuda.get_device_name(a.device) if a.device.startswith("cuda") else None}
    rows = []
    for case in cases:
        for trial in range(a.trials):
            print(f"[gpu_engine] case {case} trial {trial} ...", file=sys.stderr, flush=True)
            row = _child(a, case, trial, out)
            print(f"[gpu_engine]   {row['outcome']} in {row['wall_s']} s"
                  + (f": {row['error'].splitlines()[0][:160]}" if row["error"] else ""), file=sys.stderr, flush=True)
            rows.append(row)
    (out / "gpu_engine.json").write_text(json.dumps({"meta": meta, "args": vars(a), "cases": rows}, indent=1))
    (out / "gpu_engine.md").write_text(_markdown(rows, a, meta))
    print(_markdown(rows, a, meta))
    ok = any(r["case"] == "prewarm" and r["outcome"] == "ok" for r in rows) or "prewarm" not in cases
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
