"""Does sequential warm prevent the 3-thread cold-start failure, and does a warm disk cache alone?

Steps (each in its own subprocess, so a hang cannot block the benchmark; fresh inductor cache dirs
under --out unless a step says it keeps one):
  1. warm_cold        `compilewatch warm --devices D --json --workload <dflash mask>`, empty cache: time,
                      compiles, cache hits (the DFlash training mask, dflash.engine.warm_workload)
  2. warm_kept        the same in a new process, cache from step 1 kept
  3. threads_cold     N threads start the same workload at once, cold, no warm (seeds' race)
  4. warm_then_threads  prewarm in the main thread, then the same N threads, same process
  5. disk_warm_then_threads  `compilewatch warm` in one process, then step 3 in a new process that
                      only has the warm disk cache
Each thread has its own compiled flex_attention wrapper (as the seeds' drafter threads did).
Writes results.json and summary.md to --out (default $OUT, else ./gpu_warm_out).

  GPU:  python benchmarks/gpu_warm.py --device 0 --out $OUT
  CPU:  python benchmarks/gpu_warm.py --tiny --out /tmp/gpu_warm   (tiny shapes, aot_eager, cpu)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TINY = {"seq": 64, "blocks": 4, "block_size": 16, "heads": 2, "head_dim": 16}


def shape_args(a: argparse.Namespace) -> list[str]:
    return ["--seq", str(a.seq), "--blocks", str(a.blocks), "--block-size", str(a.block_size), "--heads", str(a.heads),
            "--head-dim", str(a.head_dim), "--dtype", a.dtype, "--backend", a.backend]


def child_env(cache_dir: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["TORCHINDUCTOR_CACHE_DIR"] = str(cache_dir)
    env.pop("TRITON_CACHE_DIR", None)  # triton follows the inductor dir
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def run_child(argv: list[str], cache_dir: Path, limit: float) -> dict:
    """Run a subprocess; return rc, wall, parsed JSON from stdout (or None) and the stderr tail."""
    t0 = time.perf_counter()
    try:
        p = subprocess.run(argv, capture_output=True, text=True, env=child_env(cache_dir), timeout=limit, cwd=ROOT)
        rc, out, err = p.returncode, p.stdout, p.stderr
    except subprocess.TimeoutExpired as e:
        rc, out, err = "killed", _s(e.stdout), _s(e.stderr) + f"\nkilled after {limit:.0f} s"
    wall = time.perf_counter() - t0
    try:
        data = json.loads(out) if out.strip() else None
    except json.JSONDecodeError:
        data = None
    return {"rc": rc, "process_wall_s": round(wall, 3), "data": data, "stderr_tail": err[-3000:],
            "cache_dir": str(cache_dir)}


def _s(b) -> str:
    return b.decode(errors="replace") if isinstance(b, bytes) else (b or "")


def warm_step(a: argparse.Namespace, cache_dir: Path) -> dict:
    # the DFlash mask, as dflash registers it (named as module:class: this checkout may not be pip-installed)
    argv = [sys.executable, "-m", "cli.main", "warm", "--devices", a.device, "--json", "--workload",
            "dflash.engine.warm_workload:DFlashAttention", *shape_args(a)]
    r = run_child(argv, cache_dir, a.timeout + 300)
    rep = r["data"] or {}
    if rep:
        w = rep["warm"][0]
        c = w["counters"]
        r["summary"] = {
            "ok": all(x["ok"] for x in rep["warm"] + rep["verify"]), "warm_s": round(w["wall_s"], 3),
            "frames": w["frames_compiled"], "fx_hit": c["fxgraph_cache_hit"], "fx_miss": c["fxgraph_cache_miss"],
            "aot_hit": c["autograd_cache_hit"], "aot_miss": c["autograd_cache_miss"],
            "peak_memory_bytes": w["peak_memory_bytes"],
            "verify_compiles": sum(x["frames_compiled"] for x in rep["verify"]),
        }
    return r


def threads_step(a: argparse.Namespace, cache_dir: Path, warm: bool) -> dict:
    # faulthandler: a child that crashes (torch 2.11 on CPU segfaults in a threaded cold dynamo compile)
    # leaves every thread's stack in stderr_tail
    argv = [sys.executable, "-X", "faulthandler", str(Path(__file__).resolve()), "--child-threads", "--device", a.device,
            "--threads", str(a.threads), "--timeout", str(a.timeout), *shape_args(a)]
    if warm:
        argv.append("--child-warm")
    r = run_child(argv, cache_dir, a.timeout + 300)
    if r["data"]:
        outs = [t["outcome"] for t in r["data"]["threads"]]
        r["summary"] = {"outcome": "hang" if "hang" in outs else ("error" if "error" in outs else "ok"),
                        "threads": outs, "threads_wall_s": r["data"]["threads_wall_s"],
                        "warm_s": r["data"].get("warm_s"), "fx_flag_stuck": r["data"]["fx_flag_stuck"],
                        "frames_in_threads": r["data"]["frames_compiled_in_threads"]}
    elif r["rc"] == "killed":
        r["summary"] = {"outcome": "hang", "threads": [], "note": "the child process was killed"}
    elif isinstance(r["rc"], int) and r["rc"] < 0:
        r["summary"] = {"outcome": "crash", "threads": [],
                        "note": f"the child process died of signal {-r['rc']} (stacks in stderr_tail)"}
    return r


def child_threads(a: argparse.Namespace) -> None:
    """In the child: N workloads (own compiled wrapper each), optional prewarm, then N threads at once."""
    from compilewatch.tracing import counters, fxpatch, stacks
    from compilewatch import torchinfo
    from compilewatch.devices import warm
    from compilewatch.devices.probe import run_threads
    from compilewatch.tracing.targets import FlexShape, WorkloadOptions
    from dflash.engine.warm_workload import DFlashAttention

    dev = a.device if not a.device.isdigit() else f"cuda:{a.device}"
    shape = FlexShape(context=a.seq, blocks=a.blocks, block_size=a.block_size, heads=a.heads, head_dim=a.head_dim,
                      dtype=a.dtype)
    workers = [DFlashAttention(WorkloadOptions(a.backend, shape), name=f"worker-{i}", trainer_kernel=False)
               for i in range(a.threads)]
    for w in workers:
        w.build()
    result: dict = {"device": dev, "torch": torchinfo.torch_build().version, "warm_s": None, "warm_ok": None}
    if a.child_warm:
        # the seeds' layout, fixed: every worker's compiled entry point runs once, in this thread
        rep = warm.prewarm(dev, lambda d: [w.run(d) for w in workers], name="workers")
        result["warm_s"] = round(rep.wall_s, 3)
        result["warm_ok"] = rep.ok
    before = counters.snapshot()
    t0 = time.perf_counter()
    outcomes, dumped = run_threads([(lambda w=w: w.run(dev)) for w in workers], timeout=a.timeout,
                                   names=[w.name for w in workers], devices=[dev] * a.threads)
    if dev.startswith("cuda") and not any(o.outcome == "hang" for o in outcomes):
        import torch

        torch.cuda.synchronize(dev)
    result["threads_wall_s"] = round(time.perf_counter() - t0, 3)
    hung = any(o.outcome == "hang" for o in outcomes)
    result["fx_flag_stuck"] = not hung and fxpatch.stuck_state().stuck
    result["frames_compiled_in_threads"] = counters.delta(before).frames_ok
    result["threads"] = [{"name": o.name, "outcome": o.outcome, "wall_s": o.wall_s,
                          "error": (o.error or "")[:600] or None} for o in outcomes]
    result["stacks"] = {k: [str(f) for f in stacks.relevant(list(v))] for k, v in dumped.items()
                        if "MainThread" not in k}
    sys.stdout.write(json.dumps(result) + "\n")
    sys.stdout.flush()
    os._exit(0)  # hung daemon threads would block a normal interpreter exit


def summary_md(res: dict) -> str:
    env = res["env"]
    lines = [f"# gpu_warm: {env['device']} ({env.get('gpu') or 'cpu'}), torch {env.get('torch')}, "
             f"backend {env['backend']}, {env['threads']} threads, timeout {env['timeout']:g} s",
             "", f"shape: {env['shape']}", "",
             "| step | result | warm time | threads time | frames compiled | FX-graph hit/miss | AOTAutograd hit/miss "
             "| process wall |", "|---|---|---|---|---|---|---|---|"]
    for name, r in res["steps"].items():
        s = r.get("summary") or {}
        if "frames" in s:  # a warm step
            result = "ok" if s["ok"] else "FAILED"
            result += f", verify compiled {s['verify_compiles']}"
            lines.append(f"| {name} | {result} | {s['warm_s']} s | - | {s['frames']} | {s['fx_hit']}/{s['fx_miss']} | "
                         f"{s['aot_hit']}/{s['aot_miss']} | {r['process_wall_s']} s |")
        else:
            outcome = s.get("outcome", f"no result (rc {r['rc']})")
            detail = ", ".join(s.get("threads", []))
            warm_s = f"{s['warm_s']} s" if s.get("warm_s") is not None else "-"
            if r.get("disk_warm"):
                warm_s = f"{r['disk_warm']['warm_s']} s (other process)"
            lines.append(f"| {name} | **{outcome}** ({detail}) | {warm_s} | {s.get('threads_wall_s', '-')} s | "
                         f"{s.get('frames_in_threads', '-')} (in threads) | - | - | {r['process_wall_s']} s |")
    lines += ["", "Errors and hung-thread stacks are in results.json (`steps.<name>.data`)."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.environ.get("OUT") or "gpu_warm_out")
    p.add_argument("--device", default=None, help="0 / cuda:0 / cpu (default: 0, or cpu with --tiny)")
    p.add_argument("--threads", type=int, default=3)
    p.add_argument("--timeout", type=float, default=150.0, help="seconds before a thread counts as hung")
    p.add_argument("--tiny", action="store_true", help="tiny shapes, aot_eager, cpu: a smoke test")
    p.add_argument("--backend", default=None)
    p.add_argument("--seq", type=int, default=3072)
    p.add_argument("--blocks", type=int, default=512)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--steps", default="warm_cold,warm_kept,threads_cold,warm_then_threads,disk_warm_then_threads")
    p.add_argument("--child-threads", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--child-warm", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.tiny:
        for k, v in TINY.items():
            if getattr(a, k) == p.get_default(k):
                setattr(a, k, v)
        a.backend = a.backend or "aot_eager"
        a.device = a.device or "cpu"
    a.backend = a.backend or "inductor"
    a.device = a.device or "0"
    if a.child_threads:
        child_threads(a)
        return 0
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    caches = Path(tempfile.mkdtemp(prefix="caches-", dir=out))
    env = {"device": a.device, "backend": a.backend, "threads": a.threads, "timeout": a.timeout,
           "python": platform.python_version(), "host": platform.node(),
           "shape": f"context {a.seq}, blocks {a.blocks} x {a.block_size}, heads {a.heads} x {a.head_dim}, "
                    f"dtype {a.dtype}"}
    env.update(_env_facts(a.device))
    res: dict = {"env": env, "steps": {}}
    wanted = a.steps.split(",")

    def save() -> None:
        (out / "results.json").write_text(json.dumps(res, indent=2) + "\n")
        (out / "summary.md").write_text(summary_md(res))

    def step(name: str, fn) -> None:
        if name in wanted:
            print(f"[gpu_warm] {name} ...", file=sys.stderr, flush=True)
            res["steps"][name] = fn()
            s = res["steps"][name].get("summary")
            print(f"[gpu_warm] {name}: {json.dumps(s)}", file=sys.stderr, flush=True)
            save()

    step("warm_cold", lambda: warm_step(a, caches / "A"))
    step("warm_kept", lambda: warm_step(a, caches / "A"))
    step("threads_cold", lambda: threads_step(a, caches / "B", warm=False))
    step("warm_then_threads", lambda: threads_step(a, caches / "C", warm=True))

    def disk() -> dict:
        first = warm_step(a, caches / "D")
        r = threads_step(a, caches / "D", warm=False)
        r["disk_warm"] = first.get("summary")
        return r

    step("disk_warm_then_threads", disk)
    save()
    print((out / "summary.md").read_text())
    return 0


def _env_facts(device: str) -> dict:
    """Torch version and GPU name, asked in a subprocess so this process never imports torch."""
    code = ("import json, torch; d=%r; i=int(d.split(':')[-1]) if d not in ('cpu',) else None; "
            "print(json.dumps({'torch': torch.__version__, 'cuda': torch.version.cuda, "
            "'gpu': torch.cuda.get_device_name(i) if i is not None and torch.cuda.is_available() else None}))") % device
    try:
        p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        return json.loads(p.stdout)
    except Exception as e:  # noqa: BLE001 - facts are best effort
        return {"env_error": str(e)}


if __name__ == "__main__":
    raise SystemExit(main())
