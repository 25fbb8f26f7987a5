"""What to do after `dflash train`: the exact commands to evaluate the run and serve its export.

Rendered from the run's result (the dict `dflash train --json` prints: `run_dir`, `checkpoints`,
`config`), on stderr: stdout carries the result. The export is the last checkpoint directory
(config.json + model.safetensors, z-lab/dflash's format): SGLang loads it with `--speculative-algorithm DFLASH`,
vLLM with a speculative config `{"method": "dflash", ...}`, each next to the target it was trained for.
"""

from __future__ import annotations

import json
import shlex

from cli import output


def next_steps(r: dict) -> list[tuple[str, str]]:
    """(command, what it does) for a finished run; a command of "" is a note."""
    run_dir = str(r["run_dir"])
    checkpoints = r.get("checkpoints") or []
    if not checkpoints:
        return [("", "no checkpoint was written (train.max_steps reached before the first save?): nothing to "
                     "evaluate or serve yet")]
    export = str(checkpoints[-1])
    cfg = r.get("config") or {}
    target = str((cfg.get("target") or {}).get("path") or "")
    block = (cfg.get("drafter") or {}).get("block_size")
    data = str((cfg.get("data") or {}).get("path") or "")
    if data.startswith("embedded:"):  # its eval prompts come from their own seed: any number is held out
        steps = [(f"dflash eval {shlex.quote(run_dir)} -n 64",
                  "τ and speedup with real speculative decoding on 64 prompts (the run's latest checkpoint; "
                  "--data FILE for your own prompts)")]
    else:  # more prompts than the run held out would be prompts it trained on (τ optimistic)
        steps = [(f"dflash eval {shlex.quote(run_dir)}",
                  "τ and speedup with real speculative decoding on the run's held-out prompts (its latest "
                  "checkpoint; --data FILE -n 64 for 64 prompts of your own)")]
    if not target or target.startswith("embedded:"):
        steps.append(("", f"serving: the export {export} drafts for the embedded tiny target, which no serving engine "
                          "loads; train against a real target (--target DIR, a Hugging Face model dir) to serve it"))
        return steps
    t, e = shlex.quote(target), shlex.quote(export)
    steps.append((f"python -m sglang.launch_server --model-path {t} --speculative-algorithm DFLASH "
                  f"--speculative-draft-model-path {e}", "serve with SGLang"))
    spec = {"method": "dflash", "model": export}
    if isinstance(block, int) and block > 1:
        spec["num_speculative_tokens"] = block - 1  # a block is the anchor + B-1 drafted tokens
    steps.append((f"vllm serve {t} --speculative-config {shlex.quote(json.dumps(spec))}", "serve with vLLM"))
    return steps


def print_next_steps(r: dict) -> None:
    """The next-steps block, on stderr."""
    e = output.err
    e.print("[bold]next:[/]")
    for cmd, what in next_steps(r):
        if cmd:
            e.print(f"  {cmd}", markup=False, highlight=False)
            e.print(f"      [dim]{what}[/]", highlight=False)
        else:
            e.print(f"  [dim]{what}[/]", highlight=False)
