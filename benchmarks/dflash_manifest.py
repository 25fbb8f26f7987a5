"""Benchmark: what checkpoint checksums cost (dflash/checkpoint/manifest.py record + check).

    python benchmarks/dflash_manifest.py                    # 15 GiB, about the Qwen3-8B recipe's checkpoint
    python benchmarks/dflash_manifest.py --gib 1 --repeat 1 # smoke run

A checkpoint-sized directory (a training_state.pt of 3/4 of the bytes and a model.safetensors of the
rest, random contents) is written once; then `record` (what every save adds, the files just written:
page cache warm) and `check` (what --resume and eval add) are timed `--repeat` times, next to a plain
read of the same bytes (the floor: the read torch.load does anyway) and xxh3-128 of an in-memory
buffer (the hash alone). Cold-cache numbers need root (`--drop-caches` writes /proc/sys/vm/drop_caches).

Results: `dflash_manifest.json` in `--out` (default $OUT, else printed only).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dflash.checkpoint import manifest  # noqa: E402

FILES = (("training_state.pt", 0.75), ("model.safetensors", 0.25))


def _write(directory: Path, total: int) -> None:
    block = os.urandom(16 << 20)
    for name, share in FILES:
        left = int(total * share)
        with open(directory / name, "wb") as fh:
            while left > 0:
                n = min(left, len(block))
                fh.write(block[:n])
                left -= n


def _plain_read(directory: Path) -> None:
    buf = bytearray(1 << 20)
    for name, _ in FILES:
        with open(directory / name, "rb", buffering=0) as fh:
            while fh.readinto(buf):
                pass


def _drop_caches() -> None:
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as fh:
        fh.write("3\n")


def _timed(fn, repeat: int, cold: bool) -> list[float]:
    out = []
    for _ in range(repeat):
        if cold:
            _drop_caches()
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gib", type=float, default=15.0)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--dir", default=None, help="where to write the files (default: a temp dir)")
    ap.add_argument("--drop-caches", action="store_true", help="time check cold too (root only)")
    ap.add_argument("--out", default=os.environ.get("OUT"))
    args = ap.parse_args()
    import xxhash

    total = int(args.gib * (1 << 30))
    d = Path(tempfile.mkdtemp(prefix="dflash-manifest-", dir=args.dir))
    try:
        _write(d, total)
        names = [n for n, _ in FILES]
        buf = os.urandom(256 << 20)
        t0 = time.perf_counter()
        xxhash.xxh3_128(buf).hexdigest()
        mem_rate = len(buf) / (time.perf_counter() - t0) / (1 << 30)
        rows = {
            "record": _timed(lambda: manifest.record(d, names), args.repeat, False),
            "check": _timed(lambda: manifest.check(d), args.repeat, False),
            "plain_read": _timed(lambda: _plain_read(d), args.repeat, False),
        }
        if args.drop_caches:
            rows["check_cold"] = _timed(lambda: manifest.check(d), args.repeat, True)
            rows["plain_read_cold"] = _timed(lambda: _plain_read(d), args.repeat, True)
        result = {
            "bytes": total, "repeat": args.repeat, "cpu": platform.processor() or platform.machine(),
            "cores": os.cpu_count(), "python": sys.version.split()[0], "xxhash": xxhash.VERSION,
            "xxh3_in_memory_gib_s": round(mem_rate, 2),
            **{k: {"min_s": round(min(v), 3), "median_s": round(statistics.median(v), 3),
                   "gib_s": round(total / min(v) / (1 << 30), 2)} for k, v in rows.items()},
        }
    finally:
        shutil.rmtree(d, ignore_errors=True)
    print(json.dumps(result, indent=2))
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "dflash_manifest.json").write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
