"""`dflash prepare DATA --target DIR`: tokenize a chat dataset into the data cache ahead of training."""

from __future__ import annotations

import shlex
from typing import Annotated, Any, Optional

import typer

from cli import output
from cli.options import JsonOpt
from cli.signals import EXIT_SIGTERM, sigterm_as_interrupt
from compilewatch.errors import BadInput
from dflash import EMBEDDED_TARGET


def prepare_cmd(
    data: Annotated[str, typer.Argument(help="Chat JSONL (messages or ShareGPT conversations), already regenerated.")],
    target: Annotated[str, typer.Option("--target", help="Local HF target directory (its tokenizer and chat template).")] = EMBEDDED_TARGET,
    out: Annotated[Optional[str], typer.Option("--cache-dir", help="Cache root (= data.cache_dir; default $DFLASH_DATA_CACHE or ~/.cache/dflash/data).")] = None,
    workers: Annotated[Optional[int], typer.Option("--workers", "-j", min=1, help="Tokenizing processes (default: one per CPU core).")] = None,
    recipe: Annotated[str, typer.Option("--recipe", help="The recipe you will train with (max length, block size).")] = "tiny",
    config: Annotated[Optional[str], typer.Option("--config", "-c", help="The TOML config you will train with.")] = None,
    set_: Annotated[Optional[list[str]], typer.Option("--set", help="The overrides you will train with (repeatable).")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Tokenize DATA once into memory-mapped shards (parallel over CPU cores), keyed by the data, the
    target's tokenizer and chat template, max length and block size; `dflash train` with the same
    data, target and config then starts from it. Give the recipe/config/--set you will train with:
    they decide the max length, block size and held-out eval prompts.

    Examples:
      dflash prepare data/regen.jsonl --target /models/Qwen3-8B --recipe qwen3_8b
      dflash prepare data/regen.jsonl --target /models/Qwen3-8B \\
        --recipe qwen3_8b --cache-dir /shared/dflash-data --workers 16
    """
    import dflash
    from cli.dflash_progress import TrainProgress
    from compilewatch.serialize import to_jsonable

    if data == dflash.EMBEDDED_DATA:  # its hint was "set data.regenerate=true", which prepare turns off
        raise BadInput(f"{data} holds prompts only, and `dflash prepare` does not regenerate answers",
                       hint="`dflash train` answers the embedded prompts at every start (nothing to prepare); "
                            "for your own data: `dflash regen IN.jsonl OUT.jsonl`, then `dflash prepare OUT.jsonl`")
    try:
        overrides = dflash.parse_set(set_ or [])
        overrides.update({"data.path": data, "target.path": target, "data.regenerate": False})
        if out is not None:
            overrides["data.cache_dir"] = out
        cfg = dflash.build_config(recipe, config, overrides)
    except ValueError as e:
        raise BadInput(f"bad config: {e}", hint="see `dflash train --print-config` for every field") from None
    # SIGTERM's default action left the build's staging directory (`.tmp-KEY-...`, never read, never removed)
    with sigterm_as_interrupt(distributed=False, closing="the unfinished build is being removed; a second signal "
                              "does not cut that. To end it at once: kill -9 {pid} (the build's `.tmp-*` "
                              "directory is then left in the cache: never read, safe to delete)") as signalled:
        try:
            with TrainProgress() as progress:
                report = dflash.prepare(cfg, workers=workers, on_event=progress)
        except KeyboardInterrupt:  # the build removed its own unfinished directory: nothing is cached
            output.err.print(("SIGTERM: " if signalled["terminated"] else "") + "interrupted before the cache was "
                             "complete: an unfinished build is removed, never read; run the command again", markup=False,
                             highlight=False)
            raise typer.Exit(EXIT_SIGTERM if signalled["terminated"] else 130) from None
    # the command to train on it, quoted: a path with a space pastes back as the same arguments
    result = {**to_jsonable(report),
              "train_with": shlex.join(["dflash", "train", "--data", data, "--target", target, "--recipe", recipe,
                                        *(["--config", config] if config else []),
                                        *(a for x in set_ or [] for a in ("--set", x)), "--set", "data.regenerate=false",
                                        *(["--set", f"data.cache_dir={out}"] if out else [])])}
    output.emit(result, as_json, _render)


def _render(r: dict[str, Any]) -> None:
    o = output.out
    for n in r["notes"]:
        output.note(n, o)
    how = "already prepared (cache hit, nothing tokenized)" if r["hit"] else \
        f"tokenized in {output.fmt_seconds(r['seconds'])} with {r['workers']} worker(s), {r['shards']} shard(s)"
    o.print(f"{r['kept']:,} of {r['records']:,} conversations kept ({r['tokens']:,} tokens, {r['loss_tokens']:,} trained), "
            f"{r['truncated']:,} truncated to {r['max_length']}, {r['skipped']:,} skipped: {how}", highlight=False)
    for reason, n in r["skipped_by_reason"].items():
        o.print(f"  {n:,} × {reason}", markup=False, highlight=False)
        for ex in r["examples"].get(reason, []):
            o.print(f"      e.g. {ex}", markup=False, highlight=False, style="dim")
    n, held = r["eval_prompts"], r["eval_held_out"]
    evals = ("no eval prompts" if not n else f"{n} eval prompts held out of training" if held == n
             else f"{n} eval prompts, not held out (too few records)" if held == 0
             else f"{n} eval prompts, held out or not: not recorded in this cache")
    o.print(f"cache: {r['cache_dir']} ({output.fmt_bytes(r['bytes'])}; block size {r['block_size']}, {evals})",
            highlight=False)
    o.print(f"train with the same config: {r['train_with']}", markup=False, highlight=False)
