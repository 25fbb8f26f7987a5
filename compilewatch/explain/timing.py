"""Warm but slow: where a watched process's compile time went, phase by phase, from torch's own timers.

torch times the steps of a compile with `torch._dynamo.utils.dynamo_timed(key, phase_name=...)`. Every
such step reports its start and end, with `time.time_ns()` stamps, to the process's
`ChromiumEventLogger` (`log_event_start(event_name, time_ns, ...)` / `log_event_end(event_name, time_ns,
...)`; the event name is `phase_name` when given, else `key`). While compilewatch watches a process it
wraps those two methods (class level, put back when the watch ends) and keeps, per thread, the stack
of open steps, so each step's own time (its duration less its timed children's) is known. The same
events feed torch's `compilation_time_metrics` and `compile_times()`, which keep durations without
their nesting, so nested steps would be counted twice there.

Each step's own time goes to its phase (`PHASES`, by torch's event name); a step torch times that is
not in the table goes to the phase of its closest timed parent that is, else to "other" (dynamo's
`dynamo`, `entire_frame_compile`, `compile_attempt_N`, `entire_backward_compile` wrappers, `gc`). The phases of a process add up
to its total: the time some timed step was open, summed over threads (`wall_s`: the same, counted
once however many threads compiled at once).

What a torch does not time is reported as not available on it, never guessed: a phase is available
when torch's source (the files in `SOURCES`, read as text, never imported) names one of its events, or
when one was seen. Seen on CPU with real compiles (tests/test_explain_timing.py) and read from each
release's source: 2.11.0, 2.13.0 and 2.15.0 time every phase in `PHASES`; 2.11.0 does not time the
triton key hashing (`CacheBase.get_system.triton_key`) nor `CachingAutotuner.combo_sequential_autotune`
(both timed in 2.13.0 and 2.15.0): there their time goes to the caller's phase.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import Any

# phase -> torch's event names (chromium event names: the phase_name of dynamo_timed when given). A
# name ending in "*" is a suffix (torch formats the rest): "*_template_autotuning" is f"{name}_template_autotuning".
PHASES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("dynamo tracing", ("bytecode_tracing", "insert_deferred_runtime_asserts", "fullgraph_capture")),
    ("guards", ("build_guards", "precompile_build_guards")),
    ("cache key", ("inductor_codecache_torch_key", "CacheBase.get_system.triton_key")),
    ("AOTAutograd lookup", ("backend_compile",)),
    ("AOTAutograd tracing", ("create_aot_dispatcher_function", "aot_collect_metadata", "aot_trace_joint_graph",
                             "min_cut_rematerialization_partition", "_recursive_joint_graph_passes",
                             "_recursive_pre_grad_passes")),
    ("FX-graph load", ("AOTAutogradCache.inductor_load", "inductor_compile", "fx_codegen_and_compile")),
    ("inductor codegen", ("additional_fake_tensor_prop", "_recursive_post_grad_passes", "GraphLowering.run",
                          "GraphLowering.compile_to_fn", "GraphLowering.compile_to_module", "code_gen",
                          "GraphLowering.codegen", "Scheduler.__init__", "Scheduler.codegen",
                          "PythonWrapperCodegen.generate", "TritonBundler.collect")),
    ("kernel compile", ("compile_file", "AotCodeCompiler.compile")),
    ("kernel load", ("PyCodeCache.load_by_key_path", "async_compile.wait", "async_compile.precompile",
                     "TritonBundler.read_and_emit")),
    ("autotune", ("CachingAutotuner.benchmark_all_configs", "CachingAutotuner.coordinate_descent_tuning",
                  "CachingAutotuner.combo_sequential_autotune", "benchmark_fused_nodes",
                  "StaticAutotunerFuture.warm_precompile", "TritonBundler.load_cached_static_autotuners",
                  "*_template_autotuning", "*_template_precompiling")),
)
OTHER = "other"
PHASE_NAMES = tuple(p for p, _ in PHASES) + (OTHER,)
WHAT = {  # one line each, for --help-like docs and the JSON
    "dynamo tracing": "dynamo turning the Python bytecode into an FX graph",
    "guards": "dynamo building the guards that decide when the compiled code may be reused",
    "cache key": "hashing torch's own build and triton for the cache keys (once a process)",
    "AOTAutograd lookup": "the backend call outside its timed steps: the AOTAutograd cache key, lookup and load",
    "AOTAutograd tracing": "AOTAutograd tracing the joint graph and partitioning it (an AOTAutograd cache miss)",
    "FX-graph load": "the FX-graph cache lookup and the loading of its entry, outside the kernel load",
    "inductor codegen": "inductor lowering and generating code (an FX-graph cache miss)",
    "kernel compile": "a C++ compiler run (compile_file)",
    "kernel load": "loading the compiled module and its triton / C++ kernels",
    "autotune": "benchmarking kernel configs or templates",
    OTHER: "dynamo's own bookkeeping around the timed steps (frame conversion, gc, logging)",
}
SOURCES = ("_dynamo/output_graph.py", "_dynamo/convert_frame.py", "_dynamo/package.py", "_dynamo/functional_export.py",
           "_dynamo/aot_compile.py", "_functorch/aot_autograd.py", "_functorch/_aot_autograd/graph_compile.py",
           "_functorch/_aot_autograd/aot_autograd_result.py", "_functorch/_aot_autograd/runtime_wrappers.py",
           "_inductor/codecache.py", "_inductor/compile_fx.py", "_inductor/graph.py", "_inductor/scheduler.py",
           "_inductor/output_code.py", "_inductor/async_compile.py", "_inductor/triton_bundler.py",
           "_inductor/cpp_builder.py", "_inductor/runtime/triton_heuristics.py", "_inductor/select_algorithm.py",
           "_inductor/codegen/wrapper.py", "_inductor/codegen/cpp_wrapper_cpu.py", "_inductor/codegen/cpp_wrapper_gpu.py")
TOP = 12  # torch steps kept by their own time

_EXACT = {ev: p for p, evs in PHASES for ev in evs if not ev.startswith("*")}
_SUFFIX = tuple((ev[1:], p) for p, evs in PHASES for ev in evs if ev.startswith("*"))


def phase_of(event: str) -> str | None:
    p = _EXACT.get(event)
    if p is None:
        p = next((ph for suf, ph in _SUFFIX if event.endswith(suf)), None)
    return p


class Timings:
    """One process's timed compile steps, own time per phase (thread-safe: a stack per thread)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._tls = threading.local()
        self.phase_ns: dict[str, int] = dict.fromkeys(PHASE_NAMES, 0)
        self.events: dict[str, list] = {}  # event -> [count, own ns, phase]
        self.total_ns = 0
        self.threads: set[int] = set()
        self._spans: list[list[int]] = []  # outermost steps' [start, end], merged
        self._wall_done_ns = 0  # spans folded out of the list (bounded), counted once
        self.unmatched = 0  # ends with no open start (a step begun before the watch)

    def _stack(self) -> list[list]:
        st = getattr(self._tls, "stack", None)
        if st is None:
            st = self._tls.stack = []
        return st

    def start(self, event: str, t_ns: int) -> None:
        st = self._stack()
        parent = st[-1][3] if st else None
        st.append([event, t_ns, 0, phase_of(event) or parent])  # name, start, children's ns, phase

    def end(self, event: str, t_ns: int) -> None:
        st = self._stack()
        i = len(st) - 1
        while i >= 0 and st[i][0] != event:
            i -= 1
        if i < 0:
            self.unmatched += 1
            return
        while len(st) > i + 1:  # steps left open inside this one (an exception torch did not close): drop
            st.pop()
        name, t0, children, phase = st.pop()
        dur = max(0, t_ns - t0)
        own = max(0, dur - children)
        with self._lock:
            self.phase_ns[phase or OTHER] += own
            ev = self.events.get(name)
            if ev is None:
                ev = self.events[name] = [0, 0, phase or OTHER]
            ev[0] += 1
            ev[1] += own
            if st:
                st[-1][2] += dur
            else:
                self.total_ns += dur
                self.threads.add(threading.get_ident())
                self._span(t0, t0 + dur)

    def _span(self, a: int, b: int) -> None:
        sp = self._spans
        if sp and a <= sp[-1][1]:
            sp[-1][1] = max(sp[-1][1], b)
            sp[-1][0] = min(sp[-1][0], a)
            while len(sp) > 1 and sp[-1][0] <= sp[-2][1]:
                last = sp.pop()
                sp[-1] = [min(sp[-1][0], last[0]), max(sp[-1][1], last[1])]
        else:
            sp.append([a, b])
            if len(sp) > 4096:  # bound: the oldest span ended long before the steps still being timed
                a0, b0 = sp.pop(0)
                self._wall_done_ns += b0 - a0

    def steps_seen(self) -> int:
        return len(self.events)

    def wall_ns(self) -> int:
        return self._wall_done_ns + sum(b - a for a, b in self._spans)

    def summary(self, torch_version: str, exposed: set[str] | None) -> dict:
        """What the store and the watch report keep. `exposed`: the events this torch's source times
        (None: not probed); a phase none of whose events is exposed or seen is `unavailable`."""
        with self._lock:
            seen = set(self.events)
            phases = {p: round(ns / 1e9, 4) for p, ns in self.phase_ns.items()}
            top = sorted(self.events.items(), key=lambda kv: -kv[1][1])[:TOP]
            out = {"torch": torch_version, "total_s": round(self.total_ns / 1e9, 4),
                   "wall_s": round(self.wall_ns() / 1e9, 4), "threads": len(self.threads),
                   "steps": sum(e[0] for e in self.events.values()),
                   "top": [[name, ph, round(ns / 1e9, 4), n] for name, (n, ns, ph) in top]}
        unavailable, unmeasured = [], []
        for p, evs in PHASES:
            have = [ev for ev in evs if _exposed(ev, exposed) or _seen(ev, seen)]
            if not have:
                unavailable.append(p)
                phases.pop(p, None)
            else:
                unmeasured += [ev for ev in evs if ev not in have and not ev.startswith("*")]
        out["phases"] = phases
        out["unavailable"] = unavailable
        out["unmeasured"] = unmeasured if exposed is not None else []
        if self.unmatched:
            out["unmatched"] = self.unmatched
        return out


def _exposed(ev: str, exposed: set[str] | None) -> bool:
    return exposed is None or ev in exposed


def _seen(ev: str, seen: set[str]) -> bool:
    return ev in seen if not ev.startswith("*") else any(s.endswith(ev[1:]) for s in seen)


_exposed_memo: dict[str, set[str]] = {}


def exposed_events(torch_dir: str | None = None) -> set[str] | None:
    """The events of `PHASES` that this torch's source times: each name, quoted, in one of `SOURCES`
    (read as text; a suffix name is looked up with its closing quote). None when torch's dir is unknown."""
    if torch_dir is None:
        mod = sys.modules.get("torch")
        f = getattr(mod, "__file__", None)
        if not f:
            return None
        torch_dir = os.path.dirname(f)
    memo = _exposed_memo.get(torch_dir)
    if memo is not None:
        return set(memo)
    texts = []
    for rel in SOURCES:
        try:
            with open(os.path.join(torch_dir, rel), encoding="utf-8", errors="replace") as fh:
                texts.append(fh.read(4 << 20))
        except OSError:
            continue
    found = set()
    for _, evs in PHASES:
        for ev in evs:
            needle = f'{ev[1:]}"' if ev.startswith("*") else f'"{ev}"'
            if any(needle in t for t in texts):
                found.add(ev)
    _exposed_memo[torch_dir] = found
    return set(found)


# --- the hook -------------------------------------------------------------------------------------
_active: Timings | None = None
_patched: list[tuple[Any, str, Any]] = []


def install(unsupported: list[str]) -> bool:
    """Wrap ChromiumEventLogger.log_event_start / log_event_end (torch._dynamo.utils is imported).
    Says in `unsupported` what this torch does not have."""
    global _active
    import torch

    utils = sys.modules.get("torch._dynamo.utils")
    cls = getattr(utils, "ChromiumEventLogger", None)
    starts, ends = (getattr(cls, n, None) for n in ("log_event_start", "log_event_end"))
    if cls is None or not callable(starts) or not callable(ends) or \
            any(_first_params(f)[:3] != ["self", "event_name", "time_ns"] for f in (starts, ends)):
        unsupported.append(f"compile time by phase: ChromiumEventLogger.log_event_start/log_event_end(event_name, "
                           f"time_ns, ...) is not available on torch {torch.__version__}")
        return False
    if hasattr(cls.__dict__.get("log_event_start"), "__compilewatch_original__"):
        return True
    _active = Timings()

    def make(fn, on):
        def wrapped(self, event_name, time_ns, *a, **k):
            t = _active
            if t is not None:
                try:
                    on(t, event_name, time_ns if isinstance(time_ns, int) else time.time_ns())
                except Exception:  # noqa: BLE001 - never break the compile
                    pass
            return fn(self, event_name, time_ns, *a, **k)
        wrapped.__wrapped__ = fn
        wrapped.__compilewatch_original__ = fn
        return wrapped

    for name, on in (("log_event_start", Timings.start), ("log_event_end", Timings.end)):
        raw = cls.__dict__[name]
        _patched.append((cls, name, raw))
        setattr(cls, name, make(raw, on))
    return True


def _first_params(fn: Any) -> list[str]:
    import inspect

    try:
        return list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return []


def active() -> Timings | None:
    return _active


def installed() -> bool:
    return bool(_patched)


def uninstall() -> Timings | None:
    """Put torch's methods back; returns what was timed."""
    global _active
    while _patched:
        owner, attr, raw = _patched.pop()
        setattr(owner, attr, raw)
    t, _active = _active, None
    return t


# --- in words -------------------------------------------------------------------------------------
def fmt_s(s: float) -> str:
    return f"{s:.1f} s" if s >= 10 else f"{s:.2f} s"


def line(rec: dict, *, warm: bool | None = None, limit: int = 6) -> str:
    """`warm compile time: 1.80 s — kernel load 1.41 s, ..., other 0.03 s` (worst first, other last)."""
    phases = rec.get("phases") or {}
    named = sorted(((p, s) for p, s in phases.items() if p != OTHER and isinstance(s, (int, float)) and s >= 0.005),
                   key=lambda kv: -kv[1])
    shown = [f"{p} {fmt_s(s)}" for p, s in named[:limit]]
    rest = sum(s for _, s in named[limit:]) + sum(s for p, s in phases.items() if p != OTHER and
                                                   isinstance(s, (int, float)) and s < 0.005)
    other = (phases.get(OTHER) or 0) + rest
    if other >= 0.005 or not shown:
        shown.append(f"other {fmt_s(other)}")
    label = "warm compile time" if warm else "compile time"
    threads = rec.get("threads") or 0
    on = f" (summed over {threads} threads; {fmt_s(rec.get('wall_s') or 0)} of wall time)" if threads > 1 else ""
    text = f"{label}: {fmt_s(rec.get('total_s') or 0)}{on} — " + ", ".join(shown)
    if rec.get("unavailable"):
        text += f"; not available on torch {rec.get('torch')}: {', '.join(rec['unavailable'])}"
    return text
