"""Fresh-process wall time of the CLI's quick commands, median of N runs each.

    python benchmarks/cli_startup.py                 # N=5, a markdown table on stdout
    python benchmarks/cli_startup.py -n 11 --json

Each run is a new interpreter (`python -m cli.main ...`), as a user's shell starts it, with stdout and
stderr captured (not a terminal). `lock --torch` is the old path (imports torch, asks torch for the
system key) and `import torch` the floor that path cannot go under; both are for comparison. The
triton-key memo lives in a temporary dir: the first `lock` run fills it (its time is `first`).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time

CASES = [
    ("compilewatch --help", ["-m", "cli.main", "--help"]),
    ("compilewatch lock --json", ["-m", "cli.main", "lock", "--json"]),
    ("compilewatch lock --torch --json", ["-m", "cli.main", "lock", "--torch", "--json"]),
    ("dflash --help", ["-m", "cli.dflash_main", "--help"]),
    ("dflash train --help", ["-m", "cli.dflash_main", "train", "--help"]),
    ("python -c 'import torch'", ["-c", "import torch"]),
]


def _once(args: list[str], env: dict) -> tuple[float, float]:
    """(wall seconds, CPU seconds: the child's user + system time, which a busy machine inflates less)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t = time.perf_counter()
    r = subprocess.run([sys.executable, *args], env=env, capture_output=True)
    dt = time.perf_counter() - t
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if r.returncode != 0:
        raise SystemExit(f"{args} failed ({r.returncode}): {r.stderr.decode()[-500:]}")
    return dt, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-n", type=int, default=5, help="runs per command (the median is reported)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    rows = []
    with tempfile.TemporaryDirectory() as state:
        env = {**os.environ, "COMPILEWATCH_STATE_DIR": state,
               "PYTHONPATH": repo + os.pathsep + os.environ.get("PYTHONPATH", "")}
        for name, argv in CASES:
            both = [_once(argv, env) for _ in range(args.n)]
            runs, cpu = [w for w, _ in both], [c for _, c in both]
            rows.append({"command": name, "first_s": runs[0], "median_s": statistics.median(runs),
                         "min_s": min(runs), "max_s": max(runs), "cpu_median_s": statistics.median(cpu),
                         "runs": runs, "cpu": cpu})
    meta = {"python": platform.python_version(), "cpus": os.cpu_count(), "n": args.n,
            "load_avg": os.getloadavg() if hasattr(os, "getloadavg") else None}
    if args.json:
        print(json.dumps({"meta": meta, "rows": rows}, indent=2))
        return 0
    print(f"python {meta['python']}, {meta['cpus']} CPUs, n={args.n}, load average after: "
          + (", ".join(f"{x:.1f}" for x in meta["load_avg"]) if meta["load_avg"] else "-"))
    print()
    print("| command | median wall | min | max | first run | median CPU (user+sys) |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| `{r['command']}` | {r['median_s']:.2f} s | {r['min_s']:.2f} s | {r['max_s']:.2f} s | "
              f"{r['first_s']:.2f} s | {r['cpu_median_s']:.2f} s |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
