"""First-hour fixes of session 14 (compilewatch): `probe --timeline` says where the timeline went, a
fingerprint file is never written into the cache it describes, `run` says why a program cannot start
before anything starts, pushing an empty cache dir says so, and the race demo of docs/probe.md fails the
same threads in every run."""

from __future__ import annotations

import json
import os

from cli.main import app
from compilewatch.tracing import torchcompat
from tests.cache_helpers import make_cache
from tests.helpers import invoke, invoke_json
from tests.limits import cli, one_clear_line


def test_probe_timeline_names_the_file_it_wrote(tmp_path):
    out = tmp_path / "probe.json"
    res = invoke(app, ["probe", "compile", "--backend", "aot_eager", "--timeline", str(out)])
    assert res.exit_code == 0, res.stderr
    assert f"timeline: {out} (open it in https://ui.perfetto.dev)" in " ".join(res.stderr.split())
    assert json.loads(out.read_text())["traceEvents"]


def test_a_fingerprint_file_inside_the_cache_it_describes_is_refused(tmp_path):
    """`-o CACHE/fp.json` added a file to the cache it fingerprinted (the next fingerprint differed)."""
    cache = tmp_path / "cache"
    make_cache(cache)
    before = sorted(p.relative_to(cache) for p in cache.rglob("*"))
    link = tmp_path / "link"
    link.symlink_to(cache)
    for target in (cache / "fp.json", cache / "fxgraph" / "fp.json", link / "fp.json"):
        res = invoke(app, ["cache", "fingerprint", "--dir", str(cache), "-o", str(target)])
        assert res.exit_code == 2 and "Traceback" not in res.stderr, res.stderr
        assert "would be written inside the cache it describes" in " ".join(res.stderr.split())
    assert sorted(p.relative_to(cache) for p in cache.rglob("*")) == before
    ok = invoke_json(app, ["cache", "fingerprint", "--dir", str(cache), "-o", str(tmp_path / "fp.json")])
    assert ok["files"] > 0 and json.loads((tmp_path / "fp.json").read_text())["content_hash"] == ok["content_hash"]


def test_an_archive_inside_the_cache_is_refused_through_a_link_too(tmp_path):
    cache = tmp_path / "cache"
    make_cache(cache)
    link = tmp_path / "link"
    link.symlink_to(cache)
    res = invoke(app, ["cache", "save", str(link / "a.tar.gz"), "--dir", str(cache)])
    assert res.exit_code == 2 and "would be written inside the cache" in " ".join(res.stderr.split()), res.stderr
    assert not (cache / "a.tar.gz").exists()


def test_run_says_why_a_program_cannot_start_before_it_starts(tmp_path):
    (tmp_path / "notes.txt").write_text("hello\n")
    (tmp_path / "script").write_text("echo hi\n")  # no #! line
    (tmp_path / "script").chmod(0o755)
    (tmp_path / "plain.py").write_text("print('hi')\n")
    (tmp_path / "plain.py").chmod(0o644)
    cases = {
        "notes.txt": "is not a command on PATH",  # a name without '/': looked up on PATH only
        str(tmp_path / "missing"): "no such file",
        str(tmp_path): "is a directory, not a program",
        str(tmp_path / "plain.py"): "is not executable",
        "./script": "is not a program this system can run",
    }
    for prog, words in cases.items():
        o = cli("run", "--", prog, timeout=60, cwd=tmp_path)
        one_clear_line(o, words=words)
    o = cli("run", "--", "notes.txt", timeout=60, cwd=tmp_path)
    assert "./notes.txt" in o.stderr and "-- python notes.txt" in o.stderr


def test_pushing_an_empty_cache_dir_says_it_holds_nothing(tmp_path, redis_url):
    empty = tmp_path / "ic"
    empty.mkdir()
    res = invoke(app, ["cache", "remote", "push", str(empty), redis_url])
    assert res.exit_code == 0, res.stderr
    assert f"nothing: {empty} holds no FX-graph or AOTAutograd entries" in " ".join(res.stdout.split())
    assert os.listdir(empty) == [] or all(n.startswith(".") for n in os.listdir(empty))


def test_the_race_demo_has_the_same_outcome_in_every_run(tmp_path):
    """docs/examples/race_target.py: worker-0 holds a symbolic_trace open until every other thread has called
    the compiled function once more. Its waits counted the live threads each time, so once a thread that had
    called (and failed) exited, the trace could end before a slower thread's call, which then passed: one or
    two failures from run to run. Counted once now: with the module-global FX flag every other thread fails,
    with the per-thread flag every one passes; three runs of 2 and 4 threads, each in its own process."""
    demo = str(__import__("pathlib").Path(__file__).resolve().parents[1] / "docs" / "examples" / "race_target.py")
    per_thread = torchcompat.fx_flag_layout().kind == "thread_local"
    for n in (2, 4, 4):
        # no address-space cap: the matrix's CUDA wheels map more than the default 1 GiB at import
        o = cli("probe", f"{demo}:run", "--threads", str(n), "--json", timeout=240, cwd=tmp_path, mem=None)
        outcomes = [t["outcome"] for t in json.loads(o.stdout)["threads"]]
        assert outcomes == ["ok"] + ["ok" if per_thread else "error"] * (n - 1), (outcomes, o.stderr[-2000:])
        assert o.rc == (0 if per_thread else 1)


def test_no_output_file_replaces_a_fifo_or_device(tmp_path):
    """Every `-o` writes a temp file and renames it over the target: as root `lock -o /dev/null` made
    /dev/null a regular file. The one atomic write (compilewatch.fsutil) refuses such a target now."""
    import stat

    from compilewatch import atomic_write_text
    from compilewatch.errors import WriteFailed

    cache = tmp_path / "cache"
    make_cache(cache)
    fifo = tmp_path / "out.fifo"
    os.mkfifo(fifo)
    res = invoke(app, ["cache", "fingerprint", "--dir", str(cache), "-o", str(fifo)])
    assert res.exit_code == 2 and "it is a FIFO" in " ".join(res.stderr.split()), res.stderr
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)
    try:
        atomic_write_text(fifo, "x")
    except WriteFailed as e:
        assert "nothing was written" in e.message
    else:
        raise AssertionError("a FIFO was replaced")
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode) and not list(tmp_path.glob(".out.fifo.*"))


def test_run_with_its_own_stdout_closed_passes_the_programs_exit_code_through(tmp_path):
    """`compilewatch run -- prog >&-`: sys.stdout is None in such a process; the summary's flush was an
    AttributeError traceback and exit 1 instead of the program's 7."""
    import shlex
    import subprocess
    import sys

    me = f"{shlex.quote(sys.executable)} -c 'from cli.main import main; main()'"
    prog = f"{shlex.quote(sys.executable)} -c 'import sys; sys.exit(7)'"
    for flags in ("", "--json"):
        p = subprocess.run(["bash", "-c", f"exec >&-; {me} run {flags} -- {prog}"], capture_output=True, text=True,
                           cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(__import__("pathlib").Path(__file__)
                                                                               .resolve().parents[1])}, timeout=120)
        assert p.returncode == 7 and "Traceback" not in p.stderr, (flags, p.returncode, p.stderr[-2000:])


def test_a_huge_device_list_is_named_in_part():
    from compilewatch.devices.spec import normalize_device
    from compilewatch.errors import BadInput

    try:
        normalize_device("x" * 3000)
    except BadInput as e:
        assert len(e.message) < 200 and e.message.startswith("unknown device 'xxx")
    else:
        raise AssertionError("accepted")


def test_findings_with_markup_in_a_key_are_shown_as_text(capsys):
    """A Redis key or a file name holding rich markup (`[/]`, `[red]x[/]`) was read as markup in `verify`'s
    table: a MarkupError traceback, or a key shown as something it is not."""
    from dataclasses import dataclass

    from cli.cache_render import print_findings

    @dataclass
    class F:
        severity: str
        kind: str
        key: str
        detail: str

    print_findings([F("error", "malformed", "pt2:x[/]", "bad [red]value[/]")], "key")
    out = " ".join(capsys.readouterr().out.split())
    assert "pt2:x[/]" in out and "bad [red]value[/]" in out
