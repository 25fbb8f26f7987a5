"""Watcher events as a Chrome trace-event timeline (the JSON that Perfetto and chrome://tracing open).

One process track per pid, one thread track per Python thread (named), keyed by the thread's
identity: ident + name + when the watcher first saw it (`thread_start`), since Python reuses idents
of threads that ended (reports without `thread_start` fall back to ident + name). Slices ("X"): every trace window
(`<tracer> <target>`), every dynamo compile, every user span (`Watcher.span`, e.g. dflash's per-device
warm-up and worker steps). Instants ("i"): flag leaks, module-call leaks, eager fallbacks, stuck
state, stalls, compiles after warm, guard blocks, compile failures, thread errors, with their stacks
and reasons in `args`. Flow arrows ("s"/"f") from the setter thread's trace slice to the victim's
call slice; both ends always sit inside a slice (a setter window that never closed gets a slice up to
the leak), so viewers draw every arrow. Counters ("C"): the FX
tracing flag and the number of open trace windows, over time.

Format: https://docs.google.com/document/d/1CvAClvFfyA5R-PhYUmn5OOQtYMH4h6I0nSsKchNAySU (JSON Object
Format: {"traceEvents": [...], "displayTimeUnit": "ms", "otherData": {...}}); ts/dur in microseconds.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

from compilewatch.tracing.watch_events import PROBLEM_KINDS, WatchEvent, read_events

_INSTANT_SCOPE = {"stuck_state": "p", "stall": "p"}  # process-wide state; the rest are thread events
# problems that are a call in the victim thread: drawn as a short slice (its real length is unknown)
_FAILED_CALL = {"flag_leak": "compiled call saw the FX flag", "eager_fallback": "compiled call ran eagerly",
                "module_call_leak": "module call through a foreign tracer"}  # args.severity: failure or risk
_FAILED_CALL_US = 100.0


@dataclass(frozen=True, slots=True)
class TimelineInfo:
    path: str
    trace_events: int  # entries in traceEvents
    slices: int
    instants: int
    processes: int
    threads: dict[str, str]  # "pid/tid" -> thread name
    problems: int


class _Ids:
    """Small, stable per-process track ids, one per Python thread: (pid, ident, thread_start), or
    (pid, ident, name) when a report has no thread_start (Python idents are reused)."""

    def __init__(self) -> None:
        self.tids: dict[tuple[int, int, Any], int] = {}
        self.names: dict[tuple[int, int, Any], str] = {}

    def tid(self, pid: int, ident: int, name: str | None = None, start: float | None = None) -> int:
        key = (pid, ident, start if start is not None else f"name:{name}")
        if key not in self.tids:
            self.tids[key] = 1 + sum(1 for k in self.tids if k[0] == pid)
        if name and key not in self.names:
            self.names[key] = name
        return self.tids[key]


def _us(t: float, t0: float) -> float:
    return round((t - t0) * 1e6, 3)


def _problem_name(e: WatchEvent) -> str:
    d = e.detail
    if e.kind in ("flag_leak", "eager_fallback"):
        return f"{e.kind.replace('_', ' ')}: {d.get('call') or d.get('reader')}"
    if e.kind == "module_call_leak":
        return f"module call leak: {d.get('module')}"
    if e.kind == "stall":
        return f"stall: {d.get('what')}"
    if e.kind == "recompile_after_warm":
        return f"compile after warm {d.get('compile_id')}"
    if e.kind == "guard_blocked":
        return f"guard blocked {d.get('function')}"
    if e.kind == "compile_failed":
        return f"compile failed: {d.get('function') or d.get('compile_id')}"
    if e.kind == "thread_error":
        return f"thread died: {str(d.get('error') or '')[:60]}"
    return e.kind.replace("_", " ")


def _nest(trace_events: list[dict[str, Any]]) -> None:
    """Viewers drop a slice that overlaps another on its thread without nesting in it (Perfetto:
    slice_drop_overlapping_complete_event). Slices whose end is not exact (a failed call, clock
    skew between two instruments) are clipped to end inside their parent; `args.clipped` says so."""
    by_thread: dict[tuple[int, int], list[dict[str, Any]]] = {}
    for e in trace_events:
        if e["ph"] == "X":
            by_thread.setdefault((e["pid"], e["tid"]), []).append(e)
    for slices in by_thread.values():
        slices.sort(key=lambda e: (e["ts"], -e["dur"]))
        stack: list[float] = []  # end times of the open parents
        for e in slices:
            while stack and stack[-1] <= e["ts"]:
                stack.pop()
            end = e["ts"] + e["dur"]
            if stack and end > stack[-1]:
                e["dur"] = round(stack[-1] - e["ts"], 3)
                e.setdefault("args", {})["clipped"] = True
                end = stack[-1]
            stack.append(end)


def _anchor_flows(out: list[dict[str, Any]], flows: list[tuple[dict[str, Any], dict[str, Any], dict[str, Any]]],
                  t0: float) -> None:
    """Nest the slices, then put each arrow's start inside the setter's trace slice (a window that
    never closed, e.g. the program was killed, gets a slice from its start to the leak)."""
    by_window = {(x["pid"], x["tid"], x["args"].get("window_id")): x for x in out
                 if x["ph"] == "X" and x.get("cat") == "trace"}
    for start, _end, s in flows:
        key = (start["pid"], start["tid"], s.get("window_id"))
        if key not in by_window and s.get("since") is not None:
            since = _us(float(s["since"]), t0)
            sl = {"ph": "X", "cat": "trace", "name": f"{s.get('tracer')} {s.get('target')} (no end recorded)",
                  "pid": start["pid"], "tid": start["tid"], "ts": since, "dur": max(round(start["ts"] - since, 3), 1.0),
                  "args": {"window_id": s.get("window_id"), "where": s.get("where"), "open": True}}
            out.append(sl)
            by_window[key] = sl
    _nest(out)
    spans: dict[tuple[int, int], list[tuple[float, float]]] = {}
    for x in out:
        if x["ph"] == "X":
            spans.setdefault((x["pid"], x["tid"]), []).append((x["ts"], x["ts"] + x["dur"]))
    for start, end, s in flows:
        for ev, sl in ((start, by_window.get((start["pid"], start["tid"], s.get("window_id")))), (end, None)):
            if sl is not None:
                ev["ts"] = min(max(ev["ts"], sl["ts"]), round(sl["ts"] + sl["dur"], 3))
            elif not any(a <= ev["ts"] <= b for a, b in spans.get((ev["pid"], ev["tid"]), [])):
                inside = [a for a, b in spans.get((ev["pid"], ev["tid"]), []) if a >= ev["ts"]]
                if inside:  # the nearest slice that follows (clipping never moves a start)
                    ev["ts"] = min(inside)


def to_trace_events(events: Iterable[WatchEvent]) -> dict[str, Any]:
    """The Chrome trace JSON object for a list of watcher events (from one or several processes)."""
    events = sorted(events, key=lambda e: (e.time, e.pid, e.seq))
    out: list[dict[str, Any]] = []
    ids = _Ids()
    if not events:
        return {"traceEvents": [], "displayTimeUnit": "ms", "otherData": {"source": "compilewatch", "t0": None}}
    t0 = min(min(e.time, float(e.detail.get("start", e.time) or e.time),
                 *(float(s["since"]) for s in e.detail.get("setters") or [] if isinstance(s, dict) and s.get("since")))
             for e in events)
    counters: list[tuple[float, int, int, int]] = []  # time, pid, +1/-1 open windows, flag after (-1: n/a)
    flows: list[tuple[dict[str, Any], dict[str, Any], dict[str, Any]]] = []  # (s, f, setter) per arrow
    for e in events:
        d = e.detail
        if e.kind in ("repeat", "end"):
            continue  # counts and the summary: no place on a thread
        tid = ids.tid(e.pid, e.thread_id, e.thread, e.thread_start)
        if e.kind == "trace" and d.get("start") is not None and d.get("end") is not None:
            out.append({"ph": "X", "cat": "trace", "name": f"{d.get('tracer')} {d.get('target')}", "pid": e.pid,
                        "tid": tid, "ts": _us(d["start"], t0), "dur": round((d["end"] - d["start"]) * 1e6, 3),
                        "args": {k: d.get(k) for k in ("window_id", "flag_before", "flag_after", "compiling", "error",
                                                       "outer_window", "where", "stack")}})
            if d.get("outer_window") is None:
                counters.append((d["start"], e.pid, +1, 1))
                counters.append((d["end"], e.pid, -1, 1 if d.get("flag_after") else 0))
        elif e.kind in ("compile", "span") and d.get("start") is not None and d.get("end") is not None:
            name = f"dynamo compile {d.get('compile_id')}" if e.kind == "compile" else str(d.get("name"))
            cat = "compile" if e.kind == "compile" else str(d.get("cat") or "span")
            args = {k: v for k, v in d.items() if k not in ("start", "end", "name", "cat")}
            out.append({"ph": "X", "cat": cat, "name": name, "pid": e.pid, "tid": tid, "ts": _us(d["start"], t0),
                        "dur": round((d["end"] - d["start"]) * 1e6, 3), "args": args})
        elif e.kind in PROBLEM_KINDS or e.kind in ("warm", "leak_prevented", "repair"):
            scope = _INSTANT_SCOPE.get(e.kind, "t")
            if e.kind in _FAILED_CALL:  # the victim's call, as a short slice the leak arrow ends on
                out.append({"ph": "X", "cat": "failed call", "name": f"{_FAILED_CALL[e.kind]}: "
                            f"{d.get('call') or d.get('module') or d.get('reader')}", "pid": e.pid, "tid": tid,
                            "ts": _us(e.time, t0), "dur": _FAILED_CALL_US, "args": {
                                "outcome": d.get("outcome") or d.get("error") or "returned normally",
                                "severity": e.severity, "duration_unknown": True}})
            out.append({"ph": "i", "s": scope, "cat": "problem" if e.kind in PROBLEM_KINDS else "info",
                        "name": _problem_name(e), "pid": e.pid, "tid": tid, "ts": _us(e.time, t0), "args": d})
            if e.kind not in _FAILED_CALL:
                continue  # an arrow needs the victim's call slice to end on
            for s in d.get("setters", []) or []:  # an arrow from the setter's open trace to the victim
                stid = ids.tid(e.pid, int(s.get("thread_id") or 0), s.get("thread"), s.get("thread_start"))
                common = {"cat": "leak", "name": f"{s.get('thread')} → {e.thread}", "id": len(flows) + 1,
                          "pid": e.pid}
                start = {**common, "ph": "s", "tid": stid, "ts": _us(e.time, t0)}
                end = {**common, "ph": "f", "bp": "e", "tid": tid, "ts": _us(e.time, t0)}
                out += [start, end]
                flows.append((start, end, s))
    # counters: open trace windows and the FX flag per process
    open_n: dict[int, int] = {}
    for t, pid, delta, flag in sorted(counters, key=lambda c: (c[0], -c[2])):
        open_n[pid] = open_n.get(pid, 0) + delta
        value = 1 if delta > 0 else flag
        # viewers name a counter track "<name> <arg>": "fx tracing flag", "open trace windows"
        out.append({"ph": "C", "name": "fx tracing", "pid": pid, "tid": 0, "ts": _us(t, t0), "args": {"flag": value}})
        out.append({"ph": "C", "name": "open trace", "pid": pid, "tid": 0, "ts": _us(t, t0),
                    "args": {"windows": open_n[pid]}})
    _anchor_flows(out, flows, t0)
    meta: list[dict[str, Any]] = []
    for pid in sorted({k[0] for k in ids.tids}):
        argv = next((e.detail.get("argv") for e in events if e.pid == pid and e.kind == "start"), None)
        label = f"pid {pid}" + (f": {' '.join(map(str, argv))[:80]}" if argv else "")
        meta.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": label}})
    for key, tid in ids.tids.items():
        pid, ident = key[0], key[1]
        meta.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid,
                     "args": {"name": ids.names.get(key, f"thread {ident}")}})
        meta.append({"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": tid, "args": {"sort_index": tid}})
    return {"traceEvents": meta + out, "displayTimeUnit": "ms",
            "otherData": {"source": "compilewatch", "t0_unix_s": t0, "events": len(events)}}


def write_timeline(events: Iterable[WatchEvent], path: str | os.PathLike[str]) -> TimelineInfo:
    """Write the timeline JSON atomically; returns what it holds."""
    import json

    from compilewatch.fsutil import atomic_write_text
    from compilewatch.serialize import to_jsonable

    events = list(events)
    data = to_trace_events(events)
    atomic_write_text(Path(path), json.dumps(to_jsonable(data)) + "\n")
    te = data["traceEvents"]
    threads = {f"{m['pid']}/{m['tid']}": m["args"]["name"] for m in te if m.get("name") == "thread_name"}
    return TimelineInfo(path=str(path), trace_events=len(te), slices=sum(1 for x in te if x["ph"] == "X"),
                        instants=sum(1 for x in te if x["ph"] == "i"),
                        processes=len({x["pid"] for x in te}), threads=threads,
                        problems=sum(1 for e in events if e.problem))


def convert(report: str | os.PathLike[str], out: str | os.PathLike[str]) -> TimelineInfo:
    """`compilewatch timeline REPORT.jsonl -o FILE.json`."""
    from compilewatch.errors import BadInput

    if Path(out).is_dir():
        raise BadInput(f"-o {out} is a directory", hint="give the timeline's file name, e.g. -o timeline.json")
    from compilewatch.fsutil import same_file

    if same_file(report, out):
        raise BadInput(f"-o {out} is the report itself: the timeline would overwrite it",
                       hint="give the timeline its own file name, e.g. -o timeline.json")
    return write_timeline(read_events(report), out)
