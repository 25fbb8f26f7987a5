"""A checker for Chrome trace-event JSON (the Object Format Perfetto and chrome://tracing load): the
structure a viewer needs, used by the timeline tests to load our output back."""

from __future__ import annotations

import json
from collections import defaultdict

_REQUIRED = {"X": {"name", "ts", "dur", "pid", "tid"}, "i": {"name", "ts", "pid", "tid", "s"},
             "C": {"name", "ts", "pid", "args"}, "M": {"name", "pid", "args"},
             "s": {"id", "ts", "pid", "tid", "cat", "name"}, "f": {"id", "ts", "pid", "tid", "cat", "name", "bp"}}


def validate(data: dict) -> list[str]:
    """Everything that would make a viewer drop or misplace an event."""
    bad: list[str] = []
    if not isinstance(data, dict) or not isinstance(data.get("traceEvents"), list):
        return ["not a JSON object with a traceEvents list"]
    te = data["traceEvents"]
    named = {(m["pid"], m["tid"]) for m in te if m.get("ph") == "M" and m.get("name") == "thread_name"}
    slices = defaultdict(list)
    for i, e in enumerate(te):
        ph = e.get("ph")
        if ph not in _REQUIRED:
            bad.append(f"#{i}: unknown ph {ph!r}")
            continue
        if missing := _REQUIRED[ph] - set(e):
            bad.append(f"#{i} ({ph}): missing {sorted(missing)}")
            continue
        if not isinstance(e["pid"], int) or ("tid" in e and not isinstance(e["tid"], int)):
            bad.append(f"#{i}: pid/tid must be integers")
        if "ts" in e and not (isinstance(e["ts"], (int, float)) and e["ts"] >= 0):
            bad.append(f"#{i}: bad ts {e.get('ts')!r}")
        if ph == "X":
            if not (isinstance(e["dur"], (int, float)) and e["dur"] >= 0):
                bad.append(f"#{i}: bad dur")
            slices[(e["pid"], e["tid"])].append((e["ts"], e["ts"] + e["dur"]))
        if ph in ("X", "i", "s", "f") and (e["pid"], e["tid"]) not in named:
            bad.append(f"#{i}: thread {e['pid']}/{e['tid']} has no thread_name")
        if ph == "C" and not all(isinstance(v, (int, float)) for v in e["args"].values()):
            bad.append(f"#{i}: counter values must be numbers")
    for key, spans in slices.items():  # slices on one thread must nest (viewers drop overlaps)
        stack: list[float] = []
        for a, b in sorted(spans, key=lambda ab: (ab[0], -(ab[1] - ab[0]))):
            while stack and stack[-1] <= a:
                stack.pop()
            if stack and b > stack[-1] + 1e-6:
                bad.append(f"thread {key}: slice [{a}, {b}] overlaps its parent ending at {stack[-1]}")
            stack.append(b)
    flows = defaultdict(dict)
    for e in te:
        if e.get("ph") in ("s", "f"):
            flows[e["id"]][e["ph"]] = e
    for fid, pair in flows.items():
        if set(pair) != {"s", "f"}:
            bad.append(f"flow {fid}: needs one s and one f")
            continue
        for ph, e in pair.items():
            if not any(a <= e["ts"] <= b for a, b in slices[(e["pid"], e["tid"])]):
                bad.append(f"flow {fid} {ph}: not inside a slice on its thread")
    json.dumps(data)  # serializable as is
    return bad
