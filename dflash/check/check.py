"""`check_export`: will this export serve as it was trained? (`dflash check`, `dflash.check`)

    report = dflash.check("runs/x", target_path="embedded:tiny")          # static + measured
    report = dflash.check("runs/x/checkpoints/step_000288", measure=False) # static only (train's summary)
    report.verdict  # "ok" | "mismatch"

EXPORT resolves as `dflash eval`'s CHECKPOINT does (an export, a checkpoint, a run directory, its
checkpoints/ or checkpoints/latest). Damaged weights (a checksum or size that differs from
manifest.json, a header that does not parse or does not fit config.json) are bad input (BadInput:
exit 2); an edited config.json is a finding (the checks then run on what it says now, which is what
an engine would read).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from compilewatch import BadInput
from dflash.check.findings import Finding
from dflash.check.measure import Acceptance

FATAL = ("hidden size", "vocabulary", "target layers", "taps", "weights")  # a mismatch here: nothing to measure


@dataclass(frozen=True)
class CheckReport:
    export: str  # the checkpoint directory checked
    target: str
    verdict: str  # "ok": serves as trained; "mismatch": at least one failed check
    findings: tuple[Finding, ...]
    acceptance: Acceptance | None
    acceptance_note: str | None  # why acceptance was not measured
    notes: tuple[str, ...]

    @property
    def ok(self) -> bool:
        return self.verdict == "ok"

    def failed(self) -> list[Finding]:
        return [f for f in self.findings if f.level == "fail"]


def _read_config(ck: Path) -> dict[str, Any]:
    from compilewatch import loads_json, read_text

    cfg = loads_json(read_text(ck / "config.json", limit=16 << 20, what="drafter config.json"), str(ck / "config.json"))
    if not isinstance(cfg, dict):
        raise BadInput(f"{ck / 'config.json'} is not a JSON object")
    return cfg


def check_export(path: str, *, target_path: str | None = None, data_path: str | None = None,
                 num_prompts: int | None = None, max_new_tokens: int | None = None, temperature: float = 0.0,
                 measure: bool = True, device: str | None = None, seed: int = 0,
                 progress: Callable[[int, int], None] | None = None, read_weights: bool = True) -> CheckReport:
    """`read_weights`: also check every weight finite (reads them all; `dflash train`'s summary skips it, the
    run checked them before saving)."""
    from dflash.check.record import read_record
    from dflash.check.serving import check_serving
    from dflash.check.static import check_static, target_facts, weights_dtype, weights_finding
    from dflash.checkpoint import manifest
    from dflash.checkpoint.store import CONFIG_FILE, checkpoint_config, read_export_spec, resolve_checkpoint
    from dflash.config import apply_overrides
    from dflash.flags import check_max_new_tokens, check_num_prompts, check_temperature

    check_num_prompts(num_prompts)
    check_max_new_tokens(max_new_tokens)
    check_temperature(temperature)
    ck = resolve_checkpoint(path)
    notes: list[str] = []
    findings: list[Finding] = []
    unverified = manifest.check(ck, ["model.safetensors"])  # damaged weights: BadInput (exit 2)
    if unverified:
        notes.append(unverified)
    else:
        # edited since the save: config.json is what an engine reads (the lines below say what differs from
        # training); train_config.toml names the target and prompts this check uses
        for name, todo in (("config.json", "the lines below say what differs from training; restore the saved "
                                           "config.json, or re-export"),
                           (CONFIG_FILE, "restore the saved train_config.toml (this check read the target and "
                                         "prompts from it), or pass --target and --data")):
            if name == CONFIG_FILE and not os.path.lexists(ck / name):
                continue
            try:
                manifest.check(ck, [name])
            except BadInput as e:
                findings.append(Finding("fail", name, f"changed after the save ({e.message})", todo))
    spec = read_export_spec(ck)  # config.json bounded and typed, the weights' header against it (BadInput)
    cfg_json = _read_config(ck)
    record = read_record(cfg_json, str(ck / "config.json"))
    overrides = {"target.path": target_path} if target_path else {}
    train_cfg = checkpoint_config(ck, overrides)
    if train_cfg is None and target_path:
        from dflash.config import tiny

        base = apply_overrides(tiny(), overrides)
    elif train_cfg is None:
        raise BadInput(f"{str(ck)!r} has no {CONFIG_FILE}; say which target it drafts for",
                       hint="pass --target DIR (or embedded:tiny)")
    cfg = train_cfg if train_cfg is not None else base
    mask_token = ((record or {}).get("tokenizer") or {}).get("mask_token") or cfg.target.mask_token
    target = target_facts(cfg.target.path, mask_token)
    findings += check_static(cfg_json, spec, weights_dtype(ck / "model.safetensors"), target, record)
    if read_weights:
        findings.append(weights_finding(ck / "model.safetensors"))
    findings += check_serving(cfg_json, (record or {}).get("trained"), mask_token)
    verdict = "mismatch" if any(f.level == "fail" for f in findings) else "ok"

    acceptance, why = None, None
    if not measure:
        why = "not measured (static checks only)"
    elif any(f.level == "fail" and f.check in FATAL for f in findings):
        why = "not measured: the export does not fit this target, or its weights are not finite (see the failed checks)"
    else:
        convs, source, data_cfg = _prompts(cfg, train_cfg, data_path, num_prompts, notes)
        if not convs:
            why = source
        else:
            new = max_new_tokens if max_new_tokens is not None else cfg.eval.max_new_tokens
            acceptance = _measure(ck, cfg, spec, convs, source, data_cfg if train_cfg is not None else None, new,
                                  temperature, seed, device, record, progress)
    return CheckReport(export=str(ck), target=cfg.target.path, verdict=verdict, findings=tuple(findings),
                       acceptance=acceptance, acceptance_note=why, notes=tuple(notes))


def _prompts(cfg, train_cfg, data_path: str | None, n: int | None, notes: list[str]) -> tuple[list, str, Any]:
    """(conversations, where from, the training data config) — or ([], why not, None). `notes` gets what the
    user should know about the run's own prompts (some trained on, fewer than asked)."""
    from dflash.config import apply_overrides
    from dflash.data.run_prompts import file_prompts, run_eval_prompts

    n = n if n is not None else cfg.eval.num_prompts
    if data_path:
        convs = file_prompts(apply_overrides(cfg, {"data.path": data_path}).data, n)  # BadInput when none
        return convs, f"{data_path} (last user turns)", train_cfg.data if train_cfg is not None else None
    if train_cfg is None:
        return [], ("not measured: no prompts (the export has no train_config.toml naming its data); "
                    "pass --data FILE (chat JSONL) to measure acceptance"), None
    convs, note = run_eval_prompts(train_cfg, n)
    if not convs:
        return [], f"not measured: no prompts in the run's data {train_cfg.data.path!r}; pass --data FILE", None
    if note is not None:  # fewer than asked, or some trained on: the label says so, and the note why
        notes.append(note)
        return convs, f"the run's eval prompts ({train_cfg.data.path}; see the note)", train_cfg.data
    return convs, f"the run's held-out eval prompts ({train_cfg.data.path})", train_cfg.data


def _measure(ck: Path, cfg, spec, convs, source, data_cfg, max_new_tokens, temperature, seed, device, record,
             progress) -> Acceptance:
    import torch

    from dflash.check.measure import measure
    from dflash.checkpoint.store import load_export
    from dflash.model.target import load_target, resolve_device

    dev = resolve_device(device or cfg.topology.device)
    if dev.type == "cpu" and cfg.train.cpu_threads:
        torch.set_num_threads(cfg.train.cpu_threads)
    target = load_target(cfg.target, spec.num_hidden_layers, dev)
    target.layer_ids = tuple(spec.target_layer_ids)  # what config.json says: what an engine would tap
    drafter = load_export(ck, spec=spec).to(dev, target.dtype).eval()
    ct = (((record or {}).get("tokenizer") or {}).get("chat_template") or {})
    return measure(drafter, target, convs, source, max_new_tokens=max_new_tokens, temperature=temperature, seed=seed,
                   ck=ck, data_cfg=data_cfg, recorded_template=ct.get("text"), progress=progress)
