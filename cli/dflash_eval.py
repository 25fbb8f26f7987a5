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

    Speculative decoding is lossless: its output must be plain greedy decoding's, token for token.
    Exit 0: measured, the outputs match; 1: they differ on some prompt (the result is still printed,
    `outputs_match: false` in --json); 2: bad input (a checkpoint, target or data that cannot be read).

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
                                  on_note=lambda note: output.err.print(f"[dim]note:[/] {note}"))
    output.emit(result, as_json, _render)
    if not result.outputs_match:
        raise CheckFailed(f"speculative decoding's outputs differ from plain greedy decoding on "
                          f"{output.count(result.mismatched_prompts, 'prompt')} of {result.prompts}: "
                          "it must be lossless",
                          hint="in fp32 a mismatch points to a bug; in bf16, near-tied logits can round either way "
                               "between the two passes (docs/dflash.md, Evaluation)")


def _render(r: EvalResult) -> None:
    o = output.out
    o.print(f"τ = {r.tau:.2f} accepted tokens per verify round (max {r.max_tau}), {r.rounds} rounds, {r.prompts} prompts")
    o.print("acceptance lengths: " + ", ".join(f"{k}: {v}" for k, v in r.acceptance_histogram.items()))
    if r.acceptance_by_position:
        o.print("accepted by block position (share of rounds whose drafts 1..k were all accepted): "
                + " ".join(f"{k}:{a:.2f}" if a is not None else f"{k}:-" for k, a in enumerate(r.acceptance_by_position, 1)))
    o.print(f"speedup {r.speedup:.2f}x: {r.spec_tokens_per_s:,.1f} vs {r.plain_tokens_per_s:,.1f} tokens/s (plain greedy)")
    o.print("outputs match plain greedy decoding" if r.outputs_match
            else f"[red]outputs differ from plain greedy decoding on {output.count(r.mismatched_prompts, 'prompt')}[/]")
