"""τ of a drafter while it trains: speculative decoding on a trainer's held-out prompts, at the end
of a run (`eval.at_end`) and every `eval.every` steps (dflash.training.trainer.RunLog). The prompts
are decoded together (dflash.eval.batched: preallocated K/V, CUDA-graph steps on a GPU), so a
periodic eval costs about as many target forwards as one prompt's rounds, not the sum over prompts.

Each trainer has one dflash.eval.reuse.EvalState (`eval_state`, made at its first eval): the later
evals reuse its slots and CUDA graphs, skip the warm-up, and take the first eval's plain baseline
where it applies (the target is frozen: only the drafter trains). The baseline is also kept in the
run directory (RUN/eval_baseline.json, dflash.eval.baseline_store): a resumed run's first eval takes
it from there where it provably applies (the same target files, device, versions, prompts and
budget). `last_cost` says what the latest eval captured and reused. In the split topology the
drafter decodes as a copy beside the target, made at the first eval; later evals copy the trainer's
weights into it in place (its graphs read them by address)."""

from __future__ import annotations

import contextlib
import weakref
from pathlib import Path
from typing import Any

import torch

from dflash.eval import baseline_store
from dflash.eval.evaluate import EvalResult, evaluate_drafter, prompt_ids
from dflash.eval.reuse import EvalState
from dflash.model.build import build_drafter

_STATES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # trainer -> EvalState (none refers back)


def eval_state(trainer: Any) -> EvalState:
    """`trainer`'s EvalState, made the first time it is asked for."""
    state = _STATES.get(trainer)
    if state is None:
        run_dir = getattr(trainer, "run_dir", None)
        cfg = getattr(trainer, "cfg", None)
        shared = baseline_store.shared_root(cfg.eval.baseline_cache) if cfg is not None and run_dir else None
        state = _STATES[trainer] = EvalState(store=Path(run_dir) / baseline_store.FILE if run_dir else None,
                                             shared=shared, run=str(Path(run_dir).resolve()) if run_dir else None)
    return state


def last_cost(trainer: Any) -> dict[str, Any]:
    """What `trainer`'s latest eval captured, reused and measured (EvalCost.event; {} before any)."""
    state = _STATES.get(trainer)
    return state.last.event() if state is not None and state.last is not None else {}


def _note_once(trainer: Any, note: str) -> None:
    """A decode note (graphs turned off, the batch-1 fallback) in the run's notes, once per run."""
    notes = getattr(trainer, "notes", None)
    if isinstance(notes, list) and f"eval: {note}" not in notes:
        notes.append(f"eval: {note}")
        on_event = getattr(trainer, "on_event", None)
        if callable(on_event):  # shown as it happens (`dflash train` prints a notes event), not only in the result
            on_event("notes", {"notes": [f"eval: {note}"]})


def _drafter_beside(t: Any, state: EvalState, device: torch.device):
    """The drafter to decode with where the target lives: the trainer's own, or (split topology) the
    state's copy there with the trainer's current weights."""
    if t.full_target is t.target:
        return t.drafter
    if state.drafter_copy is None:
        state.drafter_copy = build_drafter(t.cfg, t.drafter.spec, device, state=t.drafter.state_dict()).eval()
    else:
        state.drafter_copy.load_state_dict(t.drafter.state_dict())  # in place: the same tensors, new values
    return state.drafter_copy


def evaluate_trainer(trainer: Any, limit: int | None = None) -> EvalResult:
    """Speculative decoding with `trainer`'s drafter (a dflash.training.trainer.Trainer) on its
    held-out prompts (the first `limit` of them); the drafter is back in train mode afterwards."""
    t = trainer
    convs = t.eval_convs[:limit] if limit is not None else t.eval_convs
    t.on_event("phase", {"name": "eval", "prompts": len(convs)})
    t.drafter.eval()
    # the decode never calls the drafter's compiled layer forwards (dflash.eval.draft_step runs their
    # modules); this keeps anything compiled that it does reach from recompiling for decode shapes
    stance = torch.compiler.set_stance("force_eager") if t.cfg.train.compile_layers else contextlib.nullcontext()
    target = t.full_target
    state = eval_state(t)
    try:
        drafter = _drafter_beside(t, state, target.device)
        prompts = prompt_ids(target.tokenizer, convs)
        with stance:
            result = evaluate_drafter(drafter, target, prompts, t.cfg.eval.max_new_tokens, t.cfg.drafter.block_size,
                                      progress=lambda d, n: t.on_event("eval", {"done": d, "total": n}),
                                      on_note=lambda note: _note_once(t, note), state=state, step=t.step)
        if state.store_note is not None:
            _note_once(t, state.store_note)
            state.store_note = None
        return result
    finally:
        t.drafter.train()


def check_evals_fit(trainer: Any) -> None:
    """BadInput at the start, not at the first eval hours later, when the run's evals (periodic and at the
    end) could not fit their K/V slots in the memory free now, before training takes any
    (dflash.eval.slots.check_fits): an eval.max_new_tokens of 10**8, say."""
    from dflash.eval.batched import batched_unsupported, resolve_graphs, spec_length
    from dflash.eval.slots import check_fits

    t, ev = trainer, trainer.cfg.eval
    target = t.full_target
    evals = [(n, key) for n, key, on in ((ev.every_prompts, "eval.every_prompts", ev.every),
                                         (ev.num_prompts, "eval.num_prompts", ev.at_end)) if on]
    if not evals or not t.eval_convs or batched_unsupported(target, t.cfg.drafter.block_size) is not None:
        return
    prompts = prompt_ids(target.tokenizer, t.eval_convs[: max(n for n, _ in evals)])
    for n, key in evals:
        some = prompts[:n]
        check_fits(t.drafter, target, len(some), max(map(len, some)), ev.max_new_tokens,
                   spec_length(some, ev.max_new_tokens, t.cfg.drafter.block_size),
                   resolve_graphs(target.device, None),
                   hint=f"lower eval.max_new_tokens or {key} (--set {key}=N), or turn that eval off")
