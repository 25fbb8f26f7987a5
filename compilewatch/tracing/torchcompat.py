"""Every torch internal that compilewatch reads or patches and that differs between torch releases.

One place to read when a new torch comes out (then add a CI column). Each decision is made by probing
torch's own functions and attributes, never by comparing version strings:

| state | layouts seen | recognised by |
|---|---|---|
| FX tracing flag | `global`: module global `_is_fx_tracing_flag` (2.11-2.13); `thread_local`: `_is_fx_tracing_tls` read through `_get_is_fx_tracing` / `_set_is_fx_tracing` (2.14.1, 2.15) | the attributes, and the names the readers' code uses |
| `Tracer.trace`'s patcher | `_Patcher.patch_method` sets `nn.Module.__call__`/`__getattr__` on the class; `_new_patcher` keeps it in the module global `CURRENT_PATCHER` (every release so far, 2.14 and 2.15 included) | the helpers exist, and the names `Tracer.trace` / `_new_patcher` use |
| compiling flag | `torch.compiler._is_compiling_flag`, a process global (2.11-2.15); held for a whole dynamo compile session where `_compile_session_context` exists (2.13+) | the attribute, and the names `is_compiling` uses |
| dynamo config | per thread (a ContextVar) since 2.12 | measured: a value set here, read from a new thread |
| remote cache counters | `torch._inductor.remote_cache.cache_stats._stats`: hit/miss/put/exception per RemoteCache class (`RemoteFxGraphCache`, `RemoteAOTAutogradCache`, ...) and per backend (`backend:RedisRemoteCacheBackend`), 2.11-2.15; 2.13+ also count `LocalFxGraphCache` / `LocalAOTAutogradCache` | the object and its `_stats` mapping of objects with `hit`/`miss`/`put`/`exception` |

`race_facts()` turns the probes into sentences: what this torch fixed upstream and what it did not;
doctor, probe and `guard.support()` all report them.

The flag reader templates at the bottom replace the code of torch's `is_fx_symbolic_tracing` /
`is_fx_tracing` (compilewatch.tracing.fxpatch does the swap); they call `READER_HOOK`, an object fxpatch
puts into `torch.fx._symbolic_trace`'s globals.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from types import CodeType
from typing import Any, Callable, Literal

FlagKind = Literal["global", "thread_local", "unknown"]
READER_HOOK = "_compilewatch_fxflag"  # the name fxpatch injects into torch.fx._symbolic_trace
_READERS = ("is_fx_symbolic_tracing", "is_fx_tracing")
_PATCHER_NAMES = ("_Patcher", "_new_patcher", "_maybe_revert_all_patches", "_orig_module_call", "_orig_module_getattr")


def _st():
    import torch.fx._symbolic_trace as st

    return st


def _names(fn: Any) -> tuple[str, ...]:
    """The global/attribute names a function's code uses (through contextmanager and our wrappers)."""
    for _ in range(8):
        inner = getattr(fn, "__compilewatch_original__", None) or getattr(fn, "__wrapped__", None)
        if inner is None:
            break
        fn = inner
    return tuple(getattr(getattr(fn, "__code__", None), "co_names", ()))


# --- the FX tracing flag ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class FlagLayout:
    """How this torch keeps the FX tracing flag."""

    kind: FlagKind
    why: str  # what was recognised, or what is missing

    @property
    def known(self) -> bool:
        return self.kind != "unknown"

    @property
    def per_thread(self) -> bool:
        return self.kind == "thread_local"


def fx_flag_layout() -> FlagLayout:
    try:
        st = _st()
    except Exception as e:  # noqa: BLE001
        return FlagLayout("unknown", f"torch.fx._symbolic_trace cannot be imported: {e!r}")
    # decided by what torch's readers read (a stale attribute someone planted does not count)
    names = {n for r in _READERS for n in getattr(getattr(getattr(st, r, None), "__code__", None), "co_names", ())}
    if "_get_is_fx_tracing" in names and callable(getattr(st, "_get_is_fx_tracing", None)) \
            and callable(getattr(st, "_set_is_fx_tracing", None)):
        kind: FlagKind = "thread_local"
        marker = "_get_is_fx_tracing"
    elif "_is_fx_tracing_flag" in names and isinstance(getattr(st, "_is_fx_tracing_flag", None), bool):
        kind, marker = "global", "_is_fx_tracing_flag"
    else:
        return FlagLayout("unknown", "torch.fx._symbolic_trace's is_fx_symbolic_tracing/is_fx_tracing read neither the "
                                     "module-global _is_fx_tracing_flag nor _get_is_fx_tracing()")
    for name in _READERS:
        code = getattr(getattr(st, name, None), "__code__", None)
        if code is None or code.co_freevars or marker not in code.co_names:
            return FlagLayout("unknown", f"torch.fx._symbolic_trace.{name} does not read {marker} the known way")
    if kind == "global":
        return FlagLayout(kind, "module global torch.fx._symbolic_trace._is_fx_tracing_flag")
    return FlagLayout(kind, "per-thread torch.fx._symbolic_trace._is_fx_tracing_tls (_get/_set_is_fx_tracing)")


def fx_flag() -> bool | None:
    """The FX tracing flag as the calling thread's readers see it (a per-thread flag: this thread's
    own); None when this torch's layout is unknown."""
    layout = fx_flag_layout()
    st = _st()
    if layout.kind == "global":
        return bool(st._is_fx_tracing_flag)
    if layout.kind == "thread_local":
        return bool(st._get_is_fx_tracing())
    return None


def set_fx_flag(value: bool) -> None:
    """Set the flag (a per-thread flag: the calling thread's). Raises CompilewatchError when the
    layout is unknown: nothing is planted on a torch that does not have it."""
    layout = fx_flag_layout()
    st = _st()
    if layout.kind == "global":
        st._is_fx_tracing_flag = bool(value)
    elif layout.kind == "thread_local":
        st._set_is_fx_tracing(bool(value))
    else:
        from compilewatch.errors import CompilewatchError

        raise CompilewatchError(f"cannot set the FX tracing flag on this torch: {layout.why}")


def reset_fx_flag() -> None:
    """Put the flag back to False where this torch has one (the calling thread's, if per thread)."""
    if fx_flag_layout().known:
        set_fx_flag(False)


# --- the patcher (class-level nn.Module patch and CURRENT_PATCHER) ------------------------------------


def patcher_support() -> tuple[bool, str]:
    """Whether `Tracer.trace` takes its patcher the way compilewatch.tracing.fxpatch knows how to hook."""
    try:
        st = _st()
    except Exception as e:  # noqa: BLE001
        return False, f"torch.fx._symbolic_trace cannot be imported: {e!r}"
    for name in _PATCHER_NAMES:
        if not hasattr(st, name):
            return False, f"torch.fx._symbolic_trace.{name} is missing"
    if not callable(getattr(st._Patcher, "patch_method", None)):
        return False, "torch.fx._symbolic_trace._Patcher.patch_method is missing"
    if "_new_patcher" not in _names(st.Tracer.__dict__.get("trace")):
        return False, "Tracer.trace does not take its patcher from _new_patcher()"
    return True, "ok"


def module_patch_on_class() -> bool | None:
    """True when `Tracer.trace` patches nn.Module.__call__/__getattr__ on the class (for every thread)."""
    try:
        names = _names(_st().Tracer.__dict__.get("trace"))
    except Exception:  # noqa: BLE001
        return None
    return "patch_method" in names and "Module" in names if names else None


def patcher_global() -> bool | None:
    """True when `_new_patcher` keeps the running trace's patcher in the module global CURRENT_PATCHER."""
    try:
        st = _st()
    except Exception:  # noqa: BLE001
        return None
    if not hasattr(st, "_new_patcher"):
        return None
    return "CURRENT_PATCHER" in _names(st._new_patcher) and hasattr(st, "CURRENT_PATCHER")


def current_patcher() -> Any:
    return getattr(_st(), "CURRENT_PATCHER", None)


def clear_current_patcher() -> None:
    st = _st()
    if hasattr(st, "CURRENT_PATCHER"):
        st.CURRENT_PATCHER = None


def orig_module_call() -> Callable[..., Any]:
    return _st()._orig_module_call


def orig_module_getattr() -> Callable[..., Any]:
    return _st()._orig_module_getattr


# --- torch.compiler's compiling flag and dynamo config -------------------------------------------------


def compiling_flag() -> bool | None:
    """`torch.compiler._is_compiling_flag`, None if torch lacks it."""
    import torch

    flag = getattr(torch.compiler, "_is_compiling_flag", None)
    return None if flag is None else bool(flag)


def compiling_flag_global() -> bool | None:
    """True when `torch.compiler.is_compiling()` reads the process-global `_is_compiling_flag`."""
    import torch

    if not isinstance(getattr(torch.compiler, "_is_compiling_flag", None), bool):
        return None
    return "_is_compiling_flag" in _names(torch.compiler.is_compiling)


def compiling_flag_held_for_session() -> bool:
    """True when dynamo holds the compiling flag for a whole compile session (pytorch PR #184614)."""
    import torch

    return callable(getattr(torch.compiler, "_compile_session_context", None))


def dynamo_config_per_thread() -> bool | None:
    """Measured: set a dynamo config value here (temporarily) and read it from a new thread."""
    try:
        import torch._dynamo.config as dc

        name = "recompile_limit" if hasattr(dc, "recompile_limit") else "cache_size_limit"
        current = getattr(dc, name)
        seen: list[int] = []
        with dc.patch(**{name: current + 1}):
            t = threading.Thread(target=lambda: seen.append(getattr(dc, name)), name="compilewatch-config-probe")
            t.start()
            t.join()
        return bool(seen) and seen[0] != current + 1
    except Exception:  # noqa: BLE001 - a torch without config.patch(): cannot tell
        return None


# --- what this torch fixed, and what it did not ------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RaceFacts:
    """The thread-race state of the installed torch, probed, with the sentences verdicts use."""

    torch_version: str
    fx_flag: FlagKind
    fx_flag_why: str
    module_patch_on_class: bool | None
    patcher_global: bool | None
    compiling_flag_global: bool | None
    fixed: tuple[str, ...]  # what this torch fixed upstream
    not_fixed: tuple[str, ...]  # the race sources it still has
    unknown: tuple[str, ...]  # what could not be recognised (compilewatch cannot watch it)
    headline: str  # one line: "fixed upstream: ...; not fixed: ..."


FLAG_FIXED = ("the FX tracing flag is per thread: a trace in one thread no longer makes another thread's compiled "
              "call raise \"Detected that you are using FX to symbolically trace a dynamo-optimized function\", "
              "and overlapping traces cannot leave it stuck")
FLAG_NOT_FIXED = ("the FX tracing flag is a module global: a make_fx / symbolic_trace / compile in one thread makes "
                  "compiled calls in other threads raise (or run eagerly), and overlapping traces leave it stuck True")
PATCH_NOT_FIXED = ("Tracer.trace patches nn.Module.__call__/__getattr__ on the class: an nn.Module call in another "
                   "thread during a trace runs through that tracer (under symbolic_trace it raises NameError \"module "
                   "is not installed as a submodule\")")
PATCHER_NOT_FIXED = ("CURRENT_PATCHER is a module global: two traces overlapping in different threads corrupt it "
                     "(AssertionError \"CURRENT_PATCHER is None in finally block\") and can leave nn.Module.__call__ "
                     "patched for good")
COMPILING_NOT_FIXED = ("torch.compiler.is_compiling() reads a process global: while one thread compiles, other threads "
                       "read its value")


def race_facts() -> RaceFacts:
    import torch

    layout = fx_flag_layout()
    on_class, pglobal, cglobal = module_patch_on_class(), patcher_global(), compiling_flag_global()
    flag_state = {"thread_local": False, "global": True}.get(layout.kind)
    fixed: list[str] = []
    not_fixed: list[str] = []
    unknown: list[str] = []
    short: dict[str, list[str]] = {"fixed": [], "not": [], "unknown": []}
    for value, bad, good, label, what in (
            (flag_state, FLAG_NOT_FIXED, FLAG_FIXED, ("FX flag module-global", "FX flag per thread"), "FX tracing flag"),
            (on_class, PATCH_NOT_FIXED, "Tracer.trace no longer patches nn.Module.__call__ on the class",
             ("nn.Module.__call__ patched on the class", "nn.Module patch per trace"), "nn.Module patch"),
            (pglobal, PATCHER_NOT_FIXED, "CURRENT_PATCHER is no longer a module global",
             ("CURRENT_PATCHER module-global", "CURRENT_PATCHER not global"), "CURRENT_PATCHER"),
            (cglobal, COMPILING_NOT_FIXED, "torch.compiler.is_compiling() no longer reads a process global",
             ("is_compiling() process-global", "is_compiling() not global"), "is_compiling()")):
        if value is True:
            not_fixed.append(bad)
            short["not"].append(label[0])
        elif value is False:
            fixed.append(good)
            short["fixed"].append(label[1])
        else:
            unknown.append(f"{what}: {layout.why}" if what == "FX tracing flag" else f"{what}: not recognised")
            short["unknown"].append(what)
    headline = "; ".join(f"{title}: {', '.join(items)}" for title, items in (
        ("fixed upstream", short["fixed"]), ("not fixed", short["not"]), ("not recognised", short["unknown"])) if items)
    return RaceFacts(torch.__version__, layout.kind, layout.why, on_class, pglobal, cglobal, tuple(fixed),
                     tuple(not_fixed), tuple(unknown), headline)


# --- flag reader templates (fxpatch swaps them in; names resolve in torch.fx._symbolic_trace) -----------
# The fast path (flag False) costs what torch's own reader costs.


def _global_is_fx_symbolic_tracing() -> bool:
    return _is_fx_tracing_flag and _compilewatch_fxflag.symbolic_tracing()  # type: ignore[name-defined] # noqa: F821


def _global_is_fx_tracing() -> bool:
    is_fx_tracing_warning()  # type: ignore[name-defined] # noqa: F821
    return _is_fx_tracing_flag and _compilewatch_fxflag.tracing()  # type: ignore[name-defined] # noqa: F821


def _tls_is_fx_symbolic_tracing() -> bool:
    return _get_is_fx_tracing() and _compilewatch_fxflag.symbolic_tracing()  # type: ignore[name-defined] # noqa: F821


def _tls_is_fx_tracing() -> bool:
    is_fx_tracing_warning()  # type: ignore[name-defined] # noqa: F821
    return _get_is_fx_tracing() and _compilewatch_fxflag.tracing()  # type: ignore[name-defined] # noqa: F821


def reader_templates() -> dict[str, CodeType]:
    """Code for torch's two flag readers that asks READER_HOOK once the flag is set (this layout's
    flag). Raises CompilewatchError when the layout is unknown."""
    layout = fx_flag_layout()
    if layout.kind == "global":
        return {"is_fx_symbolic_tracing": _global_is_fx_symbolic_tracing.__code__,
                "is_fx_tracing": _global_is_fx_tracing.__code__}
    if layout.kind == "thread_local":
        return {"is_fx_symbolic_tracing": _tls_is_fx_symbolic_tracing.__code__,
                "is_fx_tracing": _tls_is_fx_tracing.__code__}
    from compilewatch.errors import CompilewatchError

    raise CompilewatchError(f"cannot instrument the FX flag on this torch: {layout.why}")


# --- torch's remote cache counters ---------------------------------------------------------------


def remote_cache_stats() -> dict[str, dict[str, int]] | None:
    """torch's own remote (and, 2.13+, local) cache counters: class name -> {hit, miss, put, exception}.

    `RemoteCache.get` counts a hit when the server returned a value and a miss when it returned
    nothing, so a server torch cannot reach counts misses (its backend swallows the error). None when
    this torch has no such counters (or remote_cache cannot be imported)."""
    try:
        from torch._inductor import remote_cache
    except Exception:  # noqa: BLE001 - a torch without it: nothing to report
        return None
    stats = getattr(getattr(remote_cache, "cache_stats", None), "_stats", None)
    if not isinstance(stats, dict):
        return None
    out: dict[str, dict[str, int]] = {}
    for name, st in list(stats.items()):
        try:
            out[str(name)] = {f: int(getattr(st, f)) for f in ("hit", "miss", "put", "exception")}
        except (AttributeError, TypeError, ValueError):
            continue
    return out
