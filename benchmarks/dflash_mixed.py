"""DFlash training throughput on chats of mixed lengths, packed (`data.pack`, the default) and padded.

Real chat data is not 3,072-token sequences: answers run from a few dozen tokens to thousands. This
benchmark makes such data (`mixed_lengths`: prompts log-normal with a median of 400 tokens, answers
with a median of 700, clipped to 60..3,200, truncated to max_length; `--uniform` for the all-3,072 case) and times the
`qwen3_8b` recipe's optimizer steps (`Trainer.train_step`: target taps, drafter forward+backward,
AdamW) with a random Qwen3-8B-shaped target (benchmarks/dflash_e2e.py's), after warming every shape
the run uses (`Trainer.warm_batches`), so the timed steps hold no compile.

Reports per layout: sequence tokens/s (total tokens / total time of the timed steps), valid blocks/s,
the share of computed drafter blocks that were valid, the share of the target's tokens that were not
padding, the median time split, and how long warming took. `--write-jsonl FILE` writes such chats as
JSONL of tiny-vocabulary words instead (for `dflash train --data FILE` on the embedded tiny target).

GPU (H200):  python benchmarks/dflash_mixed.py --out $OUT            (packed and padded, mixed lengths)
             python benchmarks/dflash_mixed.py --uniform --out $OUT  (3,072-token sequences)
CPU smoke:   python benchmarks/dflash_mixed.py --small --out /tmp/mixed
Data only:   python benchmarks/dflash_mixed.py --write-jsonl mixed.jsonl --n 400 --scale 0.03
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402


PROMPT_MEDIAN = 400  # tokens: system prompt and history; with answers of median 700, a mean chat of ~1,450 tokens


def mixed_lengths(n: int, seed: int = 0, scale: float = 1.0, max_length: int = 3072, prompt_median: int = PROMPT_MEDIAN):
    """(prompt lengths, answer lengths) of `n` chats: prompts log-normal around `prompt_median` tokens
    (10..2,000), answers log-normal with a median of 700 (60..3,200), both times `scale`, the sum
    truncated to max_length (the answer loses the excess, as truncation does). The defaults give a
    mean chat of ~1,450 tokens (the 5,773 tokens per 4 chats measured on the mixed data before packing)."""
    rng = np.random.default_rng(seed)
    prompt = np.clip(rng.lognormal(np.log(prompt_median), 0.8, n), 10, 2000) * scale
    answer = np.clip(rng.lognormal(np.log(700), 0.9, n), 60, 3200) * scale
    prompt = np.maximum(2, prompt.astype(int))
    answer = np.maximum(2, answer.astype(int))
    answer = np.minimum(answer, np.maximum(1, max_length - prompt))
    return prompt, answer


def mixed_dataset(n: int, vocab: int, cfg, *, uniform: bool, seed: int = 0, scale: float = 1.0):
    import torch

    from dflash.data.dataset import ChatDataset, DataStats, Sample

    L = cfg.data.max_length
    if uniform:
        prompt, answer = np.full(n, L // 10), np.full(n, L - L // 10)
    else:
        prompt, answer = mixed_lengths(n, seed, scale, L)
    g = torch.Generator().manual_seed(seed)
    samples = []
    for p, a in zip(prompt.tolist(), answer.tolist()):
        ids = torch.randint(0, vocab - 1, (p + a,), generator=g)
        lm = torch.zeros(p + a, dtype=torch.bool)
        lm[p:] = True
        samples.append(Sample(input_ids=ids, loss_mask=lm))
    tokens = int(sum(s.input_ids.numel() for s in samples))
    stats = DataStats(records=n, kept=n, tokens=tokens, loss_tokens=int(answer.sum()))
    return ChatDataset(samples, cfg.data, cfg.drafter.block_size, seed, stats)


def write_jsonl(path: str, n: int, seed: int, scale: float) -> None:
    import random

    from dflash.model.target import tiny_words

    words = tiny_words()
    rng = random.Random(seed)
    prompt, answer = mixed_lengths(n, seed, scale, 10**9)
    with open(path, "w", encoding="utf-8") as fh:
        for p, a in zip(prompt.tolist(), answer.tolist()):
            msgs = [{"role": "user", "content": " ".join(rng.choices(words, k=p))},
                    {"role": "assistant", "content": " ".join(rng.choices(words, k=a))}]
            fh.write(json.dumps({"messages": msgs}) + "\n")


def run_layout(a, pack: bool) -> dict:
    import torch

    from dflash.config import apply_overrides, qwen3_8b
    from dflash.model.build import build_drafter, drafter_spec
    from dflash.training.trainer import Trainer
    from dflash_e2e import QWEN3_8B, SMALL, random_target

    fields = SMALL if a.small else QWEN3_8B
    seq = 128 if a.small else 3072
    over = {"data.max_length": seq, "data.pack": pack, "checkpoint.every": 10**9, "metrics.log_every": 1,
            "data.path": "embedded:tiny-chat", "train.max_steps": 10**6}
    if a.pack_chunks:
        over["data.pack_chunks"] = a.pack_chunks
    if a.fp8_target:
        over["target.fp8"] = True
    if not pack:  # the recipe before packing: 4 micro-batches of one padded sequence a step
        over.update({"data.batch_size": 1, "train.grad_accum": 4, "data.pack_chunks": 1})
    if a.small:
        over.update({"drafter.num_layers": 2, "drafter.block_size": 8, "data.num_anchors": 8})
    cfg = apply_overrides(qwen3_8b(), over)
    device = torch.device(a.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    target = random_target(fields, device, dtype, cfg.drafter.num_layers, compile_taps=cfg.target.compile)
    fp8_taps = fp8_target(target, seq, fields["vocab_size"]) if a.fp8_target else None
    scale = 128 / 3072 if a.small else 1.0
    ds = mixed_dataset(a.n, fields["vocab_size"], cfg, uniform=a.uniform, scale=scale)
    spec = drafter_spec(cfg, target)
    drafter = build_drafter(cfg, spec, device)
    tr = Trainer(cfg, target, ds, drafter, Path(a.out) / f"run-{'packed' if pack else 'padded'}")
    t0 = time.perf_counter()
    warm = tr.warm_batches()
    for i, b in enumerate(warm):
        b = b.to(device)
        if i in (0, len(warm) // 2) or not pack:  # packed: the drafter's two shapes; every target shape
            tr.forward_backward(b, torch.tensor(1.0, device=device))
        else:
            target.taps(b.input_ids, getattr(b, "position_ids", None))
    tr.optimizer.zero_grad(set_to_none=True)
    tr._sync()
    warm_s = time.perf_counter() - t0
    steps = []
    for s in range(a.warmup + a.steps):
        m = tr.train_step(tr.micro_batches(s))
        if s >= a.warmup:
            steps.append(m)
    profile = profile_step(tr, a.warmup + a.steps, device) if a.profile else None
    syncs = sync_check(tr, a.warmup + a.steps + 1, device) if a.sync_check else None
    tot = sum(m.seconds for m in steps)
    tokens, blocks = sum(m.tokens for m in steps), sum(m.blocks for m in steps)
    split = {k: round(statistics.median(m.time_split.get(k, 0.0) for m in steps), 4)
             for k in ("target", "drafter", "optim")}
    return {"layout": "packed" if pack else "padded", "data": "uniform" if a.uniform else "mixed",
            "pack_chunks": tr.pack_chunks, "pack_chunks_config": cfg.data.pack_chunks, "chunk_plan": tr.chunk_plan.note(),
            "tokens_per_s": round(tokens / tot, 1), "valid_blocks_per_s": round(blocks / tot, 1),
            "valid_block_share": round(blocks / sum(m.block_slots for m in steps), 4),
            "target_fill": round(tokens / sum(m.token_slots for m in steps), 4),
            "tokens_per_step": round(tokens / len(steps), 1), "blocks_per_step": round(blocks / len(steps), 1),
            "median_step_s": round(statistics.median(m.seconds for m in steps), 4), "split_median_s": split,
            "step_s": [round(m.seconds, 4) for m in steps],
            "warm_s": round(warm_s, 2), "warm_shapes": len(warm), "steps": len(steps),
            "peak_gib": round(torch.cuda.max_memory_allocated(device) / 2**30, 2) if device.type == "cuda" else None,
            "peak_reserved_gib": round(torch.cuda.max_memory_reserved(device) / 2**30, 2) if device.type == "cuda" else None,
            "memory_cap_gib": a.memory_cap_gib or None,
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "torch": torch.__version__, **({"profile": profile} if profile else {}),
            **({"fp8_target": fp8_taps} if fp8_taps else {}),
            **({"syncs": syncs} if syncs is not None else {})}


def fp8_target(target, seq: int, vocab: int) -> dict:
    """target.fp8 as `load_target` applies it (dflash.model.fp8.quantize_decoder), and how far the taps move:
    one row of `seq` random tokens through the target before and after (eagerly), per tap the relative error
    ||fp8 - bf16|| / ||bf16|| and the tokens' mean cosine similarity. Random weights: not a trained model's."""
    import torch

    from dflash.model import fp8

    ids = torch.randint(0, vocab - 1, (1, seq), generator=torch.Generator().manual_seed(1)).to(target.device)
    with torch.compiler.set_stance("force_eager"):
        ref = target.taps(ids).float()
        note = fp8.quantize_decoder(target.model)
        got = target.taps(ids).float()
    torch.cuda.empty_cache() if torch.cuda.is_available() else None
    taps = []
    for r, g in zip(ref.chunk(len(target.layer_ids), -1), got.chunk(len(target.layer_ids), -1)):
        taps.append({"rel_err": round(float((g - r).norm() / r.norm()), 4),
                     "cos_mean": round(float(torch.nn.functional.cosine_similarity(g, r, dim=-1).mean()), 5)})
    return {"note": note, "layer_ids": list(target.layer_ids), "taps": taps}


KERNEL_KINDS = (  # (kind, substrings of a CUDA kernel's name), first match wins
    ("flex attention", ("flex", "triton_tem_fused")),
    ("flash / sdpa attention", ("flash", "fmha", "efficient_attention", "cudnn")),
    ("gemm", ("gemm", "sm90_xmma", "cutlass", "nvjet", "ampere_", "sm80_xmma", "splitk")),
    ("optimizer", ("adam", "multi_tensor")),
    ("fused (inductor)", ("triton_",)),
    ("copy / cast", ("copy", "convert", "cast")),
)


def kernel_kind(name: str) -> str:
    low = name.lower()
    return next((kind for kind, keys in KERNEL_KINDS if any(k in low for k in keys)), "other")


def profile_step(tr, step: int, device, top: int = 60) -> dict:
    """One more optimizer step under torch.profiler: CUDA kernel time by kind (KERNEL_KINDS), the `top`
    kernels that took the most, and the host-side ops (aten::..., CompiledFunction, ...) whose own
    kernels took the most GPU time (which eager op, or which compiled region, a kernel came from)."""
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    before = tr.micro_batches(step - 1)  # a step before the profiled one: the GPU's idle time between the two
    with profile(activities=acts, record_shapes=True) as prof:
        tr.train_step(before)
        batches = tr.micro_batches(step)
        with torch.profiler.record_function("dflash_mixed.second_step"):
            pass  # marks the host time at which the second step starts
        m = tr.train_step(batches)
        tr._sync()
    boundary = step_boundary(prof)
    kinds: dict[str, float] = {}
    kernels, ops = [], []
    for ev in prof.key_averages():
        us = getattr(ev, "self_device_time_total", 0.0) or getattr(ev, "self_cuda_time_total", 0.0)
        if us <= 0 or ev.key.startswith(("cuda", "ProfilerStep")) or getattr(ev, "is_user_annotation", False):
            continue  # (a user annotation's GPU range, e.g. Optimizer.step#AdamW.step, spans kernels counted already)
        if ev.device_type == DeviceType.CPU:  # a host op: the GPU time of the kernels it launched itself
            ops.append((us / 1e3, ev.count, ev.key[:140]))
            continue
        kinds[kernel_kind(ev.key)] = kinds.get(kernel_kind(ev.key), 0.0) + us / 1e3
        kernels.append((us / 1e3, ev.count, ev.key[:140]))
    kernels.sort(reverse=True)
    ops.sort(reverse=True)
    total = sum(kinds.values())
    return {"step_s": round(m.seconds, 4), "kernel_ms": round(total, 1),
            "by_kind_ms": {k: round(v, 1) for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])},
            "top": [{"ms": round(ms, 2), "calls": n, "kernel": k} for ms, n, k in kernels[:top]],
            "top_host_ops": [{"ms": round(ms, 2), "calls": n, "op": k} for ms, n, k in ops[:40]],
            "gemm_shapes": gemm_shapes(prof),
            "note": "kernel and host-op totals cover the profiled step and the one before it (two steps)",
            **boundary, **gpu_idle(prof)}


def gemm_dims(op: str, shapes: list) -> tuple[int, int, int, int] | None:
    """(batch, M, N, K) of a matmul host op from its recorded input shapes (aten::mm [M,K] x [K,N],
    aten::addmm [N] + [M,K] x [K,N], aten::bmm [B,M,K] x [B,K,N], aten::_scaled_mm like mm), or None."""
    dims = [s for s in shapes if isinstance(s, (list, tuple)) and len(s) >= 2]
    if op == "aten::bmm" and len(dims) >= 2 and len(dims[0]) == 3 and len(dims[1]) == 3:
        (b, m, k), (_, k2, n) = dims[0], dims[1]
        return (b, m, n, k) if k == k2 else None
    two = [s for s in dims if len(s) == 2]
    if len(two) >= 2 and two[0][1] == two[1][0]:
        (m, k), (_, n) = two[0], two[1]
        return (1, m, n, k)
    return None


def gemm_shapes(prof, top: int = 40) -> dict:
    """The matmul host ops by input shape: their kernels' GPU time and the rate they ran at (2*B*M*N*K
    FLOPs a call), the ones that took the most first. Which GEMMs run under the chip's rate, and by how much."""
    from torch.autograd import DeviceType

    rows, total_ms, total_flop = [], 0.0, 0.0
    for ev in prof.key_averages(group_by_input_shape=True):
        if ev.device_type != DeviceType.CPU or ev.key not in ("aten::mm", "aten::addmm", "aten::bmm", "aten::_scaled_mm"):
            continue
        us = getattr(ev, "self_device_time_total", 0.0) or getattr(ev, "self_cuda_time_total", 0.0)
        d = gemm_dims(ev.key, list(ev.input_shapes or []))
        if us <= 0 or d is None:
            continue
        flop = 2.0 * d[0] * d[1] * d[2] * d[3] * ev.count
        total_ms += us / 1e3
        total_flop += flop
        rows.append({"ms": round(us / 1e3, 2), "calls": ev.count, "op": ev.key, "bmnk": list(d),
                     "tflops": round(flop / (us / 1e6) / 1e12, 1)})
    rows.sort(key=lambda r: -r["ms"])
    return {"ms": round(total_ms, 1), "tflop": round(total_flop / 1e12, 1),
            "tflops": round(total_flop / (total_ms / 1e3) / 1e12, 1) if total_ms else None, "top": rows[:top]}


def step_boundary(prof) -> dict:
    """The GPU's idle time between two profiled steps: from the last kernel that started before the second
    `train_step` was called to the first kernel after it (metrics, the step's end sync, the next batches'
    copy and the target's first launches: what a step pays outside its kernels)."""
    from torch.autograd import DeviceType

    ks = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                if e.device_type == DeviceType.CUDA and e.time_range.end > e.time_range.start)
    host = sorted(e.time_range.start for e in prof.events() if e.name == "dflash_mixed.second_step")
    if not ks or not host:
        return {}
    cut = host[0]
    first_end = max((b for a, b in ks if a < cut), default=None)
    second_start = min((a for a, b in ks if a >= cut), default=None)
    if first_end is None or second_start is None:
        return {}
    return {"gpu_idle_between_steps_ms": round((second_start - first_end) / 1e3, 2)}


def sync_check(tr, step: int, device, frames: int = 6) -> list[dict]:
    """One more optimizer step with CUDA's sync debug mode on: every host-device synchronization the step
    makes (a `.item()`, a boolean-mask index, a non-pinned copy to the host, ...), with the innermost
    project frames that made it, counted by place. Each one leaves the GPU idle while the host queues
    the work after it. The step's own sync at its end is one of them."""
    import traceback
    import warnings

    import torch

    if device.type != "cuda":
        return []
    root = str(Path(__file__).resolve().parents[1])
    seen: dict[tuple, dict] = {}

    def record(message, category, filename, lineno, file=None, line=None):
        stack = [f for f in traceback.extract_stack()[:-1] if f.filename.startswith(root) and "benchmarks" not in f.filename]
        key = tuple(f"{Path(f.filename).relative_to(root)}:{f.lineno} {f.name}" for f in stack[-frames:])
        entry = seen.setdefault(key, {"count": 0, "where": list(key), "what": str(message)[:120]})
        entry["count"] += 1

    batches = tr.micro_batches(step)
    torch.cuda.synchronize(device)
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            tr.train_step(batches)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sorted(seen.values(), key=lambda e: -e["count"])


def gpu_idle(prof, top: int = 12) -> dict:
    """The GPU's idle time inside the profiled step: the gaps between its kernels (merged intervals), the
    longest ones with the kernels on either side (what the GPU waited between)."""
    from torch.autograd import DeviceType

    ks = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                if e.device_type == DeviceType.CUDA and e.time_range.end > e.time_range.start)
    if not ks:
        return {}
    gaps, end, last = [], ks[0][1], ks[0][2]
    for a, b, name in ks[1:]:
        if a > end:
            gaps.append((a - end, last, name))
        if b > end:
            end, last = b, name
    gaps.sort(reverse=True)
    return {"gpu_span_ms": round((end - ks[0][0]) / 1e3, 1), "gpu_idle_ms": round(sum(g for g, _, _ in gaps) / 1e3, 1),
            "gaps_over_100us": sum(1 for g, _, _ in gaps if g > 100),
            "longest_gaps": [{"ms": round(g / 1e3, 2), "after": x[:80], "before": y[:80]} for g, x, y in gaps[:top]]}


def machine_gemm(device) -> dict:
    """This GPU's bf16 matmul rate on 8192^3 (median of 20 after 5), and its SM clock then: fresh machines of
    one kind differ by a few percent, and a step is ~80% GEMMs, so compare tokens/s with this beside them."""
    import torch

    from cuda_timing import median_ms

    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    ms = median_ms(lambda: a @ b, iters=20, warmup=5)
    out = {"gemm_8192_tflops": round(2 * 8192 ** 3 / ms / 1e9, 1)}
    try:
        import pynvml

        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByIndex(torch.device(device).index or 0)
        out["sm_clock_mhz"] = pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_SM)
        out["sm_clock_max_mhz"] = pynvml.nvmlDeviceGetMaxClockInfo(h, pynvml.NVML_CLOCK_SM)
    except Exception:  # noqa: BLE001 - the clock is a nicety
        pass
    del a, b
    torch.cuda.empty_cache()
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=os.environ.get("OUT", "bench-out"))
    p.add_argument("--small", action="store_true", help="tiny shapes on CPU (smoke test)")
    p.add_argument("--uniform", action="store_true", help="every sequence max_length tokens (the uniform case)")
    p.add_argument("--layouts", default="packed,padded", help="packed, padded, or both (comma-separated)")
    p.add_argument("--n", type=int, default=2000, help="conversations generated")
    p.add_argument("--steps", type=int, default=6, help="timed optimizer steps")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps after the shape warm-up")
    p.add_argument("--device", default=None, help="default: cuda when present, else cpu")
    p.add_argument("--write-jsonl", metavar="FILE", help="write mixed-length chats (tiny words) and stop")
    p.add_argument("--scale", type=float, default=1.0, help="--write-jsonl: lengths times this")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--pack-chunks", default="", help='data.pack_chunks: 1, 2, 4 or auto (default: the recipe\'s)')
    p.add_argument("--profile", action="store_true", help="one more step under torch.profiler: kernel time by kind")
    p.add_argument("--memory-cap-gib", type=float, default=0.0,
                   help="cap PyTorch's allocator at this many GiB (torch.cuda.set_per_process_memory_fraction): "
                        "does a layout fit a smaller GPU")
    p.add_argument("--fp8-target", action="store_true",
                   help="target.fp8: the target's decoder linears as FP8 GEMMs; reports how far the taps move")
    p.add_argument("--sync-check", action="store_true", help="one more step in CUDA's sync debug mode: where it syncs")
    a = p.parse_args()
    if a.write_jsonl:
        write_jsonl(a.write_jsonl, a.n, a.seed, a.scale)
        print(json.dumps({"wrote": a.write_jsonl, "conversations": a.n}))
        return 0
    import torch

    a.device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if a.device == "cpu":
        torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    elif a.memory_cap_gib:
        total = torch.cuda.get_device_properties(a.device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, a.memory_cap_gib * 2**30 / total), torch.device(a.device).index or 0)
    Path(a.out).mkdir(parents=True, exist_ok=True)
    results = []
    machine = machine_gemm(a.device) if a.device.startswith("cuda") else {}
    for layout in a.layouts.split(","):
        r = {**run_layout(a, layout.strip() == "packed"), **machine}
        print(json.dumps(r), flush=True)
        results.append(r)
        import gc

        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    name = (f"dflash_mixed{'_uniform' if a.uniform else ''}{'_small' if a.small else ''}"
            f"{f'_chunks{a.pack_chunks}' if a.pack_chunks else ''}{'_fp8' if a.fp8_target else ''}.json")
    (Path(a.out) / name).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
