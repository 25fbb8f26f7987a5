"""The watcher's event model: one event per line of a JSONL report, a versioned schema, and the
summary (verdict) computed from a list of events.

Every line is a JSON object with the common fields
  schema_version, seq, kind, time (unix seconds), pid, thread, thread_id
plus the fields of its kind (docs/run.md lists them). `summarize()` is a pure function of the events,
so a report written by a process that crashed or hung (no `end` line) is summarized the same way.
Readers accept any schema_version <= SCHEMA_VERSION and ignore fields they do not know.
"""

from __future__ import annotations

import json
import os
import threading
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

from compilewatch.errors import BadInput

SCHEMA_VERSION = 1

# kinds that mean something went wrong (they make a summary not ok)
PROBLEM_KINDS = ("flag_leak", "module_call_leak", "eager_fallback", "stuck_state", "stall", "recompile_after_warm",
                 "guard_blocked")
# kinds that describe what happened
INFO_KINDS = ("start", "trace", "compile", "span", "warm", "leak_prevented", "repair", "end")
KINDS = PROBLEM_KINDS + INFO_KINDS
_COMMON = ("schema_version", "seq", "kind", "time", "pid", "thread", "thread_id")


@dataclass(frozen=True, slots=True)
class WatchEvent:
    kind: str
    time: float
    pid: int
    thread: str
    thread_id: int
    seq: int
    detail: dict[str, Any] = field(default_factory=dict)

    @property
    def problem(self) -> bool:
        return self.kind in PROBLEM_KINDS

    def to_json(self) -> dict[str, Any]:
        return {"schema_version": SCHEMA_VERSION, "seq": self.seq, "kind": self.kind, "time": self.time,
                "pid": self.pid, "thread": self.thread, "thread_id": self.thread_id, **self.detail}

    @staticmethod
    def from_json(d: dict[str, Any]) -> "WatchEvent":
        return WatchEvent(kind=str(d["kind"]), time=float(d["time"]), pid=int(d.get("pid", 0)),
                          thread=str(d.get("thread", "?")), thread_id=int(d.get("thread_id", 0)),
                          seq=int(d.get("seq", 0)), detail={k: v for k, v in d.items() if k not in _COMMON})


class EventLog:
    """Appends events to a JSONL file as they happen (flushed per line, so a hang or crash keeps
    everything up to that moment) and keeps them in memory for the summary."""

    def __init__(self, path: str | os.PathLike[str] | None) -> None:
        self.path = Path(path) if path is not None else None
        self.events: list[WatchEvent] = []
        self._lock = threading.Lock()
        self._file = None
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(self.path, "w", encoding="utf-8")  # noqa: SIM115 - a streaming log

    def append(self, event: WatchEvent) -> None:
        from compilewatch.serialize import to_jsonable

        with self._lock:
            self.events.append(event)
            if self._file is not None and not self._file.closed:
                self._file.write(json.dumps(to_jsonable(event.to_json())) + "\n")
                self._file.flush()

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()


def read_events(path: str | os.PathLike[str]) -> list[WatchEvent]:
    """Load a JSONL report; BadInput for a missing file, a bad line or a newer schema."""
    p = Path(path)
    if not p.is_file():
        raise BadInput(f"report {p} does not exist", hint="write one with `compilewatch run --report FILE -- ...`")
    events = []
    with open(p, encoding="utf-8") as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                d = json.loads(line)
            except json.JSONDecodeError as e:
                if i > 1 and not line.endswith("\n"):  # a process killed mid-write: keep what is complete
                    break
                raise BadInput(f"{p}:{i} is not JSON ({e.msg})", hint="expected a compilewatch JSONL event report") from None
            if not isinstance(d, dict) or "kind" not in d or "time" not in d:
                raise BadInput(f"{p}:{i} is not a compilewatch event (no kind/time)")
            if int(d.get("schema_version", 0)) > SCHEMA_VERSION:
                raise BadInput(f"{p} has schema_version {d['schema_version']}, this compilewatch reads <= {SCHEMA_VERSION}",
                               hint="upgrade compilewatch")
            events.append(WatchEvent.from_json(d))
    return events


@dataclass(frozen=True, slots=True)
class WatchSummary:
    """What a watched run amounted to: counts, the threads involved, verdicts and advice."""

    schema_version: int
    ok: bool
    counts: dict[str, int]  # events per kind
    problems: int
    setter_threads: tuple[str, ...]  # threads whose trace held the flag / patched Module.__call__
    victim_threads: tuple[str, ...]  # threads whose calls saw another thread's trace state
    stalled_threads: tuple[str, ...]  # threads inside compilation when a stall was reported
    pids: tuple[int, ...]
    verdicts: tuple[str, ...]
    advice: tuple[str, ...]
    first_problems: tuple[dict[str, Any], ...]  # the first few problem events, in full
    unwatched: tuple[str, ...] = ()  # what a watcher could not install on its torch (never "ok" for that)


def _first_line(text: str | None) -> str:
    return (text or "").strip().splitlines()[0] if (text or "").strip() else ""


def _setter_text(setters: list[dict[str, Any]]) -> str:
    parts = []
    for s in setters:
        where = f" at {s['where']}" if s.get("where") else ""
        parts.append(f"thread {s.get('thread')!r} ({s.get('tracer')} tracing {s.get('target')}{where})")
    return ", ".join(parts) or "no thread (the flag was stuck)"


def _verdict(e: WatchEvent) -> str:
    d = e.detail
    if e.kind == "flag_leak":
        return (f"flag leak: {_setter_text(d.get('setters', []))} held the FX tracing flag while thread {e.thread!r} "
                f"called {d.get('call') or 'a compiled function'}: {d.get('outcome')}")
    if e.kind == "eager_fallback":
        src = _setter_text(d.get("setters", [])) if d.get("cross_thread") else f"thread {e.thread!r}'s own trace"
        return (f"silent eager fallback: thread {e.thread!r} called {d.get('call') or 'a compiled function'} while "
                f"{src} held the FX flag; error_on_nested_fx_trace=False ran it uncompiled")
    if e.kind == "module_call_leak":
        return (f"module call leak: thread {e.thread!r} called a {d.get('module')} while "
                f"{_setter_text(d.get('setters', []))} had nn.Module.__call__ patched on the class; the call went "
                "through that tracer")
    if e.kind == "stuck_state":
        what = [k for k in ("flag", "module_call_patched", "module_getattr_patched", "patcher_left") if d.get(k)]
        fixed = " (repaired)" if d.get("repaired") else ""
        return (f"stuck tracing state{fixed}: {', '.join(what)} with no trace running (seen at {d.get('seen_at')}); "
                "overlapping traces restored it in the wrong order and every later compiled call fails")
    if e.kind == "stall":
        return (f"compile stall: {d.get('what')} in thread {e.thread!r} running for {d.get('open_for_s', 0):.1f} s; "
                f"threads inside compilation: {', '.join(d.get('threads_in_compile', [])) or 'none'} (all stacks in the report)")
    if e.kind == "recompile_after_warm":
        reasons = "; ".join(d.get("reasons", [])[:3]) or "no guard failure recorded (a new frame)"
        return f"compile after warm: {d.get('compile_id')} in thread {e.thread!r}: {reasons}"
    if e.kind == "guard_blocked":
        why = "; ".join(d.get("reasons") or []) or _first_line(d.get("reasons_text"))
        return f"guard blocked a compile of {d.get('function')} in thread {e.thread!r}: {why}"
    return e.kind


_ADVICE = {
    "flag_leak": "compile every entry point for every device in one thread before starting threads "
                 "(compilewatch.guard: warm() then freeze()), or make the flag thread-local (CompileGuard(thread_local=True))",
    "module_call_leak": "do not run fx.symbolic_trace/make_fx while other threads run modules, or use CompileGuard(thread_local=True)",
    "eager_fallback": "the compiled function ran eagerly (slow path): warm it before the threads start; "
                      "leave error_on_nested_fx_trace=True to see the failure",
    "stuck_state": "repair with compilewatch.fxpatch.repair_state() (Watcher(repair=True) does it), and never run two "
                   "traces at once: CompileGuard(thread_local=True) or serialize=True",
    "stall": "the stacks show which threads wait on which: warm compiles sequentially (`compilewatch warm`) and keep "
             "the inductor cache warm",
    "recompile_after_warm": "the guard reasons name what changed (shape, dtype, device): warm that variant too, or mark "
                            "the dimension dynamic",
    "guard_blocked": "warm the variant named in the error before freeze(), or use CompileGuard(serialize=True)",
}


def summarize(events: Iterable[WatchEvent]) -> WatchSummary:
    events = list(events)
    counts = Counter(e.kind for e in events)
    problems = [e for e in events if e.problem]
    setters: list[str] = []
    victims: list[str] = []
    stalled: list[str] = []

    def add(lst: list[str], name: str | None) -> None:
        if name and name not in lst:
            lst.append(name)

    for e in problems:
        if e.kind in ("flag_leak", "module_call_leak", "eager_fallback"):
            add(victims, e.thread)
            for s in e.detail.get("setters", []):
                add(setters, s.get("thread"))
        elif e.kind == "stall":
            for t in e.detail.get("threads_in_compile", []):
                add(stalled, t)
    verdicts: list[str] = []
    unwatched = tuple(dict.fromkeys(
        f"not watched (pid {e.pid}, torch {e.detail.get('torch')}): {u.get('what')}: {u.get('why')}"
        for e in events if e.kind == "start" for u in e.detail.get("unwatched") or ()))
    verdicts.extend(unwatched)
    seen: set[str] = set()
    for e in problems:
        v = _verdict(e)
        if v not in seen:
            seen.add(v)
            verdicts.append(v)
    if not problems and not unwatched:
        traces = counts.get("trace", 0)
        verdicts.append(f"no cross-thread problem seen ({traces} trace window(s), {counts.get('compile', 0)} compile(s) watched).")
    advice = tuple(dict.fromkeys(_ADVICE[e.kind] for e in problems if e.kind in _ADVICE))
    return WatchSummary(
        schema_version=SCHEMA_VERSION, ok=not problems and not unwatched, counts=dict(counts), problems=len(problems),
        setter_threads=tuple(setters), victim_threads=tuple(victims), stalled_threads=tuple(stalled),
        pids=tuple(sorted({e.pid for e in events})), verdicts=tuple(verdicts[:20]), advice=advice,
        first_problems=tuple(e.to_json() for e in problems[:10]), unwatched=unwatched,
    )
