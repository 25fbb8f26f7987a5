"""Measured acceptance: speculative decoding of the drafter with its target on prompts, per prompt
and overall, by block position, the prompts far below the rest, the training-time estimate beside
it, and what the data can say about a gap.

- τ per prompt = mean acceptance length of its rounds (dflash.eval's loop: greedy, or speculative
  sampling at `temperature`), every prompt decoded together (dflash.eval.batched; the batch-1
  reference for a target it cannot batch); overall τ = mean over all rounds.
- Far below the rest: compilewatch.low_outliers (below 60% of the median of the others).
- Training estimate: metrics.jsonl beside the checkpoint (the run directory): the mean `tau_estimate`
  and per-slot accuracy of the last TRAIN_ROWS logged steps up to the checkpoint's step.
- Token overlap: the share of a prompt's token ids seen in the training data (its first
  OVERLAP_RECORDS conversations, rendered through the target's template).
- Template: each prompt rendered with the template recorded at training and with the target's now.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

TRAIN_ROWS = 20
OVERLAP_RECORDS = 2000
GAP_RATIO = 0.85  # measured τ below this share of the training estimate: a gap worth explaining
LOW_OVERLAP = 0.6


@dataclass(frozen=True)
class PromptAcceptance:
    index: int
    tokens: int  # prompt tokens
    rounds: int
    tau: float
    overlap: float | None  # share of the prompt's token ids seen in the training data
    template_differs: bool | None  # rendered differently by the recorded template (None: not recorded)
    preview: str  # the prompt's last user turn, cut


@dataclass(frozen=True)
class Acceptance:
    prompts: int
    source: str  # where the prompts came from
    temperature: float
    rounds: int
    tau: float
    max_tau: int
    by_position: tuple[float | None, ...]  # block positions 1..B-1 (dflash.eval.generation.acceptance_by_position)
    per_prompt: tuple[PromptAcceptance, ...]
    low_prompts: tuple[int, ...]  # indices far below the rest
    training_tau: float | None
    training_accuracy: tuple[float | None, ...] | None
    training_note: str
    explanations: tuple[str, ...]


def training_estimate(ck: Path) -> tuple[float | None, tuple[float | None, ...] | None, str]:
    """(τ estimate, per-slot accuracy, where they came from) from the run's metrics.jsonl."""
    run = ck.parent.parent if ck.parent.name == "checkpoints" else None
    path = run / "metrics.jsonl" if run is not None else None
    if path is None or not path.is_file():
        return None, None, "no metrics.jsonl beside the export (not inside a run directory): no training estimate"
    step = int(ck.name.split("_")[-1]) if ck.name.startswith("step_") and ck.name.split("_")[-1].isdigit() else None
    rows = []
    with open(path, encoding="utf-8", errors="replace") as fh:
        for line in fh:
            try:
                r = json.loads(line)
            except ValueError:
                continue
            if isinstance(r, dict) and "event" not in r and isinstance(r.get("step"), int) and \
                    isinstance(r.get("tau_estimate"), (int, float)) and (step is None or r["step"] <= step):
                rows.append(r)
    rows = rows[-TRAIN_ROWS:]
    taus = [float(r["tau_estimate"]) for r in rows if r["tau_estimate"] == r["tau_estimate"]]
    if not taus:
        return None, None, f"{path} has no step rows up to this checkpoint: no training estimate"
    accs = [r.get("accuracy") for r in rows if isinstance(r.get("accuracy"), list)]
    acc = tuple(statistics.fmean(a[k] for a in accs if len(a) > k and a[k] is not None) if any(
        len(a) > k and a[k] is not None for a in accs) else None for k in range(max(map(len, accs), default=0)))
    return statistics.fmean(taus), acc or None, (f"mean of the last {len(taus)} logged steps up to step "
                                                 f"{rows[-1]['step']} (training batches, teacher-forced)")


def training_tokens(data_cfg, tokenizer) -> set[int] | None:
    """Token ids of the training data's first OVERLAP_RECORDS conversations (None: unreadable)."""
    from dflash.config import EMBEDDED_DATA
    from dflash.data.dataset import capped_lines, load_conversations, normalize_record, render_ids

    try:
        if data_cfg.path == EMBEDDED_DATA:
            convs = load_conversations(data_cfg)[0][:OVERLAP_RECORDS]
        else:
            convs = []
            with open(data_cfg.path, "rb") as fh:
                for _n, raw in capped_lines(fh, data_cfg.line_bytes()):
                    if raw is None:
                        continue
                    try:
                        convs.append(normalize_record(json.loads(raw)))
                    except (ValueError, TypeError, KeyError, AttributeError, RecursionError):
                        continue
                    if len(convs) >= OVERLAP_RECORDS:
                        break
        seen: set[int] = set()
        for c in convs:
            try:
                seen.update(render_ids(tokenizer, c, add_generation_prompt=False))
            except Exception:  # noqa: BLE001 - a conversation the template rejects adds nothing
                continue
        return seen or None
    except OSError:
        return None


def decode(drafter, target, prompts: list[list[int]], *, max_new_tokens: int, temperature: float, seed: int,
           progress: Callable[[int, int], None] | None = None) -> list:
    """One Generation per prompt: batched where the target allows it, else the batch-1 reference.
    Sampling draws from a generator seeded with `seed` (on the target's device when batched)."""
    import torch
    from dflash.eval.batched import batched_unsupported, speculative_batch
    from dflash.eval.evaluate import DrafterProposer, speculative_generate

    block = drafter.spec.block_size
    gen = torch.Generator().manual_seed(seed)
    if progress:
        progress(0, len(prompts))
    if batched_unsupported(target, block) is None:
        out = speculative_batch(drafter, target, prompts, max_new_tokens, block, temperature=temperature,
                                generator=gen, on_done=(lambda k: progress(k, len(prompts))) if progress else None)
        if progress:
            progress(len(prompts), len(prompts))  # rows that ended at their first token report nothing
        return list(out.generations)
    proposer = DrafterProposer(drafter, target)
    gens = []
    for i, p in enumerate(prompts):
        gens.append(speculative_generate(proposer, target, p, max_new_tokens, block, temperature=temperature,
                                         generator=gen))
        if progress:
            progress(i + 1, len(prompts))
    return gens


def measure(drafter, target, convs: list, source: str, *, max_new_tokens: int, temperature: float, seed: int,
            ck: Path, data_cfg, recorded_template: str | None,
            progress: Callable[[int, int], None] | None = None) -> Acceptance:
    from compilewatch import low_outliers
    from dflash.check.record import render_prompt
    from dflash.eval.evaluate import acceptance_by_position, prompt_ids

    tok = target.tokenizer
    prompts = prompt_ids(tok, convs)
    block = drafter.spec.block_size
    seen = training_tokens(data_cfg, tok) if data_cfg is not None else None
    gens = decode(drafter, target, prompts, max_new_tokens=max_new_tokens, temperature=temperature, seed=seed,
                  progress=progress)
    per, acc_all, accepted, drafted = [], [], [], []
    for i, (conv, p, g) in enumerate(zip(convs, prompts, gens)):
        acc_all += g.acceptance
        accepted += g.accepted
        drafted += g.drafted
        differs = None
        if recorded_template is not None:
            try:
                differs = render_prompt(tok, conv, recorded_template) != render_prompt(tok, conv)
            except Exception:  # noqa: BLE001 - the recorded template cannot render it: it differs
                differs = True
        last_user = next((m["content"] for m in reversed(conv) if m["role"] == "user"), "")
        per.append(PromptAcceptance(
            index=i, tokens=len(p), rounds=len(g.acceptance),
            tau=statistics.fmean(g.acceptance) if g.acceptance else float("nan"),
            overlap=(sum(t in seen for t in p) / len(p)) if seen is not None and p else None,
            template_differs=differs, preview=last_user[:40]))
    tau = statistics.fmean(acc_all) if acc_all else float("nan")
    low = tuple(sorted(low_outliers({a.index: a.tau for a in per if a.tau == a.tau})))
    t_tau, t_acc, t_note = training_estimate(ck)
    return Acceptance(prompts=len(per), source=source, temperature=temperature, rounds=len(acc_all), tau=tau,
                      max_tau=block, by_position=tuple(acceptance_by_position(accepted, drafted, block)),
                      per_prompt=tuple(per), low_prompts=low, training_tau=t_tau, training_accuracy=t_acc,
                      training_note=t_note, explanations=tuple(explain(per, low, tau, t_tau, temperature, seen, data_cfg)))


def explain(per: list[PromptAcceptance], low: tuple[int, ...], tau: float, t_tau: float | None,
            temperature: float, seen: set[int] | None, data_cfg=None) -> list[str]:
    """What the data says about the measured τ against the training estimate, and the low prompts."""
    out: list[str] = []
    differs = [a.index for a in per if a.template_differs]
    if differs:
        out.append(f"{len(differs)} of {len(per)} prompts render differently with the chat template of training "
                   "than with the target's now: the drafter never saw these prompt endings")
    ov = [a.overlap for a in per if a.overlap is not None]
    if seen is None:
        out.append("the training data could not be read here: token overlap not measured")
    elif ov and statistics.fmean(ov) < LOW_OVERLAP:
        out.append(f"the prompts share only {statistics.fmean(ov):.0%} of their tokens with the training data "
                   "(first records): they are unlike what the drafter learned")
    if low:
        lo = [per[i].overlap for i in low if per[i].overlap is not None]
        rest = [a.overlap for a in per if a.index not in low and a.overlap is not None]
        if lo and rest and statistics.fmean(lo) < statistics.fmean(rest) - 0.15:
            out.append(f"the low prompts share {statistics.fmean(lo):.0%} of their tokens with the training data, "
                       f"the others {statistics.fmean(rest):.0%}")
    if temperature > 0:
        out.append(f"sampled at temperature {temperature:g}: acceptance falls with temperature; the training "
                   "estimate is greedy (argmax per slot)")
    if t_tau is not None and tau == tau:
        if tau < GAP_RATIO * t_tau:
            head = f"measured τ {tau:.2f} is below the training estimate {t_tau:.2f}"
            if not out:
                regen = "" if getattr(data_cfg, "regenerate", True) else (
                    "; the training answers were not regenerated by the target: `dflash regen` makes them its own")
                out.append(head + ": the prompts, template and tokens here do not explain it (the estimate is "
                           "teacher-forced on training batches; decoding drafts from the drafter's own accepted "
                           f"context, past the training answers' length){regen}")
            else:
                out.insert(0, head + ":")
        else:
            out.insert(0, f"measured τ {tau:.2f} is in line with the training estimate {t_tau:.2f}")
    return out
