"""Known torch failure patterns: what a message (or a watcher finding) means, what really causes it,
and the fix that applies.

A verdict must name the real cause. Some torch errors look like the thread race and are not (the
"NYI SymInt equality" assert fails with one thread too); some are the race but need a different fix
depending on who held the tracing state. `match(message)` finds the pattern for an exception text,
`for_kind(kind)` the one for a watcher finding that has no message (stuck state, stall). The table
is shown in docs/race.md; `race` says whether more threads are the cause.
"""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Pattern:
    name: str
    regex: str | None  # searched in "Type: message" of an exception; None: matched by watcher finding kind
    kind: str | None  # the watcher finding it explains when there is no message (stuck_state, stall)
    race: bool  # True: caused by several threads; False: fails the same way in one thread
    cause: str
    fix: str
    torch_versions: str  # where it was seen / which versions the cause applies to

    def matches(self, message: str) -> bool:
        return self.regex is not None and re.search(self.regex, message) is not None


# Thread-local fix, as docs/guard.md's table says: it is the only part of the guard that prevents a
# leak from a plain make_fx / symbolic_trace (no dynamo compile is involved, so warm + freeze cannot).
THREAD_LOCAL_FIX = ("CompileGuard(thread_local=True) (compilewatch.tracing.guard): the FX state becomes per thread; "
                    "warm + freeze do not prevent this (no dynamo compile is involved); or run the trace while no "
                    "other thread calls compiled functions / modules (CompileGuard(serialize=True) + guard.shared())")
WARM_FREEZE_FIX = ("compile every entry point for every device in one thread before the threads start "
                   "(CompileGuard(), compilewatch.prewarm(...), then guard.freeze(); or `compilewatch warm`)")

PATTERNS: tuple[Pattern, ...] = (
    Pattern(
        name="recompile_dynamic_symint_assert",
        regex=r"NYI SymInt equality",
        kind=None, race=False,
        cause="a torch bug: the second compile of the same code is made dynamic by automatic "
              "dynamic shapes, and AOTAutograd's backward trace hits an internal assert (e.g. in PowBackward0); "
              "it fails the same way with one thread",
        fix="torch.compile(..., dynamic=False), or TORCH_DYNAMO_AUTOMATIC_DYNAMIC_SHAPES=0 in the environment, or "
            "compile each code object once (do not recompile the same lambda/function with new shapes)",
        torch_versions="2.11 and 2.13 CPU (aot_eager, fwd+bwd; tests/race_programs/recompile_assert_beside_hot_thread.py); the same program passes on 2.14.1 and 2.15.0",
    ),
    Pattern(
        name="nested_fx_trace",
        regex=r"Detected that you are using FX to symbolically trace a dynamo-optimized function",
        kind=None, race=True,
        cause="a compiled call saw the FX tracing flag set: another thread's Tracer.trace (make_fx, symbolic_trace, "
              "AOTAutograd, Inductor) held the process-global flag, or the flag was left stuck by overlapping traces",
        fix="depends on who held the flag: a dynamo compile in a worker -> warm + freeze; a plain make_fx / "
            "symbolic_trace -> CompileGuard(thread_local=True) only",
        torch_versions="2.11-2.13 (module-global flag); 2.14 and 2.15 keep the flag per thread (measured: 0/20)",
    ),
    Pattern(
        name="module_not_submodule",
        regex=r"is not installed as a submodule",
        kind=None, race=True,
        cause="an eager nn.Module call went through another thread's symbolic_trace: Tracer.trace patches "
              "nn.Module.__call__ / __getattr__ on the class, for every thread",
        fix=THREAD_LOCAL_FIX,
        torch_versions="2.11-2.15 (2.15 still patches the class)",
    ),
    Pattern(
        name="patcher_assert",
        regex=r"CURRENT_PATCHER is None",
        kind=None, race=True,
        cause="two Tracer.trace calls overlapped in two threads and restored the module-global patcher in the wrong "
              "order (the FX flag and nn.Module.__call__ may be left stuck)",
        fix="never run two traces at once: " + THREAD_LOCAL_FIX,
        torch_versions="2.11-2.15 (measured 20/20 on each)",
    ),
    Pattern(
        name="stuck_flag",
        regex=None, kind="stuck_state", race=True,
        cause="overlapping traces restored the FX flag / nn.Module.__call__ in the wrong order; every later compiled "
              "call in the process fails, single-threaded too",
        fix="compilewatch.tracing.fxpatch.repair_state() (compilewatch run --repair) puts it back now; prevent it with "
            "CompileGuard(thread_local=True) or serialize=True",
        torch_versions="flag and class patch: 2.11, 2.13 (20/20 with Events); 2.14, 2.15: flag per thread (0/20), nn.Module.__call__ still left patched (20/20)",
    ),
    Pattern(
        name="compile_hang",
        regex=None, kind="stall", race=True,
        cause="several threads compiling at once (cold cache): one inside a make_fx joint trace, one in "
              "compile_fx_backward, one waiting in convert_frame; seen as a hang on GPU",
        fix=WARM_FREEZE_FIX + "; keep the inductor cache warm (`compilewatch cache save/load`)",
        torch_versions="2.11+cu130 H200, 3 threads flex_attention fwd+bwd (docs/benchmarks.md, probe and warm on H200); not seen on CPU",
    ),
)


def match(message: str | None) -> Pattern | None:
    """The first known pattern whose regex is found in `message` ("Type: message")."""
    if not message:
        return None
    return next((p for p in PATTERNS if p.matches(message)), None)


def for_kind(kind: str) -> Pattern | None:
    return next((p for p in PATTERNS if p.kind == kind), None)


def by_name(name: str) -> Pattern:
    return next(p for p in PATTERNS if p.name == name)
