"""Separate vs fused projections at the Qwen3-8B training shapes: q/k/v as one GEMM, gate/up as one, and the
five drafter layers' context k/v as one.

Each case runs the projections of one layer as they are written (one `F.linear` a weight) and fused (one
`F.linear` over the weights concatenated, then split), forward only for the frozen target, forward and
backward (input and weight gradients) for the drafter. The fused drafter case concatenates its weights in
the timed region, as a training step would (its weights change every step). Median ms of --iters by CUDA
events, queued back to back. Results: <out>/gemm_fusion.json (--out, default $OUT, else ./bench-out).

GPU (H200):  python benchmarks/gemm_fusion.py --out $OUT
CPU smoke:   python benchmarks/gemm_fusion.py --small --iters 1 --warmup 0
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cuda_timing import median_ms  # noqa: E402


def case(rows: int, hidden: int, widths: list[int], grad: bool, dev, dtype, iters: int, warmup: int) -> dict:
    x = torch.randn(rows, hidden, device=dev, dtype=dtype, requires_grad=grad)
    ws = [(torch.randn(n, hidden, device=dev, dtype=dtype) * 0.02).requires_grad_(grad) for n in widths]
    gouts = [torch.randn(rows, n, device=dev, dtype=dtype) for n in widths] if grad else None

    def separate():
        outs = [F.linear(x, w) for w in ws]
        if grad:
            torch.autograd.backward(outs, gouts)

    def fused():
        outs = F.linear(x, torch.cat(ws)).split(widths, dim=-1)
        if grad:
            torch.autograd.backward(list(outs), gouts)

    with torch.set_grad_enabled(grad):
        a, b = median_ms(separate, iters, warmup), median_ms(fused, iters, warmup)
    flop = 2 * rows * hidden * sum(widths) * (3 if grad else 1)
    return {"rows": rows, "widths": widths, "grad": grad, "separate_ms": round(a, 3), "fused_ms": round(b, 3),
            "saved_ms": round(a - b, 3), "separate_tflops": round(flop / a / 1e9, 1), "fused_tflops": round(flop / b / 1e9, 1)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=os.environ.get("OUT", "bench-out"))
    p.add_argument("--small", action="store_true", help="tiny shapes (CPU smoke test)")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    a = p.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    s = 64 if a.small else 1
    h, q, kv, inter, layers = 4096 // s, 4096 // s, 1024 // s, 12288 // s, 5
    # rows: the target's 4 × 3,072 a micro-batch; the drafter's block rows and context rows of one chunk
    # (uniform: 2 rows of 512 blocks × 16; mixed: the 15,104 / 6,144 of docs/benchmarks.md session 7)
    cases = [("target qkv", 12288 // s, [q, kv, kv], False), ("target gate/up", 12288 // s, [inter, inter], False),
             ("drafter block qkv", 16384 // s, [q, kv, kv], True), ("drafter block gate/up", 16384 // s, [inter, inter], True),
             ("drafter mixed qkv", 15104 // s, [q, kv, kv], True), ("drafter mixed gate/up", 15104 // s, [inter, inter], True),
             ("drafter context k/v, one layer", 6144 // s, [kv, kv], True),
             ("drafter context k/v, all layers", 6144 // s, [kv] * (2 * layers), True)]
    results = [{"case": name, **case(r, h, w, g, dev, dtype, a.iters, a.warmup)} for name, r, w, g in cases]
    for r in results:
        print(f"{r['case']:34s} separate {r['separate_ms']:8.3f} ms ({r['separate_tflops']:6.1f} TFLOP/s)  "
              f"fused {r['fused_ms']:8.3f} ms ({r['fused_tflops']:6.1f})  saved {r['saved_ms']:.3f} ms")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gemm_fusion.json").write_text(json.dumps({"device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu",
                                                      "torch": torch.__version__, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
