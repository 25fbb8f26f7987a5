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
import math
import os
import threading
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

from compilewatch.errors import BadInput
from compilewatch.inputs import one_line

SCHEMA_VERSION = 1

# kinds that are findings: each is a failure (an exception or harm seen) or a risk (no harm seen), see severity()
PROBLEM_KINDS = ("compile_failed", "trace_failed", "thread_error", "flag_leak", "module_call_leak", "eager_fallback",
                 "stuck_state", "stall", "recompile_after_warm", "guard_blocked", "remote_cache_down")
# kinds that describe what happened (`repeat`: how often a finding recurred after its first event)
# (`instrument_error`: compilewatch's own listeners raised; the program went on, the watch may be incomplete)
# (`remote_cache`: torch's remote caches were on or used: hits/misses per kind, compilewatch.cache.remote_usage)
# (`cache_lookups`: this process's FX-graph / AOTAutograd cache lookups, their key store: compilewatch.explain.record)
INFO_KINDS = ("start", "trace", "compile", "span", "warm", "leak_prevented", "repair", "repeat", "instrument_error",
              "remote_cache", "cache_lookups", "end")
KINDS = PROBLEM_KINDS + INFO_KINDS
FAILURE, RISK = "failure", "risk"
_COMMON = ("schema_version", "seq", "kind", "time", "pid", "thread", "thread_id", "thread_start")


@dataclass(frozen=True, slots=True)
class WatchEvent:
    kind: str
    time: float
    pid: int
    thread: str
    thread_id: int
    seq: int
    detail: dict[str, Any] = field(default_factory=dict)
    # when the watcher first saw this Python thread (Python keeps no start time); with pid, thread_id
    # and the name it tells two threads apart that got the same (reused) ident
    thread_start: float | None = None

    @property
    def problem(self) -> bool:
        return self.kind in PROBLEM_KINDS

    @property
    def severity(self) -> str | None:
        return severity(self)

    def to_json(self) -> dict[str, Any]:
        d = {"schema_version": SCHEMA_VERSION, "seq": self.seq, "kind": self.kind, "time": self.time,
             "pid": self.pid, "thread": self.thread, "thread_id": self.thread_id}
        if self.thread_start is not None:
            d["thread_start"] = self.thread_start
        return {**d, **self.detail}

    @staticmethod
    def from_json(d: dict[str, Any]) -> "WatchEvent":
        ts = d.get("thread_start")
        return WatchEvent(kind=str(d["kind"]), time=float(d["time"]), pid=int(d.get("pid", 0)),
                          thread=str(d.get("thread", "?")), thread_id=int(d.get("thread_id", 0)),
                          seq=int(d.get("seq", 0)), detail={k: v for k, v in d.items() if k not in _COMMON},
                          thread_start=float(ts) if isinstance(ts, (int, float)) else None)


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


MAX_LINE = 16 << 20  # one event: stacks included, a few KB; a line this long is not one


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


_MAX_TIME_S = 1e12  # unix seconds (year ~33000): beyond it a timeline's microsecond offsets overflow to inf


def _is_time(v: Any) -> bool:
    return _is_num(v) and abs(v) <= _MAX_TIME_S


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


# What readers of an event (summaries, the timeline) assume about fields, checked at the door so a
# crafted report is one clear error instead of a TypeError deep inside a renderer.
_FIELD_CHECKS: dict[str, tuple[str, Any]] = {
    "kind": ("a string", lambda v: isinstance(v, str)),
    "time": ("a time in unix seconds", _is_time),
    "schema_version": ("an integer", _is_int),
    "pid": ("an integer", _is_int),
    "thread_id": ("an integer", _is_int),
    "seq": ("an integer", _is_int),
    "start": ("a time in unix seconds or null", lambda v: v is None or _is_time(v)),
    "end": ("a time in unix seconds or null", lambda v: v is None or _is_time(v)),
    "open_for_s": ("a finite number", _is_num),
    "setters": ("a list of objects (thread_id an integer, since a time)", lambda v: v is None or (
        isinstance(v, list) and all(isinstance(s, dict) and (s.get("thread_id") is None or _is_int(s.get("thread_id")))
                                    and (s.get("since") is None or _is_time(s.get("since"))) for s in v))),
    "threads_in_compile": ("a list of strings", lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v)),
    "reasons": ("a list of strings", lambda v: v is None or (isinstance(v, list) and all(isinstance(x, str) for x in v))),
    "reasons_text": ("a string", lambda v: v is None or isinstance(v, str)),
    "argv": ("a list", lambda v: v is None or isinstance(v, list)),
}


def _check_event(d: Any, where: str) -> dict[str, Any]:
    if not isinstance(d, dict) or "kind" not in d or "time" not in d:
        raise BadInput(f"{where} is not a compilewatch event (no kind/time)")
    for key, (what, ok) in _FIELD_CHECKS.items():
        if key in d and not ok(d[key]):
            raise BadInput(f"{where}: field {key!r} must be {what}, got {one_line(repr(d[key]), 60)}",
                           hint="expected a compilewatch JSONL event report")
    return d


def read_events(path: str | os.PathLike[str]) -> list[WatchEvent]:
    """Load a JSONL report; BadInput for a missing file, a bad line or a newer schema.

    Reports are untrusted input: a line longer than MAX_LINE, bytes that are not UTF-8, JSON nested
    past Python's limits and fields of the wrong type are BadInput naming file:line."""
    p = Path(path)
    if not p.is_file():
        what = "is not a regular file" if p.exists() else "does not exist"
        raise BadInput(f"report {p} {what}", hint="write one with `compilewatch run --report FILE -- ...`")
    events = []
    with open(p, "rb") as f:
        i = 0
        while True:
            raw = f.readline(MAX_LINE + 1)
            if not raw:
                break
            i += 1
            if len(raw) > MAX_LINE:
                raise BadInput(f"{p}:{i}: line too long (more than {MAX_LINE} bytes) for an event report")
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise BadInput(f"{p}:{i} is not UTF-8 text (byte {e.start})",
                               hint="expected a compilewatch JSONL event report") from None
            if not line.strip():
                continue
            try:
                d = json.loads(line)
            except json.JSONDecodeError as e:
                if i > 1 and not line.endswith("\n"):  # a process killed mid-write: keep what is complete
                    break
                raise BadInput(f"{p}:{i} is not JSON ({e.msg})", hint="expected a compilewatch JSONL event report") from None
            except (RecursionError, ValueError) as e:
                raise BadInput(f"{p}:{i} is not a readable event ({one_line(type(e).__name__ + ': ' + str(e), 120)})") from None
            d = _check_event(d, f"{p}:{i}")
            if d.get("schema_version", 0) > SCHEMA_VERSION:
                raise BadInput(f"{p} has schema_version {d['schema_version']}, this compilewatch reads <= {SCHEMA_VERSION}",
                               hint="upgrade compilewatch")
            events.append(WatchEvent.from_json(d))
    return events


# findings that are an exception some thread saw (they lead a verdict), then harm without an exception
_EXCEPTION_KINDS = ("compile_failed", "thread_error", "flag_leak", "module_call_leak", "trace_failed", "guard_blocked")
_MAX_FINDINGS = 20


def severity(e: WatchEvent) -> str | None:
    """`failure`: an exception or harm was observed (a compiled call or compile raised, a module call
    raised, stuck state, a stall, an uncompiled fallback); `risk`: the race's precondition was seen and
    nothing failed (a module call that went through another thread's tracer and returned, a compile
    after warm-up). None for info events."""
    if e.kind not in PROBLEM_KINDS:
        return None
    d = e.detail
    if e.kind == "module_call_leak":
        return FAILURE if d.get("error") else RISK
    if e.kind == "flag_leak":  # a compiled call raises right after the read; another reader: harm unknown
        return FAILURE if d.get("call") else RISK
    if e.kind in ("recompile_after_warm", "remote_cache_down"):  # the program went on, compiling itself
        return RISK
    return FAILURE


@dataclass(frozen=True, slots=True)
class Finding:
    """One verdict line: what failed (or could), where, torch's message, the known cause and the fix."""

    severity: str  # "failure" | "risk"
    kind: str  # the event kind (compile_failed, flag_leak, ...)
    threads: tuple[str, ...]  # the threads it happened in
    function: str | None  # the compiled function / module / traced target involved
    message: str  # torch's message (headline) or what was seen
    count: int  # occurrences (first event + its repeats, over every thread listed)
    pattern: str | None  # compilewatch.tracing.patterns name, when the message is a known torch failure
    race: bool | None  # the pattern's verdict: caused by threads (None: unknown)
    cause: str | None
    fix: str
    text: str  # the rendered verdict line
    first: dict[str, Any]  # the first event, in full (stacks, setters)


@dataclass(frozen=True, slots=True)
class WatchSummary:
    """What a watched run amounted to: findings ranked failures first, the threads involved, advice.
    `ok` is False only when something failed; risks alone leave it True (`risks` counts them)."""

    schema_version: int
    ok: bool
    counts: dict[str, int]  # events per kind
    problems: int  # finding events (failures + risks)
    failures: int  # failure events, repeats included
    risks: int  # risk events, repeats included
    setter_threads: tuple[str, ...]  # threads whose trace held the flag / patched Module.__call__
    victim_threads: tuple[str, ...]  # threads whose calls saw another thread's trace state
    stalled_threads: tuple[str, ...]  # threads inside compilation when a stall was reported
    pids: tuple[int, ...]
    findings: tuple[Finding, ...]  # failures first (exceptions before other harm), then risks
    verdicts: tuple[str, ...]  # the findings' text, same order
    advice: tuple[str, ...]  # the fixes, same order, deduplicated
    first_problems: tuple[dict[str, Any], ...]  # the first event of each of the first findings, in full
    unwatched: tuple[str, ...] = ()  # what a watcher could not install on its torch (never "ok" for that)
    instrument_errors: tuple[str, ...] = ()  # compilewatch's own listeners raised (count and first error)
    remote_cache: dict[str, dict[str, int]] | None = None  # torch's remote-cache hits/misses per kind, all processes


def headline(text: str | None) -> str:
    """The first line of an exception text; when it ends in ':' (BackendCompilerFailed's "backend='x'
    raised:"), the line that holds the real error is joined to it."""
    lines = [ln.strip() for ln in (text or "").strip().splitlines() if ln.strip()]
    if not lines:
        return ""
    out = lines[0]
    if out.endswith(":") and len(lines) > 1:
        out = f"{out} {lines[1]}"
    return out if len(out) <= 400 else out[:400] + " ..."


def _setter_text(setters: list[dict[str, Any]]) -> str:
    parts = []
    for s in setters:
        where = f" at {s['where']}" if s.get("where") else ""
        how = "dynamo compile: " if s.get("dynamo_compile") else ""
        parts.append(f"thread {s.get('thread')!r} ({how}{s.get('tracer')} tracing {s.get('target')}{where})")
    return ", ".join(parts) or "no thread (the flag was stuck)"


def _setters_compile(setters: list[dict[str, Any]]) -> bool | None:
    """True: every setter was a dynamo compile; False: a plain make_fx / symbolic_trace; None: none."""
    if not setters:
        return None
    return all(bool(s.get("dynamo_compile")) for s in setters)


def _leak_fix(setters: list[dict[str, Any]]) -> str:
    from compilewatch.tracing import patterns

    kind = _setters_compile(setters)
    if kind is None:
        return patterns.by_name("stuck_flag").fix
    return patterns.WARM_FREEZE_FIX if kind else patterns.THREAD_LOCAL_FIX


_ADVICE = {
    "eager_fallback": "the compiled function ran eagerly (slow path): warm it before the threads start; "
                      "leave error_on_nested_fx_trace=True to see the failure",
    "recompile_after_warm": "the guard reasons name what changed (shape, dtype, device): warm that variant too, or mark "
                            "the dimension dynamic",
    "remote_cache_down": "start redis-server there or fix TORCHINDUCTOR_REDIS_URL; `compilewatch cache remote status` "
                         "says why it does not answer",
    "guard_blocked": "warm the variant named in the error before freeze(), or use CompileGuard(serialize=True)",
    "compile_failed": "the compile itself raised: read torch's message; run the function once in one thread "
                      "(`compilewatch probe FILE:fn`) to see whether threads matter at all",
    "trace_failed": "the trace itself raised: run it alone to see whether another thread's trace was involved",
    "thread_error": "a thread died with an uncaught exception: its traceback is in the report",
}


def _describe(e: WatchEvent) -> tuple[str | None, str, str]:
    """(function, message, what happened) for one finding event."""
    d = e.detail
    if e.kind == "compile_failed":
        fn = d.get("function") or f"compile {d.get('compile_id')}"
        msg = headline(d.get("error"))
        return fn, msg, f"compile of {fn} failed in thread {e.thread!r} ({d.get('compile_id')}): {msg}"
    if e.kind == "trace_failed":
        fn = f"{d.get('tracer')} tracing {d.get('target')}"
        msg = headline(d.get("error"))
        where = f" at {d['where']}" if d.get("where") else ""
        return fn, msg, f"{fn} raised in thread {e.thread!r}{where}: {msg}"
    if e.kind == "thread_error":
        fn = d.get("where")
        msg = headline(d.get("error"))
        return fn, msg, f"thread {e.thread!r} died with an uncaught exception{f' at {fn}' if fn else ''}: {msg}"
    if e.kind == "flag_leak":
        fn = d.get("call") or d.get("reader")
        msg = headline(d.get("outcome"))
        return fn, msg, (f"flag leak: {_setter_text(d.get('setters', []))} held the FX tracing flag while thread "
                         f"{e.thread!r} called {d.get('call') or 'a compiled function'}: {msg}")
    if e.kind == "module_call_leak":
        fn = d.get("module")
        outcome = f"it raised {headline(d['error'])}" if d.get("error") else "it returned normally"
        msg = headline(d.get("error")) or "returned normally"
        return fn, msg, (f"module call leak: thread {e.thread!r} called a {fn} while "
                         f"{_setter_text(d.get('setters', []))} had nn.Module.__call__ patched on the class; the call "
                         f"went through that tracer and {outcome}")
    if e.kind == "eager_fallback":
        src = _setter_text(d.get("setters", [])) if d.get("cross_thread") else f"thread {e.thread!r}'s own trace"
        fn = d.get("call")
        return fn, "ran uncompiled", (f"silent eager fallback: thread {e.thread!r} called {fn or 'a compiled function'} "
                                      f"while {src} held the FX flag; error_on_nested_fx_trace=False ran it uncompiled")
    if e.kind == "stuck_state":
        what = [k for k in ("flag", "module_call_patched", "module_getattr_patched", "patcher_left") if d.get(k)]
        fixed = " (repaired)" if d.get("repaired") else ""
        return None, ", ".join(what), (f"stuck tracing state{fixed}: {', '.join(what)} with no trace running (seen at "
                                       f"{d.get('seen_at')}); every later compiled call fails")
    if e.kind == "stall":
        return d.get("what"), "stall", (
            f"compile stall: {d.get('what')} in thread {e.thread!r} running for {d.get('open_for_s', 0):.1f} s; "
            f"threads inside compilation: {', '.join(d.get('threads_in_compile', [])) or 'none'} (all stacks in the report)")
    if e.kind == "recompile_after_warm":
        reasons = "; ".join(d.get("reasons", [])[:3]) or "no guard failure recorded (a new frame)"
        return d.get("compile_id"), reasons, f"compile after warm: {d.get('compile_id')} in thread {e.thread!r}: {reasons}"
    if e.kind == "remote_cache_down":
        return d.get("url"), "unreachable", d.get("message") or f"remote cache {d.get('url')} unreachable"
    if e.kind == "guard_blocked":
        why = "; ".join(d.get("reasons") or []) or headline(d.get("reasons_text"))
        return d.get("function"), why, f"guard blocked a compile of {d.get('function')} in thread {e.thread!r}: {why}"
    return None, e.kind, e.kind


def _pattern_for(e: WatchEvent, message: str):
    from compilewatch.tracing import patterns

    if e.kind in ("stuck_state", "stall"):
        return patterns.for_kind(e.kind)
    if e.kind in ("compile_failed", "trace_failed", "thread_error", "flag_leak", "module_call_leak"):
        return patterns.match(message)
    return None


def _fix(e: WatchEvent, pattern) -> str:
    if e.kind in ("flag_leak", "module_call_leak", "eager_fallback"):
        fix = _leak_fix(e.detail.get("setters", []))
        return f"{_ADVICE['eager_fallback']}; {fix}" if e.kind == "eager_fallback" else fix
    if pattern is not None and pattern.name != "nested_fx_trace":
        return pattern.fix
    return _ADVICE.get(e.kind, pattern.fix if pattern is not None else "")


def _rank(f: Finding) -> tuple[int, int]:
    if f.severity != FAILURE:
        return (2, 0)
    return (0, 0) if f.kind in _EXCEPTION_KINDS else (1, 0)


def summarize(events: Iterable[WatchEvent]) -> WatchSummary:
    events = list(events)
    counts = Counter(e.kind for e in events)
    repeats: dict[tuple[int, int], int] = {}
    for e in events:
        if e.kind == "repeat":
            key = (int(e.detail.get("of_pid", e.pid)), int(e.detail.get("of_seq", 0)))
            repeats[key] = repeats.get(key, 0) + int(e.detail.get("count", 0))
    problems = [e for e in events if e.problem]
    setters: list[str] = []
    victims: list[str] = []
    stalled: list[str] = []

    def add(lst: list[str], name: str | None) -> None:
        if name and name not in lst:
            lst.append(name)

    groups: dict[tuple, dict[str, Any]] = {}
    failures = risks = 0
    for e in problems:
        sev = severity(e)
        n = 1 + repeats.get((e.pid, e.seq), 0)
        if sev == FAILURE:
            failures += n
        else:
            risks += n
        if e.kind in ("flag_leak", "module_call_leak", "eager_fallback"):
            add(victims, e.thread)
            for s in e.detail.get("setters", []):
                add(setters, s.get("thread"))
        elif e.kind == "stall":
            for t in e.detail.get("threads_in_compile", []):
                add(stalled, t)
        function, message, text = _describe(e)
        pattern = _pattern_for(e, message)
        setter_names = tuple(sorted({str(s.get("thread")) for s in e.detail.get("setters", []) or []}))
        key = (sev, e.kind, function, message, setter_names)
        if e.kind == "thread_error" and pattern is not None and any(
                g["event"].thread == e.thread and g["pattern"] is pattern for g in groups.values()):
            continue  # the same failure already seen where it happened (a compile, a compiled call)
        g = groups.get(key)
        if g is None:
            groups[key] = {"event": e, "sev": sev, "function": function, "message": message, "text": text,
                           "pattern": pattern, "threads": [e.thread], "count": n}
        else:
            g["count"] += n
            if e.thread not in g["threads"]:
                g["threads"].append(e.thread)
    findings: list[Finding] = []
    for g in groups.values():
        e, p = g["event"], g["pattern"]
        label = "failure" if g["sev"] == FAILURE else "risk (no harm observed)"
        text = g["text"]
        if len(g["threads"]) > 1:
            text += f" [also in thread(s) {', '.join(repr(t) for t in g['threads'][1:])}]"
        if g["count"] > 1:
            text += f" [x{g['count']}]"
        if p is not None:
            text += f" — known torch failure '{p.name}'{'' if p.race else ' (not a thread race)'}: {p.cause}"
        findings.append(Finding(
            severity=g["sev"], kind=e.kind, threads=tuple(g["threads"]), function=g["function"], message=g["message"],
            count=g["count"], pattern=p.name if p else None, race=p.race if p else None,
            cause=p.cause if p else None, fix=_fix(e, p), text=f"{label}: {text}", first=e.to_json()))
    findings.sort(key=_rank)  # stable: time order within a rank
    shown = findings[:_MAX_FINDINGS]
    unwatched = tuple(dict.fromkeys(
        f"not watched (pid {e.pid}, torch {e.detail.get('torch')}): {u.get('what')}: {u.get('why')}"
        for e in events if e.kind == "start" for u in e.detail.get("unwatched") or ()))
    instrument_errors = tuple(
        f"instrument error (pid {e.pid}): {e.detail.get('count')} failure(s) in compilewatch's own listeners, "
        f"first: {e.detail.get('first')}; this watch may be incomplete"
        for e in events if e.kind == "instrument_error")
    # what failed, then what could not be watched or may be missing (never "ok" for either: a watch
    # that is incomplete cannot vouch for the program), then risks
    incomplete = unwatched + instrument_errors
    verdicts = [f.text for f in shown if f.severity == FAILURE] + list(incomplete)
    verdicts += [f.text for f in shown if f.severity != FAILURE]
    if not problems and not incomplete:
        verdicts.append(f"no cross-thread problem seen ({counts.get('trace', 0)} trace window(s), "
                        f"{counts.get('compile', 0)} compile(s) watched).")
    elif problems and not failures:
        verdicts.insert(len(incomplete), f"nothing failed: {risks} risk(s) seen, no exception and no harm observed.")
    advice = tuple(dict.fromkeys(f.fix for f in findings if f.fix))
    return WatchSummary(
        schema_version=SCHEMA_VERSION, ok=failures == 0 and not incomplete, counts=dict(counts), problems=len(problems),
        failures=failures, risks=risks, setter_threads=tuple(setters), victim_threads=tuple(victims),
        stalled_threads=tuple(stalled), pids=tuple(sorted({e.pid for e in events})),
        findings=tuple(findings[:_MAX_FINDINGS]), verdicts=tuple(verdicts), advice=advice,
        first_problems=tuple(f.first for f in findings[:10]), unwatched=unwatched,
        instrument_errors=instrument_errors, remote_cache=_remote_counts(events),
    )


def _remote_counts(events: list[WatchEvent]) -> dict[str, dict[str, int]] | None:
    """The remote-cache counters of every process (each reports once, at close), summed per kind."""
    total: dict[str, dict[str, int]] = {}
    seen = False
    for e in events:
        if e.kind in ("remote_cache", "remote_cache_down"):
            seen = True
            for kind, c in (e.detail.get("counts") or {}).items():
                t = total.setdefault(kind, {})
                for f, n in c.items():
                    t[f] = t.get(f, 0) + int(n)
    return total if seen else None
