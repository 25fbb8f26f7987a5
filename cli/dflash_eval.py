"""`dflash eval CHECKPOINT`: speculative decoding with a trained drafter -> τ and speedup."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Optional

import typer

from cli import output
from cli.options import DeviceOpt, JsonOpt
from compilewatch.errors import CheckFailed

if TYPE_CHECKING:
    from dflash import EvalResult


def eval_cmd(
    checkpoint: Annotated[str, typer.Argument(help="A checkpoint directory, or a run directory (its latest checkpoint).")],
    target: Annotated[Optional[str], typer.Option("--target", help="Target directory (default: the one it was trained with).")] = None,
    data: Annotated[Optional[str], typer.Option("--data", help="Chat JSONL whose last user turns are the prompts.")] = None,
    prompts: Annotated[Optional[int], typer.Option("--prompts", "-n", help="Number of prompts (>= 1).")] = None,
    max_new_tokens: Annotated[Optional[int], typer.Option("--max-new-tokens", help="Tokens generated per prompt.")] = None,
    device: DeviceOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Greedy speculative decoding (drafter proposes a block, target verifies) vs plain target decoding.

    Speculative decoding is lossless: its output must be plain greedy decoding's, token for token, up to
    rounding: where they part, the target's logits of the two tokens are compared, and a gap within what
    the target's dtype rounds (a bf16 near-tie) is reported, not failed. Exit 0: measured, the outputs
    match (or part only at near-ties); 1: they differ beyond rounding on some prompt (the result is
    still printed, with each divergence in --json); 2: bad input (a checkpoint, target or data that
    cannot be read).

    Examples:
      dflash eval runs/tiny-20260101-120000
      dflash eval runs/q8/checkpoints/step_004000 \\
        --data data/test.jsonl -n 64 --json
    """
    from cli.dflash_progress import TrainProgress
    import dflash  # torch and transformers: only when evaluating

    with TrainProgress() as progress:
        def on_progress(done: int, total: int) -> None:
            if done == 0:  # the checkpoint, target and prompts loaded: a bad path was an error before any line
                progress("phase", {"name": "eval", "prompts": total})
            progress("eval", {"done": done, "total": total})

        result = dflash.evaluate(checkpoint, target_path=target, data_path=data, num_prompts=prompts,
                                  max_new_tokens=max_new_tokens, device=device, progress=on_progress,
                                  on_note=output.note)
    output.emit(result, as_json, _render)
    if result.differ_beyond_rounding:
        first = next((d for d in result.divergences if not d.near_tie), None)
        where = "" if first is None else (
            f" (first: prompt {first.prompt}, new token {first.position}: plain {first.plain_token}, speculative "
            f"{first.spec_token}" + (f", logit gap {first.logit_gap:.3g} > {first.tolerance:.3g}"
                                     if first.logit_gap is not None and first.tolerance is not None else "") + ")")
        raise CheckFailed(f"speculative decoding's outputs differ from plain greedy decoding beyond rounding on "
                          f"{output.count(result.differ_beyond_rounding, 'prompt')} of {result.prompts}{where}: "
                          "it must be lossless",
                          hint="the drafter cannot change what is accepted: look at the verify step and the target's "
                               "K/V handling (--json lists every divergence; docs/dflash.md, Evaluation)")


def _render(r: EvalResult) -> None:
    o = output.out
    o.print(f"τ = {r.tau:.2f} accepted tokens per verify round (max {r.max_tau}), {r.rounds} rounds, {output.count(r.prompts, 'prompt')}")
    o.print("acceptance lengths: " + ", ".join(f"{k}: {v}" for k, v in r.acceptance_histogram.items()))
    if r.acceptance_by_position:
        o.print("accepted by block position (share of rounds whose drafts 1..k were all accepted): "
                + " ".join(f"{k}:{a:.2f}" if a is not None else f"{k}:-" for k, a in enumerate(r.acceptance_by_position, 1)))
    o.print(f"speedup {r.speedup:.2f}x: {r.spec_tokens_per_s:,.1f} vs {r.plain_tokens_per_s:,.1f} tokens/s (plain greedy)")
    o.print(_match_line(r, markup=True))


def _match_line(r: EvalResult, markup: bool = False) -> str:
    """One line on whether speculative decoding gave plain greedy decoding's tokens (shared with dflash train)."""
    if r.outputs_match:
        return "outputs match plain greedy decoding"
    ties = (f"{output.count(r.near_tie_prompts, 'prompt')} at near-ties of the target's logits (rounding, "
            "not a failure)") if r.near_tie_prompts else ""
    if not r.differ_beyond_rounding:
        return f"outputs match plain greedy decoding up to rounding: they part on {ties}"
    line = (f"outputs differ from plain greedy decoding on {output.count(r.differ_beyond_rounding, 'prompt')}"
            + (f" (and on {ties})" if ties else ""))
    return f"[red]{line}[/]" if markup else line
