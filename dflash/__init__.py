"""dflash: a DFlash (block-diffusion speculative decoding) drafter trainer built on compilewatch.

This module is dflash's public face: the names below are what the CLI (`cli/`) and other programs
may rely on; everything under the rooms is internal and may move. tests/test_dflash_public_api.py
freezes this surface: changing it is a deliberate act.

    cfg = dflash.build_config("tiny", None, {"train.max_steps": 10})
    out = dflash.train(cfg)                      # single device, engine or torchrun: cfg.topology picks
    out = dflash.train(dflash.resume_config("runs/x", {}), resume=True)

The rooms (docs/architecture.md has the map): `model` (drafter, masks, loss, target), `data`
(conversations to tokens, the data cache, regen), `training` (the loop), `checkpoint` (files on
disk, the run lock, resume), `engine` (several devices in one process), `distributed` (torchrun
ranks), `eval` (speculative decoding), `check` (will an export serve as trained: `dflash check`). `config` and `run` sit at the top: the typed config, and the
one entry that owns a run.

Importing dflash does not import torch: the names are loaded on first use (module-level
__getattr__), so `dflash --help` stays fast.
"""

__version__ = "0.1.0"

# public name -> (module, attribute), imported on first access
_LAZY = {
    # running
    "train": ("dflash.run", "train"),
    "RunOutcome": ("dflash.run", "RunOutcome"),
    "dry_run": ("dflash.training.dryrun", "dry_run"),
    "prepare": ("dflash.data.prepare", "prepare_data"),
    "regen": ("dflash.data.regen", "regen"),
    "evaluate": ("dflash.eval.evaluate", "eval_checkpoint"),
    "check_export": ("dflash.check.check", "check_export"),
    # the config
    "Config": ("dflash.config", "Config"),
    "TargetConfig": ("dflash.config", "TargetConfig"),
    "DrafterConfig": ("dflash.config", "DrafterConfig"),
    "DataConfig": ("dflash.config", "DataConfig"),
    "OptimConfig": ("dflash.config", "OptimConfig"),
    "TrainConfig": ("dflash.config", "TrainConfig"),
    "TopologyConfig": ("dflash.config", "TopologyConfig"),
    "CheckpointConfig": ("dflash.config", "CheckpointConfig"),
    "MetricsConfig": ("dflash.config", "MetricsConfig"),
    "EvalConfig": ("dflash.config", "EvalConfig"),
    "EMBEDDED_TARGET": ("dflash.config", "EMBEDDED_TARGET"),
    "EMBEDDED_DATA": ("dflash.config", "EMBEDDED_DATA"),
    "build_config": ("dflash.config", "build_config"),
    "resume_config": ("dflash.checkpoint.resume", "build_config_for_resume"),
    "run_complete": ("dflash.checkpoint.resume", "run_complete"),
    "changes_since_checkpoint": ("dflash.checkpoint.resume", "changes_since_checkpoint"),
    "data_since_checkpoint": ("dflash.checkpoint.data_check", "data_since_checkpoint"),
    "apply_overrides": ("dflash.config", "apply_overrides"),
    "parse_set": ("dflash.config", "parse_set"),
    "config_field": ("dflash.config", "field_info"),
    "to_dict": ("dflash.config", "to_dict"),
    "to_toml": ("dflash.config", "to_toml"),
    # outcomes
    "TrainResult": ("dflash.training.result", "TrainResult"),
    "StepMetrics": ("dflash.training.metrics", "StepMetrics"),
    "EngineReport": ("dflash.engine.report", "EngineReport"),
    "DistributedResult": ("dflash.distributed.train_rank", "DistributedResult"),
    "RankReport": ("dflash.distributed.rank_report", "RankReport"),
    "PeerFailed": ("dflash.distributed.train_rank", "PeerFailed"),
    "DryRunReport": ("dflash.training.dryrun", "DryRunReport"),
    "RunComplete": ("dflash.checkpoint.resume", "RunComplete"),
    "PrepareReport": ("dflash.data.prepare", "PrepareReport"),
    "RegenResult": ("dflash.data.regen", "RegenResult"),
    "EvalResult": ("dflash.eval.evaluate", "EvalResult"),
}

__all__ = ["__version__", *_LAZY]


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        module_name, attr = _LAZY[name]
        value = getattr(importlib.import_module(module_name), attr)
        globals()[name] = value  # later lookups skip __getattr__
        return value
    raise AttributeError(f"module 'dflash' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
