"""Benchmark: the bounds of issue 31, measured on crafted inputs (CPU only, no torch import).

    python benchmarks/faults_bounds.py                      # the issue's sizes
    python benchmarks/faults_bounds.py --small              # a smoke run (seconds)

Each row: what was fed, what compilewatch answers (value or the refusal message), wall time and,
for the memory cases, peak Python memory (tracemalloc, a second untimed call), plus where useful the same input through the unguarded library
(`tarfile`, `tomllib`) at sizes small enough to finish, which shows the quadratic growth the guard
stops. Results: faults_bounds.json in --out (default $OUT, else printed only).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import platform
import sys
import tarfile
import tempfile
import time
import tracemalloc
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from compilewatch.errors import BadInput  # noqa: E402


def _call(fn) -> str:
    try:
        out = fn()
        return "ok" if out is None else str(out)[:120]
    except BadInput as e:
        return "refused: " + e.message[-160:]


def measure(fn, memory: bool = False):
    """Wall time of one untraced call; with `memory`, a second call under tracemalloc for the peak
    of Python allocations (tracemalloc slows pure-Python parsers several times: never timed)."""
    t0 = time.perf_counter()
    answer = _call(fn)
    row = {"answer": answer, "wall_s": round(time.perf_counter() - t0, 4)}
    if memory:
        tracemalloc.start()
        _call(fn)
        row["peak_mib"] = round(tracemalloc.get_traced_memory()[1] / 2**20, 1)
        tracemalloc.stop()
    return row


def pax_tar(payload: bytes) -> bytes:
    ti = tarfile.TarInfo("././@PaxHeader")
    ti.type, ti.size = tarfile.XHDTYPE, len(payload)
    m = tarfile.TarInfo("compilewatch-archive.json")
    return (ti.tobuf(format=tarfile.USTAR_FORMAT) + payload + b"\0" * (-len(payload) % 512)
            + m.tobuf(format=tarfile.USTAR_FORMAT) + b"\0" * 1024)


def unguarded_tar(data: bytes) -> None:
    with tarfile.open(fileobj=io.BytesIO(data), mode="r|") as t:
        list(t)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--out", default=os.environ.get("OUT"))
    a = ap.parse_args()
    from compilewatch.cache.archive import reader as archive
    from compilewatch.cache.local import manage
    from compilewatch.env.formats import load_env
    from compilewatch.env.formats.tomlutil import load_toml
    from tests.cache_helpers import big_cache

    rows: dict[str, dict] = {}
    tmp = Path(tempfile.mkdtemp(prefix="faults-bench-"))
    # PAX headers (CVE-2024-6232)
    pax_kb = 80 if not a.small else 8
    p = tmp / "cve.tar"
    p.write_bytes(pax_tar(b"1" * (pax_kb * 1000)))
    rows[f"archive.read_header, one {pax_kb} KB PAX header of digits"] = measure(lambda: archive.read_header(p), memory=True)
    for kb in ((5, 10, 20) if not a.small else (2, 4)):
        data = pax_tar(b"1" * (kb * 1000))
        rows[f"unguarded tarfile, {kb} KB PAX header of digits (Python {platform.python_version()})"] = \
            measure(lambda: unguarded_tar(data))
    # TOML dotted keys
    parts = 200_000 if not a.small else 20_000
    text = "a" + ".a" * parts + " = 1\n"
    rows[f"load_toml, one key of {parts} dotted parts ({len(text) // 1000} KB)"] = measure(lambda: load_toml(text, "x.toml"))
    import tomllib

    for n in ((2000, 4000, 8000) if not a.small else (1000, 2000)):
        t = "a" + ".a" * n + " = 1\n"
        rows[f"unguarded tomllib, one key of {n} dotted parts"] = measure(lambda: tomllib.loads(t) and None, memory=True)
    # YAML aliases
    y = tmp / "environment.yml"
    y.write_text('x: &a "' + "y" * 100_000 + '"\ndependencies:\n' + "  - *a\n" * (120_000 if not a.small else 5_000))
    rows[f"load_env, {y.stat().st_size // 1000} KB environment.yml aliasing a 100 KB string"] = measure(lambda: load_env(y), memory=True)
    # requirements
    n = 1_000_000 if not a.small else 20_000
    r = tmp / "big.txt"
    r.write_text("".join(f"pkg{i}==1.{i}.0\n" for i in range(n)))
    rows[f"load_env, {n} requirement lines"] = measure(lambda: f"{len(load_env(r).packages)} packages")
    line = tmp / "line.txt"
    line.write_text("a" * (60 << 20 if not a.small else 1 << 20))
    rows[f"load_env, one line of {line.stat().st_size >> 20} MiB"] = measure(lambda: load_env(line), memory=True)
    # prune
    files = 20_000 if not a.small else 1_000
    root = big_cache(tmp / "cache", files, size=8)
    rows[f"cache prune --dry-run, {files} files"] = measure(lambda: f"{len(manage.prune(0, root, dry_run=True).removed)} entries")
    rows[f"cache prune, {files} files"] = measure(lambda: f"{len(manage.prune(0, root).removed)} entries")
    result = {"machine": {"python": platform.python_version(), "cpus": os.cpu_count(), "platform": platform.platform(),
                          "load_avg": os.getloadavg()}, "rows": rows}
    text = json.dumps(result, indent=2)
    print(text)
    if a.out:
        Path(a.out).mkdir(parents=True, exist_ok=True)
        (Path(a.out) / "faults_bounds.json").write_text(text + "\n")


if __name__ == "__main__":
    main()
