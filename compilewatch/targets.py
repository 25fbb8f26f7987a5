"""What `probe` and `warm` can run: built-in targets and user callables.

A target is a function `fn(device: str) -> object`. Built-ins (`create_block_mask`,
`flex_attention`, `compile`) reproduce the seeds' experiments; a user target is given as
`package.module:callable` or `path/to/file.py:callable`; if the callable takes no parameter it is
called without the device.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from compilewatch.errors import BadInput

Backend = str  # a torch.compile backend name: "inductor" (default), "aot_eager", "eager"


@dataclass(frozen=True, slots=True)
class Target:
    name: str
    description: str
    fn: Callable[[str], Any]  # called with the device string


def _causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def run_create_block_mask(device: str) -> Any:
    """The seeds' experiment: causal mask_mod, B=None, H=None, Q_LEN=1024, KV_LEN=2048 (uncompiled)."""
    from torch.nn.attention.flex_attention import create_block_mask

    return create_block_mask(_causal, B=None, H=None, Q_LEN=1024, KV_LEN=2048, device=device)


def make_flex_attention(backend: Backend = "inductor", *, seq: int = 256, heads: int = 4, head_dim: int = 64,
                        backward: bool | None = None) -> Callable[[str], Any]:
    """A fresh `torch.compile(flex_attention)` with a causal block mask, fwd (+bwd where supported).

    Each call of the returned function compiles its own wrapper, as each seeds' drafter thread did.
    Flex attention has no backward on CPU (FACTS.md §2), so backward runs only on CUDA by default.
    """

    def run(device: str) -> Any:
        import torch
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        do_bwd = device.startswith("cuda") if backward is None else backward
        compiled = torch.compile(flex_attention, backend=backend)
        mask = create_block_mask(_causal, B=None, H=None, Q_LEN=seq, KV_LEN=seq, device=device)
        dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
        q, k, v = (torch.randn(1, heads, seq, head_dim, device=device, dtype=dtype, requires_grad=do_bwd)
                   for _ in range(3))
        out = compiled(q, k, v, block_mask=mask)
        if do_bwd:
            out.sum().backward()
        return out

    return run


def make_compile(backend: Backend = "inductor") -> Callable[[str], Any]:
    """A small compiled MLP step, forward and backward."""

    def run(device: str) -> Any:
        import torch

        def step(x, w1, w2):
            return (torch.nn.functional.gelu(x @ w1) @ w2).square().mean()

        compiled = torch.compile(step, backend=backend)
        g = torch.Generator().manual_seed(0)
        x = torch.randn(32, 64, generator=g).to(device)
        w1 = torch.randn(64, 128, generator=g).to(device).requires_grad_()
        w2 = torch.randn(128, 64, generator=g).to(device).requires_grad_()
        loss = compiled(x, w1, w2)
        loss.backward()
        return loss

    return run


def builtin_targets(backend: Backend = "inductor") -> dict[str, Target]:
    return {
        "create_block_mask": Target(
            "create_block_mask",
            "create_block_mask(causal, B=None, H=None, Q_LEN=1024, KV_LEN=2048) uncompiled: the seeds' experiment",
            run_create_block_mask,
        ),
        "flex_attention": Target(
            "flex_attention",
            "torch.compile(flex_attention) with a causal block mask; backward on CUDA",
            make_flex_attention(backend),
        ),
        "compile": Target("compile", "a small torch.compile'd MLP, forward and backward", make_compile(backend)),
    }


def _load_file_module(path: Path):
    name = f"_compilewatch_target_{abs(hash(path.resolve()))}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise BadInput(f"cannot load {path} as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def resolve(spec: str, backend: Backend = "inductor") -> Target:
    """Turn a target name or `module:callable` / `file.py:callable` into a Target, or raise BadInput."""
    builtins = builtin_targets(backend)
    if spec in builtins:
        return builtins[spec]
    if ":" not in spec:
        raise BadInput(
            f"unknown target {spec!r}",
            hint=f"use a built-in ({', '.join(builtins)}), module:callable or path/to/file.py:callable; see --list",
        )
    mod_part, _, attr = spec.rpartition(":")
    if not mod_part or not attr:
        raise BadInput(f"target {spec!r} is not of the form module:callable")
    try:
        if mod_part.endswith(".py") or "/" in mod_part:
            path = Path(mod_part)
            if not path.is_file():
                raise BadInput(f"target file {mod_part!r} does not exist")
            module = _load_file_module(path)
        else:
            module = importlib.import_module(mod_part)
    except BadInput:
        raise
    except Exception as e:  # noqa: BLE001 - any import failure is the user's input to fix
        raise BadInput(f"cannot import {mod_part!r} for target {spec!r}: {type(e).__name__}: {e}") from e
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise BadInput(f"{mod_part!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise BadInput(f"{spec!r} is not callable (it is a {type(obj).__name__})")
    return Target(spec, f"user callable {spec}", _device_adapter(obj))


def _device_adapter(fn: Callable[..., Any]) -> Callable[[str], Any]:
    try:
        params = [p for p in inspect.signature(fn).parameters.values()
                  if p.default is inspect.Parameter.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        params = [None]
    if not params:
        return lambda device: fn()
    return fn
