"""`compilewatch lock` and `compilewatch diff-env` through the CLI: output, JSON, exit codes."""

from __future__ import annotations

import json
from pathlib import Path

from cli.main import app
from tests.helpers import invoke, invoke_json

FX = Path(__file__).parent / "fixtures" / "env"
SEEDS = FX / "seeds"


def test_diff_env_seeds_human_output_grouped_by_severity():
    r = invoke(app, ["diff-env", str(SEEDS / "old-freeze.txt"), str(SEEDS / "new-freeze.txt")])
    assert r.exit_code == 1
    out = r.stdout
    assert "critical (1)\n  Updated torch v2.11.0+cu128 -> v2.11.0+cu130\n" in out
    assert "  Updated transformers v5.6.0 -> v5.8.1\n" in out
    assert out.index("critical (1)") < out.index("warning (8)") < out.index("info (3)")
    assert "exit 1: changes at or above critical" in out
    assert "compare only between two compilewatch locks" in r.stderr  # notes go to stderr


def test_diff_env_json_and_fail_on_threshold(tmp_path):
    data = invoke_json(app, ["diff-env", str(SEEDS / "old.lock.json"), str(SEEDS / "new.lock.json")], expect_code=1)
    assert data["old"]["torch"] == "2.11.0+cu128" and data["new"]["torch"] == "2.11.0+cu130"
    heads = [c["headline"] for c in data["changes"] if c["severity"] == "critical"]
    assert heads[0] == "Updated torch v2.11.0+cu128 -> v2.11.0+cu130"
    assert "Removed inductor cache /tmp/torchinductor_root (353.0 MB, 1204 files)" in heads
    old, new = tmp_path / "old.txt", tmp_path / "new.txt"
    old.write_text("torch==2.11.0+cu130\ntransformers==5.6.0\nrich==14.0.0\n")
    new.write_text("torch==2.11.0+cu130\ntransformers==5.8.1\nrich==15.0.0\n")
    assert invoke(app, ["diff-env", str(old), str(new)]).exit_code == 0  # only a warning: below critical
    assert invoke(app, ["diff-env", str(old), str(new), "--fail-on", "warning"]).exit_code == 1
    assert invoke(app, ["diff-env", str(old), str(old), "--fail-on", "info"]).exit_code == 0


def test_diff_env_unreadable_input_exits_2_with_file_and_line(tmp_path):
    bad = FX / "malformed" / "freeze-bad-requirement.txt"
    r = invoke(app, ["diff-env", str(bad), str(SEEDS / "new-freeze.txt")])
    assert r.exit_code in (0, 1)  # one invalid line: a note, and the rest of the file still diffs
    assert f"{bad}:3: not a requirement" in r.stderr
    assert "Traceback" not in r.stderr
    garbage = tmp_path / "garbage.txt"
    garbage.write_text("%%% not a requirement\n")
    r = invoke(app, ["diff-env", str(garbage), str(SEEDS / "new-freeze.txt")])
    assert r.exit_code == 2 and f"{garbage}:1: not a requirement" in r.stderr
    r = invoke(app, ["diff-env", str(SEEDS / "old-freeze.txt"), str(FX / "nope.txt")])
    assert r.exit_code == 2 and "no such file" in r.stderr


def test_diff_env_format_overrides_and_bad_options(tmp_path):
    lock_as_txt = tmp_path / "lock.txt"
    lock_as_txt.write_text((FX / "uv-project" / "uv.lock").read_text())
    data = invoke_json(app, ["diff-env", str(lock_as_txt), str(FX / "uv-project" / "requirements.txt"),
                             "--format", "uv.lock", "--format", "requirements"], expect_code=0)
    assert data["old"]["format"] == "uv.lock" and data["new"]["format"] == "requirements"
    assert [c["headline"] for c in data["changes"]] == ["Removed drafter-train v0.1.0"]  # uv export drops the project
    r = invoke(app, ["diff-env", str(SEEDS / "old-freeze.txt"), str(SEEDS / "new-freeze.txt"), "--format", "pylock"])
    assert r.exit_code == 2 and "invalid TOML" in r.stderr
    r = invoke(app, ["diff-env", str(SEEDS / "old-freeze.txt"), str(SEEDS / "new-freeze.txt"), "--fail-on", "fatal"])
    assert r.exit_code == 2 and "unknown severity" in r.stderr
    r = invoke(app, ["diff-env", "a", "b", "--format", "poetry"])
    assert r.exit_code == 2 and "unknown format" in r.stderr


def test_lock_writes_a_file_that_diffs_clean_against_itself(tmp_path):
    target = tmp_path / "env.lock.json"
    r = invoke(app, ["lock", "-o", str(target), "--no-gpus"])
    assert r.exit_code == 0, r.stderr
    assert f"wrote {target}" in r.stdout and "torch" in r.stdout
    data = json.loads(target.read_text())
    assert data["schema"] == "compilewatch.lock" and data["schema_version"] == 1
    same = invoke(app, ["diff-env", str(target), str(target), "--fail-on", "info"])
    assert same.exit_code == 0 and "no changes" in same.stdout


def test_lock_json_on_stdout(monkeypatch):
    from compilewatch.env import lock as envlock

    fixture = envlock.load_lock(SEEDS / "old.lock.json")
    monkeypatch.setattr("cli.env.envlock.snapshot", lambda **kw: fixture)
    data = invoke_json(app, ["lock"])
    assert data["torch"]["version"] == "2.11.0+cu128"
    assert len(data["gpus"]) == 8 and data["env_left_out"] == ["HF_TOKEN"]
    r = invoke(app, ["lock", "-o", "/"])
    assert r.exit_code == 2 and "is a directory" in r.stderr


def test_format_names_in_help_match_the_readers():
    from cli.env import FORMAT_NAMES
    from compilewatch.env.formats import FORMATS

    assert FORMAT_NAMES == FORMATS


def _freezes(tmp_path, n: int):
    """Two pip freezes where `n` packages off the compile path changed (updated, added, removed)."""
    old = ["torch==2.13.0"] + [f"pkg-up-{i}==1.0" for i in range(n)] + ["pkg-gone==1.0"]
    new = ["torch==2.13.0"] + [f"pkg-up-{i}==1.1" for i in range(n)] + ["pkg-new==2.0"]
    (tmp_path / "old.txt").write_text("\n".join(old) + "\n")
    (tmp_path / "new.txt").write_text("\n".join(new) + "\n")
    return str(tmp_path / "old.txt"), str(tmp_path / "new.txt")


def test_diff_env_counts_info_changes_and_lists_them_on_request(tmp_path):
    old, new = _freezes(tmp_path, 40)
    r = invoke(app, ["diff-env", old, new])
    assert r.exit_code == 0, r.output
    info = r.stdout[r.stdout.index("info (42)"):]
    assert "42 changes: 40 updated, 1 added, 1 removed (e.g. " in info
    assert "Updated pkg-up-7" not in r.stdout  # counted, not listed
    assert "--all lists every one" in r.stderr
    every = invoke(app, ["diff-env", old, new, "--all"])
    assert all(f"Updated pkg-up-{i} v1.0 -> v1.1" in every.stdout for i in range(40))
    assert "Added pkg-new" in every.stdout and "Removed pkg-gone" in every.stdout
    # info is the finding with --fail-on info: then every one is listed
    assert "Updated pkg-up-7 v1.0 -> v1.1" in invoke(app, ["diff-env", old, new, "--fail-on", "info"]).stdout
    data = invoke_json(app, ["diff-env", old, new])  # --json keeps the full data
    assert sum(c["severity"] == "info" for c in data["changes"]) == 42


def test_diff_env_lists_a_few_info_changes_as_they_are(tmp_path):
    old, new = _freezes(tmp_path, 1)
    r = invoke(app, ["diff-env", old, new])
    assert "Updated pkg-up-0 v1.0 -> v1.1" in r.stdout and "Added pkg-new v2.0" in r.stdout
    assert "--all" not in r.stderr
