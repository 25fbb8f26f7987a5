"""An exported drafter checked before anything is allocated for it.

An export (config.json + model.safetensors) is a file from elsewhere. Building `DFlashDrafter(spec)`
allocates what config.json claims (an `intermediate_size` of 1e9 asks for hundreds of GB), and a
tensor whose shape differs from the config, a tap layer past the target's depth, a mask token id
past the vocabulary or a RoPE factor that is a string fail later as tracebacks. So, in this order:

1. `check_spec(spec, where)`: every size within sane bounds (`SPEC_LIMITS`: generous, a few times
   the largest published model), ids in range (taps in [0, num_target_layers), the mask token in
   [0, vocab_size)), layer types known, the RoPE fields typed and the RoPE frequencies computable
   and finite (they are head_dim/2 floats: computing them is the check).
2. `check_weights(path, spec)`: the safetensors header (read with safetensors' `safe_open`, which
   bounds the header and checks every tensor's offsets against the file size; no tensor data is
   read) names exactly the tensors the spec implies, with the shapes it implies (computed on the
   meta device: nothing allocated) and a floating dtype. After this, loading allocates no more than
   the file holds (times 2 or 4 for the fp32 copy).

Relative to a target (`dflash.checkpoint.store.check_compatible`): hidden size, depth, taps and the
mask token id against the target's vocabulary, once the target is known.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

from compilewatch import BadInput
from dflash.model.drafter import DrafterSpec

# upper bounds on a drafter's sizes: ~4-16x the largest published dense models (hidden 16384,
# 126 layers, intermediate 53248, vocab 256k, 128k-1M context); a config past them is damaged
SPEC_LIMITS = {
    "hidden_size": 1 << 16, "num_hidden_layers": 256, "num_attention_heads": 1024, "num_key_value_heads": 1024,
    "head_dim": 2048, "intermediate_size": 1 << 18, "vocab_size": 1 << 23, "max_position_embeddings": 1 << 24,
    "block_size": 4096, "num_target_layers": 4096, "sliding_window": 1 << 24,
}
LAYER_TYPES = ("full_attention", "sliding_attention")
WEIGHT_DTYPES = {"F32", "F16", "BF16"}  # safetensors' names for what write_export saves
ROPE_NUMBERS = ("factor", "attention_factor", "beta_fast", "beta_slow", "low_freq_factor", "high_freq_factor",
                "mscale", "mscale_all_dim")
ROPE_INTS = ("original_max_position_embeddings",)
ROPE_LISTS = ("short_factor", "long_factor")


def _real(v: Any) -> bool:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return False
    try:
        return math.isfinite(v)
    except OverflowError:  # an int past float's range (JSON and pickles hold ints of any size)
        return False


def spec_problems(spec: DrafterSpec) -> list[str]:
    """What in `spec` is out of bounds or out of range (empty: nothing)."""
    problems = []
    for name, limit in SPEC_LIMITS.items():
        v = getattr(spec, name)
        if v is None:
            continue
        if not 1 <= v <= limit:
            problems.append(f"{name} is {v}, expected 1..{limit}")
    if problems:
        return problems  # the rules below assume sane sizes
    if not 0 < spec.rms_norm_eps < 1:
        problems.append(f"rms_norm_eps is {spec.rms_norm_eps}, expected a number in (0, 1)")
    if not spec.rope_theta > 0:
        problems.append(f"rope_theta is {spec.rope_theta}, expected a number > 0")
    if spec.head_dim % 2:
        problems.append(f"head_dim is {spec.head_dim}, expected an even number (rotary halves)")
    if not spec.target_layer_ids:
        problems.append("target_layer_ids is empty, expected the target layers the drafter reads")
    if len(spec.target_layer_ids) > spec.num_target_layers:
        problems.append(f"{len(spec.target_layer_ids)} target_layer_ids for a {spec.num_target_layers}-layer target")
    bad = [i for i in spec.target_layer_ids if not 0 <= i < spec.num_target_layers]
    if bad:
        problems.append(f"target_layer_ids {bad[:4]} are not layers of the {spec.num_target_layers}-layer target "
                        f"(0..{spec.num_target_layers - 1})")
    if not 0 <= spec.mask_token_id < spec.vocab_size:
        problems.append(f"mask_token_id {spec.mask_token_id} is not a token id of the {spec.vocab_size}-token vocabulary")
    unknown = sorted({t for t in spec.layer_types if t not in LAYER_TYPES})
    if unknown:
        problems.append(f"layer_types {unknown[:3]} are not {' or '.join(LAYER_TYPES)}")
    if "sliding_attention" in spec.layer_types and spec.sliding_window is None:
        problems.append("sliding_attention layers without a sliding_window")
    problems += _rope_problems(spec)
    return problems


def _rope_problems(spec: DrafterSpec) -> list[str]:
    rs = spec.rope_scaling
    if rs is None:
        return []
    if not isinstance(rs, dict):
        return [f"rope_scaling is a {type(rs).__name__}, expected an object"]
    problems = []
    kind = rs.get("rope_type", rs.get("type"))
    if not isinstance(kind, str):
        problems.append(f"rope_scaling.rope_type is {kind!r}, expected a string")
    for k in ROPE_NUMBERS:
        if k in rs and rs[k] is not None and (not _real(rs[k]) or rs[k] <= 0):
            problems.append(f"rope_scaling.{k} is {str(rs[k])[:40]!r}, expected a number > 0")
    for k in ROPE_INTS:
        if k in rs and rs[k] is not None and (isinstance(rs[k], bool) or not isinstance(rs[k], int)
                                               or not 1 <= rs[k] <= SPEC_LIMITS["max_position_embeddings"]):
            problems.append(f"rope_scaling.{k} is {str(rs[k])[:40]!r}, expected a positive integer")
    for k in ROPE_LISTS:
        if k in rs and rs[k] is not None and (not isinstance(rs[k], list) or len(rs[k]) != spec.head_dim // 2
                                               or not all(_real(x) for x in rs[k])):
            problems.append(f"rope_scaling.{k} is not a list of {spec.head_dim // 2} numbers")
    for k, v in rs.items():
        if k not in (*ROPE_NUMBERS, *ROPE_INTS, *ROPE_LISTS) and not (v is None or isinstance(v, (str, bool)) or _real(v)):
            problems.append(f"rope_scaling.{str(k)[:40]} is a {type(v).__name__}, expected a plain value")
    if problems:
        return problems
    return _rope_computable(spec)


def _rope_computable(spec: DrafterSpec) -> list[str]:
    """The RoPE frequencies the drafter would use: computing them (head_dim/2 floats) is the check."""
    import torch

    from dflash.model.drafter import rope_frequencies

    try:
        inv_freq, scaling = rope_frequencies(spec)
    except (ValueError, TypeError, KeyError, AttributeError, ZeroDivisionError, OverflowError, RuntimeError) as e:
        from compilewatch import one_line

        return [f"rope_scaling {one_line(repr(spec.rope_scaling), 120)} is not usable: {one_line(e, 160)}"]
    if not (bool(torch.isfinite(inv_freq).all()) and math.isfinite(scaling)):
        return [f"rope_scaling {spec.rope_scaling!r} gives frequencies that are not finite"]
    return []


def check_spec(spec: DrafterSpec, where: str) -> DrafterSpec:
    """`spec`, or BadInput naming what in it is out of bounds (before anything is allocated for it)."""
    problems = spec_problems(spec)
    if problems:
        raise BadInput(f"{where}: not a usable drafter config: " + "; ".join(problems[:4])
                       + (f" (and {len(problems) - 4} more)" if len(problems) > 4 else ""),
                       hint="the export is damaged or was not written by dflash: use another checkpoint")
    return spec


def expected_shapes(spec: DrafterSpec) -> dict[str, tuple[int, ...]]:
    """The exported tensors' names and shapes for `spec` (the module built on the meta device)."""
    import torch

    from dflash.model.drafter import DFlashDrafter

    with torch.device("meta"):
        model = DFlashDrafter(spec)
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def check_weights(path: Path, spec: DrafterSpec) -> None:
    """BadInput unless the safetensors file `path` holds exactly the tensors `spec` implies, with
    their shapes and a floating dtype. Reads the header only (no tensor data)."""
    from safetensors import SafetensorError, safe_open

    from compilewatch import one_line
    from dflash.checkpoint.manifest import open_regular

    fd, _st = open_regular(path, "drafter weights")  # a directory or a FIFO: BadInput, never opened for reading
    os.close(fd)
    want = expected_shapes(spec)
    try:
        with safe_open(str(path), framework="pt") as f:
            got = {}
            for k in f.keys():
                sl = f.get_slice(k)
                got[k] = (tuple(sl.get_shape()), str(sl.get_dtype()))
    except (SafetensorError, OSError, ValueError, RuntimeError, TypeError) as e:
        raise BadInput(f"cannot read {str(path)!r}: {one_line(e, 200)}",
                       hint="the export is damaged: use another checkpoint") from None
    problems = []
    missing = [k for k in want if k not in got]
    unexpected = [k for k in got if k not in want]
    if missing:
        problems.append(f"{len(missing)} tensors missing ({', '.join(missing[:3])})")
    if unexpected:
        problems.append(f"{len(unexpected)} tensors config.json does not imply ({', '.join(k[:60] for k in unexpected[:3])})")
    for k, shape in want.items():
        if k in got and got[k][0] != shape:
            problems.append(f"{k} has shape {list(got[k][0])}, config.json implies {list(shape)}")
        elif k in got and got[k][1] not in WEIGHT_DTYPES:
            problems.append(f"{k} is {got[k][1]}, expected one of {', '.join(sorted(WEIGHT_DTYPES))}")
    if problems:
        raise BadInput(f"{str(path)!r} does not match its config.json: " + "; ".join(problems[:4])
                       + (f" (and {len(problems) - 4} more)" if len(problems) > 4 else ""),
                       hint="config.json and model.safetensors come from different drafters, or one is damaged")
