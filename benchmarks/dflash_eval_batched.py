"""Eval decoding, batch-1 reference vs batched (issue 39 part 3, issue 40's 8B bound): seconds, rounds, τ.

For each case (P prompts × N new tokens), the same drafter and prompts through
- `old`: dflash.eval.reference's loop (what its `evaluate` runs), what `dflash eval`/`check` and periodic eval ran before:
  one prompt at a time, plain then speculative, transformers DynamicCache, eager (on at most
  --old-prompts prompts: at 8B it costs ~75 ms a round);
- `batched`: what they run now (dflash.eval.evaluate.evaluate_drafter's batched path): the warm-up,
  plain_batch and speculative_batch over all P prompts at once (CUDA graphs on CUDA unless
  --no-graphs). `eval_wall_s` is all of it: what a periodic eval or `dflash eval` waits for decoding.
One JSON line per case on stdout: seconds (plain, speculative, the whole eval), verify rounds summed
over prompts, batched forwards (`steps`), τ, and on how many of the prompts both decoders gave the
same tokens (bf16 on a GPU may differ where two logits tie within rounding).

`--periodic N`: instead, per case, N consecutive evals as a training run's periodic eval makes them
(dflash.eval.in_training): one dflash.eval.reuse.EvalState for all of them, the drafter in fp32 as the
trainer holds it, its weights changed in place between evals (as an optimizer step changes them). One
JSON line per eval: its wall seconds (`eval_wall_s`: what the periodic_eval event's `seconds` counts
of decoding), τ, speedup, and what it captured and reused (graphs, the plain baseline, the warm-up);
`--check-fresh` then decodes the last weights once more without the state and says whether τ, rounds
and the acceptance histogram are the same. Each row has the eval's own `parts_s` (what the periodic_eval
event carries) and `calls_s` (every timed call: the warm-up's plain and speculative decodes come first);
`--profile-first` runs the first eval under cProfile (`host_profile`: where its first-call seconds go).

Targets: the embedded tiny one (default; CPU), `--target DIR` (a local Hugging Face directory), or
`--random-8b` (a Qwen3-8B-shaped model with random weights, bf16 on CUDA, built from its config on the device:
no download). The drafter is a random one of the recipe's shape (τ ≈ 1: the time per round is what
is measured), or `--drafter EXPORT` (a trained export). Prompts: the embedded chat prompts through the
target's template when it has a tokenizer, else random token ids of --prompt-tokens/2 .. --prompt-tokens.

    CPU:        python benchmarks/dflash_eval_batched.py
                python benchmarks/dflash_eval_batched.py --cases 4x32 --periodic 3 --check-fresh
    GPU (8B):   python benchmarks/dflash_eval_batched.py --random-8b --device cuda
                python benchmarks/dflash_eval_batched.py --random-8b --device cuda --cases 4x256 --periodic 3 --check-fresh
                python benchmarks/dflash_eval_batched.py --random-8b --device cuda --cases 4x256 --periodic 2 --profile-first
                python benchmarks/dflash_eval_batched.py --target /models/Qwen3-8B --device cuda --drafter RUN
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

def random_8b(device: torch.device, num_draft_layers: int):
    """A frozen Qwen3-8B-shaped target with random weights made on `device` in the dtype `load_target`
    would use there (bf16 on CUDA, made straight in bf16: no fp32 copy; fp32 on CPU): dflash_e2e's."""
    from dflash.model.target import resolve_dtype
    from dflash_e2e import QWEN3_8B, random_target

    t = random_target(QWEN3_8B, device, resolve_dtype("auto", device), num_draft_layers)
    t.source = "benchmark:random-8b"
    return t


def build(a):
    """(target, drafter) as the arguments ask: the drafter on the target's device, in its dtype."""
    from dflash.config import apply_overrides, qwen3_8b, tiny
    from dflash.model.build import build_drafter, drafter_spec
    from dflash.model.target import load_target

    dev = torch.device(a.device)
    base = tiny() if not (a.random_8b or a.target) else qwen3_8b()
    cfg = apply_overrides(base, {"train.compile_layers": False, **({"target.path": a.target} if a.target else {})})
    if a.drafter:
        from dflash.checkpoint.store import load_export, read_export_spec, resolve_checkpoint

        ck = resolve_checkpoint(a.drafter)
        spec = read_export_spec(ck)
        n_layers = spec.num_hidden_layers
    else:
        ck, spec, n_layers = None, None, cfg.drafter.num_layers
    target = random_8b(dev, n_layers) if a.random_8b else load_target(cfg.target, n_layers, dev)
    if ck is not None:
        target.layer_ids = tuple(spec.target_layer_ids)
        drafter = load_export(ck, spec=spec)
    else:
        drafter = build_drafter(cfg, drafter_spec(cfg, target), dev)
    return target, drafter.to(dev, target.dtype).eval()


def make_prompts(target, n: int, max_tokens: int) -> list[list[int]]:
    if target.tokenizer is not None:
        from dflash.data.dataset import embedded_prompts
        from dflash.eval.evaluate import prompt_ids

        ids = prompt_ids(target.tokenizer, embedded_prompts(n, seed=0))
        return [ids[i % len(ids)] for i in range(n)]
    g = torch.Generator().manual_seed(0)
    lens = torch.randint(max(1, max_tokens // 2), max_tokens + 1, (n,), generator=g).tolist()
    return [torch.randint(0, target.vocab_size - 1, (k,), generator=g).tolist() for k in lens]


def case(target, drafter, prompts: list[list[int]], new: int, old_prompts: int, use_graphs: bool | None) -> dict:
    from dflash.eval.batched import batched_unsupported, plain_batch, speculative_batch
    from dflash.eval.divergence import weigh
    from dflash.eval.generation import summarize, sync
    from dflash.eval.reference import DrafterProposer, plain_generate, speculative_generate

    bs = drafter.spec.block_size
    why = batched_unsupported(target, bs)
    if why is not None:
        return {"error": f"cannot batch this target: {why}"}
    row: dict = {"prompts": len(prompts), "new_tokens": new, "block_size": bs,
                 "prompt_tokens": [min(map(len, prompts)), max(map(len, prompts))]}
    t0 = time.perf_counter()
    plain_batch(target, prompts[:1], 2, use_graphs=False)  # the warm-up evaluate_drafter runs
    speculative_batch(drafter, target, prompts[:1], 2, bs, use_graphs=False)
    plain = plain_batch(target, prompts, new, use_graphs=use_graphs)
    spec = speculative_batch(drafter, target, prompts, new, bs, use_graphs=use_graphs)
    sync(target.device)
    wall = time.perf_counter() - t0
    r = summarize(list(plain.generations), list(spec.generations), plain.seconds, spec.seconds, bs)
    t_w = time.perf_counter()
    r = weigh(r, target, prompts)  # evaluate_drafter's last part: each divergence's logit gap
    sync(target.device)
    weigh_s = time.perf_counter() - t_w
    row["batched"] = {"eval_wall_s": round(wall, 3), "spec_s": round(spec.seconds, 3), "plain_s": round(plain.seconds, 3),
                      "rounds": r.rounds, "steps": spec.steps, "plain_steps": plain.steps, "tau": round(r.tau, 4),
                      "speedup": round(r.speedup, 3), "outputs_match": r.outputs_match,
                      "mismatched_prompts": r.mismatched_prompts, "near_tie_prompts": r.near_tie_prompts,
                      "weigh_s": round(weigh_s, 3),
                      "divergences": [{"position": d.position, "gap": None if d.logit_gap is None else round(d.logit_gap, 4),
                                       "tolerance": None if d.tolerance is None else round(d.tolerance, 4)}
                                      for d in r.divergences],
                      "graphs": spec.graphs and plain.graphs, "notes": list(plain.notes + spec.notes)}
    k = min(old_prompts, len(prompts))
    if k:  # what dflash.eval.reference.evaluate runs, prompt by prompt (its tokens kept for the comparison)
        proposer = DrafterProposer(drafter, target)
        plain_generate(target, prompts[0], 2)  # its warm-up
        speculative_generate(proposer, target, prompts[0], 2, bs)
        t0 = time.perf_counter()
        plains, specs = [], []
        for p in prompts[:k]:
            plains.append(plain_generate(target, p, new))
            specs.append(speculative_generate(proposer, target, p, new, bs))
        wall = time.perf_counter() - t0
        o = summarize(plains, specs, sum(g.seconds for g in plains), sum(g.seconds for g in specs), bs)
        row["old"] = {"prompts": k, "eval_wall_s": round(wall, 3), "spec_s": round(o.spec_seconds, 3),
                      "plain_s": round(o.plain_seconds, 3), "rounds": o.rounds, "tau": round(o.tau, 4),
                      "speedup": round(o.speedup, 3), "outputs_match": o.outputs_match,
                      "spec_s_per_prompt": round(o.spec_seconds / k, 3)}
        same = sum(g.tokens == b.tokens and g.acceptance == b.acceptance for g, b in zip(specs, spec.generations))
        row["same_as_batched"] = f"{same}/{k} prompts (tokens and acceptance)"
    return row


@contextlib.contextmanager
def timed_calls():
    """Seconds evaluate_drafter spends in each of its parts, by name, appended to the yielded dict's lists:
    `weigh` (dflash.eval.divergence.weigh, the near-tie forwards), `plain` and `speculative` (each call of
    dflash.eval.batched's plain_batch / speculative_batch: the first of each is the eval's eager warm-up
    when it makes one), `workspace` (EvalState.workspace_for: the speculative buffers). A periodic eval's
    wall time is these plus what is left (the comparison, the bookkeeping)."""
    import dflash.eval.batched as batched
    import dflash.eval.divergence as div
    from dflash.eval.reuse import EvalState

    spent: dict[str, list[float]] = {}
    patched = [(div, "weigh", "weigh"), (batched, "plain_batch", "plain"),
               (batched, "speculative_batch", "speculative"), (EvalState, "workspace_for", "workspace")]
    real = [getattr(owner, attr) for owner, attr, _ in patched]

    def timed(fn, name):
        def call(*args, **kw):
            t = time.perf_counter()
            try:
                return fn(*args, **kw)
            finally:
                if torch.cuda.is_available():
                    torch.cuda.synchronize()
                spent.setdefault(name, []).append(round(time.perf_counter() - t, 3))
        return call

    for (owner, attr, name), fn in zip(patched, real):
        setattr(owner, attr, timed(fn, name))
    try:
        yield spent
    finally:
        for (owner, attr, _), fn in zip(patched, real):
            setattr(owner, attr, fn)


def host_profile(fn, top: int = 40) -> tuple[object, list[str]]:
    """(fn(), the `top` functions by cumulative time under cProfile): where a first eval's host seconds
    go (first calls, kernel loading inside the first launches, imports), one line per function."""
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    out = prof.runcall(fn)
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("cumulative").print_stats(top)
    lines = [ln.rstrip() for ln in s.getvalue().splitlines() if ln.strip()]
    return out, lines[-top - 1:]


def periodic(target, drafter, prompts: list[list[int]], new: int, evals: int, use_graphs: bool | None,
             check_fresh: bool, profile_first: bool = False) -> list[dict]:
    """`evals` periodic evals on one EvalState (module docstring): one row each, then the fresh check.
    `profile_first`: the first eval under cProfile (its row gains `host_profile`; its times include
    cProfile's overhead, so the later rows are the timing)."""
    import copy

    from dflash.eval.evaluate import evaluate_drafter
    from dflash.eval.generation import sync
    from dflash.eval.reuse import EvalState

    bs = drafter.spec.block_size
    training = copy.deepcopy(drafter).float().eval()  # the trainer's fp32 master weights
    state = EvalState()
    rows, same = [], ("prompts", "rounds", "tau", "acceptance_histogram", "outputs_match")
    r = None
    for i in range(evals):
        if i:
            with torch.no_grad():  # an optimizer step's worth of change, in place: the graphs read these tensors
                for p in training.parameters():
                    p.mul_(1 - 1e-3)
        notes: list[str] = []
        sync(target.device)
        t0 = time.perf_counter()
        hot: list[str] = []
        with timed_calls() as parts:
            def run():
                return evaluate_drafter(training, target, prompts, new, bs, use_graphs=use_graphs, state=state,
                                        step=i + 1, on_note=notes.append)
            if profile_first and i == 0:
                r, hot = host_profile(run)
            else:
                r = run()
        sync(target.device)
        rows.append({"eval": i + 1, "eval_wall_s": round(time.perf_counter() - t0, 3), "spec_s": round(r.spec_seconds, 3),
                     "plain_s": round(r.plain_seconds, 3), "weigh_s": round(sum(parts.get("weigh", [])), 3),
                     "calls_s": parts,  # each timed call (the warm-up's plain and speculative first); parts_s: the eval's own
                     "tau": round(r.tau, 4), "rounds": r.rounds,
                     "speedup": round(r.speedup, 3), "outputs_match": r.outputs_match,
                     "mismatched_prompts": r.mismatched_prompts, "near_tie_prompts": r.near_tie_prompts,
                     **(state.last.event() if state.last else {}), "notes": notes,
                     **({"host_profile": hot} if hot else {})})
    if check_fresh and r is not None:
        t0 = time.perf_counter()
        fresh = evaluate_drafter(training, target, prompts, new, bs, use_graphs=use_graphs)
        rows.append({"fresh": True, "eval_wall_s": round(time.perf_counter() - t0, 3), "tau": round(fresh.tau, 4),
                     "same_as_last_periodic": all(getattr(fresh, k) == getattr(r, k) for k in same)})
    return rows


def profile_decode(target, drafter, prompts: list[list[int]], new: int) -> dict:
    """plain_batch and speculative_batch over `prompts` for `new` tokens (CUDA graphs), each run once unprofiled,
    then once under torch.profiler: wall seconds, steps, GPU kernel time by kind (dflash_mixed's kinds), kernels
    per step, and the GPU's idle time: is a decode step bound by its kernels or by the host between them."""
    from torch.profiler import ProfilerActivity, profile

    from dflash.eval.batched import plain_batch, speculative_batch
    from dflash_mixed import gpu_idle, kernel_kind

    bs = drafter.spec.block_size
    runs = {"plain": lambda: plain_batch(target, prompts, new),
            "speculative": lambda: speculative_batch(drafter, target, prompts, new, bs)}
    out = {}
    for name, fn in runs.items():
        fn()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            t0 = time.perf_counter()
            d = fn()
            torch.cuda.synchronize()
            wall = time.perf_counter() - t0
        kinds: dict[str, float] = {}
        n_kernels = 0
        for ev in prof.events():
            if ev.device_type == torch.autograd.DeviceType.CUDA and ev.time_range.end > ev.time_range.start:
                kinds[kernel_kind(ev.name)] = kinds.get(kernel_kind(ev.name), 0.0) + (ev.time_range.end - ev.time_range.start) / 1e3
                n_kernels += 1
        top: dict[str, float] = {}
        for ev in prof.key_averages():
            us = getattr(ev, "self_device_time_total", 0.0) or 0.0
            if ev.device_type == torch.autograd.DeviceType.CUDA and us > 0:
                top[ev.key[:100]] = us / 1e3
        out[name] = {"wall_s": round(wall, 3), "steps": d.steps, "graphs": d.graphs, "ms_per_step": round(wall * 1e3 / max(1, d.steps), 2),
                     "kernels_per_step": round(n_kernels / max(1, d.steps), 1), "setup_s": round(d.setup_s, 3),
                     "kernel_ms_by_kind": {k: round(v, 1) for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])},
                     "top_kernels_ms": dict(sorted(top.items(), key=lambda kv: -kv[1])[:15]), **gpu_idle(prof, top=6)}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", help="a local Hugging Face model directory (default: the embedded tiny target)")
    ap.add_argument("--random-8b", action="store_true", help="a random-weight Qwen3-8B-shaped target (no download)")
    ap.add_argument("--drafter", help="a trained export, checkpoint or run directory (default: a random drafter)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--cases", default="4x256,64x128",
                    help="PROMPTSxNEW_TOKENS, comma-separated (default: a periodic eval and `dflash eval -n 64`)")
    ap.add_argument("--prompt-tokens", type=int, default=300, help="longest random prompt (targets without a tokenizer)")
    ap.add_argument("--old-prompts", type=int, default=None,
                    help="prompts the batch-1 reference decodes per case (default: all on CPU, 4 on CUDA)")
    ap.add_argument("--no-graphs", action="store_true", help="run the batched steps eagerly on CUDA too")
    ap.add_argument("--threads", type=int, default=1, help="CPU torch threads (the tiny recipe uses 1)")
    ap.add_argument("--periodic", type=int, default=0, metavar="N",
                    help="N consecutive periodic evals per case on one trainer-like EvalState (one line per eval)")
    ap.add_argument("--profile", type=int, default=0, metavar="NEW",
                    help="CUDA: per case, plain and speculative decoding of NEW tokens under torch.profiler (one JSON line)")
    ap.add_argument("--check-fresh", action="store_true",
                    help="with --periodic: decode the last weights again without the state; same τ?")
    ap.add_argument("--profile-first", action="store_true",
                    help="with --periodic: the first eval under cProfile (its row's host_profile: where its "
                         "first-call seconds go; its times then include cProfile's overhead)")
    ap.add_argument("--no-cudnn-sdpa", action="store_true",
                    help="CUDA: take cuDNN out of sdpa's backends for the whole process (what its per-shape "
                         "plan building costs a first eval)")
    a = ap.parse_args(argv)
    if a.no_cudnn_sdpa:
        torch.backends.cuda.enable_cudnn_sdp(False)
    if a.device == "cpu":
        torch.set_num_threads(a.threads)
    cases = [tuple(int(x) for x in c.lower().split("x")) for c in a.cases.split(",")]
    t0 = time.perf_counter()
    target, drafter = build(a)
    print(f"built target {target.source} and drafter on {a.device} in {time.perf_counter() - t0:.1f} s",
          file=sys.stderr)
    for n, new in cases:
        if a.profile and target.device.type == "cuda":
            print(json.dumps({"case": f"{n}x{a.profile}", "profile": profile_decode(
                target, drafter, make_prompts(target, n, a.prompt_tokens), a.profile)}), flush=True)
        if a.periodic > 0:
            head = {"case": f"{n}x{new}", "target": target.source, "device": str(target.device)}
            for row in periodic(target, drafter, make_prompts(target, n, a.prompt_tokens), new, a.periodic,
                                False if a.no_graphs else None, a.check_fresh, a.profile_first):
                print(json.dumps({**head, **row}), flush=True)
            continue
        old = a.old_prompts if a.old_prompts is not None else (n if target.device.type == "cpu" else min(n, 4))
        row = {"case": f"{n}x{new}", "target": target.source, "device": str(target.device),
               **case(target, drafter, make_prompts(target, n, a.prompt_tokens), new, old,
                      False if a.no_graphs else None)}
        print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
