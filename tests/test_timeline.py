"""The Chrome trace-event timeline: written by the watcher, `timeline`, `probe --timeline`; loaded back
and checked against the format (JSON Object Format: traceEvents with ph/ts/pid/tid, X slices with dur,
M metadata naming every thread track, s/f flow pairs bound to slices, C counters)."""

from __future__ import annotations

import json

import torch

from cli.main import app
from compilewatch.tracing.watcher import Watcher
from tests.helpers import invoke, invoke_json
from tests.race_cases import GLOBAL_FLAG, leak_trial, X, clean_race_state, step  # noqa: F401 (autouse fixture)
from tests.timeline_format import validate


def _race():
    """The victim's call that races on this torch: a compiled call where the FX flag is module-global
    (a flag leak), else an eager module call (torch 2.14+ still patches nn.Module.__call__ on the class)."""
    if GLOBAL_FLAG:
        return (lambda: step(X)), "flag leak"
    lin = torch.nn.Linear(4, 4)
    return (lambda: lin(X)), "module call leak"


def test_watcher_timeline_shows_the_race(tmp_path):
    path = tmp_path / "race.json"
    with Watcher(tmp_path / "r.jsonl", timeline=path) as w:
        with w.span("warm cpu", cat="warm", device="cpu"):
            torch.compile(lambda x: x * 5, backend="aot_eager")(X)
        call, marker = _race()
        leak_trial(call)
    data = json.loads(path.read_text())
    assert validate(data) == []
    te = data["traceEvents"]
    threads = {m["args"]["name"]: m["tid"] for m in te if m.get("name") == "thread_name"}
    assert {"MainThread", "setter", "victim"} <= set(threads)
    names = {(e["ph"], e["name"]) for e in te}
    assert ("X", "warm cpu") in names
    assert any(ph == "X" and n.startswith("dynamo compile") for ph, n in names)
    assert any(ph == "X" and n.startswith("Tracer ") and e_tid == threads["setter"]
               for ph, n, e_tid in ((e["ph"], e["name"], e.get("tid")) for e in te))
    leak = next(e for e in te if e["ph"] == "i" and e["name"].startswith(marker))
    assert leak["tid"] == threads["victim"] and leak["args"]["setters"][0]["thread"] == "setter"
    flow = {e["ph"]: e for e in te if e["ph"] in ("s", "f")}
    assert flow["s"]["tid"] == threads["setter"] and flow["f"]["tid"] == threads["victim"]
    flag = [e["args"]["flag"] for e in te if e["ph"] == "C" and e["name"] == "fx tracing"]
    assert 1 in flag and flag[-1] == 0


def test_timeline_command_converts_a_report(tmp_path):
    report = tmp_path / "r.jsonl"
    with Watcher(report):
        leak_trial(_race()[0])
    out = tmp_path / "t.json"
    info = invoke_json(app, ["timeline", str(report), "-o", str(out)])
    assert info["problems"] == 1 and info["slices"] >= 2 and set(info["threads"].values()) >= {"setter", "victim"}
    assert validate(json.loads(out.read_text())) == []


def test_timeline_command_bad_input(tmp_path):
    res = invoke(app, ["timeline", str(tmp_path / "missing.jsonl")])
    assert res.exit_code == 2 and "does not exist" in res.stderr
    junk = tmp_path / "junk.jsonl"
    junk.write_text("not json\n")
    res = invoke(app, ["timeline", str(junk)])
    assert res.exit_code == 2 and "not JSON" in res.stderr


def test_probe_timeline(tmp_path):
    out = tmp_path / "probe.json"
    invoke_json(app, ["probe", "compile", "--backend", "aot_eager", "--timeline", str(out)])
    data = json.loads(out.read_text())
    assert validate(data) == []
    names = [e["name"] for e in data["traceEvents"] if e["ph"] == "X"]
    assert any(n.startswith("dynamo compile") for n in names) and any("Tracer" in n for n in names)


def test_slices_that_would_overlap_are_clipped_to_nest():
    from compilewatch.tracing.timeline import to_trace_events
    from compilewatch.tracing.watch_events import WatchEvent

    ev = [WatchEvent("span", 10.0, 1, "w", 7, 1, {"name": "step", "start": 10.0, "end": 10.00005}),
          WatchEvent("flag_leak", 10.00001, 1, "w", 7, 2, {"call": "f", "setters": []})]
    data = to_trace_events(ev)
    assert validate(data) == []
    failed = next(e for e in data["traceEvents"] if e.get("cat") == "failed call")
    assert failed["args"]["clipped"] and failed["dur"] <= 40.0


def test_empty_report_gives_an_empty_valid_timeline(tmp_path):
    from compilewatch.tracing.timeline import to_trace_events

    assert validate(to_trace_events([])) == []


def test_threads_that_reuse_an_ident_get_their_own_tracks():
    """Python reuses a finished thread's ident: tracks are keyed by ident + first-seen time + name."""
    from compilewatch.tracing.timeline import to_trace_events
    from compilewatch.tracing.watch_events import WatchEvent

    ev = [WatchEvent("span", 1.0, 1, "worker-a", 7, 1, {"name": "a", "start": 1.0, "end": 1.1}, thread_start=1.0),
          WatchEvent("span", 2.0, 1, "worker-b", 7, 2, {"name": "b", "start": 2.0, "end": 2.1}, thread_start=2.0),
          WatchEvent("span", 3.0, 1, "worker-a", 7, 3, {"name": "a2", "start": 3.0, "end": 3.1}, thread_start=1.0)]
    te = to_trace_events(ev)["traceEvents"]
    tracks = {m["args"]["name"]: m["tid"] for m in te if m.get("name") == "thread_name"}
    assert set(tracks) == {"worker-a", "worker-b"} and tracks["worker-a"] != tracks["worker-b"]
    by_name = {e["name"]: e["tid"] for e in te if e["ph"] == "X"}
    assert by_name == {"a": tracks["worker-a"], "b": tracks["worker-b"], "a2": tracks["worker-a"]}


def test_real_threads_with_a_reused_ident_are_told_apart(tmp_path):
    import threading

    with Watcher() as w:
        for name in ("first", "second"):  # the second thread usually gets the first one's ident back
            t = threading.Thread(target=lambda: w._emit("span", {"name": "s", "cat": "span", "start": 0.0, "end": 0.0}),
                                 name=name)
            t.start()
            t.join()
    spans = [e for e in w.events if e.kind == "span"]
    assert [e.thread for e in spans] == ["first", "second"]
    assert spans[0].thread_start != spans[1].thread_start


def test_every_flow_end_sits_inside_a_slice():
    """A setter window that never closed (the program was killed) still anchors its arrow; info
    events with setters (leak_prevented) draw no arrow, since the victim has no call slice."""
    from compilewatch.tracing.timeline import to_trace_events
    from compilewatch.tracing.watch_events import WatchEvent

    setter = {"thread": "tracer", "thread_id": 9, "thread_start": 0.5, "window_id": 4, "tracer": "Tracer",
              "target": "f", "since": 1.0, "where": "p.py:3"}
    ev = [WatchEvent("flag_leak", 2.0, 1, "victim", 8, 1, {"call": "g", "outcome": "RuntimeError: x",
                                                         "setters": [setter]}, thread_start=0.6),
          WatchEvent("leak_prevented", 2.5, 1, "victim", 8, 2, {"call": "g", "setters": [setter]}, thread_start=0.6)]
    data = to_trace_events(ev)
    assert validate(data) == []
    flows = [e for e in data["traceEvents"] if e["ph"] in ("s", "f")]
    assert len(flows) == 2
    open_slice = next(e for e in data["traceEvents"] if e["ph"] == "X" and e["name"].endswith("(no end recorded)"))
    assert open_slice["ts"] <= flows[0]["ts"] <= open_slice["ts"] + open_slice["dur"]
