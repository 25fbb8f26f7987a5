"""End-to-end DFlash training throughput at Qwen3-8B scale: one device, the engine, or torchrun ranks.

Builds a Qwen3-8B-shaped target from a transformers `Qwen3Config` with random bf16 weights (no
download), synthetic 3072-token sequences (the first tenth prompt, the rest trained), and runs the
`qwen3_8b` recipe's optimizer steps through the code path `dflash train` runs:

  --mode colocated  (a) one device: `Trainer.train_step` (target forward with taps, drafter
                    forward+backward per micro-batch, clip + fused AdamW), the batches made by the
                    trainer's own `micro_batches`.
  --mode engine     (b) `dflash.engine.program.train_multi` (what `--target-devices/--drafter-devices` run):
                    target worker threads on --target-devices feed drafter replicas on
                    --drafter-devices through the engine's queues; prewarm, guard and watcher on.
                    The trainer (replica 0) holds a full target copy on its device, as the CLI's
                    `Trainer.from_config` does.
  --mode dist       (c) one rank of a torchrun job: `dflash.train(cfg, distributed=True)`
                    (every rank co-located on cuda:LOCAL_RANK, its engine with one target thread and
                    one drafter thread, gradients summed over NCCL in every step barrier).

Only the target and the data are swapped for random ones (`load_target`, `load_training_data`), and
`Trainer.save` does nothing (a 1B-parameter drafter + AdamW checkpoint is ~12 GB of disk writes).

Reports: time to the first step (compile included; cold or warm depending on the inductor cache) and
from process start, the inductor / AOTAutograd cache counters after it, steady-state sequence
tokens/s (median step) and per GPU, the time split per step, MFU of the target forward and of the
drafter step (analytic FLOPs over the measured parts), peak memory per device. colocated also
measures the memory of the target's taps (`--taps-probe`) and the watcher's and guard's overhead on
the real step (`--overhead N`: N interleaved rounds of plain / watcher / guard / both).
Results: <out>/dflash_e2e[_TAG][_rankN].json (and .md without a tag).

GPU (H200):        python benchmarks/dflash_e2e.py --out $OUT
                   python benchmarks/dflash_e2e.py --mode engine --target-devices cuda:0 --drafter-devices cuda:1 --tag b
                   torchrun --standalone --nproc-per-node 2 benchmarks/dflash_e2e.py --mode dist --tag c
CPU smoke (tiny):  python benchmarks/dflash_e2e.py --small --out /tmp/e2e  (--mode engine / dist too)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

T_PROCESS = time.perf_counter()  # before torch is imported: "time to first step" counts from here

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from dflash.config import TopologyConfig, apply_overrides, qwen3_8b  # noqa: E402
from dflash.data.dataset import ChatDataset, DataStats, Sample  # noqa: E402
from dflash.model.drafter import default_layer_ids  # noqa: E402
from dflash.model.fused_norm import fuse_norms  # noqa: E402
from dflash.model.target import Target  # noqa: E402
from dflash.model.build import build_drafter, drafter_spec  # noqa: E402
from dflash.training.trainer import Trainer
from dflash_cold import counters  # noqa: E402
from dflash_step import Shape, compile_times, step_flops  # noqa: E402

QWEN3_8B = dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                rope_theta=1_000_000.0, rms_norm_eps=1e-6, tie_word_embeddings=False)
SMALL = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=1024, rope_theta=10000.0,
             rms_norm_eps=1e-6, tie_word_embeddings=False)


def random_target(fields: dict, device: torch.device, dtype: torch.dtype, num_draft_layers: int,
                  compile_taps: bool = False) -> Target:
    """A frozen Qwen3 of the given shape with random weights, built on `device` (no download);
    `compile_taps` as `load_target` sets it (`target.compile` on CUDA)."""
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
    norms = fuse_norms(model)  # as dflash.model.target.finish_target does for a loaded target
    L = cfg.num_hidden_layers
    return Target(model=model, tokenizer=None, layer_ids=default_layer_ids(L, num_draft_layers),
                  mask_token_id=cfg.vocab_size - 1, device=device, dtype=dtype, source="benchmark:random",
                  notes=[norms] if norms else [], compile_taps=compile_taps and device.type == "cuda")


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


def target_flops(fields: dict, tokens: int, seq: int, layers: int | None = None) -> float:
    """Forward FLOPs of the target over `tokens` tokens in sequences of `seq`: 2·params per token for
    the decoder layers run (`layers`: the taps' forward stops after the last tapped layer; default
    all) plus causal attention; no LM head (the taps need none)."""
    h, i = fields["hidden_size"], fields["intermediate_size"]
    L = layers if layers is not None else fields["num_hidden_layers"]
    q, kv = fields["num_attention_heads"] * fields["head_dim"], fields["num_key_value_heads"] * fields["head_dim"]
    per_layer = h * q + 2 * h * kv + q * h + 3 * h * i
    attn = 2 * 2 * q * (seq * (seq + 1) / 2) * (tokens / seq)  # QK^T and PV over the causal half
    return 2 * L * per_layer * tokens + L * attn


def setup(a):
    """The recipe with the benchmark's overrides, the target's shape fields and the sequence length."""
    fields = SMALL if a.small else QWEN3_8B
    seq = 64 if a.small else a.seq
    over = {"train.max_steps": a.warmup + a.steps, "metrics.log_every": 1, "data.max_length": seq,
            "data.buckets": [seq], "checkpoint.every": 10**9, "target.compile": not a.no_target_compile,
            "data.path": "embedded:tiny-chat",  # never read: the loaders are swapped (random_loaders)
            # the padded layout of uniform sequences, 4 micro-batches of one a step (what this benchmark has
            # always measured; packed training on mixed lengths: benchmarks/dflash_mixed.py)
            "data.pack": False, "data.batch_size": 1, "train.grad_accum": 4, "data.pack_chunks": 1}
    if a.small:
        over.update({"drafter.num_layers": 2, "drafter.block_size": 8, "data.num_anchors": 4})
    return apply_overrides(qwen3_8b(), over), fields, seq


def dtype_on(device: torch.device) -> torch.dtype:
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def n_sequences(a, cfg, world: int = 1, replicas: int = 1) -> int:
    return (a.warmup + a.steps) * cfg.train.grad_accum * cfg.data.batch_size * world * replicas


@contextlib.contextmanager
def random_target_and_data(fields: dict, n_seq: int, seq: int):
    """While open, `dflash train`'s loaders build the random target and the synthetic data (engine,
    dist): `Trainer.from_config` (dflash.training.build) and the engine's per-device target
    (`dflash.engine.program._target_on`) call them. `Trainer.save` does nothing (checkpoints are not what is measured). Restored on exit."""
    import dflash.model.target
    import dflash.training.build

    def load(tcfg, num_draft_layers, device):
        device = torch.device(device)
        return random_target(fields, device, dtype_on(device), num_draft_layers, compile_taps=tcfg.compile)

    def data(cfg_, target, on_event):
        return synthetic_dataset(n_seq, seq, fields["vocab_size"], cfg_), [], []

    saved = (dflash.model.target.load_target, dflash.training.build.load_target, dflash.training.build.load_training_data,
             Trainer.save, Trainer.preflight_disk)
    dflash.model.target.load_target = dflash.training.build.load_target = load
    dflash.training.build.load_training_data = data
    Trainer.save = lambda self, final=False, **kw: str(Path(self.run_dir) / "not-saved")  # type: ignore[method-assign]
    Trainer.preflight_disk = lambda self: None  # type: ignore[method-assign]  # nothing is saved: no disk needed
    try:
        yield
    finally:
        (dflash.model.target.load_target, dflash.training.build.load_target, dflash.training.build.load_training_data,
         Trainer.save, Trainer.preflight_disk) = saved


def shape_of(fields: dict, cfg, seq: int) -> Shape:
    return Shape(hidden=fields["hidden_size"], heads=cfg.drafter.num_attention_heads or fields["num_attention_heads"],
                 kv_heads=fields["num_key_value_heads"], head_dim=fields["head_dim"],
                 intermediate=fields["intermediate_size"], layers=cfg.drafter.num_layers,
                 target_layers=fields["num_hidden_layers"], block=cfg.drafter.block_size,
                 anchors=cfg.data.num_anchors, seq=seq, batch=1, vocab=fields["vocab_size"])


def peak_memory(devices) -> dict:
    out = {}
    for d in dict.fromkeys(str(x) for x in devices):
        if d.startswith("cuda"):
            out[d] = round(torch.cuda.max_memory_allocated(d) / 2**30, 2)
    return out


def env(device: torch.device) -> dict:
    import transformers

    return {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "torch": torch.__version__, "transformers": transformers.__version__,
            "gpus": torch.cuda.device_count() if torch.cuda.is_available() else 0}


def taps_probe(target: Target, dataset: ChatDataset, device: torch.device, sizes=(1, 4)) -> list[dict]:
    """Memory of the target's taps at batch sizes `sizes`: the (B, S, k·H) tensor a producer hands
    over, and the forward's transient peak (output_hidden_states keeps every layer's output)."""
    if device.type != "cuda":
        return []
    out = []
    for b in sizes:
        ids = torch.stack([dataset.samples[i % len(dataset.samples)].input_ids for i in range(b)]).to(device)
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        t = time.perf_counter()
        with torch.no_grad():
            taps = target.taps(ids)
        torch.cuda.synchronize(device)
        out.append({"batch": b, "seconds": round(time.perf_counter() - t, 4),
                    "taps_gb": round(taps.numel() * taps.element_size() / 2**30, 3),
                    "forward_peak_gb": round((torch.cuda.max_memory_allocated(device) - base) / 2**30, 3)})
        del taps
    torch.cuda.reset_peak_memory_stats(device)
    return out


def profiled(fn, into: dict, top: int = 40):
    """fn() under cProfile; the `top` functions by cumulative and by own time into `into` (where
    the first step's seconds go: dynamo tracing, cache loads, kernel loading, CUDA start-up)."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    out = prof.runcall(fn)
    st = pstats.Stats(prof)
    for key, col in (("cumulative", 3), ("self", 2)):  # stats values: (cc, nc, tt, ct, callers)
        rows = sorted(st.stats.items(), key=lambda kv: kv[1][col], reverse=True)[:top]
        into[key] = [{"function": f"{Path(f).name}:{line}({name})", "calls": nc, "self_s": round(tt, 3),
                      "cum_s": round(ct, 3)} for (f, line, name), (cc, nc, tt, ct, _callers) in rows]
    return out


def target_ab(target: Target, fields: dict, ids: torch.Tensor, iters: int = 5, warmup: int = 2) -> list[dict]:
    """The target forward three ways on the same ids: as trained (truncated at the last tap, compiled
    when `target.compile`), truncated eager, and the whole model with output_hidden_states (the code
    before: 36 layers, final norm, one row of logits). Median ms of `iters` after `warmup`; FLOPs of
    the layers each one runs. The whole-model variant runs last: asking transformers for hidden
    states puts capture hooks on the layers, which would break a later compile of them."""
    import dataclasses

    device = ids.device
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    eager = dataclasses.replace(target, compile_taps=False)

    def whole(x):
        out = target.model(input_ids=x, output_hidden_states=True, use_cache=False, logits_to_keep=1)
        return torch.cat([out.hidden_states[i + 1] for i in target.layer_ids], dim=-1)

    seq = ids.shape[1]
    rows = []
    for name, fn, layers in (("as trained" + (" (compiled)" if target.compile_taps else ""), target.taps, target.layers_run),
                             ("truncated, eager", eager.taps, eager.layers_run),
                             ("whole model, eager (before)", whole, target.num_layers)):
        times = []
        with torch.no_grad():
            for k in range(warmup + iters):
                sync()
                t = time.perf_counter()
                out = fn(ids)
                sync()
                times.append(time.perf_counter() - t)
        ms = statistics.median(times[warmup:]) * 1e3
        flops = target_flops(fields, ids.numel(), seq, layers)
        rows.append({"variant": name, "layers": layers, "ms": round(ms, 2), "tflop": round(flops / 1e12, 3),
                     "first_call_s": round(times[0], 2), "shape": list(out.shape)})
    return rows


def run_colocated(a) -> dict:
    device = torch.device(a.device)
    cfg, fields, seq = setup(a)
    cfg = apply_overrides(cfg, {"topology.device": str(device)})
    dtype = dtype_on(device)
    t0 = time.perf_counter()
    target = random_target(fields, device, dtype, cfg.drafter.num_layers, compile_taps=cfg.target.compile)
    build_s = time.perf_counter() - t0
    dataset = synthetic_dataset(n_sequences(a, cfg), seq, fields["vocab_size"], cfg)
    taps = taps_probe(target, dataset, device) if a.taps_probe else []
    drafter = build_drafter(cfg, drafter_spec(cfg, target), device)
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    steps = []
    first_profile: dict = {}
    compiled: dict = {}
    first_counters: dict = {}
    to_first = 0.0
    overhead: dict = {}
    with tempfile.TemporaryDirectory() as run_dir:
        trainer = Trainer(cfg, target, dataset, drafter, Path(run_dir))
        trainer.drafter.train()

        def one_step() -> dict:
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
            return {"seconds": total, "tokens": m.tokens, "loss": m.loss, "split": split,
                    "anchors": [b.anchors for b in batches]}

        for i in range(a.warmup + a.steps):
            st = profiled(one_step, first_profile) if i == 0 and a.profile_first else one_step()
            steps.append(st)
            if i == 0:
                to_first = time.perf_counter() - T_PROCESS
                compiled, first_counters = compile_times(), counters()
                print(f"first step {st['seconds']:.1f} s ({to_first:.1f} s from process start), split {st['split']}, "
                      f"compile times {compiled}, counters {first_counters}", file=sys.stderr, flush=True)
            else:
                print(f"step {i + 1}: {st['seconds']:.3f} s, {st['tokens'] / st['seconds']:,.0f} tok/s",
                      file=sys.stderr, flush=True)
        if a.overhead:
            overhead = measure_overhead(one_step, a.overhead, a.overhead_steps)
        ab = target_ab(target, fields, dataset.samples[0].input_ids[None].to(device)) if a.target_ab else []
        for row in ab:
            print(f"target forward {row['variant']}: {row['ms']} ms ({row['layers']} layers)", file=sys.stderr, flush=True)
        trainer.close()
    timed = steps[a.warmup:]
    med = statistics.median(s["seconds"] for s in timed)
    tokens = timed[0]["tokens"]
    split = {k: statistics.mean(s["split"][k] for s in timed) for k in timed[0]["split"]}
    d_flops = sum(step_flops(shape_of(fields, cfg, seq), anc) for anc in timed[-1]["anchors"])
    t_flops = target_flops(fields, tokens, seq, target.layers_run)
    peak = a.peak_tflops * 1e12
    return {
        "mode": "colocated", "env": {**env(device), "peak_tflops": a.peak_tflops},
        "setup": {"recipe": cfg.recipe, "seq": seq, "grad_accum": cfg.train.grad_accum,
                  "batch_size": cfg.data.batch_size, "anchors": cfg.data.num_anchors,
                  "compile_layers": cfg.train.compile_layers, "target_build_s": round(build_s, 2),
                  "cache_dir": os.environ.get("TORCHINDUCTOR_CACHE_DIR")},
        "first_step_s": steps[0]["seconds"], "process_to_first_step_s": to_first,
        "first_step_split": steps[0]["split"], "compile_s": compiled, "cache_counters_after_first_step": first_counters,
        "step_s": med, "tokens_per_step": tokens, "tokens_per_s": tokens / med, "tokens_per_s_per_gpu": tokens / med,
        "split_s": split, "target_tflop": t_flops / 1e12, "drafter_tflop": d_flops / 1e12,
        "target_mfu": t_flops / split["target"] / peak if split["target"] > 0 else None,
        "drafter_mfu": d_flops / split["drafter"] / peak if split["drafter"] > 0 else None,
        "step_mfu": (t_flops + d_flops) / med / peak,
        "peak_memory_gb": peak_memory([device]).get(str(device)), "taps_probe": taps, "overhead": overhead,
        "first_step_profile": first_profile,
        "target_layers_run": target.layers_run, "target_compiled": target.compile_taps, "target_ab": ab,
        "losses": [round(s["loss"], 4) for s in steps],
    }


def measure_overhead(one_step, rounds: int, per: int) -> dict:
    """The real step plain, under the watcher, under the frozen guard, under both: `rounds` rounds,
    the configurations interleaved inside each round, `per` steps each; median step per configuration.
    The seams are the engine's own (dflash.engine.compile_safety): the guard frozen after warm-up, as the
    engine does after prewarm."""
    from dflash.engine.compile_safety import CompileBarrier, watching

    configs = ("plain", "watcher", "guard", "watcher+guard")
    seen: dict[str, list[float]] = {c: [] for c in configs}
    for _ in range(rounds):
        for c in configs:
            with contextlib.ExitStack() as stack:
                if "guard" in c:
                    barrier = stack.enter_context(CompileBarrier(True))
                    barrier.freeze()
                if "watcher" in c:
                    stack.enter_context(watching(True, stall_after=600.0))
                for _ in range(per):
                    seen[c].append(one_step()["seconds"])
    base = statistics.median(seen["plain"])
    out = {c: {"median_s": statistics.median(v), "min_s": min(v), "n": len(v),
               "overhead_pct": 100 * (statistics.median(v) / base - 1)} for c, v in seen.items()}
    print(f"overhead: {json.dumps(out)}", file=sys.stderr, flush=True)
    return out


def sample_anchors(cfg, fields: dict, seq: int) -> torch.Tensor:
    """The anchors of one micro-batch as the trainer samples them (for the drafter's FLOP count)."""
    ds = synthetic_dataset(cfg.data.batch_size, seq, fields["vocab_size"], cfg)
    return ds.make_batch(ds.epoch_plan(0)[0], 0).anchors


def engine_summary(report, a, cfg, fields: dict, seq: int, gpus: int) -> dict:
    """Steady state of an EngineReport: median committed step after `a.warmup`, its split, MFU, tokens/s."""
    recs = list(report.steps)[a.warmup:] or list(report.steps)
    if not recs:
        return {"outcome": report.outcome, "verdicts": list(report.verdicts),
                "failure": report.failure.error if report.failure else None}
    med = statistics.median(r.wall_s for r in recs)
    tokens = recs[0].tokens or 0
    R = len(report.drafter_devices)
    mean = lambda xs: statistics.mean(xs)  # noqa: E731
    split = {"wall": mean([r.wall_s for r in recs]),
             "drafter_compute": mean([statistics.mean(r.compute_s) for r in recs]),
             "drafter_wait_for_target": mean([statistics.mean(r.wait_s) for r in recs]),
             "barrier": mean([statistics.mean(r.barrier_s) for r in recs]), "reduce": mean([r.reduce_s for r in recs])}
    split["optimizer_and_rest"] = max(0.0, split["wall"] - split["drafter_compute"] - split["drafter_wait_for_target"]
                                      - split["barrier"] - split["reduce"])
    items = (report.steps_done - report.start_step) * cfg.train.grad_accum * R  # micro-batches trained
    targets = [t for t in report.threads if t.role == "target"]
    target_busy = sum(t.busy_s for t in targets)
    per_item_target = target_busy / items if items else None
    d_flops_item = step_flops(shape_of(fields, cfg, seq), sample_anchors(cfg, fields, seq))
    per_item_drafter = split["drafter_compute"] / cfg.train.grad_accum
    depth = max(default_layer_ids(fields["num_hidden_layers"], cfg.drafter.num_layers)) + 1  # taps stop there
    t_flops_item = target_flops(fields, seq * cfg.data.batch_size, seq, depth)
    peak = a.peak_tflops * 1e12
    return {
        "outcome": report.outcome, "target_devices": list(report.target_devices),
        "drafter_devices": list(report.drafter_devices), "guard": report.guard,
        "setup_s": report.setup_s, "prewarm_s": report.prewarm.wall_s if report.prewarm else None,
        "steps_done": report.steps_done, "wall_s": report.wall_s, "step_s": med, "tokens_per_step": tokens,
        "tokens_per_s": tokens / med if med else None, "tokens_per_s_per_gpu": tokens / med / gpus if med else None,
        "gpus": gpus, "split_s": split, "wait_fraction": report.wait_fraction,
        "target_s_per_microbatch": per_item_target, "drafter_s_per_microbatch": per_item_drafter,
        "target_utilization": target_busy / len(targets) / report.wall_s if report.wall_s and targets else None,
        "target_mfu": t_flops_item / per_item_target / peak if per_item_target else None,
        "drafter_mfu": d_flops_item / per_item_drafter / peak if per_item_drafter else None,
        "threads": [{"name": t.name, "busy_s": t.busy_s, "waiting_s": t.waiting_s} for t in report.threads],
        "max_param_diff": report.max_param_diff, "verdicts": list(report.verdicts),
        "failure": report.failure.error if report.failure else None,
        "step_walls": [round(r.wall_s, 4) for r in report.steps],
    }


def run_engine(a) -> dict:
    """(b): the engine as `dflash train --target-devices T --drafter-devices D` runs it."""
    from dflash.engine.program import target_home, train_multi

    cfg, fields, seq = setup(a)
    targets = tuple(a.target_devices.split(","))
    drafters = tuple(a.drafter_devices.split(","))
    dev0 = torch.device(drafters[0])
    cfg = apply_overrides(cfg, {"topology.device": drafters[0]})
    t0 = time.perf_counter()
    with random_target_and_data(fields, n_sequences(a, cfg, replicas=len(drafters)), seq), \
            tempfile.TemporaryDirectory() as run_dir:
        cfg = apply_overrides(cfg, {"checkpoint.out_dir": str(Path(run_dir) / "run")})
        trainer = Trainer.from_config(cfg, target_device=target_home(targets, drafters))  # as dflash.run does
        build_s = time.perf_counter() - t0
        try:
            topo = TopologyConfig(target_devices=targets, drafter_devices=drafters, stall_after=a.stall_after)
            _, report = train_multi(trainer, topo)
        finally:
            trainer.close()
    devices = sorted(set(targets) | set(drafters))
    gpus = len([d for d in devices if d.startswith("cuda")]) or 1
    return {"mode": "engine", "env": {**env(dev0), "peak_tflops": a.peak_tflops},
            "setup": {"seq": seq, "grad_accum": cfg.train.grad_accum, "trainer_build_s": round(build_s, 2),
                      "note": "replica 0 (the trainer) holds the target's embedding and head only when no target "
                              "worker shares its device (dflash.engine.program.target_home)"},
            "process_to_end_s": time.perf_counter() - T_PROCESS,
            **engine_summary(report, a, cfg, fields, seq, gpus), "peak_memory_gb": peak_memory(devices)}


def run_dist(a) -> dict:
    """(c): one rank of `torchrun ... -m dflash train` (co-located on cuda:LOCAL_RANK, NCCL)."""
    import dflash
    from dflash.distributed.group import require_rank_info

    info = require_rank_info()
    cfg, fields, seq = setup(a)
    run = Path(tempfile.gettempdir()) / f"dflash_e2e_dist_{os.environ.get('TORCHELASTIC_RUN_ID', 'run')}"
    cfg = apply_overrides(cfg, {"topology.device": "auto" if not a.small else "cpu", "checkpoint.out_dir": str(run),
                                "topology.stall_after": a.stall_after})
    with random_target_and_data(fields, n_sequences(a, cfg, world=info.world_size), seq):
        out = dflash.train(cfg, distributed=True, info=info).distributed
    dev = torch.device(out.engine.drafter_devices[0])
    return {"mode": "dist", "rank": info.rank, "world_size": info.world_size,
            "env": {**env(dev), "peak_tflops": a.peak_tflops}, "ok": out.ok, "dist_verdicts": list(out.verdicts),
            "process_to_end_s": time.perf_counter() - T_PROCESS,
            **engine_summary(out.engine, a, cfg, fields, seq, 1),
            "peak_memory_gb": peak_memory(out.engine.target_devices + out.engine.drafter_devices)}


def markdown(r: dict) -> str:
    mfu = lambda x: "-" if x is None else f"{x:.1%}"  # noqa: E731
    if r["mode"] != "colocated":
        s = r.get("split_s", {})
        lines = [f"{r['mode']}: device {r['env']['device']} · torch {r['env']['torch']} · targets "
                 f"{r.get('target_devices')} drafters {r.get('drafter_devices')} · outcome {r.get('outcome')}", "",
                 "| tokens/s | per GPU | s/step | drafter compute | wait for target | barrier | reduce | optimizer+rest "
                 "| target s/mb | target MFU | drafter MFU | prewarm s | peak GB |",
                 "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        if "step_s" in r:
            lines.append(f"| {r['tokens_per_s']:,.0f} | {r['tokens_per_s_per_gpu']:,.0f} | {r['step_s']:.3f} | "
                         f"{s['drafter_compute']:.3f} | {s['drafter_wait_for_target']:.3f} | {s['barrier']:.3f} | "
                         f"{s['reduce']:.3f} | {s['optimizer_and_rest']:.3f} | {r['target_s_per_microbatch'] or 0:.3f} | "
                         f"{mfu(r['target_mfu'])} | {mfu(r['drafter_mfu'])} | {r['prewarm_s'] or 0:.1f} | "
                         f"{r['peak_memory_gb']} |")
        return "\n".join(lines + [""])
    s = r["split_s"]
    mem = f"{r['peak_memory_gb']:.1f}" if r["peak_memory_gb"] is not None else "-"
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
    p.add_argument("--mode", choices=("colocated", "engine", "dist"), default="colocated")
    p.add_argument("--tag", default="", help="name the result files dflash_e2e_TAG[_rankN].json (no .md)")
    p.add_argument("--steps", type=int, default=4, help="timed optimizer steps")
    p.add_argument("--warmup", type=int, default=2, help="untimed optimizer steps (the first compiles)")
    p.add_argument("--seq", type=int, default=3072, help="sequence length")
    p.add_argument("--peak-tflops", type=float, default=790.0, help="dense bf16 peak for MFU (H200: 790)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="colocated: the device")
    p.add_argument("--target-devices", default="cuda:0" if torch.cuda.is_available() else "cpu", help="engine mode")
    p.add_argument("--drafter-devices", default="cuda:1" if torch.cuda.device_count() > 1 else "cpu", help="engine mode")
    p.add_argument("--stall-after", type=float, default=600.0, help="engine/dist: the engine's stall watchdog")
    p.add_argument("--taps-probe", action="store_true", help="colocated: measure the taps' memory at batch 1 and 4")
    p.add_argument("--overhead", type=int, default=0, metavar="ROUNDS",
                   help="colocated: after the timed steps, ROUNDS rounds of plain / watcher / guard / both")
    p.add_argument("--overhead-steps", type=int, default=3, help="steps per configuration per round")
    p.add_argument("--target-ab", action="store_true",
                   help="colocated: after the steps, time the target forward as trained / truncated eager / whole model")
    p.add_argument("--profile-first", action="store_true", help="colocated: cProfile the first step (top 40 by cumulative time)")
    p.add_argument("--no-target-compile", action="store_true", help="run the target's layers eagerly (target.compile=false)")
    a = p.parse_args(argv)
    r = {"colocated": run_colocated, "engine": run_engine, "dist": run_dist}[a.mode](a)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    name = "dflash_e2e" + (f"_{a.tag}" if a.tag else "") + (f"_rank{r['rank']}" if "rank" in r else "")
    (out / f"{name}.json").write_text(json.dumps(r, indent=2, default=str) + "\n")
    if not a.tag:
        (out / f"{name}.md").write_text(markdown(r))
    print(markdown(r))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
