"""The two attentions of a packed DFlash training step at Qwen3-8B shapes, each timed several ways.

Real packed micro-batches (benchmarks/dflash_mixed.py's mixed-length chats through the `qwen3_8b` recipe's
packer), random bf16 q/k/v of the model's head shapes (32 query heads, 8 K/V heads, head_dim 128):

- **target**: causal attention within each conversation of a packed micro-batch (R rows of 3,072 tokens),
  forward only (the target is frozen): `sdpa-dense-mask` is what transformers runs for packed rows (a dense
  block-diagonal causal bool mask), `varlen` is flash attention over the conversations
  (`torch.nn.attention.varlen.varlen_attn`), `flex-doc` a compiled flex_attention with a document mask;
  `sdpa-causal` (one causal run per row, ignoring the boundaries) is the uniform case's cost for scale.
  The outputs are compared with `varlen`'s on the real tokens.
- **drafter**: one chunk of the drafter's packed attention (its BlockMask, `dflash.model.mask.build_packed_masks`),
  forward + backward, with flex's default kernel options and with others (`--drafter-options`), each
  compiled on its own.

Median ms over --iters runs after --warmup, by CUDA events. Results: <out>/attention_kernels.json.

GPU (H200):  python benchmarks/attention_kernels.py --out $OUT
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128

DRAFTER_OPTIONS = {  # name -> flex kernel_options (fwd_/bwd_ prefixes: torch._inductor.kernel.flex)
    "default": {},
    "fwd128x128": {"fwd_BLOCK_M": 128, "fwd_BLOCK_N": 128, "fwd_num_warps": 8, "fwd_num_stages": 2},
    "bwd64x64": {"bwd_BLOCK_M1": 64, "bwd_BLOCK_N1": 64, "bwd_BLOCK_M2": 64, "bwd_BLOCK_N2": 64,
                 "bwd_num_warps": 4, "bwd_num_stages": 3},
    "bwd32x128": {"bwd_BLOCK_M1": 32, "bwd_BLOCK_N1": 128, "bwd_BLOCK_M2": 128, "bwd_BLOCK_N2": 32,
                  "bwd_num_warps": 4, "bwd_num_stages": 3},
    "bwd64x128s2": {"bwd_BLOCK_M1": 64, "bwd_BLOCK_N1": 128, "bwd_BLOCK_M2": 128, "bwd_BLOCK_N2": 64,
                    "bwd_num_warps": 8, "bwd_num_stages": 2},
    "bwd64x128w4": {"bwd_BLOCK_M1": 64, "bwd_BLOCK_N1": 128, "bwd_BLOCK_M2": 128, "bwd_BLOCK_N2": 64,
                    "bwd_num_warps": 4, "bwd_num_stages": 3},
    "bwd32x64s4": {"bwd_BLOCK_M1": 32, "bwd_BLOCK_N1": 64, "bwd_BLOCK_M2": 64, "bwd_BLOCK_N2": 32,
                   "bwd_num_warps": 4, "bwd_num_stages": 4},
    "fwd128x128w4": {"fwd_BLOCK_M": 128, "fwd_BLOCK_N": 128, "fwd_num_warps": 4, "fwd_num_stages": 3},
    # every query row of a packed DFlash mask sees at least its own block (no row is empty when Q is aligned)
    "safe": {"ROWS_GUARANTEED_SAFE": True},
}


def timed(fn, iters: int, warmup: int) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b))
    return round(statistics.median(out), 3)


def packed_batches(n: int, count: int, seed: int = 0):
    from dflash.config import apply_overrides, qwen3_8b
    from dflash_mixed import mixed_dataset

    cfg = apply_overrides(qwen3_8b(), {"data.path": "embedded:tiny-chat"})
    ds = mixed_dataset(n, 151936, cfg, uniform=False, seed=seed)
    plan = ds.epoch_plan(0)
    return cfg, [ds.make_batch(ix, 0) for ix in plan[:count]]


def doc_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """(R, L) -> (R*L,) a conversation index per token: a new one wherever the positions restart."""
    return (position_ids.reshape(-1) == 0).cumsum(0) - 1


def target_case(pos: torch.Tensor, iters: int, warmup: int) -> dict:
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    from torch.nn.attention.varlen import varlen_attn

    dev = torch.device("cuda")
    R, L = pos.shape
    pos = pos.to(dev)
    g = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(R, HEADS, L, HEAD_DIM, device=dev, dtype=torch.bfloat16, generator=g)
    k = torch.randn(R, KV_HEADS, L, HEAD_DIM, device=dev, dtype=torch.bfloat16, generator=g)
    v = torch.randn(R, KV_HEADS, L, HEAD_DIM, device=dev, dtype=torch.bfloat16, generator=g)
    doc = doc_ids(pos).view(R, L)
    causal = torch.ones(L, L, dtype=torch.bool, device=dev).tril()
    dense = (causal & (doc[:, :, None] == doc[:, None, :]))[:, None]  # (R, 1, L, L)
    starts = torch.nonzero(pos.reshape(-1) == 0).flatten()
    cu = torch.cat([starts, starts.new_tensor([R * L])]).to(torch.int32)
    lens = cu.diff()
    max_len = int(lens.max())
    qf, kf, vf = (t.transpose(1, 2).reshape(R * L, t.shape[1], HEAD_DIM) for t in (q, k, v))
    import inspect

    gqa = {"enable_gqa": True} if "enable_gqa" in inspect.signature(varlen_attn).parameters else {}
    doc_flat = doc.reshape(-1)

    def doc_causal(b, h, qi, ki):
        return (qi >= ki) & (doc_flat[qi] == doc_flat[ki])

    bm = create_block_mask(doc_causal, 1, 1, R * L, R * L, device=dev)
    flex = torch.compile(flex_attention, dynamic=False)
    q1, k1, v1 = (t.transpose(1, 2).reshape(1, R * L, t.shape[1], HEAD_DIM).transpose(1, 2) for t in (q, k, v))
    runs = {
        "sdpa-dense-mask": lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=dense, enable_gqa=True),
        "sdpa-causal": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True),
        "varlen": lambda: varlen_attn(qf, kf, vf, cu, cu, max_len, max_len, window_size=(-1, 0), **gqa),
        "flex-doc": lambda: flex(q1, k1, v1, block_mask=bm, enable_gqa=True),
    }
    out: dict = {"rows": R, "conversations": int(lens.numel()), "max_len": max_len}
    with torch.no_grad():
        ref = runs["varlen"]().float()  # (R*L, H, D)
        for name, fn in runs.items():
            try:
                ms = timed(fn, iters, warmup)
                o = fn()
                o = o.transpose(1, 2).reshape(R * L, HEADS, HEAD_DIM) if o.dim() == 4 else o
                gap = float((o.float() - ref).abs().max())
                out[name] = {"ms": ms, "max_abs_diff_vs_varlen": round(gap, 4)}
            except Exception as e:  # noqa: BLE001 - a benchmark reports what failed and goes on
                out[name] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
    return out


def drafter_case(cfg, batch, options: list[str], iters: int, warmup: int) -> dict:
    from torch.nn.attention.flex_attention import flex_attention

    from dflash.model import mask as masks

    dev = torch.device("cuda")
    chunks = cfg.data.pack_chunks
    part, _rows = batch.chunk(0, chunks)
    part = part.to(dev)
    R, L = part.input_ids.shape
    rows = max(R, part.rows_total)
    bs = cfg.drafter.block_size
    m = masks.build_packed_masks(part.anchor_row, part.doc_start, part.anchor_col, L, rows * L, bs, "flex")["full"]
    q_len = part.anchor_col.numel() * bs
    kv_len = rows * L + q_len
    q_pad, kv_pad = m.seq_lengths
    g = torch.Generator(device=dev).manual_seed(1)
    q = torch.randn(1, HEADS, q_pad, HEAD_DIM, device=dev, dtype=torch.bfloat16, generator=g).requires_grad_()
    k = torch.randn(1, KV_HEADS, kv_pad, HEAD_DIM, device=dev, dtype=torch.bfloat16, generator=g).requires_grad_()
    v = torch.randn(1, KV_HEADS, kv_pad, HEAD_DIM, device=dev, dtype=torch.bfloat16, generator=g).requires_grad_()
    do = torch.randn(1, HEADS, q_pad, HEAD_DIM, device=dev, dtype=torch.bfloat16, generator=g)
    out: dict = {"q_len": q_len, "kv_len": kv_len, "blocks_valid": int(part.anchor_valid.sum()),
                 "tiles": {"partial": int(m.kv_num_blocks.sum()), "full": int(m.full_kv_num_blocks.sum())
                           if m.full_kv_num_blocks is not None else 0}}
    # the committed mask (per-row key intervals) with each kernel option, and the row-formula mask_mod
    # (make_packed_mask_mod: a division and a modulo per element) with the same tiles, for comparison
    from torch.nn.attention.flex_attention import BlockMask

    row_formula = masks.pad_mask_mod(masks.make_packed_mask_mod(part.anchor_row, part.doc_start, part.anchor_col, L,
                                                                rows * L, bs), q_len, kv_len, dev)
    formula = BlockMask.from_kv_blocks(m.kv_num_blocks, m.kv_indices, m.full_kv_num_blocks, m.full_kv_indices,
                                       BLOCK_SIZE=masks.FLEX_BLOCK, mask_mod=row_formula, seq_lengths=m.seq_lengths)
    variants = [(name, m) for name in options] + [("row-formula/default", formula)]
    for label, bm in variants:
        opts = DRAFTER_OPTIONS[label.split("/")[-1]]
        torch._dynamo.reset()
        fn = torch.compile(flex_attention, dynamic=False)

        def fwd(fn=fn, opts=opts, bm=bm):
            return fn(q, k, v, block_mask=bm, enable_gqa=True, kernel_options=opts or None)

        def fwd_bwd(fwd=fwd):
            o = fwd()
            q.grad = k.grad = v.grad = None
            o.backward(do)

        try:
            out[label] = {"fwd_ms": timed(fwd, iters, warmup), "fwd_bwd_ms": timed(fwd_bwd, iters, warmup)}
            if bm is not m:  # the same attention as the committed mask's
                ref_o = torch.compile(flex_attention, dynamic=False)(q, k, v, block_mask=m, enable_gqa=True)
                out[label]["max_abs_diff"] = float((fwd() - ref_o).abs().max())
        except Exception as e:  # noqa: BLE001
            out[label] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=os.environ.get("OUT", "bench-out"))
    p.add_argument("--n", type=int, default=600, help="mixed-length conversations generated")
    p.add_argument("--batches", type=int, default=3, help="packed micro-batches measured (target part)")
    p.add_argument("--drafter-options", default=",".join(DRAFTER_OPTIONS))
    p.add_argument("--parts", default="target,drafter", help="which attentions to time (comma-separated)")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    a = p.parse_args()
    if not torch.cuda.is_available():
        print("attention_kernels: needs a CUDA GPU", file=sys.stderr)
        return 2
    cfg, batches = packed_batches(a.n, a.batches)
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "target": [target_case(b.position_ids, a.iters, a.warmup) for b in batches] if "target" in a.parts else [],
           "drafter": drafter_case(cfg, batches[0], [s for s in a.drafter_options.split(",") if s], a.iters, a.warmup)
           if "drafter" in a.parts else {}}
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / "attention_kernels.json").write_text(json.dumps(res, indent=2))
    print(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
