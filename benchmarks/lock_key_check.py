"""Check the fast system key against torch's own on this machine (run it on the GPU machine).

    python benchmarks/lock_key_check.py            # both keys, the method, timings, NVML vs torch GPU names; exit 1 if they differ
    python benchmarks/lock_key_check.py --json

Order matters: the fast key and `compilewatch lock` are timed first, in fresh processes, before
anything here imports torch; then torch's `CacheBase.get_system()` is asked in a fresh process too.
The triton key memo is put in a temporary dir, so the first fast run hashes triton's files (a
cold-memo figure) and the second reads the memo.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

FAST = """
import json, time
t = time.perf_counter()
from compilewatch.env import systemkey
k = systemkey.key()
view = systemkey.read_devices()
print(json.dumps({"nvml_names": list(view.names) if view is not None else None, "key": k.key, "method": k.method, "reason": k.reason, "device": k.device,
                  "triton_memo": k.triton_memo, "seconds": time.perf_counter() - t}))
"""
TORCH = """
import json, time
t = time.perf_counter()
import torch
from torch._inductor.codecache import CacheBase
s = CacheBase.get_system()
names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
print(json.dumps({"torch_names": names, "key": s["hash"], "system": {k: v for k, v in s.items() if k != "hash"}, "torch": torch.__version__,
                  "cuda_available": torch.cuda.is_available(), "seconds": time.perf_counter() - t}, default=str))
"""


def _run(code: str, env: dict) -> dict:
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _time_lock(env: dict) -> float | None:
    """A fresh `compilewatch lock --json`; None when the CLI cannot run here (e.g. typer not installed)."""
    t = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "cli.main", "lock", "--json"], env=env, capture_output=True, text=True)
    if r.returncode != 0:
        print(f"compilewatch lock failed here ({r.returncode}): {r.stderr.strip()[-300:]}", file=sys.stderr)
        return None
    return time.perf_counter() - t


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with tempfile.TemporaryDirectory() as state:
        env = {**os.environ, "COMPILEWATCH_STATE_DIR": state,
               "PYTHONPATH": repo + os.pathsep + os.environ.get("PYTHONPATH", "")}
        cold = _run(FAST, env)
        warm = _run(FAST, env)
        lock_s = [_time_lock(env) for _ in range(3)]
        real = _run(TORCH, env)
    report = {"fast_cold_memo": cold, "fast": warm, "torch": real, "lock_seconds": lock_s,
              "equal": cold["key"] == real["key"] == warm["key"],
              "names_equal": (warm.get("nvml_names") or []) == real["torch_names"]}
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        system = json.dumps(real["system"], sort_keys=True)
        print(f"torch {real['torch']}, CUDA available {real['cuda_available']}, system {system[:160]}")
        print(f"torch's key  {real['key']}  ({real['seconds']:.2f} s: import torch + get_system)")
        print(f"fast key     {warm['key']}  method {warm['method']}, device {warm['device']!r}"
              + (f", fell back: {warm['reason']}" if warm["reason"] else ""))
        print(f"fast key timings: {cold['seconds']:.2f} s with a cold triton-key memo, {warm['seconds']:.2f} s with it")
        print("compilewatch lock --json, fresh processes: "
              + ", ".join("-" if s is None else f"{s:.2f} s" for s in lock_s))
        print(f"GPU names: NVML {warm.get('nvml_names')} vs torch {real['torch_names']}: "
              + ("equal" if report["names_equal"] else "DIFFERENT"))
        print("EQUAL" if report["equal"] else "DIFFERENT: the fast path is wrong on this machine")
    return 0 if report["equal"] and report["names_equal"] else 1


if __name__ == "__main__":
    sys.exit(main())
