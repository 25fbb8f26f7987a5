"""End-to-end DFlash training throughput at Qwen3-8B scale on one device (target and drafter co-located).

Builds a Qwen3-8B-shaped target from a transformers `Qwen3Config` with random bf16 weights (no
download), synthetic 3072-token sequences (the first tenth prompt, the rest trained), and runs the
`qwen3_8b` recipe's optimizer steps through `dflash.trainer.Trainer.train_step`: the code path `dflash
train` runs on one device (target forward with taps, drafter forward+backward per micro-batch, clip +
fused AdamW), with the batches made by the trainer's own `micro_batches`.

Reports: time to the first step (compile included; cold or warm depending on the inductor cache),
steady-state sequence tokens/s (median step), the time split per step (data / target / drafter /
optimizer / waiting = the rest of the step), MFU of the target forward and of the drafter step
(analytic FLOPs over the measured parts), peak memory, and dynamo/inductor compile times.
Results: <out>/dflash_e2e.json and .md.

GPU (H200):        python benchmarks/dflash_e2e.py --out $OUT
CPU smoke (tiny):  python benchmarks/dflash_e2e.py --small --out /tmp/e2e
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from dflash.config import apply_overrides, qwen3_8b  # noqa: E402
from dflash.data import ChatDataset, DataStats, Sample  # noqa: E402
from dflash.model import default_layer_ids  # noqa: E402
from dflash.target import Target  # noqa: E402
from dflash.trainer import Trainer, build_drafter, drafter_spec  # noqa: E402
from dflash_step import Shape, compile_times, step_flops  # noqa: E402

QWEN3_8B = dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                rope_theta=1_000_000.0, rms_norm_eps=1e-6, tie_word_embeddings=False)
SMALL = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=1024, rope_theta=10000.0,
             rms_norm_eps=1e-6, tie_word_embeddings=False)


def random_target(fields: dict, device: torch.device, dtype: torch.dtype, num_draft_layers: int) -> Target:
    """A frozen Qwen3 of the given shape with random weights, built on `device` (no download)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(**fields)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # init straight in bf16: no fp32 copy of 8B weights
    try:
        with torch.device(device):
            torch.manual_seed(0)
            model = Qwen3ForCausalLM(cfg)
    finally:
        torch.set_default_dtype(prev)
    model.requires_grad_(False).eval()
    L = cfg.num_hidden_layers
    return Target(model=model, tokenizer=None, layer_ids=default_layer_ids(L, num_draft_layers),
                  mask_token_id=cfg.vocab_size - 1, device=device, dtype=dtype, source="benchmark:random")


def synthetic_dataset(n: int, seq: int, vocab: int, cfg, seed: int = 0) -> ChatDataset:
    """n sequences of `seq` random tokens; the first tenth is prompt (not trained)."""
    g = torch.Generator().manual_seed(seed)
    samples = []
    for _ in range(n):
        ids = torch.randint(0, vocab - 1, (seq,), generator=g)
        lm = torch.ones(seq, dtype=torch.bool)
        lm[: seq // 10] = False
        samples.append(Sample(input_ids=ids, loss_mask=lm))
    stats = DataStats(records=n, kept=n, tokens=n * seq, loss_tokens=int(n * (seq - seq // 10)))
    return ChatDataset(samples, cfg.data, cfg.drafter.block_size, seed, stats)


def target_flops(fields: dict, tokens: int, seq: int) -> float:
    """Forward FLOPs of the target over `tokens` tokens in sequences of `seq`: 2·params per token for
    the decoder layers (the head reads one position: logits_to_keep=1) plus causal attention."""
    h, L, i = fields["hidden_size"], fields["num_hidden_layers"], fields["intermediate_size"]
    q, kv = fields["num_attention_heads"] * fields["head_dim"], fields["num_key_value_heads"] * fields["head_dim"]
    per_layer = h * q + 2 * h * kv + q * h + 3 * h * i
    attn = 2 * 2 * q * (seq * (seq + 1) / 2) * (tokens / seq)  # QK^T and PV over the causal half
    return 2 * L * per_layer * tokens + L * attn


def run(a) -> dict:
    device = torch.device(a.device)
    fields = SMALL if a.small else QWEN3_8B
    seq = 64 if a.small else a.seq
    cfg = qwen3_8b()
    over = {"topology.device": str(device), "train.max_steps": a.warmup + a.steps, "metrics.log_every": 1,
            "data.max_length": seq, "data.buckets": [seq]}
    if a.small:
        over.update({"drafter.num_layers": 2, "drafter.block_size": 8, "data.num_anchors": 4})
    cfg = apply_overrides(cfg, over)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    t0 = time.perf_counter()
    target = random_target(fields, device, dtype, cfg.drafter.num_layers)
    build_s = time.perf_counter() - t0
    n_seq = (a.warmup + a.steps) * cfg.train.grad_accum * cfg.data.batch_size
    dataset = synthetic_dataset(n_seq, seq, fields["vocab_size"], cfg)
    drafter = build_drafter(cfg, drafter_spec(cfg, target), device)
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    steps = []
    compiled: dict = {}
    with tempfile.TemporaryDirectory() as run_dir:
        trainer = Trainer(cfg, target, dataset, drafter, Path(run_dir))
        trainer.drafter.train()
        for i in range(a.warmup + a.steps):
            sync()
            t_start = time.perf_counter()
            batches = trainer.micro_batches(trainer.step)
            data_s = time.perf_counter() - t_start
            m = trainer.train_step(batches)
            sync()
            total = time.perf_counter() - t_start
            split = {"data": data_s, "target": m.time_split.get("target", 0.0),
                     "drafter": m.time_split.get("drafter", 0.0), "optimizer": m.time_split.get("optim", 0.0)}
            split["waiting"] = max(0.0, total - sum(split.values()))
            steps.append({"seconds": total, "tokens": m.tokens, "loss": m.loss, "split": split,
                          "anchors": [b.anchors for b in batches]})
            if i == 0:
                compiled = compile_times()
                print(f"first step {total:.1f} s, split {split}, compile times {compiled}", file=sys.stderr, flush=True)
            else:
                print(f"step {i + 1}: {total:.3f} s, {m.tokens / total:,.0f} tok/s", file=sys.stderr, flush=True)
        trainer.close()
    timed = steps[a.warmup:]
    med = statistics.median(s["seconds"] for s in timed)
    tokens = timed[0]["tokens"]
    split = {k: statistics.mean(s["split"][k] for s in timed) for k in timed[0]["split"]}
    shape = Shape(hidden=fields["hidden_size"], heads=cfg.drafter.num_attention_heads or fields["num_attention_heads"],
                  kv_heads=fields["num_key_value_heads"], head_dim=fields["head_dim"],
                  intermediate=fields["intermediate_size"], layers=cfg.drafter.num_layers,
                  target_layers=fields["num_hidden_layers"], block=cfg.drafter.block_size,
                  anchors=cfg.data.num_anchors, seq=seq, batch=1, vocab=fields["vocab_size"])
    d_flops = sum(step_flops(shape, anc) for anc in timed[-1]["anchors"])  # one optimizer step's micro-batches
    t_flops = target_flops(fields, tokens, seq)
    peak = a.peak_tflops * 1e12
    return {
        "env": {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                "torch": torch.__version__, "peak_tflops": a.peak_tflops},
        "setup": {"recipe": cfg.recipe, "seq": seq, "grad_accum": cfg.train.grad_accum,
                  "batch_size": cfg.data.batch_size, "anchors": cfg.data.num_anchors,
                  "compile_layers": cfg.train.compile_layers, "target_build_s": round(build_s, 2)},
        "first_step_s": steps[0]["seconds"], "first_step_split": steps[0]["split"], "compile_s": compiled,
        "step_s": med, "tokens_per_step": tokens, "tokens_per_s": tokens / med, "split_s": split,
        "target_tflop": t_flops / 1e12, "drafter_tflop": d_flops / 1e12,
        "target_mfu": t_flops / split["target"] / peak if split["target"] > 0 else None,
        "drafter_mfu": d_flops / split["drafter"] / peak if split["drafter"] > 0 else None,
        "step_mfu": (t_flops + d_flops) / med / peak,
        "peak_memory_gb": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None,
        "losses": [round(s["loss"], 4) for s in steps],
    }


def markdown(r: dict) -> str:
    s = r["split_s"]
    mem = f"{r['peak_memory_gb']:.1f}" if r["peak_memory_gb"] is not None else "-"
    mfu = lambda x: "-" if x is None else f"{x:.1%}"  # noqa: E731
    return "\n".join([
        f"device: {r['env']['device']} · torch {r['env']['torch']} · {r['setup']}", "",
        "| tokens/s | s/step | data | target | drafter | optimizer | waiting | target MFU | drafter MFU | step MFU | peak GB | first step s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
        f"| {r['tokens_per_s']:,.0f} | {r['step_s']:.3f} | {s['data']:.3f} | {s['target']:.3f} | {s['drafter']:.3f} | "
        f"{s['optimizer']:.3f} | {s['waiting']:.3f} | {mfu(r['target_mfu'])} | {mfu(r['drafter_mfu'])} | "
        f"{mfu(r['step_mfu'])} | {mem} | {r['first_step_s']:.1f} |", ""])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=os.environ.get("OUT", "bench-out"), help="result directory (default $OUT)")
    p.add_argument("--small", action="store_true", help="tiny shapes, runs on CPU (smoke test)")
    p.add_argument("--steps", type=int, default=4, help="timed optimizer steps")
    p.add_argument("--warmup", type=int, default=2, help="untimed optimizer steps (the first compiles)")
    p.add_argument("--seq", type=int, default=3072, help="sequence length")
    p.add_argument("--peak-tflops", type=float, default=790.0, help="dense bf16 peak for MFU (H200: 790)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    a = p.parse_args(argv)
    r = run(a)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "dflash_e2e.json").write_text(json.dumps(r, indent=2, default=str) + "\n")
    (out / "dflash_e2e.md").write_text(markdown(r))
    print(markdown(r))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
