"""Benchmark one DFlash drafter training step (forward + backward) at Qwen3-8B shapes.

Runs the trainer's own step code (dflash.model.loss.drafter_loss: model, mask, loss) on synthetic inputs: target taps
(B, S, 5·H) and a frozen 151936-row embedding and LM head in bf16; fp32 master weights under bf16
autocast, as `dflash train` does on GPU. Modes:

  flex-compiled     BlockMask from create_block_mask + torch.compile(flex_attention), layers eager
  drafter-compiled  flex-compiled, plus torch.compile of every decoder layer (train.compile_layers, the
                    trainer's default on CUDA)
  sdpa-dense        a dense boolean mask from the same mask_mod + scaled_dot_product_attention (fallback)
  sdpa-compiled     sdpa-dense with every decoder layer compiled (the fallback as the trainer runs it on CUDA)
  flex-eager        the same BlockMask, flex_attention uncompiled (dense math, materializes Q·Kᵀ)

Reports per mode: ms per step (median), sequence tokens/s, block tokens/s, model FLOPs per step
(analytic, attention counted over the mask's visible pairs only; the mask build is inside the step and
also timed alone), MFU against --peak-tflops
(790 dense bf16 on H200), peak memory, first-step (compile) time, and the mask build time.
Results: <out>/dflash_step.json and <out>/dflash_step.md (--out, default $OUT, else ./bench-out).

GPU (H200, about 3 minutes):   python benchmarks/dflash_step.py --out $OUT
CPU smoke test (small shapes): python benchmarks/dflash_step.py --small --out /tmp/bench
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import torch  # noqa: E402

from dflash.model import mask as masks  # noqa: E402
from dflash.data.dataset import Batch  # noqa: E402
from dflash.model.loss import loss_weights, make_blocks, weight_sum  # noqa: E402
from dflash.model.drafter import DFlashDrafter, DrafterSpec, default_layer_ids  # noqa: E402
from dflash.model.loss import drafter_loss  # noqa: E402

MODES = ("flex-compiled", "drafter-compiled", "sdpa-dense", "sdpa-compiled", "flex-eager")  # the memory-hungry one last


@dataclass(frozen=True)
class Shape:
    hidden: int = 4096
    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    intermediate: int = 12288
    layers: int = 5
    target_layers: int = 36
    block: int = 16
    anchors: int = 512
    seq: int = 3072
    batch: int = 1
    vocab: int = 151936


SMALL = Shape(hidden=64, heads=4, kv_heads=2, head_dim=16, intermediate=128, layers=2, target_layers=8, block=4,
              anchors=8, seq=64, batch=2, vocab=512)


@dataclass
class ModeResult:
    mode: str
    status: str  # ok | skipped | error
    detail: str = ""
    ms_per_step: float | None = None
    ms_all: list[float] = field(default_factory=list)
    first_step_s: float | None = None
    mask_ms: float | None = None
    seq_tokens_per_s: float | None = None
    block_tokens_per_s: float | None = None
    tflop_per_step: float | None = None
    mfu: float | None = None
    peak_memory_gb: float | None = None
    top_ops: list[dict] = field(default_factory=list)  # --profile: torch.profiler key_averages, per step
    compile_s: dict = field(default_factory=dict)  # dynamo's compile_times() after the first step


def step_flops(s: Shape, anchors: torch.Tensor) -> float:
    """Model FLOPs of one fwd+bwd: 2·m·n·k per matmul; backward = 2× forward for trained weights,
    1× for the frozen head (input gradient only), 2.5× for attention; attention over visible pairs."""
    q = s.batch * s.anchors * s.block
    ctx = s.batch * s.seq
    nh_d, nkv_d = s.heads * s.head_dim, s.kv_heads * s.head_dim
    per_layer = (2 * q * s.hidden * nh_d + 2 * 2 * (ctx + q) * s.hidden * nkv_d + 2 * q * nh_d * s.hidden
                 + 3 * 2 * q * s.hidden * s.intermediate)
    pairs = float(((anchors.clamp(max=s.seq) + s.block) * s.block).sum())  # visible (q, kv) pairs per head
    attn = 2 * 2 * s.heads * s.head_dim * pairs
    fc = 2 * ctx * (s.layers * s.hidden) * s.hidden  # taps = number of draft layers
    head = 2 * s.batch * s.anchors * (s.block - 1) * s.hidden * s.vocab  # slot 0 is not read out
    return 3 * (s.layers * per_layer) + 3.5 * s.layers * attn + 2 * fc + 2 * head


def build(s: Shape, device: torch.device):
    spec = DrafterSpec(hidden_size=s.hidden, num_hidden_layers=s.layers, num_attention_heads=s.heads,
                       num_key_value_heads=s.kv_heads, head_dim=s.head_dim, intermediate_size=s.intermediate,
                       vocab_size=s.vocab, block_size=s.block, num_target_layers=s.target_layers,
                       target_layer_ids=default_layer_ids(s.target_layers, s.layers), mask_token_id=s.vocab - 1)
    g = torch.Generator().manual_seed(0)
    drafter = DFlashDrafter(spec)
    drafter.init_weights(g)
    drafter.to(device)
    lowp = torch.bfloat16 if device.type == "cuda" else torch.float32
    embed = torch.nn.Embedding(s.vocab, s.hidden).to(device, lowp).requires_grad_(False)
    head = torch.nn.Linear(s.hidden, s.vocab, bias=False).to(device, lowp).requires_grad_(False)
    ids = torch.randint(0, s.vocab - 1, (s.batch, s.seq), generator=g).to(device)
    taps = torch.randn(s.batch, s.seq, s.layers * s.hidden, generator=g).to(device, lowp)
    anchors = torch.stack([torch.sort(torch.randperm(s.seq - s.block + 1, generator=g)[: s.anchors])[0]
                           for _ in range(s.batch)]).to(device)
    return drafter, embed, head, ids, taps, anchors


def make_step(s: Shape, device: torch.device, backend: str, *, compile_layers: bool):
    """One drafter training step (fwd + bwd, the trainer's `drafter_loss`) at shape `s` as a callable,
    and its anchors. `compile_layers`: `torch.compile` every decoder layer (`train.compile_layers`)."""
    drafter, embed, head, ids, taps, anchors = build(s, device)
    if compile_layers:
        drafter.compile_layers(dynamic=False)  # what train.compile_layers does
    batch = Batch(input_ids=ids, loss_mask=torch.ones_like(ids, dtype=torch.bool),
                  lengths=torch.full((s.batch,), s.seq, device=device), anchors=anchors,
                  anchor_valid=torch.ones_like(anchors, dtype=torch.bool))
    w = loss_weights(s.block, 7.0, device=device)
    lowp = torch.bfloat16 if device.type == "cuda" else torch.float32
    denom = weight_sum(make_blocks(ids, batch.loss_mask, batch.lengths, anchors, batch.anchor_valid, s.block,
                                   s.vocab - 1), w)

    def step():
        out = drafter_loss(drafter, embed, head, taps, batch, mask_token_id=s.vocab - 1, weights=w,
                           denominator=denom, backend=backend, compute_dtype=lowp)  # the trainer's step code
        out.loss.backward()
        drafter.zero_grad(set_to_none=True)
    return step, anchors


def profile_steps(step, device: torch.device, steps: int = 2, top: int = 15) -> list[dict]:
    """torch.profiler over `steps` calls of `step`: the ops with the most self device time, per step."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        for _ in range(steps):
            step()
    on_gpu = device.type == "cuda"
    per_name: dict[str, list[float]] = {}  # kernel (GPU) or op (CPU) name -> [calls, microseconds]
    for e in prof.key_averages():
        if on_gpu and e.device_type != torch.autograd.DeviceType.CUDA:
            continue  # keep kernels only: an aten op's self device time repeats its kernels'
        t = e.self_device_time_total if on_gpu else e.self_cpu_time_total
        acc = per_name.setdefault(e.key, [0.0, 0.0])
        acc[0] += e.count
        acc[1] += t
    total = sum(t for _, t in per_name.values()) or 1.0
    rows = sorted(per_name.items(), key=lambda kv: -kv[1][1])
    return [{"name": name[:90], "calls_per_step": calls / steps, "ms_per_step": t / steps / 1e3, "share": t / total}
            for name, (calls, t) in rows[:top]]


def compile_times() -> dict:
    """Seconds dynamo/inductor spent per timed phase so far (torch._dynamo.utils.compilation_time_metrics)."""
    try:
        from torch._dynamo.utils import compilation_time_metrics

        return {k: round(sum(v), 3) for k, v in compilation_time_metrics.items()}
    except Exception:  # noqa: BLE001 - diagnostics only; the API moved between versions
        return {}


def run_mode(mode: str, s: Shape, device: torch.device, iters: int, warmup: int, peak_tflops: float,
             profile: bool = False) -> ModeResult:
    if mode in ("flex-compiled", "flex-eager", "drafter-compiled") and device.type != "cuda":
        return ModeResult(mode, "skipped", "flex_attention has no backward on CPU (torch raises NotImplementedError)")
    if mode == "sdpa-compiled" and device.type != "cuda":
        return ModeResult(mode, "skipped", "the trainer compiles layers on CUDA only")
    torch.compiler.reset()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    masks.use_compiled_flex(mode != "flex-eager")
    backend = "sdpa" if mode.startswith("sdpa") else "flex"
    step, anchors = make_step(s, device, backend, compile_layers=mode in ("drafter-compiled", "sdpa-compiled"))
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    times, mask_times = [], []
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)

    compiled = {}
    top: list[dict] = []
    try:
        for i in range(warmup + iters):
            sync()
            t0 = time.perf_counter()
            masks.build_masks(anchors, s.seq, s.block, backend)  # alone, for the mask column
            sync()
            t1 = time.perf_counter()
            step()
            sync()
            t2 = time.perf_counter()
            times.append(t2 - t1)
            mask_times.append(t1 - t0)
            if i == 0:
                compiled = compile_times()
        peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
        if profile:
            top = profile_steps(step, device)
            sync()
    except Exception as e:  # noqa: BLE001 - one failing mode (OOM, a compile error) must not lose the others
        return ModeResult(mode, "error", f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:300]}")
    finally:
        masks.use_compiled_flex(True)
    timed = times[warmup:]
    med = statistics.median(timed)
    flops = step_flops(s, anchors)
    return ModeResult(
        mode, "ok", ms_per_step=med * 1e3, ms_all=[round(t * 1e3, 2) for t in timed], first_step_s=times[0],
        mask_ms=statistics.median(mask_times[warmup:]) * 1e3,
        seq_tokens_per_s=s.batch * s.seq / med, block_tokens_per_s=s.batch * s.anchors * s.block / med,
        tflop_per_step=flops / 1e12, mfu=flops / med / (peak_tflops * 1e12),
        peak_memory_gb=peak, top_ops=top, compile_s=compiled)


def markdown(env: dict, shape: Shape, results: list[ModeResult]) -> str:
    lines = [f"device: {env['device']} · torch {env['torch']} · shapes: {asdict(shape)}", "",
             "| mode | ms/step | seq tok/s | block tok/s | TFLOP/step | MFU | peak GB | first step s | mask ms |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        if r.status != "ok":
            lines.append(f"| {r.mode} | {r.status}: {r.detail} | | | | | | | |")
            continue
        mem = f"{r.peak_memory_gb:.1f}" if r.peak_memory_gb is not None else "-"
        lines.append(f"| {r.mode} | {r.ms_per_step:.1f} | {r.seq_tokens_per_s:,.0f} | {r.block_tokens_per_s:,.0f} | "
                     f"{r.tflop_per_step:.2f} | {r.mfu:.1%} | {mem} | {r.first_step_s:.1f} | {r.mask_ms:.1f} |")
    for r in results:
        if r.top_ops:
            lines += ["", f"top ops, {r.mode} (torch.profiler, self device time per step):", "",
                      "| op | calls/step | ms/step | share |", "|---|---|---|---|"]
            lines += [f"| `{o['name']}` | {o['calls_per_step']:g} | {o['ms_per_step']:.2f} | {o['share']:.1%} |"
                      for o in r.top_ops]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=os.environ.get("OUT", "bench-out"), help="result directory (default $OUT)")
    p.add_argument("--small", action="store_true", help="tiny shapes, runs on CPU (smoke test)")
    p.add_argument("--modes", default=",".join(MODES), help=f"comma list of {', '.join(MODES)}")
    p.add_argument("--iters", type=int, default=None, help="timed steps per mode (default 10, small 2)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps per mode (default 3, small 1)")
    p.add_argument("--peak-tflops", type=float, default=790.0, help="dense bf16 peak for MFU (H200: 790)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--profile", action="store_true", help="torch.profiler over 2 more steps: top ops per mode")
    a = p.parse_args(argv)
    shape = SMALL if a.small else Shape()
    device = torch.device(a.device)
    modes = [m.strip() for m in a.modes.split(",") if m.strip()]
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        p.error(f"unknown mode(s) {unknown}; choose from {', '.join(MODES)}")
    iters = a.iters or (2 if a.small else 10)
    warmup = a.warmup or (1 if a.small else 3)
    env = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
           "torch": torch.__version__, "cuda": torch.version.cuda, "peak_tflops": a.peak_tflops}
    results = []
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    for m in modes:
        r = run_mode(m, shape, device, iters if m != "flex-eager" else max(1, iters // 3), warmup, a.peak_tflops,
                     profile=a.profile)
        print(f"{m}: {r.status} {r.detail} {'' if r.ms_per_step is None else f'{r.ms_per_step:.1f} ms, MFU {r.mfu:.1%}'}",
              file=sys.stderr, flush=True)
        results.append(r)
        # written after every mode: a run cut short (a cold compile past a timeout) keeps what it measured
        (out / "dflash_step.json").write_text(json.dumps({"env": env, "shape": asdict(shape),
                                                          "results": [asdict(r) for r in results]}, indent=2) + "\n")
        (out / "dflash_step.md").write_text(markdown(env, shape, results))
    print(markdown(env, shape, results))
    return 0 if all(r.status != "error" for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
