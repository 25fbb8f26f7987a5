"""Where a cold first DFlash training step spends its time, piece by piece, at Qwen3-8B shapes.

From whatever inductor cache TORCHINDUCTOR_CACHE_DIR points at (empty = cold), times the first and
second call of each compiled piece of the drafter step, in this order, each fwd+bwd where it trains:

  mask      build_masks (compiled create_block_mask)
  flex      compiled flex_attention at the step's shapes (Q 8192, KV 11264, 32/8 heads, head_dim 128)
  head_ce   the chunked head + CE (Triton per-chunk CE on CUDA)
  step      one whole drafter step with compiled layers (what is left: the decoder layers' compile)

After each piece: dynamo/inductor phase times (compilation_time_metrics, cumulative) and the inductor
and AOTAutograd cache counters. Results: <out>/dflash_cold.json.

GPU:  TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) python benchmarks/dflash_cold.py --out $OUT
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from dflash.model import mask as masks  # noqa: E402
from dflash.model.head_ce import head_cross_entropy  # noqa: E402
from dflash_step import Shape, build, compile_times  # noqa: E402


def counters() -> dict:
    from torch._dynamo.utils import counters as c

    return {k: dict(c[k]) for k in ("inductor", "aot_autograd", "frames") if c[k]}


def timed(fn, sync) -> float:
    sync()
    t = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - t


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=os.environ.get("OUT", "bench-out"))
    p.add_argument("--device", default="cuda")
    a = p.parse_args(argv)
    dev = torch.device(a.device)
    sync = lambda: torch.cuda.synchronize(dev)  # noqa: E731
    s = Shape()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    drafter, embed, head, ids, taps, anchors = build(s, dev)
    result: dict = {"cache_dir": os.environ.get("TORCHINDUCTOR_CACHE_DIR"), "build_s": time.perf_counter() - t0,
                    "pieces": []}
    q_len, kv_len = s.anchors * s.block, s.seq + s.anchors * s.block
    bf = torch.bfloat16
    q = torch.randn(1, s.heads, q_len, s.head_dim, device=dev, dtype=bf, requires_grad=True)
    k = torch.randn(1, s.kv_heads, kv_len, s.head_dim, device=dev, dtype=bf, requires_grad=True)
    v = torch.randn(1, s.kv_heads, kv_len, s.head_dim, device=dev, dtype=bf, requires_grad=True)
    rows = s.anchors * (s.block - 1)
    h = torch.randn(rows, s.hidden, device=dev, dtype=bf, requires_grad=True)
    labels = torch.randint(0, s.vocab, (rows,), device=dev)
    w = torch.rand(rows, device=dev)
    state: dict = {}

    def mask():
        state["m"] = masks.build_masks(anchors, s.seq, s.block, "flex")["full"]

    def flex():
        masks.flex_attend(q, k, v, state["m"]).sum().backward()

    def head_ce():
        head_cross_entropy(h, head, labels, w)[0].backward()

    def step():
        from dflash.data.dataset import Batch
        from dflash.model.loss import loss_weights
        from dflash.model.loss import drafter_loss

        if not drafter.layers_compiled:
            drafter.compile_layers(dynamic=False)
        batch = Batch(input_ids=ids, loss_mask=torch.ones_like(ids, dtype=torch.bool),
                      lengths=torch.full((1,), s.seq, device=dev), anchors=anchors,
                      anchor_valid=torch.ones_like(anchors, dtype=torch.bool))
        lw = loss_weights(s.block, 7.0, device=dev)
        drafter_loss(drafter, embed, head, taps, batch, mask_token_id=s.vocab - 1, weights=lw, denominator=1.0,
                     backend="flex", compute_dtype=bf).loss.backward()
        drafter.zero_grad(set_to_none=True)

    for name, fn in (("mask", mask), ("flex", flex), ("head_ce", head_ce), ("step", step)):
        first = timed(fn, sync)
        second = timed(fn, sync)
        piece = {"piece": name, "first_s": round(first, 3), "second_s": round(second, 4),
                 "compile_times_cumulative": compile_times(), "counters_cumulative": counters()}
        result["pieces"].append(piece)
        print(f"{name}: first {first:.1f} s, second {second * 1e3:.1f} ms", file=sys.stderr, flush=True)
        (out / "dflash_cold.json").write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
