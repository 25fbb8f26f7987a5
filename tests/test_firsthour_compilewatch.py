"""A new user's first hour with `compilewatch`, and an adversarial tester's: bad flag values, paths given
in the wrong place, two options naming one file. Each case is one finding of the red-team pass: exit 2
with one `error:` line (no traceback), and nothing of the user's overwritten."""

from __future__ import annotations

import sys

import pytest

from cli.main import app
from compilewatch.devices import handoff
from compilewatch.errors import BadInput
from tests.cache_helpers import make_cache
from tests.helpers import invoke, invoke_json


def bad_input(args: list[str], *needles: str):
    """Run the CLI; assert exit 2, no traceback, and every needle in the message."""
    r = invoke(app, args)
    out = r.stdout + r.stderr
    assert r.exit_code == 2, (r.exit_code, out)
    assert "Traceback" not in out and "error:" in r.stderr, out
    for n in needles:
        assert n in r.stderr, (n, r.stderr)
    return r


# --- cache verify DIR: the dir given as ARCHIVE -------------------------------------------------------
def test_verify_given_a_cache_dir_as_archive_says_to_use_dir(tmp_path):
    root = make_cache(tmp_path / "my cache")
    bad_input(["cache", "verify", str(root)], "is a directory", f"--dir '{root}'")
    assert invoke_json(app, ["cache", "verify", "--dir", str(root)])["ok"] is True  # what the hint says works


def test_diff_negative_limit_is_refused(tmp_path):
    a, b = make_cache(tmp_path / "a"), make_cache(tmp_path / "b", n_fx=2)
    bad_input(["cache", "diff", str(a), str(b), "-n", "-1"], "--limit must be >= 0")
    r = invoke(app, ["cache", "diff", str(a), str(b), "-n", "0"])  # 0 still means "counts only"
    assert r.exit_code == 1 and "more in fxgraph" in r.stdout


# --- gpus --watch / --count ---------------------------------------------------------------------------
@pytest.mark.parametrize("args, needle", [
    (["--watch", "nan", "--count", "1"], "--watch must be a number of seconds"),  # was: ValueError traceback
    (["--watch", "inf", "--count", "1"], "--watch must be a number of seconds"),  # was: OverflowError traceback
    (["--watch", "1e10", "--count", "1"], "--watch must be a number of seconds"),
    (["--watch", "-1"], "--watch must be a number of seconds"),
    (["--watch", "1", "--count", "0"], "must be >= 1"),  # was: exit 0, nothing shown
    (["--count", "3"], "--watch is not given"),  # was: --count silently ignored
])
def test_gpus_odd_watch_and_count_values(args, needle):
    bad_input(["gpus", *args], needle)


# --- cache remote: --timeout, pull's deadline, a database that is not a number -----------------------
@pytest.mark.parametrize("command", [["status"], ["verify"], ["push", "."], ["pull"], ["clear"]])
@pytest.mark.parametrize("value", ["inf", "1e10"])
def test_remote_timeout_out_of_range_is_bad_input(command, value, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    make_cache(tmp_path / "c")
    if command == ["push", "."]:
        command = ["push", str(tmp_path / "c")]
    # was: OverflowError traceback in the deadline's watchdog thread (status/verify/push/clear)
    bad_input(["cache", "remote", *command, "redis://127.0.0.1:1/0", "--timeout", value], "--timeout must be")


def test_remote_pull_keeps_its_timeout(tmp_path):
    """`pull --timeout` was accepted and ignored: pull connected with the 60 s default deadline."""
    from tests.test_remote_bounds import DripServer

    with DripServer() as srv:
        r = invoke(app, ["cache", "remote", "pull", srv.url, "--dir", str(tmp_path / "c"), "--timeout", "1.5"])
    out = r.stdout + r.stderr
    assert r.exit_code == 2 and "Traceback" not in out, out
    assert "network deadline (1.5 s" in out, out
    assert not (tmp_path / "c").exists()


@pytest.mark.parametrize("url", ["redis://127.0.0.1:1/cache", "redis://127.0.0.1:1/0x1", "rediss://h:1/db 2"])
def test_remote_url_with_a_database_that_is_not_a_number(url):
    # redis-py (and torch) silently use database 0 for these: the user meant another one
    bad_input(["cache", "remote", "status", url], "is not a number")
    bad_input(["cache", "remote", "status", "--url", url], "is not a number")


def test_remote_url_database_number_is_fine():
    from compilewatch.cache.remote import server

    for url in ("redis://h:1", "redis://h:1/", "redis://h:1/3", "unix:///tmp/redis.sock", "rediss://:pw@h/12"):
        server.check_db(url)  # no BadInput


# --- one file for two outputs -------------------------------------------------------------------------
def test_timeline_output_onto_its_own_report_is_refused(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    report = tmp_path / "watch.jsonl"
    report.write_text('{"schema_version": 1, "seq": 1, "kind": "start", "time": 1.0, "pid": 1}\n')
    before = report.read_bytes()
    (tmp_path / "link.json").symlink_to(report)
    for out in ("watch.jsonl", "./watch.jsonl", str(report), "link.json"):
        bad_input(["timeline", "watch.jsonl", "-o", out], "is the report itself")
    assert report.read_bytes() == before  # was: the report replaced by the timeline, exit 0


def test_run_report_and_timeline_on_one_file_is_refused(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    marker = tmp_path / "ran"
    bad_input(["run", "--report", "w.jsonl", "--timeline", "./w.jsonl", "--",
               sys.executable, "-c", f"open({str(marker)!r}, 'w')"], "--report and --timeline are the same file")
    assert not marker.exists() and not (tmp_path / "w.jsonl").exists()  # refused before the program ran


def test_watcher_report_and_timeline_on_one_file_is_refused(tmp_path):
    from compilewatch.tracing.watcher import Watcher

    with pytest.raises(BadInput, match="same file"):
        Watcher(report=tmp_path / "w.jsonl", timeline=str(tmp_path / "w.jsonl"))
    with pytest.raises(BadInput, match="stall_after"):
        Watcher(stall_after=float("nan"))


def test_run_stall_after_nan_is_refused():
    # was: accepted, and stall detection silently never fired (nan compares false)
    bad_input(["run", "--stall-after", "nan", "--", "true"], "--stall-after must be > 0")


# --- cache explain --against a dir that is not a cache ------------------------------------------------
def test_explain_against_a_dir_that_is_not_a_cache(tmp_path):
    here = make_cache(tmp_path / "inductor-cache")
    other = tmp_path / "repo"
    (other / "src").mkdir(parents=True)
    (other / "README.md").write_text("not a cache\n")
    # was: exit 0, "0 of 0 entries would hit here"
    bad_input(["cache", "explain", "--against", str(other), "--dir", str(here)], "does not look like an inductor cache")
    (tmp_path / "empty").mkdir()  # an empty dir is still fine: nothing in it would hit
    assert invoke_json(app, ["cache", "explain", "--against", str(tmp_path / "empty"), "--dir", str(here)])["entries"] == 0


# --- warm / probe: a backend torch does not know; -m MODULE that does not exist ------------------------
def test_warm_unknown_backend_is_bad_input():
    # was: torch._dynamo.exc.InvalidBackend traceback from inside the first compile
    bad_input(["warm", "--devices", "cpu", "--workload", "compile", "--backend", "bogus"],
              "unknown torch.compile backend 'bogus'")


def test_probe_unknown_backend_is_bad_input():
    # was: exit 0 (create_block_mask never compiles) or 1 (a failed "compile" probe)
    bad_input(["probe", "create_block_mask", "--backend", "bogus"], "unknown torch.compile backend 'bogus'")


def test_warm_handoff_to_a_missing_module_is_refused_before_warming(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(BadInput, match="module 'nosuchmod_cw_xyz' not found"):
        handoff.plan(["-m", "nosuchmod_cw_xyz"])
    with pytest.raises(BadInput, match="not found"):
        handoff.plan([sys.executable, "-m", "nosuchmod_cw_xyz.train"])
    (tmp_path / "localpkg").mkdir()  # found in the current dir, as `python -m` finds it
    (tmp_path / "localpkg" / "__main__.py").write_text("")
    assert handoff.plan(["-m", "localpkg"]).mode == "in-process"
    assert handoff.plan(["-m", "json.tool"]).target == "json.tool"
    # was: the warm ran, then runpy's ImportError traceback (exit 1)
    r = bad_input(["warm", "--devices", "cpu", "--workload", "compile", "--backend", "eager", "--",
                   "-m", "nosuchmod_cw_xyz"], "not found")
    assert "warming" not in r.stderr


# --- clear / load / pull on a cache dir that is a symlink ---------------------------------------------
@pytest.mark.parametrize("args", [
    ["cache", "clear"],  # was: the link renamed to <link>.backup-*, a "backup" its own restore command refused
    ["cache", "clear", "--no-backup", "--yes"],  # was: the link renamed away, then an rmtree OSError traceback
    ["cache", "load", "ARCHIVE"],  # was: the link replaced by a dir, the old cache "backed up" as a link
    ["cache", "remote", "pull", "redis://127.0.0.1:1/0"],
])
def test_a_symlinked_cache_dir_is_refused_by_what_renames_it(args, tmp_path):
    from compilewatch.cache.archive import save as archive_save

    real = make_cache(tmp_path / "real cache")
    link = tmp_path / "link"
    link.symlink_to(real)
    archive = archive_save.save(tmp_path / "a.tar", make_cache(tmp_path / "src")).archive
    args = [str(archive) if a == "ARCHIVE" else a for a in args]
    before = {p.name for p in tmp_path.iterdir()}
    bad_input([*args, "--dir", str(link)], "is a symlink to", f"--dir '{real}'")
    assert link.is_symlink() and {p.name for p in tmp_path.iterdir()} - {f".{link.name}.compilewatch.lock"} == before
    assert (real / "fxgraph").is_dir()
    assert invoke(app, ["cache", "fingerprint", "--dir", str(link)]).exit_code == 0  # reading through it is fine


# --- TORCHINDUCTOR_CACHE_DIR that is a file ------------------------------------------------------------
@pytest.mark.parametrize("args", [
    ["doctor"],
    ["warm", "--devices", "cpu", "--workload", "compile", "--backend", "eager"],
    ["probe", "compile", "--backend", "eager"],
])
@pytest.mark.parametrize("under", [False, True])
def test_a_cache_dir_env_that_names_a_file(args, under, tmp_path, monkeypatch):
    """Was: FileExistsError / NotADirectoryError traceback from torch's os.makedirs while importing
    torch._dynamo (torch 2.13 resolves its cache dir at import)."""
    f = tmp_path / "notes.txt"
    f.write_text("mine\n")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(f / "cache" if under else f))
    bad_input(args, "TORCHINDUCTOR_CACHE_DIR", "lies under" if under else "is a file")
    assert f.read_text() == "mine\n"


def test_check_cache_dir_usable_accepts_missing_and_existing_dirs(tmp_path, monkeypatch):
    from compilewatch import torchinfo

    for d in (tmp_path / "new" / "deeper", tmp_path):
        monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(d))
        torchinfo.check_cache_dir_usable()
    assert not (tmp_path / "new").exists()  # only stats: nothing created


@pytest.mark.parametrize("command", [["status"], ["verify"], ["pull"]])
def test_remote_max_value_past_what_redis_takes_is_bad_input(command, tmp_path, monkeypatch):
    """Was: Redis refused the GETRANGE ("value is not an integer or out of range"), reported as "the server
    failed during status ... run it again when the server is back"."""
    monkeypatch.chdir(tmp_path)
    bad_input(["cache", "remote", *command, "redis://127.0.0.1:1/0", "--max-value", "99999999999999999999999G"],
              "--max-value", "at most 1T")


# --- commands printed for the user to paste, on paths with spaces ---------------------------------------
def test_the_restore_command_of_clear_pastes_on_a_path_with_spaces(tmp_path):
    """Was: `compilewatch cache load /x/my cache.backup-... --dir /x/my cache` (unquoted: four arguments)."""
    import shlex

    root = make_cache(tmp_path / "my cachë dir")
    c = invoke_json(app, ["cache", "clear", "--dir", str(root)])
    argv = shlex.split(c["restore_command"])
    assert argv[:3] == ["compilewatch", "cache", "load"] and argv[3:] == [c["backup"], "--dir", str(root)]
    r = invoke(app, argv[1:])
    assert r.exit_code == 0, r.stderr
    assert (root / "fxgraph").is_dir()


def test_where_says_a_file_is_not_a_directory(tmp_path):
    f = tmp_path / "notes.txt"
    f.write_text("x")
    r = invoke(app, ["cache", "where", "--dir", str(f)])
    assert r.exit_code == 0 and "not a directory" in r.stdout and "does not exist" not in r.stdout
