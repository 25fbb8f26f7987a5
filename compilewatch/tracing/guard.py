"""The compile barrier: make threaded torch.compile programs safe instead of lucky.

    guard = CompileGuard()                        # installed now: thread-local FX flag where this torch allows it
    report = prewarm(["cuda:0", "cuda:1"], {"step": step_fn})   # compilewatch.devices.warm: every entry point x device, here
    guard.freeze()                                # from now on a compile in any thread raises GuardError
    ... start worker threads ...
    guard.close()

Three independent parts (docs/race.md says why each is needed):
- warm + freeze: compiles happen in one thread, one after another (`compilewatch.prewarm`:
  a warm pass, then a verify pass that must compile nothing); after `freeze()` a cache miss that would compile raises `GuardError` naming the function, the thread and torch's guard-failure
  reasons, instead of racing. Hooked where dynamo picks the frame callback for every compiled call
  (`torch._dynamo.eval_frame._callback_from_stance`, a module global read at call time, torch >= 2.6):
  per thread, unlike `set_stance("fail_on_recompile")`, which is process-wide.
- serialize (opt in): a reader-writer lock. A compile (dynamo cache miss, or a `Tracer.trace` window
  started by a Python thread outside dynamo) is exclusive; calls made inside `guard.shared()` or
  through `guard.wrap(fn)` are shared. A thread inside a shared section that must compile gives its
  share up first, so two such threads cannot deadlock.
- thread-local FX flag (`compilewatch.tracing.fxpatch`): the flag readers and the class-level
  `nn.Module.__call__` patch become per thread, so a make_fx / symbolic_trace in one thread cannot
  break compiled calls or module calls in another, and overlapping traces cannot leave state stuck.
  It covers what the installed torch did not fix: torch 2.14 and 2.15 keep the flag per thread themselves, so
  there only the class-level patch and CURRENT_PATCHER are made per thread (`support()` says which).

What none of them changes: `torch.compiler.is_compiling()` stays a process global (2.11-2.15), and
since 2.12 dynamo config set in one thread does not reach others (set it in each worker).
"""

from __future__ import annotations

import contextlib
import functools
import threading
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping, Sequence

from compilewatch.tracing import fxpatch, tracehooks
from compilewatch.errors import BadInput, CompilewatchError


class GuardError(CompilewatchError, RuntimeError):
    """A compile was attempted where the guard forbids it (after freeze())."""

    exit_code = 1


@dataclass(frozen=True, slots=True)
class GuardSupport:
    """What the installed torch allows the guard to do, and why."""

    torch_version: str
    freeze: bool
    freeze_how: str
    serialize: bool
    thread_local_flag: bool  # the thread-local mode can install here
    thread_local_why: str  # what it makes per thread on this torch, or why it cannot install
    dynamo_config_per_thread: bool | None  # measured (torch >= 2.12: a per-thread ContextVar)
    compiling_flag_global: bool | None  # torch.compiler.is_compiling() reads a process global
    fx_flag: str = "unknown"  # how torch keeps the FX flag: "global", "thread_local" or "unknown"
    fixed_upstream: tuple[str, ...] = ()  # thread-race sources this torch fixed itself
    not_fixed_upstream: tuple[str, ...] = ()  # the ones it still has (the guard covers them)


def support() -> GuardSupport:
    import torch._dynamo.eval_frame as ef

    from compilewatch.tracing import torchcompat

    freeze = hasattr(ef, "_callback_from_stance")
    tl, why = fxpatch.readers_patchable()
    race = torchcompat.race_facts()
    if tl:
        why = ("nn.Module.__call__/__getattr__ patch and CURRENT_PATCHER per thread (torch keeps the FX flag per "
               "thread itself)" if race.fx_flag == "thread_local" else
               "FX flag readers, nn.Module.__call__/__getattr__ patch and CURRENT_PATCHER per thread")
    return GuardSupport(
        torch_version=race.torch_version,
        freeze=freeze,
        freeze_how="per-thread hook on eval_frame._callback_from_stance" if freeze else "unavailable (torch < 2.6)",
        serialize=freeze,
        thread_local_flag=tl,
        thread_local_why=why,
        dynamo_config_per_thread=torchcompat.dynamo_config_per_thread(),
        compiling_flag_global=race.compiling_flag_global,
        fx_flag=race.fx_flag,
        fixed_upstream=race.fixed,
        not_fixed_upstream=race.not_fixed,
    )


class _RWLock:
    """Shared (compiled calls) / exclusive (compiles), reentrant per thread; a shared holder that
    asks for exclusive gives its share up while it waits, and gets it back afterwards."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._readers = 0
        self._writer: int | None = None
        self._depth = 0
        self._waiting = 0
        self._tls = threading.local()

    def _held(self) -> int:
        return getattr(self._tls, "reads", 0)

    def acquire_shared(self) -> None:
        me = threading.get_ident()
        with self._cond:
            if self._writer == me:  # a section opened while this thread compiles: nothing to wait for
                self._tls.in_write = getattr(self._tls, "in_write", 0) + 1
                return
            if self._held() == 0:  # reentrant holders never wait (a waiting writer would deadlock them)
                while self._writer is not None or self._waiting:
                    self._cond.wait()
            self._readers += 1
            self._tls.reads = self._held() + 1

    def release_shared(self) -> None:
        with self._cond:
            if self._writer == threading.get_ident() and getattr(self._tls, "in_write", 0) > 0:
                self._tls.in_write -= 1
                return
            if self._held() <= 0:  # the share was given up by an interrupted acquire_exclusive: nothing to release
                return
            self._tls.reads = self._held() - 1
            self._readers -= 1
            self._cond.notify_all()

    def acquire_exclusive(self) -> None:
        me = threading.get_ident()
        with self._cond:
            if self._writer == me:
                self._depth += 1
                return
            held = self._held()
            self._readers -= held
            suspended = getattr(self._tls, "suspended", [])
            suspended.append(held)
            self._tls.suspended = suspended
            self._tls.reads = 0
            self._cond.notify_all()
            self._waiting += 1
            try:
                while self._writer is not None or self._readers > 0:
                    self._cond.wait()
            except BaseException:  # interrupted (KeyboardInterrupt in the wait): the share stays given up
                self._waiting -= 1
                suspended.pop()
                self._cond.notify_all()  # readers held back by this waiter may go on
                raise
            self._waiting -= 1
            self._writer, self._depth = me, 1

    def release_exclusive(self) -> None:
        with self._cond:
            self._depth -= 1
            if self._depth:
                return
            self._writer = None
            held = self._tls.suspended.pop()
            self._readers += held
            self._tls.reads = held
            self._cond.notify_all()

    def is_writer(self) -> bool:
        return self._writer == threading.get_ident()


_hook_lock = threading.Lock()
_active: "CompileGuard | None" = None
# torch's own `_callback_from_stance`, kept once captured and never cleared: a thread that read the hook
# just before `close()` put torch's function back (a stuck daemon thread) still calls through it safely
_orig_from_stance: Any = None
_wrapped: dict[int, tuple[Any, Any]] = {}  # id(dynamo callback) -> (callback, guarded callback)


def _guarded_from_stance(callback):
    cb = _orig_from_stance(callback)
    guard = _active
    if guard is None or cb in (False, None):
        return cb
    entry = _wrapped.get(id(cb))
    if entry is None or entry[0] is not cb:
        entry = (cb, _make_guarded(cb))
        _wrapped[id(cb)] = entry
    return entry[1]


def _make_guarded(cb):
    @functools.wraps(cb)
    def guarded(frame, *args, **kwargs):
        guard = _active
        if guard is None:
            return cb(frame, *args, **kwargs)
        return guard._on_cache_miss(cb, frame, args, kwargs)

    guarded._torchdynamo_orig_backend = cb  # keeps dynamo's backend-identity guard from missing
    return guarded


def _miss_reasons(cb, frame) -> tuple[list[str], bool]:
    """torch's own guard-failure reasons for a cache miss; (reasons, had_cache_entries)."""
    try:
        from torch._C._dynamo.eval_frame import _debug_get_cache_entry_list
        from torch._dynamo.eval_frame import innermost_backend
        from torch._dynamo.guards import get_and_maybe_log_recompilation_reasons

        entries = _debug_get_cache_entry_list(frame.f_code)
        if not entries:
            return [], False
        backend = innermost_backend(cb)
        try:  # torch >= 2.12 takes the list of cache entries
            reasons = get_and_maybe_log_recompilation_reasons(entries, frame, backend, skip_logging=True)
        except AttributeError:  # torch <= 2.11 takes the head entry and walks `.next` itself
            reasons = get_and_maybe_log_recompilation_reasons(entries[0], frame, backend, skip_logging=True)
        return list(reasons), True
    except Exception as e:  # noqa: BLE001 - the reasons are a courtesy; the block itself must happen
        return [f"(guard reasons unavailable: {type(e).__name__}: {e})"], True


class CompileGuard:
    """See the module docstring. One guard is active per process at a time."""

    def __init__(self, *, thread_local: bool | None = None, serialize: bool = False) -> None:
        """Installs the guard now: from this line on the thread-local FX state (and serialize) protect
        every thread; `compilewatch.prewarm(...)` then `freeze()` add the compile barrier.
        thread_local: make the FX state per thread (None: where this torch allows it, else off; True: required, raises
        CompilewatchError when unsupported). serialize: the RW-lock mode. Raises BadInput while
        another guard is installed; `close()` (or `with`) removes it, `install()` puts it back."""
        self._thread_local_req = thread_local
        self.serialize = serialize
        self.thread_local = False
        self._frozen = False
        self._allowed = threading.local()
        self._rw = _RWLock()
        self._installed = False
        self.blocked: list[str] = []  # messages of every GuardError raised
        self.serialized_compiles = 0
        self.install()

    # --- lifecycle ------------------------------------------------------------------------------
    def install(self) -> "CompileGuard":
        global _active, _orig_from_stance
        if self._installed:
            return self
        import torch._dynamo.eval_frame as ef

        sup = support()
        if not sup.freeze:
            raise CompilewatchError(f"compilewatch.tracing.guard needs torch >= 2.6 (found {sup.torch_version})")
        with _hook_lock:
            if _active is not None:
                raise BadInput("another CompileGuard is already installed in this process",
                               hint="close() it first, or reuse it")
            if ef._callback_from_stance is not _guarded_from_stance:
                _orig_from_stance = ef._callback_from_stance
                ef._callback_from_stance = _guarded_from_stance
            _active = self
        want_tl = self._thread_local_req if self._thread_local_req is not None else sup.thread_local_flag
        if want_tl:
            try:
                fxpatch.enable_thread_local()
                self.thread_local = True
            except CompilewatchError:
                if self._thread_local_req:
                    self.close()
                    raise
        if self.serialize:
            tracehooks.subscribe(self)
        from compilewatch.remote_usage import verify_remote_reads

        verify_remote_reads()  # torch's remote-cache reads verified before it unpickles them
        self._installed = True
        return self

    def close(self) -> None:
        """Safe while other threads are inside the hook: they fall through to torch's function."""
        global _active
        import torch._dynamo.eval_frame as ef

        if self.serialize:
            tracehooks.unsubscribe(self)
        if self.thread_local:
            fxpatch.disable_thread_local()
            self.thread_local = False
        with _hook_lock:
            if _active is self:
                _active = None
                if ef._callback_from_stance is _guarded_from_stance:
                    ef._callback_from_stance = _orig_from_stance
                _wrapped.clear()
        self._installed = False
        self._frozen = False

    def __enter__(self) -> "CompileGuard":
        return self.install()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- warm (deprecated) and freeze ------------------------------------------------------------
    def warm(self, entry_points: "Mapping[str, Callable[[str], Any]] | Callable[[str], Any]",
             devices: "Sequence[str] | str" = ("cpu",), *, verify: bool = True) -> Any:
        """Deprecated in 0.2.0, removed in the release after it: use `compilewatch.prewarm(devices,
        entry_points)`, the one warm implementation (`compilewatch warm` and dflash use it too).

        Runs every entry point for every device in this thread, one after another, and, with
        `verify`, a second pass that must compile nothing; returns prewarm's WarmReport (`.ok`).
        Works before and after `freeze()` (it warms inside `allow_compiles()`)."""
        import warnings

        import compilewatch  # the public name it forwards to (tracing does not import the devices room)

        warnings.warn("CompileGuard.warm(entry_points, devices) is deprecated and will be removed in the next "
                      "release: use compilewatch.prewarm(devices, entry_points) (same entry points, same "
                      "verify pass; inside guard.allow_compiles() after freeze())", DeprecationWarning, stacklevel=2)
        self.install()
        with self.allow_compiles():
            return compilewatch.prewarm(list(devices) if not isinstance(devices, str) else devices, entry_points,
                                        verify=verify)

    def freeze(self) -> None:
        """From now on, a compile in any thread (outside `allow_compiles()`) raises GuardError."""
        self.install()
        self._frozen = True

    def thaw(self) -> None:
        self._frozen = False

    @property
    def frozen(self) -> bool:
        return self._frozen

    @contextlib.contextmanager
    def allow_compiles(self) -> Iterator[None]:
        """Let this thread compile while frozen (a deliberate, single-threaded late warm-up)."""
        prev = getattr(self._allowed, "on", False)
        self._allowed.on = True
        try:
            yield
        finally:
            self._allowed.on = prev

    # --- serialize ------------------------------------------------------------------------------
    @contextlib.contextmanager
    def shared(self) -> Iterator[None]:
        """A section of compiled calls that must not overlap a compile (serialize mode; a no-op
        otherwise)."""
        if not self.serialize:
            yield
            return
        self._rw.acquire_shared()
        try:
            yield
        finally:
            self._rw.release_shared()

    def wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """`fn` with every call inside `shared()`."""

        @functools.wraps(fn)
        def call(*args, **kwargs):
            with self.shared():
                return fn(*args, **kwargs)

        return call

    def on_trace_enter(self, window: tracehooks.TraceWindow) -> None:
        # A trace outside dynamo (make_fx, symbolic_trace) is a compile for the lock. Threads torch
        # starts itself (autograd device threads: _DummyThread) run lazy backward compiles while their
        # caller holds a shared section; locking there would deadlock, so they are left alone.
        if window.outer_window is None and not isinstance(threading.current_thread(), threading._DummyThread):
            self._rw.acquire_exclusive()
            window_ids = getattr(self._allowed, "trace_locks", [])
            window_ids.append(window.window_id)
            self._allowed.trace_locks = window_ids

    def on_trace_exit(self, window: tracehooks.TraceWindow) -> None:
        ids = getattr(self._allowed, "trace_locks", [])
        if ids and ids[-1] == window.window_id:
            ids.pop()
            self._rw.release_exclusive()

    # --- the hook -------------------------------------------------------------------------------
    def _on_cache_miss(self, cb, frame, args, kwargs):
        if self._frozen and not getattr(self._allowed, "on", False):
            from torch._dynamo import convert_frame, trace_rules

            if trace_rules.check(frame.f_code) or not convert_frame.has_tensor_in_frame(frame):
                return cb(frame, *args, **kwargs)  # dynamo would skip this frame: nothing compiles
            raise self._blocked(cb, frame)
        if self.serialize:
            self._rw.acquire_exclusive()
            try:
                self.serialized_compiles += 1
                return cb(frame, *args, **kwargs)
            finally:
                self._rw.release_exclusive()
        return cb(frame, *args, **kwargs)

    def _blocked(self, cb, frame) -> GuardError:
        from compilewatch.tracing import stacks

        code = frame.f_code
        where = f"{stacks.short_path(code.co_filename)}:{code.co_firstlineno}"
        thread = threading.current_thread().name
        reasons, had_entries = _miss_reasons(cb, frame)
        if reasons:
            why = "guard failure(s):\n" + "\n".join(f"  - {r}" for r in reasons)
        elif had_entries:
            why = "a guard failed (torch gave no reason)"
        else:
            why = "it was never compiled (not during the warm phase either)"
        msg = (f"compilewatch.tracing.guard: thread {thread!r} tried to compile {code.co_name} ({where}) after freeze(); "
               f"{why}")
        self.blocked.append(msg)
        from compilewatch.tracing import watcher as _watcher

        _watcher.notify_all("guard_blocked", {"function": f"{code.co_name} ({where})", "reasons": reasons,
                                            "reasons_text": why})
        return GuardError(msg, hint="compile this variant (shape, dtype, device) in compilewatch.prewarm(...) before freeze(), "
                                    "mark the dimension dynamic, or use CompileGuard(serialize=True) for late compiles")
