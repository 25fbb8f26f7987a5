"""The frozen LM head + CE (dflash.model.head_ce) at Qwen3-8B shapes, by the rows of a chunk.

`head_cross_entropy` runs the head in row chunks (one GEMM for the logits, the CE kernel, and one GEMM for
the hidden states' gradient a chunk). How many rows a chunk holds decides the GEMMs' shapes: cuBLAS tiles
the rows by 128-256, so a chunk of 1,707 rows (the default's near-equal split of 15,360) leaves a part-filled
row of tiles in every chunk, and the backward GEMM (rows × 4,096 out, 151,936 deep) has few tiles to spread
over the 132 SMs. Times the whole op, forward and backward, over a drafter chunk's rows (15,360: uniform
data, 512 blocks × 2 rows × 15 slots; 14,160: the mixed data's chunk) for each `--chunk-rows`, and the two
GEMMs alone at each chunk size. Median ms of --iters by CUDA events. Results: <out>/head_chunks.json.

GPU (H200):  python benchmarks/head_chunks.py --out $OUT
CPU smoke:   python benchmarks/head_chunks.py --small --iters 1 --warmup 0
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from cuda_timing import median_ms  # noqa: E402
from dflash.model.head_ce import CHUNK_ELEMENTS, chunk_bounds, head_cross_entropy  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=os.environ.get("OUT", "bench-out"))
    p.add_argument("--small", action="store_true", help="tiny shapes (CPU smoke test)")
    p.add_argument("--rows", default="15360,14160", help="total rows of the op (comma-separated)")
    p.add_argument("--chunk-rows", default="0,1536,1792,1920,2048,2304,2560,3072",
                   help="rows a chunk (0: the default, CHUNK_ELEMENTS // vocab)")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    a = p.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    s = 64 if a.small else 1
    hidden, vocab = 4096 // s, 151936 // s
    g = torch.Generator(device=dev).manual_seed(0)
    head = torch.nn.Linear(hidden, vocab, bias=False, device=dev, dtype=dtype).requires_grad_(False)
    with torch.no_grad():
        head.weight.copy_(torch.randn(vocab, hidden, device=dev, generator=g, dtype=dtype) * 0.02)
    default = max(1, CHUNK_ELEMENTS // vocab)
    results: dict = {"device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu", "torch": torch.__version__,
                     "default_chunk_rows": default, "op": [], "gemm": []}
    sizes = [int(c) or default for c in a.chunk_rows.split(",")]
    for total in (int(r) // s for r in a.rows.split(",")):
        h = torch.randn(total, hidden, device=dev, generator=g, dtype=dtype).requires_grad_()
        labels = torch.randint(0, vocab, (total,), device=dev, generator=g)
        w = torch.rand(total, device=dev, generator=g) + 0.1

        for rows in dict.fromkeys(sizes):
            def step(rows=rows):
                h.grad = None
                wce, _pred = head_cross_entropy(h, head, labels, w, chunk_rows=rows)
                wce.backward()

            ms = median_ms(step, a.iters, a.warmup)
            bounds = chunk_bounds(total, rows)
            results["op"].append({"rows": total, "chunk_rows": rows, "chunks": len(bounds),
                                  "rows_per_chunk": sorted({hi - lo for lo, hi in bounds}), "ms": round(ms, 3),
                                  "tflops": round(4 * total * hidden * vocab / ms / 1e9, 1)})
            print(json.dumps(results["op"][-1]), flush=True)
    for rows in sorted(set(sizes + [1707, 1573])):
        x = torch.randn(rows // s if a.small else rows, hidden, device=dev, generator=g, dtype=dtype)
        d = torch.randn(x.shape[0], vocab, device=dev, generator=g, dtype=dtype)
        fwd = median_ms(lambda: torch.nn.functional.linear(x, head.weight), a.iters, a.warmup)
        bwd = median_ms(lambda: torch.mm(d, head.weight), a.iters, a.warmup)
        flop = 2 * x.shape[0] * hidden * vocab
        results["gemm"].append({"rows": x.shape[0], "fwd_ms": round(fwd, 3), "bwd_ms": round(bwd, 3),
                                "fwd_tflops": round(flop / fwd / 1e9, 1), "bwd_tflops": round(flop / bwd / 1e9, 1)})
        print(json.dumps(results["gemm"][-1]), flush=True)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "head_chunks.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
