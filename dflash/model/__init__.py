"""The networks: the DFlash drafter, its attention masks, its loss, the chunked head + CE, the frozen
target it reads hidden states from, and the drafter a config builds. No data, no loop.

The room's entry: the names below are what the other rooms (the training loop, the engine, eval)
use; they are loaded on first use, like dflash's own face, so importing one module of the room does
not load the others.
"""

# name -> module of this room, imported on first access
_LAZY = {
    # the drafter and its build from a config
    "DFlashDrafter": "dflash.model.drafter",
    "DrafterSpec": "dflash.model.drafter",
    "build_drafter": "dflash.model.build",
    "drafter_spec": "dflash.model.build",
    # the frozen target
    "Target": "dflash.model.target",
    "load_target": "dflash.model.target",
    "resolve_device": "dflash.model.target",
    "resolve_dtype": "dflash.model.target",
    # the training objective: blocks, weights, loss, attention backend
    "LossOutput": "dflash.model.loss",
    "blocks_of": "dflash.model.loss",
    "drafter_loss": "dflash.model.loss",
    "estimated_tau": "dflash.model.loss",
    "loss_weights": "dflash.model.loss",
    "loss_backward": "dflash.model.loss",
    "make_blocks": "dflash.model.loss",
    "weight_sum": "dflash.model.loss",
    "detect_backend": "dflash.model.mask",
    # a diverged drafter's weights
    "nonfinite_parameters": "dflash.model.finite",
    "nonfinite_tensors": "dflash.model.finite",
}

__all__ = list(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value  # later lookups skip __getattr__
        return value
    raise AttributeError(f"module 'dflash.model' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
