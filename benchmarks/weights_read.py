"""How fast a target's safetensors reach the GPU, by read method, from the disk and from the page cache.

The target is the random Qwen3-8B-shaped one of benchmarks/dflash_startup.py (16.4 GB in 4 shards; its
`--work` directory is shared, so the two benchmarks build it once). Each method runs twice: first with the
files dropped from the page cache (posix_fadvise DONTNEED after fsync: the read comes from the disk, as on
a fresh machine), then again with them cached. Methods:

- `mapped`: safetensors' memory mapping, each tensor copied to the GPU from 4 threads (the read before
  the direct one; `dflash.model.weights._read_mapped`);
- `direct-N`: `dflash.model.weights.read_weights` (chunks read with preadv by N threads into pinned
  buffers, copied on to one device allocation per file), N in --readers;
- `disk-N`: the files read by N threads in CHUNK pieces into host memory only (`dflash.model.prefetch`,
  what `dflash train` starts before torch): what the disk gives, for scale.

The direct read's tensors are checked equal to the mapped read's (every tensor, on the GPU).

GPU (H200):  python benchmarks/weights_read.py --out $OUT
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def evict(paths: list[Path]) -> None:
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=os.environ.get("OUT", "bench-out"))
    p.add_argument("--work", default="/tmp/dflash-startup", help="dflash_startup.py's work dir (its target)")
    p.add_argument("--readers", default="4,8,16", help="reader thread counts of the direct and disk-only reads")
    p.add_argument("--no-mapped", action="store_true", help="skip the mapped read (and the equality check)")
    a = p.parse_args(argv)
    import torch

    from dflash.model import weights
    from dflash.model.prefetch import Prefetch
    from dflash_startup import make_target

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    target = Path(a.work) / "target"
    target.parent.mkdir(parents=True, exist_ok=True)
    build_s = make_target(target, small=False)
    files = weights.safetensors_files(target)
    assert files, f"no safetensors in {target}"
    total = sum(f.stat().st_size for f in files)
    dev = torch.device("cuda")
    torch.ones(1, device=dev)  # the CUDA context, outside the timings
    readers = [int(x) for x in a.readers.split(",") if x]
    methods: list[tuple[str, object]] = []
    if not a.no_mapped:
        methods.append(("mapped", lambda: weights._read_mapped(files, dev, None)))
    for n in readers:
        methods.append((f"direct-{n}", lambda n=n: _direct(weights, files, dev, n)))
    for n in readers:
        methods.append((f"disk-{n}", lambda n=n: Prefetch(files, readers=n, chunk=weights.CHUNK).start().done.wait()))
    rows, reference = [], None
    for name, fn in methods:
        for cached in (False, True):
            if not cached:
                evict(files)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            got = fn()
            torch.cuda.synchronize()
            s = time.perf_counter() - t0
            same = None
            if isinstance(got, dict):
                if name == "mapped":
                    reference = got if not cached else reference
                elif reference is not None:
                    same = set(got) == set(reference) and all(torch.equal(got[k], reference[k]) for k in reference)
                if got is not reference:
                    got.clear()
            del got
            torch.cuda.empty_cache()
            row = {"method": name, "page_cache": "cached" if cached else "dropped", "seconds": round(s, 3),
                   "GB_per_s": round(total / s / 1e9, 2), "same_as_mapped": same}
            rows.append(row)
            print(json.dumps(row), flush=True)
    result = {"machine": os.uname().nodename, "argv": sys.argv, "bytes": total, "files": len(files),
              "target_build_s": round(build_s, 1), "chunk": weights.CHUNK, "rows": rows,
              "torch": torch.__version__, "gpu": torch.cuda.get_device_name(dev)}
    (out / "weights_read.json").write_text(json.dumps(result, indent=1) + "\n")
    return 0


def _direct(weights, files, dev, n: int):
    before = weights.READERS
    weights.READERS = n
    try:
        return weights.read_weights(files, dev)
    finally:
        weights.READERS = before


if __name__ == "__main__":
    raise SystemExit(main())
