"""What a reader of the docs walks through, where the code had drifted from them (docs walk, s13).

- docs/cache.md, Verify: after `cache verify --fix` has moved the bad entries aside, the output ends
  with `moved N path(s) to ...` and exit 0; it must not go on to suggest running `--fix`.
"""

from __future__ import annotations

from cli.main import app
from tests.cache_helpers import OTHER_KEY, entry_pickle, make_cache, write
from tests.helpers import invoke


def test_verify_fix_does_not_suggest_fix_after_moving(tmp_path):
    root = make_cache(tmp_path / "c")
    write(root, "aotautograd/aforeign/e", entry_pickle(OTHER_KEY))
    before = invoke(app, ["cache", "verify", "--dir", str(root)])
    assert before.exit_code == 1 and "cache verify --fix" in before.stderr
    fixed = invoke(app, ["cache", "verify", "--dir", str(root), "--fix"])
    assert fixed.exit_code == 0
    assert "moved 1 path(s) to" in fixed.stdout
    assert "cache verify --fix" not in fixed.stdout + fixed.stderr


def test_gpus_watch_in_a_pipe_prints_every_refresh(monkeypatch):
    """docs/gpus.md: `--watch S` refreshes every S seconds; in a log or pipe (no redraw) each refresh must
    reach the output, not only the last frame when the command ends (it would print nothing to a log
    until Ctrl-C)."""
    from compilewatch.devices import gpus as gpus_lib

    calls = []

    def status():
        calls.append(1)
        return gpus_lib.GpuStatus(available=False, reason=f"refresh {len(calls)}", driver_version=None,
                                  gpus=(), imbalances=(), verdicts=(f"refresh {len(calls)}",), warnings=())

    monkeypatch.setattr(gpus_lib, "status", status)
    r = invoke(app, ["gpus", "--watch", "0", "--count", "3"])
    assert r.exit_code == 0
    assert [f"refresh {i}" in r.stdout for i in (1, 2, 3)] == [True, True, True], r.stdout


def test_explain_report_without_lookups_hint_speaks_to_the_user(tmp_path):
    """docs/explain.md: `cache explain REPORT` on a report of a program that compiled nothing through
    inductor (e.g. backend="eager") is exit 2; its hint says why in the user's terms, not an issue number."""
    import json

    rep = tmp_path / "w.jsonl"
    rep.write_text(json.dumps({"kind": "start", "time": 1, "pid": 1, "detail": {}}) + "\n")
    r = invoke(app, ["cache", "explain", str(rep)])
    assert r.exit_code == 2 and "records no cache lookups" in r.stderr
    assert "issue" not in r.stderr and "compiled nothing with inductor" in r.stderr
