"""`dflash regen INPUT OUTPUT`: regenerate a chat dataset's answers with the target."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

import typer

from cli import output
from cli.options import DeviceOpt, JsonOpt
from dflash import EMBEDDED_TARGET

if TYPE_CHECKING:
    from dflash import RegenResult


def regen_cmd(
    input: Annotated[str, typer.Argument(help="Chat JSONL (messages or ShareGPT conversations).")],
    out_path: Annotated[str, typer.Argument(metavar="OUTPUT", help="Where to write the regenerated chat JSONL.")],
    target: Annotated[str, typer.Option("--target", help="Local HF target directory.")] = EMBEDDED_TARGET,
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens", help="Longest answer.")] = 512,
    batch_size: Annotated[int, typer.Option("--batch-size", help="Conversations generated together.")] = 32,
    temperature: Annotated[float, typer.Option("--temperature", help="Sampling temperature; 0 is greedy.")] = 0.0,
    device: DeviceOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Answer every user turn again with the target (how DFlash training data is made).

    Examples:
      dflash regen data/sharegpt.jsonl data/regen.jsonl \\
        --target /models/Qwen3-8B --device 0
    """
    import dflash  # torch and transformers: only when regenerating
    from cli.dflash_progress import TrainProgress

    with TrainProgress() as progress:
        result = dflash.regen(input, out_path, target=target, device=device, max_new_tokens=max_new_tokens,
                              batch_size=batch_size, temperature=temperature, on_event=progress)
    output.emit(result, as_json, _render)


def _render(r: RegenResult) -> None:
    output.out.print(f"regenerated {r.turns} answers in {r.conversations} conversations ({r.generated_tokens} tokens, "
                     f"{output.fmt_seconds(r.seconds)}) -> {r.output}")
