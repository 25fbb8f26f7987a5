"""What `probe` and `warm` can run: built-in targets, warm workloads, plugins and user callables.

A target is a function `fn(device: str) -> object`. Built-ins (`create_block_mask`,
`flex_attention`, `compile`) reproduce the experiments of the case this project comes from
(docs/index.md); a user target is given as
`package.module:callable` or `path/to/file.py:callable`; if the callable takes no parameter it is
called without the device.

A warm workload (`Workload`: `build()` once, `run(device)` per device and pass) is a built-in
(`flex_attention`, `compile`: generic, nothing model-specific), a plugin that another installed
package registers in the `compilewatch.workloads` entry-point group (a factory called with
`WorkloadOptions`; dflash registers `dflash`), or `module:obj` / `file.py:obj`.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Protocol

from compilewatch.errors import BadInput

Backend = str  # a torch.compile backend name: "inductor" (default), "aot_eager", "eager"


def check_backend(backend: Backend) -> None:
    """BadInput for a torch.compile backend torch does not know, before anything compiles (torch raises
    InvalidBackend only from inside the first compile, deep in a warm or probe run)."""
    import torch._dynamo
    from torch._dynamo.exc import InvalidBackend

    try:
        torch._dynamo.lookup_backend(backend)
    except InvalidBackend:
        raise BadInput(f"unknown torch.compile backend {backend!r}",
                       hint="use inductor, aot_eager or eager; torch._dynamo.list_backends(exclude_tags=()) lists "
                            "every backend this torch has") from None


@dataclass(frozen=True, slots=True)
class Target:
    name: str
    description: str
    fn: Callable[[str], Any]  # called with the device string


def _causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def run_create_block_mask(device: str) -> Any:
    """The experiment that showed create_block_mask does not trace (docs/probe.md): causal mask_mod,
    B=None, H=None, Q_LEN=1024, KV_LEN=2048 (uncompiled)."""
    from torch.nn.attention.flex_attention import create_block_mask

    return create_block_mask(_causal, B=None, H=None, Q_LEN=1024, KV_LEN=2048, device=device)


DTYPES = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp16": "float16", "float16": "float16",
          "fp32": "float32", "float32": "float32"}


@dataclass(frozen=True, slots=True)
class FlexShape:
    """Attention shapes for warm workloads (`compilewatch warm --seq --blocks --block-size --heads
    --head-dim --batch --dtype`). Defaults: Qwen3-8B attention (32 heads x 128) over a 3072-token
    context (Qwen3-8B's attention config; 3072 is the max length of SpecForge's DFlash reference run).

    The built-in `flex_attention` workload is causal with Q = KV = `context`; `blocks` and
    `block_size` are for block-structured workloads from plugins (dflash's: `blocks` query blocks of
    `block_size` tokens attending to the context plus their own block).
    """

    context: int = 3072  # S: context tokens (Q = KV = S for the causal workload)
    blocks: int = 512  # N: query blocks per sequence (block-structured workloads)
    block_size: int = 16  # B: tokens per block (block-structured workloads)
    heads: int = 32  # query and KV heads (Qwen3-8B has 32 query heads)
    head_dim: int = 128
    batch: int = 1
    dtype: str = "auto"  # bf16 | fp16 | fp32 | auto (bf16 on CUDA, fp32 on CPU)

    def __post_init__(self) -> None:
        for name in ("context", "blocks", "block_size", "heads", "head_dim", "batch"):
            if getattr(self, name) < 1:
                raise BadInput(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise BadInput(f"unknown dtype {self.dtype!r}", hint=f"use auto or one of {', '.join(DTYPES)}")

    def torch_dtype(self, device: str):
        import torch

        if self.dtype == "auto":
            return torch.bfloat16 if device.startswith("cuda") else torch.float32
        return getattr(torch, DTYPES[self.dtype])


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
    device. compile_once=False (probe's race): every `run` compiles its own wrapper, as each drafter
    thread of the 8-GPU DFlash trainer in docs/index.md did. Subclasses define `_compile()` and `run()`.
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
    """`torch.compile(flex_attention)` with a block mask, forward and backward where the device
    supports it (flex has no backward on CPU: torch 2.13's `torch/nn/attention/flex_attention.py` raises
    "FlexAttention does not support backward on CPU"). Causal, Q = KV = `shape.context`.

    A subclass changes the mask (`block_mask`) or the call (`attend`): q, k and v take their
    lengths from the mask's `seq_lengths`. compile_once: see `_CompiledWorkload`.
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

    def block_mask(self, device: str) -> Any:
        """The BlockMask for one run (uncompiled create_block_mask)."""
        from torch.nn.attention.flex_attention import create_block_mask

        n = self.shape.context
        return create_block_mask(_causal, B=None, H=None, Q_LEN=n, KV_LEN=n, device=device)

    def attend(self, compiled: Any, q: Any, k: Any, v: Any, mask: Any) -> Any:
        return compiled(q, k, v, block_mask=mask)

    def describe(self) -> str:
        sh = self.shape
        return f"causal flex_attention, seq {sh.context}, {sh.heads} heads x {sh.head_dim}, dtype {sh.dtype}"

    def run(self, device: str) -> Any:
        import torch

        compiled = self.compiled()
        sh = self.shape
        do_bwd = device.startswith("cuda") if self.backward is None else self.backward
        dtype = sh.torch_dtype(device)
        mask = self.block_mask(device)
        q_len, kv_len = mask.seq_lengths
        q = torch.randn(sh.batch, sh.heads, q_len, sh.head_dim, device=device, dtype=dtype, requires_grad=do_bwd)
        k, v = (torch.randn(sh.batch, sh.heads, kv_len, sh.head_dim, device=device, dtype=dtype,
                            requires_grad=do_bwd) for _ in range(2))
        out = self.attend(compiled, q, k, v, mask)
        if do_bwd:
            out.sum().backward()
        return out


def make_flex_attention(backend: Backend = "inductor", *, seq: int = 256, heads: int = 4, head_dim: int = 64,
                        backward: bool | None = None) -> Callable[[str], Any]:
    """A fresh `torch.compile(flex_attention)` per call with a causal block mask, fwd (+bwd where supported).

    Each call of the returned function compiles its own wrapper, as each drafter
    thread of the 8-GPU DFlash trainer in docs/index.md did.
    Flex attention has no backward on CPU (torch 2.13 raises "FlexAttention does not support backward on
    CPU"), so backward runs only on CUDA by default.
    """
    shape = FlexShape(context=seq, heads=heads, head_dim=head_dim)
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
            "create_block_mask(causal, B=None, H=None, Q_LEN=1024, KV_LEN=2048) uncompiled: the experiment that showed it does not trace",
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


class EntryPointError(Exception):
    """An entry point of an `EntryPoints` workload failed; the message names it."""

    def __init__(self, entry: str, error: BaseException) -> None:
        super().__init__(f"entry point {entry!r}: {type(error).__name__}: {error}")
        self.entry = entry


class EntryPoints:
    """Several `fn(device)` entry points as one Workload (`{"step": step_fn, "eval": eval_fn}`):
    `run(device)` calls each in order, so warm covers every compiled entry point of the program on
    every device. An entry point's exception is re-raised as `EntryPointError` naming it."""

    def __init__(self, entry_points: Mapping[str, Callable[..., Any]], name: str | None = None) -> None:
        if not entry_points:
            raise BadInput("no entry points to warm", hint="pass a mapping of name -> fn(device)")
        self.entries = {k: _device_adapter(fn) for k, fn in entry_points.items()}
        self.name = name or ", ".join(self.entries)

    def build(self) -> None:
        pass

    def run(self, device: str) -> None:
        for entry, fn in self.entries.items():
            try:
                fn(device)
            except Exception as e:  # noqa: BLE001 - re-raised with the entry point's name
                raise EntryPointError(entry, e) from e


BUILTIN_WORKLOADS = {
    "flex_attention": "torch.compile(flex_attention) with a causal block mask (Q = KV = --seq), fwd (+bwd on CUDA)",
    "compile": "a small torch.compile'd MLP, forward and backward",
}
ENTRY_POINT_GROUP = "compilewatch.workloads"  # where installed packages register their warm workloads


@dataclass(frozen=True, slots=True)
class WorkloadOptions:
    """What a workload factory (built-in or plugin) is built from: `compilewatch warm`'s options."""

    backend: Backend = "inductor"  # the torch.compile backend to compile with
    shape: FlexShape = FlexShape()  # --seq --blocks --block-size --heads --head-dim --batch --dtype


@dataclass(frozen=True, slots=True)
class InstalledWorkload:
    """A workload another package registered in the `compilewatch.workloads` entry-point group."""

    name: str
    value: str  # "package.module:factory"
    dist: str | None  # the distribution that registered it


def installed_workloads() -> dict[str, list[InstalledWorkload]]:
    """Every name in the `compilewatch.workloads` entry-point group (nothing is imported), with
    every package that registered it. Built-in names are not listed (built-ins win)."""
    from importlib.metadata import entry_points

    out: dict[str, list[InstalledWorkload]] = {}
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.name in BUILTIN_WORKLOADS:
            continue
        dist = getattr(getattr(ep, "dist", None), "name", None)
        found = InstalledWorkload(ep.name, ep.value, dist)
        if found not in out.get(ep.name, []):
            out.setdefault(ep.name, []).append(found)
    return out


def workload_names() -> list[str]:
    """Built-in workload names, then installed plugins' names (sorted)."""
    return [*BUILTIN_WORKLOADS, *sorted(installed_workloads())]


def _load_plugin(spec: InstalledWorkload, options: WorkloadOptions) -> Workload:
    """Import a plugin's factory and call it with `options`; any failure is BadInput naming the
    plugin, its package and the error."""
    from importlib.metadata import EntryPoint

    where = f"{spec.value}" + (f", from package {spec.dist}" if spec.dist else "")
    try:
        factory = EntryPoint(spec.name, spec.value, ENTRY_POINT_GROUP).load()
    except Exception as e:  # noqa: BLE001 - a broken plugin is an installation problem to report
        raise BadInput(f"workload plugin {spec.name!r} ({where}) failed to import: {type(e).__name__}: {e}",
                       hint="fix or reinstall the package that provides it, or pick another workload "
                            f"({', '.join(BUILTIN_WORKLOADS)})") from e
    if not callable(factory):
        raise BadInput(f"workload plugin {spec.name!r} ({where}) is a {type(factory).__name__}, not a factory",
                       hint="an entry point in compilewatch.workloads must be a callable taking WorkloadOptions")
    try:
        workload = factory(options)
    except BadInput:
        raise
    except Exception as e:  # noqa: BLE001 - same: report, do not crash
        raise BadInput(f"workload plugin {spec.name!r} ({where}) failed to build: {type(e).__name__}: {e}") from e
    return as_workload(workload, spec.name)


def as_workload(obj: Any, name: str | None = None) -> Workload:
    """A Workload as is (anything with `run`; `build` optional), a mapping of entry points
    (`EntryPoints`), or a plain callable wrapped."""
    if isinstance(obj, Mapping):
        return EntryPoints(obj, name)
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
    """A workload by name or path:
    - a built-in (`flex_attention`, `compile`);
    - a name another package registered in the `compilewatch.workloads` entry-point group (dflash
      registers `dflash`): its factory is called with `WorkloadOptions(backend, shape)`;
    - `module:obj` or `file.py:obj`: a Workload object, a Workload class (built with
      `WorkloadOptions` when its constructor takes an argument, e.g.
      `dflash.engine.warm_workload:DFlashAttention` from a source checkout without installed entry points),
      or a callable taking the device.
    Unknown names and plugins that fail to import or build raise BadInput."""
    if spec == "flex_attention":
        return FlexAttentionWorkload(backend, shape)
    if spec == "compile":
        return MLPWorkload(backend)
    if ":" not in spec:
        installed = installed_workloads()
        if spec not in installed:
            raise BadInput(f"unknown workload {spec!r}",
                           hint=f"installed workloads: {', '.join(workload_names())}; "
                                "or module:obj / path/to/file.py:obj")
        found = installed[spec]
        if len(found) > 1:
            raise BadInput(f"workload {spec!r} is registered by several packages: "
                           + "; ".join(f"{f.value} ({f.dist})" for f in found),
                           hint="uninstall one of them, or name the factory as module:obj")
        return _load_plugin(found[0], WorkloadOptions(backend, shape or FlexShape()))
    obj = _import_object(spec, "workload", alias=True)
    if isinstance(obj, type) and callable(getattr(obj, "run", None)):  # a Workload class: one instance per process
        obj = obj(WorkloadOptions(backend, shape or FlexShape())) if _required_positional(obj) else obj()
    return as_workload(obj, spec)


def _required_positional(fn: Callable[..., Any]) -> int:
    """How many positional parameters `fn` requires (1 when its signature cannot be read)."""
    try:
        return sum(1 for p in inspect.signature(fn).parameters.values()
                   if p.default is inspect.Parameter.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD))
    except (TypeError, ValueError):
        return 1


def _device_adapter(fn: Callable[..., Any]) -> Callable[[str], Any]:
    if not _required_positional(fn):
        return lambda device: fn()
    return fn
