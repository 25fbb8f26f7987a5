"""`dflash eval`: real speculative decoding with a trained drafter -> τ and speedup vs plain decoding.

Two decoders give the same tokens and the same acceptance under greedy decoding:
- the batched one (dflash.eval.batched): every prompt decoded together over preallocated K/V slots,
  its steps CUDA graphs where the device allows. `dflash eval`, `dflash check` and the trainer's
  periodic eval run it (`evaluate_drafter`).
- the batch-1 reference (dflash.eval.reference: `speculative_generate`, `plain_generate`, `evaluate`
  for any `Proposer`), which the batched one is tested against and falls back to for a target it
  cannot batch (`batched_unsupported`: another attention implementation, sliding-window target
  layers).
What is reported (EvalResult, τ, acceptance by block position, speedup) is dflash.eval.generation's.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Callable

import torch

from dflash.eval.batched import batched_unsupported, evaluate_batched, spec_length
from dflash.eval.generation import EvalResult, Generation, acceptance_by_position
from dflash.eval.reference import DrafterProposer, Proposer, evaluate, plain_generate, speculative_generate
from dflash.flags import check_num_prompts  # its home before dflash.flags: still importable from here

if TYPE_CHECKING:
    from dflash.eval.reuse import EvalState

__all__ = ["EvalResult", "Generation", "acceptance_by_position", "DrafterProposer", "Proposer", "evaluate",
           "plain_generate", "speculative_generate", "evaluate_drafter", "check_num_prompts", "prompt_ids",
           "eval_checkpoint"]


def evaluate_drafter(drafter, target, prompts: list[list[int]], max_new_tokens: int, block_size: int,
                     progress: Callable[[int, int], None] | None = None, *, batched: bool = True,
                     use_graphs: bool | None = None, on_note: Callable[[str], None] | None = None,
                     state: EvalState | None = None, step: int | None = None) -> EvalResult:
    """τ and speedup of `drafter` on `prompts`: batched decoding where the target allows it (and
    `batched`), else the batch-1 reference; `use_graphs`: None = CUDA graphs on CUDA. `on_note`: why
    the reference ran, why graphs were turned off, or that the plain baseline was reused. `state`
    (dflash.eval.reuse.EvalState): what a run's evals keep for the next (`step`: this one's training
    step); without it, as `dflash eval` runs, everything is measured afresh."""
    from dflash.eval.attention import decode_attention
    from dflash.flags import check_count

    check_count(max_new_tokens, "max_new_tokens", "the tokens generated per prompt")
    with decode_attention():  # no cuDNN sdpa: its first-call kernel builds cost a first eval seconds
        return _evaluate(drafter, target, prompts, max_new_tokens, block_size, progress, batched=batched,
                         use_graphs=use_graphs, on_note=on_note, state=state, step=step)


def _evaluate(drafter, target, prompts, max_new_tokens, block_size, progress, *, batched, use_graphs, on_note,
              state, step) -> EvalResult:
    from dflash.eval.divergence import weigh

    why = batched_unsupported(target, block_size) if batched else "asked for the batch-1 reference"
    if why is None:
        result, notes = evaluate_batched(drafter, target, prompts, max_new_tokens, block_size, progress,
                                         use_graphs=use_graphs, state=state, step=step)
        for note in notes:
            if on_note is not None:
                on_note(note)
    else:
        if on_note is not None and batched:
            on_note(f"decoded one prompt at a time: {why}")
        t0 = time.perf_counter()
        result = evaluate(DrafterProposer(drafter, target), target, prompts, max_new_tokens, block_size, progress)
        if state is not None:
            state.record_reference(time.perf_counter() - t0)
    t0 = time.perf_counter()
    result = weigh(result, target, prompts)  # where outputs differ: near-ties of the target's logits or not
    if state is not None and state.last is not None:
        state.last = state.last.with_part("weigh", time.perf_counter() - t0)
    return result


def eval_target_config(target_cfg, device: torch.device):
    """(the target config an eval on `device` runs, a note or None): a run trained with `target.fp8` is
    evaluated with its FP8 target where the device has FP8 GEMMs, and with the target in its dtype where it
    has not (a CPU, an older GPU), rather than refused: the note says that τ is then the unquantized target's."""
    import dataclasses

    from dflash.model import fp8
    from dflash.model.target import resolve_dtype

    if not target_cfg.fp8:
        return target_cfg, None
    why = fp8.unsupported(device, resolve_dtype(target_cfg.dtype, device))
    if why is None:
        return target_cfg, None
    return dataclasses.replace(target_cfg, fp8=False), (
        f"the run trained with target.fp8, which cannot run here ({why}): the target runs unquantized, "
        "so τ is that of the target it was not trained beside")


def prompt_ids(tokenizer, convs: list[list[dict[str, str]]]) -> list[list[int]]:
    from dflash.data.dataset import render_ids

    return [render_ids(tokenizer, c, add_generation_prompt=True) for c in convs]


def eval_checkpoint(path: str, *, target_path: str | None = None, data_path: str | None = None,
                    num_prompts: int | None = None, max_new_tokens: int | None = None, device: str | None = None,
                    progress: Callable[[int, int], None] | None = None,
                    on_note: Callable[[str], None] | None = None) -> EvalResult:
    """Load a checkpoint (or a run's latest), its target and prompts, and evaluate it. The export is
    checked before anything is allocated for it (checksums, config bounds, the weights' header;
    dflash.checkpoint.export_check), and against the target before its weights are read. `on_note`:
    things to tell the user (an export without checksums)."""
    from compilewatch import BadInput
    from dflash.checkpoint import manifest
    from dflash.checkpoint.store import (CONFIG_FILE, EXPORT_FILES, check_compatible, checkpoint_config, load_export,
                                         read_export_spec, resolve_checkpoint)
    from dflash.config import apply_overrides
    from dflash.data.run_prompts import file_prompts, run_eval_prompts
    from dflash.flags import check_max_new_tokens
    from dflash.model.target import load_target, resolve_device

    check_num_prompts(num_prompts)
    check_max_new_tokens(max_new_tokens)
    ck = resolve_checkpoint(path)
    unverified = manifest.check(ck, [*EXPORT_FILES, *([CONFIG_FILE] if (ck / CONFIG_FILE).exists() else [])])
    if unverified and on_note is not None:
        on_note(unverified)
    overrides = {}
    if target_path:
        overrides["target.path"] = target_path
    if data_path:
        overrides["data.path"] = data_path
    cfg = checkpoint_config(ck, overrides)
    if cfg is None:
        if not target_path:
            raise BadInput(f"{str(ck)!r} has no {CONFIG_FILE}; say which target it drafts for",
                           hint="pass --target DIR")
        from dflash.config import tiny

        cfg = apply_overrides(tiny(), overrides)
    dev = resolve_device(device or cfg.topology.device)
    if dev.type == "cpu" and cfg.train.cpu_threads:
        torch.set_num_threads(cfg.train.cpu_threads)
    spec = read_export_spec(ck)
    target_cfg, why = eval_target_config(cfg.target, dev)
    if why is not None and on_note is not None:
        on_note(why)
    target = load_target(target_cfg, spec.num_hidden_layers, dev)
    if cfg.target.layer_ids is None:  # the checkpoint's taps are authoritative
        target.layer_ids = tuple(spec.target_layer_ids)
    check_compatible(spec, target.hidden_size, target.num_layers, target.layer_ids, str(ck),
                     target_vocab=target.vocab_size)
    drafter = load_export(ck, spec=spec).to(dev, target.dtype).eval()
    from dflash.model import nonfinite_parameters

    bad = nonfinite_parameters(drafter)
    if bad:  # it would decode as a drafter that never drafts (τ 1.0), which reads as a measurement
        raise BadInput(f"{str(ck)!r}: {len(bad)} of the drafter's weights hold NaN or infinite values (e.g. {bad[0]}): "
                       "training diverged before this save", hint="evaluate an earlier checkpoint (`dflash check` "
                                                                  "names the tensors)")
    n = num_prompts if num_prompts is not None else cfg.eval.num_prompts
    new = max_new_tokens if max_new_tokens is not None else cfg.eval.max_new_tokens
    # before the prompts are made (the embedded ones are generated: -n 10**9 ran for hours) and tokenized:
    # even prompts of one token each must fit their slots (all rows at once where the decode is batched)
    from dflash.eval.slots import check_fits

    rows = n if batched_unsupported(target, drafter.spec.block_size) is None else 1
    check_fits(drafter, target, rows, 1, new, spec_length([[0]], new, drafter.spec.block_size), False, shortest=True)
    if data_path:
        convs = file_prompts(cfg.data, n)  # BadInput saying why when it has none
    else:  # the run's own data: its held-out prompts, said when some were trained on
        convs, note = run_eval_prompts(cfg, n)
        if note is not None and on_note is not None:
            on_note(note)
    if not convs:
        raise BadInput(f"no prompts found in {cfg.data.path!r}", hint="pass --data with chat JSONL holding user turns")
    prompts = prompt_ids(target.tokenizer, convs)
    return evaluate_drafter(drafter, target, prompts, new, drafter.spec.block_size, progress=progress, on_note=on_note)
