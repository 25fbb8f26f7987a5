"""Is `picklescan.scan` linear in the pickle's size? Time vs size for pickles crafted to be slow.

Issue 31 measured `cache verify`/`load` > 60 s on a crafted 300 KB pickle: the scan looked inside a
tuple every time the tuple was taken off its model stack, and a tuple fetched from the memo again
and again was looked into again and again (quadratic). Each shape below is built at growing sizes;
a linear scan keeps `us_per_kb` flat.

- `memo_tuple`: one tuple of N items, then N times (BINGET it, POP): the issue-31 shape.
- `memo_tuple_call`: the same tuple handed N times to an allowed class's constructor (NEWOBJ).
- `nested_tuples`: tuples nested N deep.
- `many_marks`: N (MARK, item, TUPLE) groups; `real_like`: a dict of N small lists (plain data).

    python benchmarks/picklescan_linear.py --out /tmp/pl.json [--max-kb 2048] [--streamed]
Writes JSON: per shape, size in bytes -> seconds; prints a table. `--streamed` also scans each pickle
from a file (`picklescan.scan_file`, what `cache load` and `cache verify` of a large member do) and
reports both times. Exit 1 when the largest size of any
shape takes more than 20x the time per byte of its smallest (the scan went superlinear).
"""

from __future__ import annotations

import argparse
import json
import pickle
import struct
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from compilewatch.cache.trust import picklescan


def _memo_tuple(n: int, call: bool) -> bytes:
    items = b"".join(b"K\x01" for _ in range(n))  # BININT1 1
    head = b"\x80\x04(" + items + b"t" + b"\x94"  # MARK ... TUPLE, MEMOIZE (index 0)
    if call:
        g = b"\x8c\x1btorch._inductor.output_code\x94\x8c\x0fCompiledFxGraph\x94\x93\x94"  # memo 1, 2, 3
        body = g + b"0" + b"".join(b"h\x03h\x00\x810" for _ in range(n))  # BINGET cls, BINGET tuple, NEWOBJ, POP
    else:
        body = b"".join(b"h\x000" for _ in range(n))  # BINGET 0, POP
    return head + body + b"N."


def _nested(n: int) -> bytes:
    return b"\x80\x04" + b"N\x85" * n + b"."  # NONE, TUPLE1, TUPLE1, ...


def _marks(n: int) -> bytes:
    return b"\x80\x04" + b"(K\x01t0" * n + b"N."


def _real_like(n: int) -> bytes:
    return pickle.dumps({f"k{i}": [i, float(i), "s"] for i in range(n)}, protocol=4)


SHAPES = {
    "memo_tuple": lambda n: _memo_tuple(n, False),
    "memo_tuple_call": lambda n: _memo_tuple(n, True),
    "nested_tuples": _nested,
    "many_marks": _marks,
    "real_like": _real_like,
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--max-kb", type=int, default=2048)
    ap.add_argument("--streamed", action="store_true", help="also time scan_file on the pickle written to a file")
    args = ap.parse_args()
    streamed: dict[str, dict[int, float]] = {}
    tmp = Path(tempfile.mkdtemp()) / "p.pkl"
    picklescan.scan(_real_like(10))  # warm the name resolution (imports torch modules once)
    results: dict[str, dict[int, float]] = {}
    worst = 0.0
    for shape, make in SHAPES.items():
        results[shape] = {}
        picklescan.scan(make(10))  # warm: the first scan of a shape resolves its globals (imports torch modules)
        n = 1000
        while True:
            blob = make(n)
            if len(blob) > args.max_kb * 1024:
                break
            t0 = time.perf_counter()
            r = picklescan.scan(blob)
            dt = time.perf_counter() - t0
            results[shape][len(blob)] = dt
            line = f"{shape:16} {len(blob) / 1024:9.0f} KB {dt:8.3f} s {dt / len(blob) * 1e6 * 1024:8.1f} us/KB ok={r.ok}"
            if args.streamed:
                tmp.write_bytes(blob)
                t0 = time.perf_counter()
                with open(tmp, "rb") as fh:
                    rs = picklescan.scan_file(fh, len(blob))
                ds = time.perf_counter() - t0
                assert rs == r, (shape, len(blob))
                streamed.setdefault(shape, {})[len(blob)] = ds
                line += f"   streamed {ds:8.3f} s ({ds / dt:.2f}x)"
            print(line)
            n *= 4
        sizes = sorted(results[shape])
        if len(sizes) >= 2:
            small, big = sizes[0], sizes[-1]
            ratio = (results[shape][big] / big) / max(results[shape][small] / small, 1e-12)
            worst = max(worst, ratio)
    out = {"python": sys.version.split()[0], "results": {k: {str(s): t for s, t in v.items()} for k, v in results.items()},
           "worst_per_byte_ratio": worst,
           "streamed": {k: {str(s): t for s, t in v.items()} for k, v in streamed.items()}}
    if args.out:
        args.out.write_text(json.dumps(out, indent=2))
    print(f"worst per-byte time ratio, largest vs smallest: {worst:.1f}x")
    return 1 if worst > 20 else 0


if __name__ == "__main__":
    raise SystemExit(main())
