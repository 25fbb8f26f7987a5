"""Benchmark `compilewatch lock` and `compilewatch diff-env` on an environment of ~500 distributions.

Goal (issue #5): lock <= 1.5 s, diff <= 0.2 s. The real environment is topped up with synthetic
distributions (dist-info folders with METADATA, RECORD and, for some, PEP 610 direct_url.json) so
the scan sees `--dists` in all. Measured:

- scan: `envlock.scan_distributions` over all of them (median of --repeat runs);
- lock, in process: `envlock.snapshot()` cold (first call: inductor import + system key) and warm,
  after `import torch` (timed on its own: every torch-facing command pays it);
- lock, CLI: `compilewatch lock -o FILE` as a fresh process, end to end (interpreter, torch import,
  system key, NVML, scan, write);
- diff: `envdiff.diff_files` of two such locks and of two 500-line pip freezes that differ like the
  seeds (cu128 -> cu130, transformers, ~50 other updates/adds/removes), parse included; and the CLI
  `compilewatch diff-env` as a fresh process.

    python benchmarks/env_lock_diff.py --out results/      # JSON + Markdown into results/
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def synth_site(site: Path, n: int, seed: int = 0) -> None:
    rng = random.Random(seed)
    for i in range(n):
        name, version = f"synthpkg-{i:04d}", f"{rng.randint(0, 9)}.{rng.randint(0, 30)}.{rng.randint(0, 9)}"
        d = site / f"synthpkg_{i:04d}-{version}.dist-info"
        d.mkdir(parents=True)
        (d / "METADATA").write_text(
            f"Metadata-Version: 2.4\nName: {name}\nVersion: {version}\nSummary: synthetic distribution {i}\n"
            "Requires-Python: >=3.10\nRequires-Dist: numpy>=1.26\nRequires-Dist: packaging\n\n" + "x" * 2000)
        (d / "RECORD").write_text("".join(f"synthpkg_{i:04d}/m{j}.py,sha256=abc,100\n" for j in range(20)))
        (d / "INSTALLER").write_text("pip\n")
        if i % 10 == 0:
            (d / "direct_url.json").write_text(json.dumps(
                {"url": f"https://example.org/synth/{name}.git", "vcs_info": {"vcs": "git", "commit_id": f"{i:040x}"}}))


def timed(fn, repeat: int) -> tuple[float, list[float]]:
    runs = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        runs.append(time.perf_counter() - t)
    return statistics.median(runs), runs


def freeze_pair(n: int) -> tuple[str, str]:
    """Two freezes of n lines that differ like the seeds plus ~50 ordinary changes."""
    from tests.fixtures.env.make_fixtures import COMMON, CU12, CU13, EXTRAS

    base = {f"synthpkg-{i:04d}": f"1.{i % 30}.0" for i in range(n - len(COMMON) - len(CU12) - 2)}
    old = {**base, **COMMON, **CU12, "torch": "2.11.0+cu128", "transformers": "5.6.0"}
    new = {**base, **COMMON, **CU13, **EXTRAS, "torch": "2.11.0+cu130", "transformers": "5.8.1"}
    names = sorted(base)
    for name in names[:30]:
        new[name] = "2.0.0"
    for name in names[30:40]:
        del new[name]
    for i in range(10):
        new[f"newpkg-{i}"] = "0.1.0"

    def text(d):
        return "".join(f"{k}=={v}\n" for k, v in sorted(d.items()))

    return text(old), text(new)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "bench-out"), help="directory for results (default $OUT)")
    ap.add_argument("--dists", type=int, default=500, help="total distributions to scan (real + synthetic)")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--skip-cli", action="store_true", help="skip the fresh-process CLI timings (quick check)")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="cw-envbench-"))
    try:
        return run(args, out, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def run(args, out: Path, work: Path) -> int:
    from compilewatch.env import diff as envdiff, lock as envlock
    from compilewatch.fsutil import atomic_write_json

    real = len(envlock.scan_distributions())
    site = work / "site"
    synth_site(site, max(0, args.dists - real))
    paths = [str(site), *sys.path]
    results: dict = {"machine": f"{platform.node() or '?'}: {platform.processor() or platform.machine()}, "
                                f"{os.cpu_count()} cores, Python {platform.python_version()}",
                     "distributions": len(envlock.scan_distributions(paths))}

    results["scan_s"], _ = timed(lambda: envlock.scan_distributions(paths), args.repeat)
    t = time.perf_counter()
    import torch

    results["import_torch_s"] = time.perf_counter() - t
    results["torch"] = torch.__version__
    t = time.perf_counter()
    lock = envlock.snapshot(paths=paths)
    results["lock_cold_s"] = time.perf_counter() - t  # system key + inductor import on first call
    results["lock_warm_s"], _ = timed(lambda: envlock.snapshot(paths=paths), args.repeat)

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(ROOT)])}
    lock_file = work / "env.lock.json"
    cli_runs = []
    for _ in range(0 if args.skip_cli else max(1, args.repeat // 2)):
        t = time.perf_counter()
        subprocess.run([sys.executable, "-m", "cli.main", "lock", "-o", str(lock_file)], env=env, check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        cli_runs.append(time.perf_counter() - t)
    results["lock_cli_s"] = statistics.median(cli_runs) if cli_runs else None

    # diff: two locks (the second: seeds-like changes) and two freezes
    old_lock, new_lock = work / "old.lock.json", work / "new.lock.json"
    atomic_write_json(old_lock, lock)
    changed = [d if i % 17 else type(d)(name=d.name, version=d.version + ".post1") for i, d in
               enumerate(lock.distributions)]
    import dataclasses

    atomic_write_json(new_lock, dataclasses.replace(lock, distributions=tuple(changed[:-10])))
    results["diff_lock_s"], _ = timed(lambda: envdiff.diff_files(old_lock, new_lock), args.repeat)
    old_txt, new_txt = freeze_pair(args.dists)
    (work / "old.txt").write_text(old_txt)
    (work / "new.txt").write_text(new_txt)
    d = envdiff.diff_files(work / "old.txt", work / "new.txt")
    results["diff_freeze_changes"] = d.counts
    results["diff_freeze_s"], _ = timed(lambda: envdiff.diff_files(work / "old.txt", work / "new.txt"), args.repeat)
    results["diff_cli_s"] = None
    if not args.skip_cli:
        t = time.perf_counter()
        subprocess.run([sys.executable, "-m", "cli.main", "diff-env", str(work / "old.txt"), str(work / "new.txt")],
                       env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        results["diff_cli_s"] = time.perf_counter() - t

    (out / "env_lock_diff.json").write_text(json.dumps(results, indent=2) + "\n")
    md = render(results)
    (out / "env_lock_diff.md").write_text(md)
    print(md)
    return 0


def render(r: dict) -> str:
    def ms(s):
        if s is None:
            return "skipped"
        return f"{s * 1000:.0f} ms" if s < 1 else f"{s:.2f} s"

    rows = [
        ("scan distributions (importlib.metadata)", r["scan_s"]),
        ("`import torch` (paid by any torch-facing command)", r["import_torch_s"]),
        ("lock in process, first call (inductor import + system key)", r["lock_cold_s"]),
        ("lock in process, warm", r["lock_warm_s"]),
        ("`compilewatch lock -o FILE`, fresh process, end to end", r["lock_cli_s"]),
        ("diff two locks (parse + diff)", r["diff_lock_s"]),
        ("diff two pip freezes (parse + diff)", r["diff_freeze_s"]),
        ("`compilewatch diff-env` freeze vs freeze, fresh process", r["diff_cli_s"]),
    ]
    lines = [f"{r['machine']}; torch {r['torch']}; {r['distributions']} distributions.", "",
             "| step | time |", "|---|---|"]
    lines += [f"| {name} | {ms(v)} |" for name, v in rows]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
