"""Benchmark: fingerprint a synthetic inductor cache, cold and incremental, next to du + sha256sum.

    python benchmarks/cache_fingerprint.py                      # 20,000 files / 1 GiB (the issue's size)
    python benchmarks/cache_fingerprint.py --files 500 --bytes 8M --repeat 1 --no-cli   # smoke run

The cache is laid out like a real one (fxgraph / aotautograd pickles carrying a system-key line,
two-character codegen folders with .py/.cpp/.so), file sizes log-normal, contents random (so nothing
compresses or dedups). Files get an mtime one hour in the past, as a cache written by a training run
and fingerprinted later would; files modified within 2 s of a fingerprint are re-hashed next time by
design (the stat index's "racily clean" rule).

Measured, each `--repeat` times (min and median reported):
- cold: `fingerprint()` with no stat index (every file read and hashed); the page cache is warm
  (the files were just written or read), as is the baseline's.
- incremental: `fingerprint()` again, unchanged cache (stat only).
- incremental after rewriting 1% of the files.
- baseline: `du -s DIR`, then `sha256sum` of every file (serial, and `xargs -P <cores>`).
- per-process costs the library call does not include: importing torch and `system_key()`; and the
  CLI end to end (`compilewatch cache fingerprint`, incremental), unless `--no-cli`.

Results: `cache_fingerprint.json` and `cache_fingerprint.md` in `--out` (default $OUT, else printed only).
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

from compilewatch.cache.content import fingerprint as fp_mod
from compilewatch.cache.local.layout import SIDECAR
from compilewatch.cache.local.manage import parse_size


def build(root: Path, n_files: int, total: int, seed: int = 0) -> int:
    """Write the synthetic cache; returns the bytes written."""
    from compilewatch import torchinfo

    rng = random.Random(seed)
    raw = [rng.lognormvariate(9.5, 1.6) for _ in range(n_files)]
    scale = total / sum(raw)
    sizes = [max(1, int(x * scale)) for x in raw]
    pool = os.urandom(8 << 20)
    stamp = f"[abc] system_info[hash]: {torchinfo.system_key()}".encode()
    past = time.time() - 3600
    written = 0
    for i, size in enumerate(sizes):
        kind = i % 12
        h = f"{rng.getrandbits(128):032x}{i:019d}"  # 51 characters, like torch's base32 sha256 keys
        if kind < 2:  # torch's layout: <2 chars after the prefix letter>/<prefix letter + key>
            rel = f"fxgraph/{h[:2]}/f{h}/e{h[:20]}"
        elif kind == 2:
            rel = f"aotautograd/a{h}/e{h[:20]}"
        else:
            rel = f"{h[:2]}/c{h}." + ("py", "cpp", "so")[kind % 3]
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        off = rng.randrange(0, len(pool) - min(size, len(pool)) + 1)
        with open(p, "wb") as fh:
            if kind <= 2:
                fh.write(b"\x80\x04" + stamp)
            left = size
            while left > 0:
                chunk = pool[off:off + min(left, len(pool) - off)] or pool[: min(left, len(pool))]
                fh.write(chunk)
                left -= len(chunk)
                off = 0
        os.utime(p, (past, past))
        written += p.stat().st_size
    return written


def timed(fn, repeat: int) -> list[float]:
    out = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


def sh(cmd: str) -> float:
    t = time.perf_counter()
    subprocess.run(cmd, shell=True, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - t


def stats(xs: list[float]) -> dict:
    return {"min_s": round(min(xs), 4), "median_s": round(statistics.median(xs), 4), "runs": [round(x, 4) for x in xs]}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--files", type=int, default=20_000)
    ap.add_argument("--bytes", default="1G", help="total size, e.g. 1G, 200M")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--dir", type=Path, help="where to build the cache (default: a temp dir, removed after)")
    ap.add_argument("--out", type=Path, default=os.environ.get("OUT"), help="results dir (default $OUT)")
    ap.add_argument("--no-cli", action="store_true", help="skip the end-to-end CLI timing")
    args = ap.parse_args(argv)

    from compilewatch import torchinfo

    t = time.perf_counter()
    torchinfo.torch_module()
    import_s = time.perf_counter() - t
    t = time.perf_counter()
    torchinfo.system_key()
    system_key_s = time.perf_counter() - t

    tmp = None
    if args.dir is None:
        tmp = Path(tempfile.mkdtemp(prefix="cw-bench-"))
        root = tmp / "inductor-cache"
    else:
        root = args.dir
        if root.exists():
            shutil.rmtree(root)
    try:
        t = time.perf_counter()
        total = build(root, args.files, parse_size(args.bytes))
        build_s = time.perf_counter() - t
        index = root / SIDECAR

        def cold():
            shutil.rmtree(index, ignore_errors=True)
            fp_mod.fingerprint(root)

        fp_mod.fingerprint(root, use_index=False)  # warm the page cache like the baseline's first pass
        cold_runs = timed(cold, args.repeat)
        fp_mod.fingerprint(root)  # leaves a fresh index
        incr_runs = timed(lambda: fp_mod.fingerprint(root), args.repeat)
        last = fp_mod.fingerprint(root)
        assert last.hashed == 0 and last.files == args.files, (last.hashed, last.files)

        files = sorted(p for p in root.rglob("*") if p.is_file() and SIDECAR not in p.parts)
        touched = files[:: max(1, len(files) // max(1, args.files // 100))][: max(1, args.files // 100)]
        for p in touched:
            with open(p, "r+b") as fh:
                fh.write(b"\x80\x05")
            os.utime(p, (time.time() - 60, time.time() - 60))
        changed = fp_mod.fingerprint(root)
        changed_s = changed.duration_s

        cores = os.cpu_count() or 1
        du_runs = [sh(f"du -s {root}") for _ in range(args.repeat)]
        sha_runs = [sh(f"find {root} -type f -print0 | xargs -0 sha256sum") for _ in range(args.repeat)]
        sha_par_runs = [sh(f"find {root} -type f -print0 | xargs -0 -n 500 -P {cores} sha256sum")
                        for _ in range(args.repeat)]
        cli = None
        if not args.no_cli:
            env = dict(os.environ, PYTHONPATH=str(ROOT))
            cmd = [sys.executable, "-m", "cli.main", "cache", "fingerprint", "--dir", str(root), "--json"]
            cli_runs = []
            for _ in range(args.repeat):
                t = time.perf_counter()
                subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL, cwd=ROOT)
                cli_runs.append(time.perf_counter() - t)
            cli = stats(cli_runs)
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)

    result = {
        "benchmark": "cache_fingerprint",
        "command": "python benchmarks/cache_fingerprint.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": {"cpu_count": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                    "cpu": _cpu_model(), "load_avg_1m": round(os.getloadavg()[0], 2)},
        "cache": {"files": args.files, "bytes": total, "build_s": round(build_s, 2)},
        "fingerprint_cold": stats(cold_runs),
        "fingerprint_incremental": stats(incr_runs),
        "fingerprint_after_1pct_changed": {"s": round(changed_s, 4), "hashed": changed.hashed},
        "du_s": stats(du_runs),
        "sha256sum_serial": stats(sha_runs),
        "sha256sum_parallel": stats(sha_par_runs),
        "du_plus_sha256sum_serial_min_s": round(min(du_runs) + min(sha_runs), 4),
        "per_process": {"import_torch_s": round(import_s, 3), "system_key_s": round(system_key_s, 3)},
        "cli_incremental_end_to_end": cli,
        "goals": {"cold_s": 2.0, "incremental_s": 0.3},
    }
    md = _markdown(result)
    print(md)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "cache_fingerprint.json").write_text(json.dumps(result, indent=2) + "\n")
        (args.out / "cache_fingerprint.md").write_text(md + "\n")
    return result


def _cpu_model() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def _markdown(r: dict) -> str:
    c = r["cache"]
    rows = [
        ("compilewatch fingerprint, cold (no stat index)", r["fingerprint_cold"]),
        ("compilewatch fingerprint, incremental (unchanged)", r["fingerprint_incremental"]),
        ("`du -s`", r["du_s"]),
        ("`sha256sum` every file, serial", r["sha256sum_serial"]),
        (f"`sha256sum` every file, `xargs -P {r['machine']['cpu_count']}`", r["sha256sum_parallel"]),
    ]
    lines = [
        f"{c['files']} files, {c['bytes'] / 2**30:.2f} GiB; {r['machine']['cpu_count']} cores ({r['machine']['cpu']}), "
        f"Python {r['machine']['python']}, load average {r['machine']['load_avg_1m']} at the end",
        "",
        "| what | min | median |",
        "|---|---|---|",
    ]
    lines += [f"| {name} | {s['min_s']:.3f} s | {s['median_s']:.3f} s |" for name, s in rows]
    ch = r["fingerprint_after_1pct_changed"]
    lines.append(f"| compilewatch fingerprint after rewriting 1% ({ch['hashed']} files re-hashed) | {ch['s']:.3f} s | |")
    lines.append(f"| `du -s` + serial `sha256sum` | {r['du_plus_sha256sum_serial_min_s']:.3f} s | |")
    pp = r["per_process"]
    lines.append(f"| per process, not in the rows above: import torch / `system_key()` | "
                 f"{pp['import_torch_s']:.2f} s / {pp['system_key_s']:.2f} s | |")
    if r["cli_incremental_end_to_end"]:
        s = r["cli_incremental_end_to_end"]
        lines.append(f"| `compilewatch cache fingerprint --json`, incremental, end to end | {s['min_s']:.2f} s | "
                     f"{s['median_s']:.2f} s |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
