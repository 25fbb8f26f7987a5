"""The FX tracing flag's readers and the class-level `nn.Module` patch: one patch point for both.

`torch.fx._symbolic_trace` keeps tracing state that other threads see (`_is_fx_tracing_flag`,
`_Patcher`, `CURRENT_PATCHER` in torch 2.13's `torch/fx/_symbolic_trace.py`; 2.15 keeps the flag in
`_is_fx_tracing_tls`; how each torch
keeps it is probed in compilewatch.tracing.torchcompat, the only module that knows the layouts):
- the FX tracing flag, read through `is_fx_symbolic_tracing()` / `is_fx_tracing()`: a module global
  up to torch 2.13, per thread from 2.14 (dynamo's `compile_wrapper` binds `is_fx_symbolic_tracing`
  when `torch.compile(fn)` runs, so rebinding the module attribute would miss every function compiled
  before us: we swap the two functions' `__code__` for torchcompat's template of this layout, which
  every existing reference sees);
- the `_Patcher` that `Tracer.trace` uses to set `nn.Module.__call__` / `__getattr__` **on the
  class**, plus `CURRENT_PATCHER`, a module global that two overlapping traces corrupt (2.14 and 2.15 too).

This module owns those patches (tracehooks owns `Tracer.trace`; nothing else patches these):

- observers (the watcher) hear every flag read that returns True and every module call that a
  thread makes through *another* thread's class-level `__call__` patch;
- thread-local mode (the guard) makes the state effectively per thread: with a global flag, a reader
  returns True only in a thread that is inside `Tracer.trace` (and only while the global flag is
  set, so torch's own "not tracing here" override in `_set_compilation_env` keeps working; a
  per-thread flag is left as torch keeps it); the class patch dispatches to the tracing thread's
  wrapper only in that thread; `CURRENT_PATCHER` lives in a thread-local. Function globals a trace
  autowraps (`math.sqrt`, `torch.fx.wrap`'d functions) stay process-wide.

Everything is refcounted and fully reverted when the last user leaves. Installing is all or
nothing: on a torch whose layout torchcompat does not recognise, nothing is patched (tracehooks'
`Tracer.trace` patch included) and CompilewatchError says what was not recognised.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from dataclasses import dataclass
from types import FrameType
from typing import Any, Callable, Protocol

from compilewatch.tracing import torchcompat, tracehooks

_lock = threading.RLock()
_observers: list["FlagObserver"] = []
_thread_local_users = 0
_saved: dict[str, Any] = {}  # what we replaced, to put back
_routes: dict[str, dict[int, list[Callable[..., Any]]]] = {"__call__": {}, "__getattr__": {}}
_tls = threading.local()
_global_flag_lock = threading.Lock()


@dataclass(frozen=True, slots=True)
class FlagRead:
    """A read of the FX tracing flag that found it set (the global flag, or the reading thread's own)."""

    reader: str  # "is_fx_symbolic_tracing" or "is_fx_tracing"
    original: bool  # what torch's own reader would have returned
    effective: bool  # what it returned (differs only in thread-local mode)
    thread_is_tracing: bool  # the reading thread is inside Tracer.trace itself
    caller: FrameType | None  # the frame that called the reader (dynamo's compile_wrapper, ...)


@dataclass(frozen=True, slots=True)
class ForeignModuleCall:
    """A module call made by one thread through the `nn.Module.__call__` another thread's trace set."""

    module: str  # class name of the module called
    owner_thread_id: int  # the thread whose Tracer.trace installed the patch
    error: str | None = None  # "Type: message" when the call raised (e.g. NameError: not a submodule), else None


class FlagObserver(Protocol):
    def on_flag_read(self, read: FlagRead) -> None: ...

    def on_foreign_module_call(self, call: ForeignModuleCall) -> None: ...


# --- the flag readers -------------------------------------------------------------------------
# torchcompat.reader_templates() replace the readers' code; they call this object (injected into
# torch.fx._symbolic_trace's globals as torchcompat.READER_HOOK) once the flag reads True.


class _Readers:
    """Decides a flag read when the flag is set; injected into the FX module's globals."""

    def symbolic_tracing(self) -> bool:
        import torch

        original = not torch.compiler.is_compiling()
        return self._decide("is_fx_symbolic_tracing", original)

    def tracing(self) -> bool:
        return self._decide("is_fx_tracing", True)

    def _decide(self, reader: str, original: bool) -> bool:
        tracing_here = tracehooks.thread_is_tracing()
        # thread-local mode narrows a global flag to the tracing thread; a per-thread flag already is
        effective = original and (tracing_here if _thread_local_users and not _per_thread_flag() else True)
        if _observers:
            read = FlagRead(reader, original, effective, tracing_here, sys._getframe(3))
            for obs in list(_observers):
                try:
                    obs.on_flag_read(read)
                except Exception as e:  # noqa: BLE001 - an instrument never breaks the program
                    tracehooks.note_listener_error(f"{type(obs).__name__}.on_flag_read", e)
        return effective


_readers = _Readers()


def _per_thread_flag() -> bool:
    return _saved.get("flag_kind") == "thread_local"


def readers_patchable() -> tuple[bool, str]:
    """Whether this torch's flag readers and patcher have a layout this module can patch (all or
    nothing), and why not."""
    layout = torchcompat.fx_flag_layout()
    if not layout.known:
        return False, layout.why
    ok, why = torchcompat.patcher_support()
    if not ok:
        return False, why
    return True, f"ok ({layout.why})"


# --- the class-level Module patch --------------------------------------------------------------


class _ThreadPatch:
    """Stands in `_Patcher.patches_made` for a Module patch in thread-local mode: it routes the
    patch for the patching thread only, instead of setting it on the class for everyone."""

    __slots__ = ("name", "new_fn", "ident")

    def __init__(self, name: str, new_fn: Callable[..., Any], ident: int) -> None:
        self.name, self.new_fn, self.ident = name, new_fn, ident

    def patch(self) -> None:
        with _lock:
            _routes[self.name].setdefault(self.ident, []).append(self.new_fn)
            _set_dispatcher(self.name, True)

    def revert(self) -> None:
        with _lock:
            stack = _routes[self.name].get(self.ident, [])
            for i in range(len(stack) - 1, -1, -1):
                if stack[i] is self.new_fn:
                    del stack[i]
                    break
            if not stack:
                _routes[self.name].pop(self.ident, None)
            if not _routes[self.name]:
                _set_dispatcher(self.name, False)


def _dispatch_call(self, *args, **kwargs):
    stack = _routes["__call__"].get(threading.get_ident())
    if stack:
        return stack[-1](self, *args, **kwargs)
    return _saved["orig_module_call"](self, *args, **kwargs)


def _dispatch_getattr(self, name):
    stack = _routes["__getattr__"].get(threading.get_ident())
    if stack:
        return stack[-1](self, name)
    return _saved["orig_module_getattr"](self, name)


_DISPATCHERS = {"__call__": _dispatch_call, "__getattr__": _dispatch_getattr}


def _set_dispatcher(name: str, on: bool) -> None:
    import torch

    orig = _saved["orig_module_call" if name == "__call__" else "orig_module_getattr"]
    setattr(torch.nn.Module, name, _DISPATCHERS[name] if on else orig)


def _observed_call(new_fn: Callable[..., Any], owner: int) -> Callable[..., Any]:
    """Wrap a tracer's `module_call_wrapper` so calls from other threads are reported."""

    def notify(mod, error: str | None) -> None:
        call = ForeignModuleCall(type(mod).__name__, owner, error)
        for obs in list(_observers):
            try:
                obs.on_foreign_module_call(call)
            except Exception as e:  # noqa: BLE001
                tracehooks.note_listener_error(f"{type(obs).__name__}.on_foreign_module_call", e)

    def module_call_wrapper(mod, *args, **kwargs):
        if threading.get_ident() == owner or not _observers:
            return new_fn(mod, *args, **kwargs)
        try:  # observed after the call, so the report says whether it did harm
            out = new_fn(mod, *args, **kwargs)
        except Exception as e:
            notify(mod, f"{type(e).__name__}: {e}"[:2000])
            raise
        notify(mod, None)
        return out

    module_call_wrapper.__wrapped__ = new_fn  # type: ignore[attr-defined]
    return module_call_wrapper


def _patch_method(self, cls, name, new_fn, deduplicate=True):
    import torch

    if cls is torch.nn.Module and name in _routes:
        if _thread_local_users:
            new_fn.__fx_already_patched = deduplicate
            p = _ThreadPatch(name, new_fn, threading.get_ident())
            self.patches_made.append(p)
            p.patch()
            return None
        if _observers and name == "__call__":
            new_fn = _observed_call(new_fn, threading.get_ident())
    return _saved["patch_method"](self, cls, name, new_fn, deduplicate)


@contextlib.contextmanager
def _tl_new_patcher():
    import torch.fx._symbolic_trace as st

    prior = getattr(_tls, "patcher", None)
    patcher = st._Patcher()
    _tls.patcher = patcher
    try:
        yield patcher
    finally:
        patcher.revert_all_patches()
        _tls.patcher = prior


@contextlib.contextmanager
def _tl_maybe_revert_all_patches():
    patcher = getattr(_tls, "patcher", None)
    removed = patcher.revert_all_patches() if patcher is not None else None
    try:
        yield
    finally:
        made = patcher.reapply_all_patches() if patcher is not None else None
        if made != removed:
            raise AssertionError("CURRENT_PATCHER was changed during a revert_all_patches")


class _GlobalFlagKeeper:
    """In thread-local mode: after each trace, set the global flag to "some thread is tracing", so
    two overlapping traces cannot leave it stuck (the readers no longer depend on it anyway)."""

    def on_trace_enter(self, window: tracehooks.TraceWindow) -> None:
        pass

    def on_trace_exit(self, window: tracehooks.TraceWindow) -> None:
        with _global_flag_lock:
            torchcompat.set_fx_flag(bool(tracehooks.active_windows()))


_keeper = _GlobalFlagKeeper()


# --- install / uninstall -------------------------------------------------------------------------


def _install_base() -> None:
    """Swap the readers' code and `_Patcher.patch_method` (idempotent; caller holds _lock)."""
    if "readers" in _saved:
        return
    ok, why = readers_patchable()
    if not ok:
        from compilewatch.errors import CompilewatchError

        raise CompilewatchError(f"cannot instrument the FX flag on this torch: {why}")
    import torch.fx._symbolic_trace as st

    templates = torchcompat.reader_templates()
    setattr(st, torchcompat.READER_HOOK, _readers)
    _saved["flag_kind"] = torchcompat.fx_flag_layout().kind
    _saved["readers"] = {name: getattr(st, name).__code__ for name in templates}
    for name, code in templates.items():
        getattr(st, name).__code__ = code
    _saved["patch_method"] = st._Patcher.__dict__["patch_method"]
    _saved["orig_module_call"] = torchcompat.orig_module_call()
    _saved["orig_module_getattr"] = torchcompat.orig_module_getattr()
    st._Patcher.patch_method = _patch_method


def _uninstall_base_if_unused() -> None:
    if _observers or _thread_local_users or "readers" not in _saved:
        return
    import torch.fx._symbolic_trace as st

    for name, code in _saved.pop("readers").items():
        getattr(st, name).__code__ = code
    st._Patcher.patch_method = _saved.pop("patch_method")
    _saved.pop("flag_kind", None)
    st.__dict__.pop(torchcompat.READER_HOOK, None)


def add_observer(observer: FlagObserver) -> None:
    """Hear flag reads that find the flag set and cross-thread module calls (the watcher). Raises
    CompilewatchError, having installed nothing, when this torch's layout is not recognised."""
    with _lock:  # subscribed under the lock: a concurrent last remove_observer cannot unsubscribe it meanwhile
        tracehooks.subscribe(_noop)  # thread_is_tracing() needs tracehooks' patch installed
        try:
            _install_base()
        except Exception:
            _unsubscribe_if_unused()
            raise
        if observer not in _observers:
            _observers.append(observer)


def remove_observer(observer: FlagObserver) -> None:
    with _lock:
        if observer in _observers:
            _observers.remove(observer)
        _uninstall_base_if_unused()
    _unsubscribe_if_unused()


class _NoopListener:
    def on_trace_enter(self, window: tracehooks.TraceWindow) -> None:
        pass

    def on_trace_exit(self, window: tracehooks.TraceWindow) -> None:
        pass


_noop = _NoopListener()


def _unsubscribe_if_unused() -> None:
    with _lock:
        if not _observers and not _thread_local_users:
            tracehooks.unsubscribe(_noop)


def enable_thread_local() -> None:
    """Make the FX flag and the class-level Module patch per thread (refcounted). Raises
    CompilewatchError when the installed torch has a layout this module does not know."""
    global _thread_local_users
    import torch.fx._symbolic_trace as st

    with _lock:
        tracehooks.subscribe(_noop)
        try:
            _install_base()
        except Exception:
            _unsubscribe_if_unused()
            raise
        if not _per_thread_flag():  # a global flag: keep it "some thread traces" after each trace
            tracehooks.subscribe(_keeper)
        if _thread_local_users == 0:

            def switch() -> None:  # under tracehooks' lock: no trace starts while the state is reset and swapped
                global _thread_local_users
                repair_state()  # nn.Module.__call__ / __getattr__ are torch's own again
                _saved["new_patcher"] = st.__dict__["_new_patcher"]
                _saved["maybe_revert"] = st.__dict__["_maybe_revert_all_patches"]
                st._new_patcher = _tl_new_patcher
                _tl_new_patcher.__compilewatch_original__ = _saved["new_patcher"]  # torchcompat probes through it
                st._maybe_revert_all_patches = _tl_maybe_revert_all_patches
                _thread_local_users = 1

            if not tracehooks.when_idle(switch)[0]:
                from compilewatch.errors import CompilewatchError

                tracehooks.unsubscribe(_keeper)
                _uninstall_base_if_unused()
                _unsubscribe_if_unused()
                raise CompilewatchError("cannot switch the FX flag to thread-local while a trace is running",
                                        hint="enable it before threads start tracing or compiling")
        else:
            _thread_local_users += 1


def disable_thread_local() -> None:
    global _thread_local_users
    import torch.fx._symbolic_trace as st

    with _lock:
        if _thread_local_users == 0:
            return
        _thread_local_users -= 1
        if _thread_local_users == 0:
            st._new_patcher = _saved.pop("new_patcher")
            _tl_new_patcher.__compilewatch_original__ = None
            st._maybe_revert_all_patches = _saved.pop("maybe_revert")
        _uninstall_base_if_unused()
        last = _thread_local_users == 0
    if last:
        tracehooks.unsubscribe(_keeper)
    _unsubscribe_if_unused()


def thread_local_enabled() -> bool:
    return _thread_local_users > 0


@dataclass(frozen=True, slots=True)
class StuckState:
    """Tracing state left behind with no trace running (overlapping traces restore out of order)."""

    flag: bool  # the FX flag True (a per-thread flag: the checking thread's own)
    module_call_patched: bool  # nn.Module.__call__ is not the original
    module_getattr_patched: bool
    patcher_left: bool  # CURRENT_PATCHER not None

    @property
    def stuck(self) -> bool:
        return self.flag or self.module_call_patched or self.module_getattr_patched or self.patcher_left


def stuck_state() -> StuckState:
    """What is set although no thread is inside Tracer.trace (only meaningful with no trace open).
    A per-thread flag (torch 2.14+) can only be read for the calling thread."""
    import torch

    call = torch.nn.Module.__dict__["__call__"]
    getattr_ = torch.nn.Module.__dict__["__getattr__"]
    return StuckState(
        flag=torchcompat.fx_flag() is True,
        module_call_patched=call is not torchcompat.orig_module_call() and call is not _dispatch_call,
        module_getattr_patched=getattr_ is not torchcompat.orig_module_getattr() and getattr_ is not _dispatch_getattr,
        patcher_left=torchcompat.current_patcher() is not None,
    )


def repair_state() -> StuckState:
    """Put the flag, `nn.Module.__call__`/`__getattr__` and `CURRENT_PATCHER` back to "not tracing".
    Call it only when no thread is tracing. Returns what was stuck before the repair."""
    import torch

    before = stuck_state()
    torchcompat.reset_fx_flag()
    if before.module_call_patched:
        torch.nn.Module.__call__ = torchcompat.orig_module_call()
    if before.module_getattr_patched:
        torch.nn.Module.__getattr__ = torchcompat.orig_module_getattr()
    if before.patcher_left:
        torchcompat.clear_current_patcher()
    return before
