"""τ of a drafter while it trains: speculative decoding on a trainer's held-out prompts, at the end
of a run (`eval.at_end`) and every `eval.every` steps (dflash.training.trainer.RunLog)."""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from dflash.eval.evaluate import DrafterProposer, EvalResult, evaluate, prompt_ids
from dflash.model.build import build_drafter


def evaluate_trainer(trainer: Any, limit: int | None = None) -> EvalResult:
    """Speculative decoding with `trainer`'s drafter (a dflash.training.trainer.Trainer) on its
    held-out prompts (the first `limit` of them); the drafter is back in train mode afterwards."""
    t = trainer
    convs = t.eval_convs[:limit] if limit is not None else t.eval_convs
    t.on_event("phase", {"name": "eval", "prompts": len(convs)})
    t.drafter.eval()
    # decoding shapes change every round: run compiled layers eagerly instead of recompiling them
    stance = torch.compiler.set_stance("force_eager") if t.cfg.train.compile_layers else contextlib.nullcontext()
    target = t.full_target
    # the drafter decodes beside the target: a copy of it where the target lives, when the trainer
    # holds only the target's embedding and head (the engine's split topology)
    drafter = t.drafter if target is t.target else build_drafter(
        t.cfg, t.drafter.spec, target.device, state=t.drafter.state_dict()).eval()
    try:
        prompts = prompt_ids(target.tokenizer, convs)
        with stance:
            return evaluate(DrafterProposer(drafter, target), target, prompts, t.cfg.eval.max_new_tokens,
                            t.cfg.drafter.block_size, progress=lambda d, n: t.on_event("eval", {"done": d, "total": n}))
    finally:
        t.drafter.train()
