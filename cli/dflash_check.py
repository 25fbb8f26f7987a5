"""`dflash check EXPORT --target DIR`: will the drafter accept at serving what it accepted in training?"""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from cli import output
from cli.options import DeviceOpt, JsonOpt
from compilewatch.errors import CheckFailed
from compilewatch.serialize import to_jsonable

MARK = {"ok": "[green]ok[/]  ", "warn": "[yellow]warn[/]", "fail": "[red]FAIL[/]"}


def check_cmd(
    export: Annotated[str, typer.Argument(help="An export (config.json + model.safetensors), a checkpoint, or a run directory (its latest checkpoint).")],
    target: Annotated[Optional[str], typer.Option("--target", help="Target directory, or embedded:tiny (default: the one it was trained with).")] = None,
    data: Annotated[Optional[str], typer.Option("--data", help="Chat JSONL whose last user turns are the prompts (default: the run's held-out eval prompts).")] = None,
    prompts: Annotated[Optional[int], typer.Option("--prompts", "-n", help="Number of prompts (>= 1).")] = None,
    temperature: Annotated[float, typer.Option("--temperature", help="Sampling temperature of the measured decoding (0: greedy).")] = 0.0,
    max_new_tokens: Annotated[Optional[int], typer.Option("--max-new-tokens", help="Tokens generated per prompt.")] = None,
    static: Annotated[bool, typer.Option("--static", help="Static checks only: do not measure acceptance.")] = False,
    device: DeviceOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Check an export against the target it will be served with: sizes, taps, RoPE, mask token,
    dtype, the tokenizer and chat template of training against the target's now, the fields SGLang's
    and vLLM's DFlash loaders read; then measure acceptance on prompts. Exit 0: serves as trained;
    1: a mismatch; 2: bad input (a damaged export, a missing target).

    Examples:
      dflash check runs/tiny-20260101-120000 --target embedded:tiny
      dflash check runs/q8/checkpoints/step_004000 --target /models/Qwen3-8B \\
        --data data/test.jsonl -n 64 --json
    """
    from cli.dflash_progress import TrainProgress
    import dflash  # torch and transformers: only when checking

    with TrainProgress() as progress:
        def on_progress(done: int, total: int) -> None:
            if done == 0:
                progress("phase", {"name": "check", "prompts": total})
            progress("eval", {"done": done, "total": total})

        report = dflash.check_export(export, target_path=target, data_path=data, num_prompts=prompts,
                                     max_new_tokens=max_new_tokens, temperature=temperature, measure=not static,
                                     device=device, progress=on_progress)
    output.emit({**to_jsonable(report), "ok": report.ok}, as_json, render)
    if not report.ok:
        raise CheckFailed(f"{len(report.failed())} check(s) failed: the export will not serve as it was trained")


def verdict_lines(r: dict) -> list[str]:
    """The static verdict in a few lines (`dflash train`'s end summary uses these too)."""
    failed = [f for f in r["findings"] if f["level"] == "fail"]
    warned = [f for f in r["findings"] if f["level"] == "warn"]
    if not failed:
        head = f"check: the export serves as trained against {r['target']} ({len(r['findings'])} checks"
        return [head + (f", {len(warned)} warnings: `dflash check {r['export']}`)" if warned else ")")]
    lines = [f"check: {len(failed)} mismatch(es) against {r['target']}: `dflash check {r['export']}`"]
    lines += [f"  {f['check']}: {f['found']}" for f in failed[:3]]
    return lines


def render(r: dict) -> None:
    o = output.out
    o.print(f"dflash check {r['export']} against {r['target']}")
    for n in r["notes"]:
        output.note(n)
    for f in r["findings"]:
        o.print(f"{MARK.get(f['level'], f['level'])} {f['check']}: {f['found']}" + (f" -> {f['todo']}" if f["todo"] else ""),
                highlight=False)
    a = r["acceptance"]
    if a is None:
        o.print(f"acceptance: {r['acceptance_note']}")
    else:
        temp = "greedy" if not a["temperature"] else f"temperature {a['temperature']:g}"
        o.print(f"acceptance ({temp}, {a['prompts']} prompts from {a['source']}): τ = {a['tau']:.2f} "
                f"(max {a['max_tau']}), {a['rounds']} rounds")
        est = f"{a['training_tau']:.2f} ({a['training_note']})" if a["training_tau"] is not None else a["training_note"]
        o.print(f"  training estimate: τ {est}")
        o.print("  by block position (share of rounds accepting drafts 1..k): "
                + " ".join(f"{k}:{v:.2f}" if v is not None else f"{k}:-" for k, v in enumerate(a["by_position"], 1)))
        if a["training_accuracy"]:
            o.print("  training per-slot accuracy:                              "
                    + " ".join(f"{k}:{v:.2f}" if v is not None else f"{k}:-" for k, v in enumerate(a["training_accuracy"], 1)))
        o.print("  per prompt τ: " + " ".join(f"{p['tau']:.2f}" for p in a["per_prompt"]))
        for i in a["low_prompts"]:
            p = a["per_prompt"][i]
            ov = f", {p['overlap']:.0%} of its tokens in the training data" if p["overlap"] is not None else ""
            o.print(f"  [yellow]far below the rest[/]: prompt {i} τ {p['tau']:.2f} ({p['tokens']} tokens{ov}): "
                    f"{p['preview']!r}", highlight=False)
        for e in a["explanations"]:
            o.print(f"  {e}")
    o.print("[green]verdict: serves as trained[/]" if r["ok"] else "[red]verdict: mismatch[/]")
