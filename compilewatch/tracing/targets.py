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
from typing import Any, Callable, Literal, Protocol

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


DTYPES = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp16": "float16", "float16": "float16",
          "fp32": "float32", "float32": "float32"}


@dataclass(frozen=True, slots=True)
class FlexShape:
    """Shapes of the flex_attention workload. Defaults: one DFlash training step at Qwen3-8B shapes
    (FACTS.md §6): 512 blocks of 16 query tokens attend to a 3072-token context plus their own block.

    mask "dflash": Q = blocks*block_size, KV = context + Q; block j sees context kv < anchor_j
    (strict) and its own block (bidirectional). mask "causal": Q = KV = context, causal.
    """

    context: int = 3072  # S: context tokens (KV prefix); Q=KV length for the causal mask
    blocks: int = 512  # N: anchors (blocks) per sequence
    block_size: int = 16  # B: tokens per block
    heads: int = 32  # query and KV heads (Qwen3-8B has 32 query heads)
    head_dim: int = 128
    batch: int = 1
    dtype: str = "auto"  # bf16 | fp16 | fp32 | auto (bf16 on CUDA, fp32 on CPU)
    mask: Literal["dflash", "causal"] = "dflash"

    def __post_init__(self) -> None:
        for name in ("context", "blocks", "block_size", "heads", "head_dim", "batch"):
            if getattr(self, name) < 1:
                raise BadInput(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise BadInput(f"unknown dtype {self.dtype!r}", hint=f"use auto or one of {', '.join(DTYPES)}")
        if self.mask not in ("dflash", "causal"):
            raise BadInput(f"unknown mask {self.mask!r}", hint="use dflash or causal")
        if self.mask == "dflash" and self.context <= self.block_size:
            raise BadInput(f"context ({self.context}) must be larger than block_size ({self.block_size})")

    @property
    def q_len(self) -> int:
        return self.blocks * self.block_size if self.mask == "dflash" else self.context

    @property
    def kv_len(self) -> int:
        return self.context + self.q_len if self.mask == "dflash" else self.context

    def torch_dtype(self, device: str):
        import torch

        if self.dtype == "auto":
            return torch.bfloat16 if device.startswith("cuda") else torch.float32
        return getattr(torch, DTYPES[self.dtype])

    def describe(self) -> str:
        if self.mask == "dflash":
            return (f"dflash mask, {self.blocks} blocks x {self.block_size} over {self.context} context "
                    f"(Q={self.q_len}, KV={self.kv_len}), {self.heads} heads x {self.head_dim}, dtype {self.dtype}")
        return f"causal mask, seq {self.context}, {self.heads} heads x {self.head_dim}, dtype {self.dtype}"


def dflash_block_mask(shape: FlexShape, device: str, seed: int = 0) -> Any:
    """A create_block_mask (uncompiled) block mask for `shape`, anchors drawn with a fixed seed."""
    import torch
    from torch.nn.attention.flex_attention import create_block_mask

    if shape.mask == "causal":
        return create_block_mask(_causal, B=None, H=None, Q_LEN=shape.q_len, KV_LEN=shape.kv_len, device=device)
    S, N, B = shape.context, shape.blocks, shape.block_size
    g = torch.Generator().manual_seed(seed)
    n = min(N, S - B)
    anchors = torch.sort(torch.randperm(S - B, generator=g)[:n])[0]
    if n < N:  # more blocks than positions: repeat the last anchor
        anchors = torch.cat([anchors, anchors[-1:].expand(N - n)])
    anchors = anchors.to(device)

    def mask_mod(b, h, q_idx, kv_idx):
        blk = q_idx // B
        ctx = (kv_idx < S) & (kv_idx < anchors[blk])  # strict: the anchor itself is in the block
        own = (kv_idx >= S) & ((kv_idx - S) // B == blk)
        return ctx | own

    return create_block_mask(mask_mod, B=None, H=None, Q_LEN=shape.q_len, KV_LEN=shape.kv_len, device=device)


class Workload(Protocol):
    """What `warm` runs: `build()` once per process (create the compiled callables), then `run(device)`
    per device and pass. The compiled callables must be the ones the program uses afterwards, so a
    workload keeps them (a fresh `torch.compile(...)` per call would be a new, cold wrapper)."""

    name: str

    def build(self) -> None: ...

    def run(self, device: str) -> Any: ...


class _CompiledWorkload:
    """The compile-once logic shared by the built-in workloads.

    compile_once=True (warm): the compiled callable is built once in `build()` and shared by every
    device. compile_once=False (probe's race): every `run` compiles its own wrapper, as each of the
    seeds' drafter threads did. Subclasses define `_compile()` and `run()`.
    """

    def __init__(self, backend: Backend, *, compile_once: bool, name: str) -> None:
        self.name = name
        self.backend = backend
        self.compile_once = compile_once
        self._compiled: Any = None

    def _compile(self) -> Any:
        raise NotImplementedError

    def build(self) -> None:
        if self.compile_once and self._compiled is None:
            self._compiled = self._compile()

    def compiled(self) -> Any:
        """The compiled callable for this run: the shared one, or a fresh one per call."""
        if not self.compile_once:
            return self._compile()
        self.build()
        return self._compiled


class FlexAttentionWorkload(_CompiledWorkload):
    """`torch.compile(flex_attention)` with a `create_block_mask` mask, forward and backward where
    the device supports it (flex has no backward on CPU, FACTS.md §2).

    compile_once: see `_CompiledWorkload`.
    """

    def __init__(self, backend: Backend = "inductor", shape: FlexShape | None = None, *,
                 backward: bool | None = None, compile_once: bool = True, name: str = "flex_attention") -> None:
        super().__init__(backend, compile_once=compile_once, name=name)
        self.shape = shape or FlexShape()
        self.backward = backward

    def _compile(self) -> Any:
        import torch
        from torch.nn.attention.flex_attention import flex_attention

        return torch.compile(flex_attention, backend=self.backend)

    def run(self, device: str) -> Any:
        import torch

        compiled = self.compiled()
        sh = self.shape
        do_bwd = device.startswith("cuda") if self.backward is None else self.backward
        dtype = sh.torch_dtype(device)
        mask = dflash_block_mask(sh, device)
        q = torch.randn(sh.batch, sh.heads, sh.q_len, sh.head_dim, device=device, dtype=dtype, requires_grad=do_bwd)
        k, v = (torch.randn(sh.batch, sh.heads, sh.kv_len, sh.head_dim, device=device, dtype=dtype,
                            requires_grad=do_bwd) for _ in range(2))
        out = compiled(q, k, v, block_mask=mask)
        if do_bwd:
            out.sum().backward()
        return out


def make_flex_attention(backend: Backend = "inductor", *, seq: int = 256, heads: int = 4, head_dim: int = 64,
                        backward: bool | None = None) -> Callable[[str], Any]:
    """A fresh `torch.compile(flex_attention)` per call with a causal block mask, fwd (+bwd where supported).

    Each call of the returned function compiles its own wrapper, as each seeds' drafter thread did.
    Flex attention has no backward on CPU (FACTS.md §2), so backward runs only on CUDA by default.
    """
    shape = FlexShape(context=seq, heads=heads, head_dim=head_dim, mask="causal")
    return FlexAttentionWorkload(backend, shape, backward=backward, compile_once=False).run


class MLPWorkload(_CompiledWorkload):
    """A small compiled MLP step, forward and backward (compile_once: see `_CompiledWorkload`)."""

    def __init__(self, backend: Backend = "inductor", *, compile_once: bool = True, name: str = "compile") -> None:
        super().__init__(backend, compile_once=compile_once, name=name)

    def _compile(self) -> Any:
        import torch

        def step(x, w1, w2):
            return (torch.nn.functional.gelu(x @ w1) @ w2).square().mean()

        return torch.compile(step, backend=self.backend)

    def run(self, device: str) -> Any:
        import torch

        compiled = self.compiled()
        g = torch.Generator().manual_seed(0)
        x = torch.randn(32, 64, generator=g).to(device)
        w1 = torch.randn(64, 128, generator=g).to(device).requires_grad_()
        w2 = torch.randn(128, 64, generator=g).to(device).requires_grad_()
        loss = compiled(x, w1, w2)
        loss.backward()
        return loss


def make_compile(backend: Backend = "inductor") -> Callable[[str], Any]:
    """A small compiled MLP step, forward and backward; a fresh compiled wrapper per call."""
    return MLPWorkload(backend, compile_once=False).run


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


def _load_file_module(path: Path, alias: bool = False):
    """Load a file as a module. alias=True also registers it under its stem (`wl.py` -> `wl`) when
    that name is free and would import this same file, so a program that later does `import wl`
    gets this module (and its compiled functions), not a second copy."""
    name = f"_compilewatch_target_{abs(hash(path.resolve()))}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise BadInput(f"cannot load {path} as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    stem = path.stem
    if alias and stem.isidentifier() and stem not in sys.modules:
        try:
            found = importlib.util.find_spec(stem)
        except (ImportError, ValueError):
            found = None
        if found is None or (found.origin and Path(found.origin).resolve() == path.resolve()):
            sys.modules[stem] = module
    return module


def _import_object(spec: str, kind: str = "target", alias: bool = False) -> Any:
    """Import `module:attr` or `path/file.py:attr` (dotted attrs allowed) or raise BadInput."""
    mod_part, _, attr = spec.rpartition(":")
    if not mod_part or not attr:
        raise BadInput(f"{kind} {spec!r} is not of the form module:callable")
    try:
        if mod_part.endswith(".py") or "/" in mod_part:
            path = Path(mod_part)
            if not path.is_file():
                raise BadInput(f"{kind} file {mod_part!r} does not exist")
            module = _load_file_module(path, alias)
        else:
            module = importlib.import_module(mod_part)
    except BadInput:
        raise
    except Exception as e:  # noqa: BLE001 - any import failure is the user's input to fix
        raise BadInput(f"cannot import {mod_part!r} for {kind} {spec!r}: {type(e).__name__}: {e}") from e
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise BadInput(f"{mod_part!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    return obj


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
    obj = _import_object(spec)
    if not callable(obj):
        raise BadInput(f"{spec!r} is not callable (it is a {type(obj).__name__})")
    return Target(spec, f"user callable {spec}", _device_adapter(obj))


class CallableWorkload:
    """A plain `fn(device)` as a Workload: `build()` does nothing, so `fn` must keep its compiled
    callables itself (module level, or a closure built once), or warm cannot carry them over."""

    def __init__(self, fn: Callable[..., Any], name: str | None = None) -> None:
        self.name = name or getattr(fn, "__qualname__", None) or repr(fn)
        self._fn = _device_adapter(fn)

    def build(self) -> None:
        pass

    def run(self, device: str) -> Any:
        return self._fn(device)


BUILTIN_WORKLOADS = {
    "flex_attention": "torch.compile(flex_attention) + create_block_mask at DFlash shapes, fwd (+bwd on CUDA)",
    "compile": "a small torch.compile'd MLP, forward and backward",
}


def as_workload(obj: Any, name: str | None = None) -> Workload:
    """A Workload as is (anything with `run`; `build` optional), or a plain callable wrapped."""
    if callable(getattr(obj, "run", None)) and not isinstance(obj, type):
        if not callable(getattr(obj, "build", None)):
            obj.build = lambda: None  # type: ignore[attr-defined]
        if not getattr(obj, "name", None):
            obj.name = name or type(obj).__name__  # type: ignore[attr-defined]
        return obj
    if callable(obj):
        return CallableWorkload(obj, name)
    raise BadInput(f"{name or obj!r} is neither a workload (an object with run(device)) nor a callable")


def resolve_workload(spec: str = "flex_attention", backend: Backend = "inductor",
                     shape: FlexShape | None = None) -> Workload:
    """A built-in workload by name (`flex_attention`, `compile`) or `module:obj`: a Workload object,
    a zero-argument factory class of one, or a callable taking the device."""
    if spec == "flex_attention":
        return FlexAttentionWorkload(backend, shape)
    if spec == "compile":
        return MLPWorkload(backend)
    if ":" not in spec:
        raise BadInput(f"unknown workload {spec!r}",
                       hint=f"use a built-in ({', '.join(BUILTIN_WORKLOADS)}), module:callable or file.py:callable")
    obj = _import_object(spec, "workload", alias=True)
    if isinstance(obj, type) and callable(getattr(obj, "run", None)):
        obj = obj()  # a Workload class: one instance per process
    return as_workload(obj, spec)


def _device_adapter(fn: Callable[..., Any]) -> Callable[[str], Any]:
    try:
        params = [p for p in inspect.signature(fn).parameters.values()
                  if p.default is inspect.Parameter.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        params = [None]
    if not params:
        return lambda device: fn()
    return fn
