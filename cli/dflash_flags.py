"""The `dflash train` options that mirror one config field each, from one table over the config tree.

Each row names the flag, the field it sets and its help; the option's type and the "= --set KEY=..."
note come from the field (dflash.config_field), so a flag cannot drift from the config it sets. A
row may imply other fields when they are not given themselves (`--device` means one device: it
clears device lists a resumed run had; the device lists mean the engine: the device goes back to
auto). Every check on the values is the config's own (they arrive as `--set` overrides would)."""

from __future__ import annotations

import functools
import inspect
import types
import typing
from dataclasses import dataclass, field
from typing import Annotated, Any, Callable, Optional

import typer

import dflash


@dataclass(frozen=True)
class Flag:
    names: tuple[str, ...]  # ("--device", "-d")
    key: str  # the config field it sets
    help: str
    value: Any = None  # for a switch: the value it sets (--no-prewarm: False); None = the option takes a value
    implies: dict[str, Any] = field(default_factory=dict)  # fields set with it, unless given themselves

    @property
    def param(self) -> str:
        return self.names[0].lstrip("-").replace("-", "_")


TRAIN_FLAGS = (
    Flag(("--target",), "target.path", "Local HF target directory."),
    Flag(("--data",), "data.path", "Chat JSONL."),
    Flag(("--out", "-o"), "checkpoint.out_dir", "Run directory (default runs/<recipe>-<time>)."),
    Flag(("--device", "-d"), "topology.device",
         "One device: cpu, cuda, cuda:N or N (auto: the first GPU, else cpu).",
         implies={"topology.target_devices": (), "topology.drafter_devices": ()}),
    Flag(("--max-steps",), "train.max_steps", "Stop after N optimizer steps."),
    Flag(("--strict",), "data.strict", "Any skipped data record is an error (exit 2).", value=True),
    Flag(("--target-devices",), "topology.target_devices",
         "Target workers, one thread per entry: 0,1,2,3,4 (cpu and repeats allowed). "
         "With --drafter-devices: train with the multi-device engine.", implies={"topology.device": "auto"}),
    Flag(("--drafter-devices",), "topology.drafter_devices",
         "Drafter replicas, one thread per entry: 5,6,7; replica 0 (the trainer) runs on the first. Every "
         "replica's step is compiled in the main thread first, one device after another; then compiling is frozen.",
         implies={"topology.device": "auto"}),
    Flag(("--no-prewarm",), "topology.prewarm",
         "Engine: skip the sequential prewarm (brings back the cross-thread compile race: for experiments only).", value=False),
    Flag(("--no-guard",), "topology.guard", "Engine: do not freeze compiles during training.", value=False),
    Flag(("--stall-after",), "topology.stall_after",
         "Engine: no step for this many seconds = stall: dump every thread's stack and stop."),
    Flag(("--dist-backend",), "topology.dist_backend",
         "Distributed: auto (NCCL for CUDA drafters, gloo beside it; gloo on CPU), gloo or nccl."),
    Flag(("--dist-timeout",), "topology.dist_timeout",
         "Distributed: seconds a rank may wait in a collective before it fails (must exceed the slowest "
         "rank's prewarm and rank 0's checkpoint save)."),
)


def _option(flag: Flag) -> tuple[Any, Any]:
    """(annotation, default) of the typer parameter for `flag`, from its config field."""
    info = dflash.config_field(flag.key)
    if flag.value is not None:
        return Annotated[bool, typer.Option(*flag.names, help=f"{flag.help.rstrip('.')} (= --set {flag.key}="
                                                              f"{str(flag.value).lower()}).")], False
    tp = info.type
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    base = args[0] if typing.get_origin(tp) in (typing.Union, types.UnionType) else tp
    py = base if base in (int, float) else str  # lists and choices arrive as text; the config parses them
    default = "" if info.default in (None, ()) else f"default {info.default}; "
    return Annotated[Optional[py], typer.Option(*flag.names, help=f"{flag.help.rstrip('.')} ({default}= --set {flag.key}=...).")], None


def overrides_from(flags: tuple[Flag, ...], given: dict[str, Any]) -> dict[str, Any]:
    """The fields the given flags set (flags not given are absent: a resumed run keeps its
    config.toml's), then what they imply where not given themselves."""
    out: dict[str, Any] = {}
    for f in flags:
        v = given.get(f.param)
        if v is None or (f.value is not None and not v):
            continue
        if f.value is None and typing.get_origin(dflash.config_field(f.key).type) is tuple and not str(v).strip(", "):
            from compilewatch.errors import BadInput

            raise BadInput(f"{f.names[0]}: no devices given", hint=f"e.g. {f.names[0]} 0,1,2 or {f.names[0]} cpu,cpu")
        out[f.key] = f.value if f.value is not None else v
    implied: dict[str, Any] = {}
    for f in flags:
        if f.key in out:
            implied.update({k: v for k, v in f.implies.items() if k not in out})
    return {**implied, **out}


def with_config_flags(flags: tuple[Flag, ...]) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Add one typer option per row to a command; the command gets them as `config_flags`, a dict
    of config overrides (overrides_from)."""
    def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
        hints = typing.get_type_hints(fn, include_extras=True)
        sig = inspect.signature(fn)
        params = [p.replace(annotation=hints[p.name]) for p in sig.parameters.values() if p.name != "config_flags"]
        extra = []
        for f in flags:
            ann, default = _option(f)
            extra.append(inspect.Parameter(f.param, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=ann))
        params = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in params[:-1] + extra + params[-1:]]  # --json last

        @functools.wraps(fn)
        def command(**kw: Any) -> Any:
            given = {f.param: kw.pop(f.param) for f in flags}
            return fn(**kw, config_flags=overrides_from(flags, given))

        del command.__wrapped__  # typer reads this signature, not fn's
        command.__signature__ = sig.replace(parameters=params)  # type: ignore[attr-defined]
        command.__annotations__ = {p.name: p.annotation for p in params}
        return command
    return wrap
