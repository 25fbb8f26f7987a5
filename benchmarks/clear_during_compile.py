"""Benchmark: `cache clear` in a loop while a torch process compiles into the same cache (issue 31).

    python benchmarks/clear_during_compile.py                    # 30 compiles, CPU inductor
    python benchmarks/clear_during_compile.py --compiles 5       # a smoke run
    python benchmarks/clear_during_compile.py --no-check         # the check switched off: the old behaviour

A child process torch.compiles `--compiles` distinct functions (dynamo reset between them, so each
is a fresh inductor compile with a C++ build) into a fresh TORCHINDUCTOR_CACHE_DIR, while this
process calls `compilewatch.cache.manage.clear` on that dir every 50 ms. Reports how many compiles
failed, how many clears went through (between compiles) and how many were refused (a compile was in
flight: `cache/busy.py`). Results: clear_during_compile.json in --out (default $OUT, else printed).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CHILD = """
import sys, torch
ok = fail = 0
for i in range(int(sys.argv[1])):
    def f(x, i=i):
        return (x * (i + 1)).sin() + x.cos() * i
    torch._dynamo.reset()
    try:
        torch.compile(f)(torch.randn(8 + i))
        ok += 1
    except Exception as e:
        fail += 1
        print("FAIL", i, type(e).__name__, str(e)[:160], file=sys.stderr, flush=True)
print(ok, fail)
"""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--compiles", type=int, default=30)
    ap.add_argument("--no-check", action="store_true", help="switch busy.not_compiling off (what clear did before)")
    ap.add_argument("--out", default=os.environ.get("OUT"))
    a = ap.parse_args()
    from compilewatch.cache.local import busy, manage
    from compilewatch.errors import BadInput, CheckFailed

    if a.no_check:
        busy.not_compiling = lambda *_a, **_k: contextlib.nullcontext()
    work = Path(tempfile.mkdtemp(prefix="clear-bench-"))
    root = work / "cache"
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(root))
    t0 = time.perf_counter()
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(a.compiles)], env=env, stdout=subprocess.PIPE, text=True)
    cleared = refused = not_yet = 0
    while child.poll() is None:
        try:
            manage.clear(root, force=True)
            cleared += 1
        except CheckFailed:
            refused += 1
        except BadInput:  # no cache dir yet (just cleared, torch has not recreated it)
            not_yet += 1
        time.sleep(0.05)  # a benchmark's pacing, not a synchronization
    ok, fail = map(int, child.stdout.read().split())
    result = {"compiles": a.compiles, "check": not a.no_check, "compiles_ok": ok, "compiles_failed": fail,
              "clears_done": cleared, "clears_refused": refused, "no_dir_yet": not_yet,
              "wall_s": round(time.perf_counter() - t0, 1), "cpus": os.cpu_count()}
    shutil.rmtree(work, ignore_errors=True)
    text = json.dumps(result, indent=2)
    print(text)
    if a.out:
        Path(a.out).mkdir(parents=True, exist_ok=True)
        name = "clear_during_compile" + ("_nocheck" if a.no_check else "") + ".json"
        (Path(a.out) / name).write_text(text + "\n")


if __name__ == "__main__":
    main()
