"""`dflash regen`'s generation with and without cuDNN's sdpa (what dflash.eval.attention does for the eval).

`dflash regen` has the target answer each prompt again with transformers' `generate` (dflash.data.regen.
generate_batch: left-padded batches, a DynamicCache, the sdpa attention with a padding mask): every batch has a
new prompt length and every decode step a new key length. If cuDNN's sdpa builds kernels per shape at first
calls (as it does for the eval's shapes: docs/benchmarks.md, session 15), a regen batch pays it at every step.

Times `generate_batch` on a random Qwen3-8B-shaped target (bf16, no tokenizer needed: prompts are random ids,
nothing is decoded to text) for BATCHES batches of B prompts of 100-300 tokens × NEW new tokens, each batch
its own prompt lengths; one JSON line per batch (seconds, new tokens, tokens/s). Run once as is and once with
--no-cudnn-sdpa, each in a fresh process:

    python benchmarks/dflash_regen_attention.py --device cuda
    python benchmarks/dflash_regen_attention.py --device cuda --no-cudnn-sdpa
CPU smoke (tiny shape): python benchmarks/dflash_regen_attention.py --small --new 8
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

SMALL = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=4096)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--small", action="store_true", help="a tiny random Qwen3 (CPU smoke)")
    ap.add_argument("--batches", type=int, default=3)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--new", type=int, default=128, help="new tokens per prompt")
    ap.add_argument("--no-cudnn-sdpa", action="store_true", help="take cuDNN out of sdpa's backends")
    a = ap.parse_args(argv)
    if a.no_cudnn_sdpa:
        torch.backends.cuda.enable_cudnn_sdp(False)
    from dflash.data.regen import generate_batch
    from dflash.model.target import resolve_dtype
    from dflash_e2e import QWEN3_8B, random_target

    dev = torch.device(a.device)
    t = random_target(SMALL if a.small else QWEN3_8B, dev, resolve_dtype("auto", dev), 1)
    vocab = t.model.config.vocab_size
    target = SimpleNamespace(tokenizer=SimpleNamespace(pad_token_id=0), eos_ids=[1], mask_token_id=vocab - 1,
                             model=t.model, device=dev)
    g = torch.Generator().manual_seed(0)
    for b in range(a.batches):
        lens = torch.randint(100, 301, (a.batch,), generator=g).tolist()
        prompts = [torch.randint(2, vocab - 1, (n,), generator=g).tolist() for n in lens]
        if dev.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        answers = generate_batch(target, prompts, a.new)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        s = time.perf_counter() - t0
        new = sum(len(x) for x in answers)
        print(json.dumps({"batch": b, "cudnn_sdpa": torch.backends.cuda.cudnn_sdp_enabled(), "seconds": round(s, 3),
                          "new_tokens": new, "tokens_per_s": round(new / s, 1), "prompt_tokens": [min(lens), max(lens)]}),
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
