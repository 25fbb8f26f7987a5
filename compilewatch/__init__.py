"""compilewatch: torch.compile cache, thread-race and environment diagnostics.

The library never prints; every function returns data (frozen dataclasses) that the CLI in `cli/`
renders. This module is compilewatch's public API: the names below are what other code (dflash, a
user's training script) may rely on; everything under the sub-packages is internal and may move.
tests/test_public_api.py freezes this surface: changing it is a deliberate act.

The house, by capability (docs/architecture.md has the map):
- `compilewatch.tracing`: trace & threads (FX tracing state, watcher, guard, probe, run, timelines)
- `compilewatch.cache`: the inductor cache as an artifact (where, fingerprint, verify, save/load, prune)
- `compilewatch.env`: environment locks and diffs, torch build facts, inductor's system key
- `compilewatch.devices.spec`: device specs, GPU sampling, sequential prewarm, hand-off to training
- at the top: errors, atomic file writes, capped untrusted input, JSON helpers, torch build facts
  (torchinfo: read by cache/, env/ and devices/), doctor

Importing compilewatch does not import torch: the names are loaded on first use (module-level
__getattr__), so `compilewatch --help` and `from compilewatch import BadInput` stay fast.
"""

__version__ = "0.1.0"

from compilewatch.errors import BadInput, CheckFailed, CompilewatchError  # noqa: E402

# public name -> (module, attribute or None for the module itself), imported on first access
_LAZY = {
    # trace & threads
    "watch": ("compilewatch.tracing.watcher", "watch"),
    "Watcher": ("compilewatch.tracing.watcher", "Watcher"),
    "guard": ("compilewatch.tracing.guard", None),
    "CompileGuard": ("compilewatch.tracing.guard", "CompileGuard"),
    "GuardError": ("compilewatch.tracing.guard", "GuardError"),
    "Frame": ("compilewatch.tracing.stacks", "Frame"),
    "current_stack": ("compilewatch.tracing.stacks", "current_stack"),
    "all_thread_stacks": ("compilewatch.tracing.stacks", "all_thread_stacks"),
    # devices
    "normalize_device": ("compilewatch.devices.spec", "normalize_device"),
    "parse_device": ("compilewatch.devices.spec", "parse_device"),
    "parse_devices": ("compilewatch.devices.spec", "parse_devices"),
    "prewarm": ("compilewatch.devices.warm", "prewarm"),
    "WarmReport": ("compilewatch.devices.warm", "WarmReport"),
    "sample_gpus": ("compilewatch.devices.gpus", "sample"),
    "low_outliers": ("compilewatch.devices.gpus", "low_outliers"),
    # warm workloads: the plugin API (entry-point group `compilewatch.workloads`, docs/warm.md)
    "Workload": ("compilewatch.tracing.targets", "Workload"),
    "WorkloadOptions": ("compilewatch.tracing.targets", "WorkloadOptions"),
    "FlexShape": ("compilewatch.tracing.targets", "FlexShape"),
    "FlexAttentionWorkload": ("compilewatch.tracing.targets", "FlexAttentionWorkload"),
    # environment
    "inductor_cache_dir": ("compilewatch.torchinfo", "inductor_cache_dir"),
    "system_key": ("compilewatch.torchinfo", "system_key"),
    "cpu_info": ("compilewatch.env.lock", "cpu_info"),
    # cache
    "fingerprint": ("compilewatch.cache.content.fingerprint", "fingerprint"),
    "enable_remote_cache": ("compilewatch.remote_usage", "enable"),
    "remote_cache_usage": ("compilewatch.remote_usage", "usage"),
    # files, untrusted input, JSON
    "FILE_MODE": ("compilewatch.fsutil", "FILE_MODE"),
    "atomic_write_bytes": ("compilewatch.fsutil", "atomic_write_bytes"),
    "atomic_write_text": ("compilewatch.fsutil", "atomic_write_text"),
    "atomic_write_json": ("compilewatch.fsutil", "atomic_write_json"),
    "check_writable": ("compilewatch.fsutil", "check_writable"),
    "same_file": ("compilewatch.fsutil", "same_file"),
    "nearest_existing": ("compilewatch.fsutil", "nearest_existing"),
    "read_text": ("compilewatch.inputs", "read_text"),
    "open_untrusted": ("compilewatch.inputs", "open_untrusted"),
    "loads_json": ("compilewatch.inputs", "loads_json"),
    "loads_toml": ("compilewatch.env.formats.tomlutil", "load_toml"),
    "one_line": ("compilewatch.inputs", "one_line"),
    "dataclass_from_json": ("compilewatch.jsonshape", "build"),
    "to_jsonable": ("compilewatch.serialize", "to_jsonable"),
}

__all__ = ["__version__", "BadInput", "CheckFailed", "CompilewatchError", *_LAZY]


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        module_name, attr = _LAZY[name]
        module = importlib.import_module(module_name)
        value = module if attr is None else getattr(module, attr)
        globals()[name] = value  # later lookups skip __getattr__
        return value
    raise AttributeError(f"module 'compilewatch' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
