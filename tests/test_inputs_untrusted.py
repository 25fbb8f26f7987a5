"""Issue 18, text inputs: diff-env and timeline on crafted files exit 2 with one bounded line, never a
traceback, and never read without bound. Each case from the issue is one named test."""

from __future__ import annotations

import json

import pytest

from cli.main import app
from compilewatch.env.formats import detect_format, load_env
from compilewatch.errors import BadInput
from compilewatch.inputs import one_line, read_text
from tests.helpers import invoke

OK_REQS = "torch==2.11.0\n"


def _diff_env(tmp_path, name, content):
    ok = tmp_path / "ok.txt"
    ok.write_text(OK_REQS)
    bad = tmp_path / name
    bad.write_bytes(content if isinstance(content, bytes) else content.encode())
    return invoke(app, ["diff-env", str(ok), str(bad)])


def _exit_2_one_line(r, *words):
    assert r.exit_code == 2, (r.exit_code, r.stdout[-500:], r.stderr[-2000:])
    assert "Traceback" not in r.stderr
    error = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert len(error) == 1 and len(error[0]) < 700, r.stderr[:2000]
    for w in words:
        assert w in r.stderr


BILLION_LAUGHS = ("a: &a [x,x,x,x,x,x,x,x,x]\nb: &b [*a,*a,*a,*a,*a,*a,*a,*a,*a]\nc: &c [*b,*b,*b,*b,*b,*b,*b,*b,*b]\n"
                  "d: &d [*c,*c,*c,*c,*c,*c,*c,*c,*c]\ne: &e [*d,*d,*d,*d,*d,*d,*d,*d,*d]\n"
                  "f: &f [*e,*e,*e,*e,*e,*e,*e,*e,*e]\ng: &g [*f,*f,*f,*f,*f,*f,*f,*f,*f]\n"
                  "h: &h [*g,*g,*g,*g,*g,*g,*g,*g,*g]\ni: &i [*h,*h,*h,*h,*h,*h,*h,*h,*h]\ndependencies: [*i]\n")


def test_yaml_billion_laughs_is_refused(tmp_path):
    _exit_2_one_line(_diff_env(tmp_path, "env.yml", BILLION_LAUGHS), "aliases expand")


def test_yaml_alias_error_message_stays_one_short_line(tmp_path):
    """The 237-byte variant: a dependency that is a huge aliased structure must not print megabytes."""
    text = "\n".join(BILLION_LAUGHS.splitlines()[:5]) + "\ndependencies: [*e]\n"  # 9^5 values: allowed, not a spec
    _exit_2_one_line(_diff_env(tmp_path, "env.yml", text), "neither a conda spec")


def test_dev_zero_stops_at_the_limit():
    with pytest.raises(BadInput, match="file too large"):
        read_text("/dev/zero", limit=1 << 16)
    with pytest.raises(BadInput, match="file too large"):
        load_env("/dev/zero")


def test_version_of_200000_digits_is_read_without_a_traceback(tmp_path):
    # a 200,007-character line is longer than any requirement (issue 31: line length is capped on input)
    _exit_2_one_line(_diff_env(tmp_path, "big.txt", "torch==" + "1" * 200_000 + "\n"), "longer than any requirement")


def test_json_nested_100000_deep_is_bad_input(tmp_path):
    _exit_2_one_line(_diff_env(tmp_path, "deep.json", "[" * 100_000 + "]" * 100_000), "nested too deeply")


def test_lock_with_a_wrong_typed_field_names_the_field(tmp_path):
    lock = {"schema": "compilewatch.lock", "schema_version": 1, "python": "3.12", "cpu": {"model": "x", "count": 1}}
    _exit_2_one_line(_diff_env(tmp_path, "a.json", json.dumps(lock)), "python: expected an object")
    lock["python"] = {"version": "3.12", "implementation": "CPython", "platform": "linux", "abi": "cp312"}
    lock["gpus"] = [{"index": 0, "name": "H200", "capability": "9.0", "memory_bytes": "80GB", "uuid_hash": "x"}]
    _exit_2_one_line(_diff_env(tmp_path, "b.json", json.dumps(lock)), "gpus[0].memory_bytes: expected an integer")


def test_uv_lock_whose_first_package_is_past_4096_bytes(tmp_path):
    text = 'version = 1\nrequires-python = ">=3.11"\n' + "".join(f"# comment line {i}\n" for i in range(400)) \
        + '\n[[package]]\nname = "torch"\nversion = "2.11.0"\nsource = { registry = "https://pypi.org/simple" }\n'
    assert len(text.split("[[package]]")[0]) > 4096
    f = tmp_path / "project.uv.lock"
    f.write_text(text)
    assert detect_format(f, text) == "uv.lock"
    assert [(p.name, p.version) for p in load_env(f).packages] == [("torch", "2.11.0")]


@pytest.mark.parametrize("line, name, kind", [
    ("-e .", "local:.", "local"),
    (".", "local:.", "local"),
    ("./tools/mypkg", "mypkg", "local"),
    ("dist/foo-1.2.0-py3-none-any.whl", "foo", "local"),
    ("git+https://github.com/psf/requests.git", "requests", "vcs"),
    ("bzr+lp:bzr-svn", "bzr-svn", "vcs"),
    ("https://example.com/archive/master.zip", "url:https://example.com/archive/master.zip", "url"),
])
def test_every_line_pip_accepts_is_an_entry_of_its_kind(tmp_path, line, name, kind):
    f = tmp_path / "requirements.txt"
    f.write_text(f"{line}\nnumpy==2.0.0\n")
    pkgs = {p.name: p for p in load_env(f).packages}
    assert pkgs[name].kind == kind and "numpy" in pkgs


def test_unnamed_entries_diff_with_a_severity(tmp_path):
    (tmp_path / "old.txt").write_text("torch==2.11.0\n")
    (tmp_path / "new.txt").write_text("torch==2.11.0\n-e .\nhttps://example.com/x/master.zip\n")
    r = invoke(app, ["diff-env", str(tmp_path / "old.txt"), str(tmp_path / "new.txt"), "--json"])
    data = json.loads(r.stdout)
    added = {c["subject"]: c["severity"] for c in data["changes"] if c["action"] == "Added"}
    assert added == {"local:.": "info", "url:https://example.com/x/master.zip": "info"}


def test_timeline_on_a_binary_file_exits_2(tmp_path):
    f = tmp_path / "r.jsonl"
    f.write_bytes(b"\xff\xfe\x00\x01" * 100)
    _exit_2_one_line(invoke(app, ["timeline", str(f), "-o", str(tmp_path / "t.json")]), "not UTF-8")


def test_timeline_with_time_not_a_number_exits_2(tmp_path):
    f = tmp_path / "r.jsonl"
    f.write_text(json.dumps({"kind": "start", "time": "x"}) + "\n")
    _exit_2_one_line(invoke(app, ["timeline", str(f), "-o", str(tmp_path / "t.json")]), "'time' must be a time in unix seconds")


def test_timeline_output_a_directory_exits_2(tmp_path):
    f = tmp_path / "r.jsonl"
    f.write_text(json.dumps({"kind": "start", "time": 1.0}) + "\n")
    _exit_2_one_line(invoke(app, ["timeline", str(f), "-o", str(tmp_path)]), "is a directory")


def test_one_line_cuts_and_flattens():
    assert one_line("a\nb\tc") == "a b c"
    assert len(one_line("x" * 10_000, 50)) == 50
