"""τ of a drafter while it trains: speculative decoding on a trainer's held-out prompts, at the end
of a run (`eval.at_end`) and every `eval.every` steps (dflash.training.trainer.RunLog). The prompts
are decoded together (dflash.eval.batched: preallocated K/V, CUDA-graph steps on a GPU), so a
periodic eval costs about as many target forwards as one prompt's rounds, not the sum over prompts."""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from dflash.eval.evaluate import EvalResult, evaluate_drafter, prompt_ids
from dflash.model.build import build_drafter


def _note_once(trainer: Any, note: str) -> None:
    """A decode note (graphs turned off, the batch-1 fallback) in the run's notes, once per run."""
    notes = getattr(trainer, "notes", None)
    if isinstance(notes, list) and f"eval: {note}" not in notes:
        notes.append(f"eval: {note}")


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
    # the drafter decodes beside the target: a copy of it where the target lives, when the trainer
    # holds only the target's embedding and head (the engine's split topology)
    drafter = t.drafter if target is t.target else build_drafter(
        t.cfg, t.drafter.spec, target.device, state=t.drafter.state_dict()).eval()
    try:
        prompts = prompt_ids(target.tokenizer, convs)
        with stance:
            return evaluate_drafter(drafter, target, prompts, t.cfg.eval.max_new_tokens, t.cfg.drafter.block_size,
                                    progress=lambda d, n: t.on_event("eval", {"done": d, "total": n}),
                                    on_note=lambda note: _note_once(t, note))
    finally:
        t.drafter.train()
