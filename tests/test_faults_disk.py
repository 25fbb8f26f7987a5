"""Issue 31, writes that fail: a full disk, an unwritable place, a program that cannot run.

A full disk is made real with RLIMIT_FSIZE in the child (SIGXFSZ ignored): every write past the
limit fails with EFBIG, the same path through compilewatch.fsutil as ENOSPC (which the in-process
test raises directly, since a test cannot fill a real disk). Each case: one clear message, exit 2,
nothing half-written beside the target.
"""

from __future__ import annotations

import errno
import os
import sys

import pytest

from compilewatch import fsutil
from compilewatch.cache.archive import save as archive
from compilewatch.errors import WriteFailed
from tests.cache_helpers import make_cache
from tests.limits import cli, file_size_limit, one_clear_line


def _debris(folder, name):
    return [n for n in os.listdir(folder) if n.startswith(f".{name}.")]


def test_cache_save_on_a_full_disk_leaves_nothing(tmp_path):
    src = make_cache(tmp_path / "src", n_fx=6, n_codegen=8)
    out = tmp_path / "out"
    out.mkdir()
    with file_size_limit(4096):
        with pytest.raises(WriteFailed, match="File too large") as e:
            archive.save(out / "a.tar", src, mega=False)
    assert "nothing was written" in e.value.message and e.value.exit_code == 2
    assert os.listdir(out) == []
    assert archive.save(out / "a.tar", src, mega=False).files > 0  # and with room, it saves


def test_lock_output_on_a_full_disk_leaves_nothing(tmp_path):
    o = cli("lock", "-o", str(tmp_path / "env.lock.json"), fsize=512, timeout=60, mem=None)
    one_clear_line(o, words="cannot write")
    assert not (tmp_path / "env.lock.json").exists() and not _debris(tmp_path, "env.lock.json")


def test_atomic_writer_turns_enospc_into_one_message_and_keeps_the_old_file(tmp_path, monkeypatch):
    target = tmp_path / "report.json"
    target.write_text("old")

    def full(self, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(type(target), "write_bytes", full)
    with pytest.raises(WriteFailed, match="No space left on device") as e:
        fsutil.atomic_write_text(target, "new")
    monkeypatch.undo()
    assert e.value.exit_code == 2 and e.value.errno == errno.ENOSPC and "free some space" in e.value.hint
    assert isinstance(e.value, OSError)  # best-effort writers that tolerate OSError keep doing so
    assert target.read_text() == "old" and not _debris(tmp_path, "report.json")


def test_an_io_error_on_fsync_is_one_message(tmp_path, monkeypatch):
    def eio(fd):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(fsutil.os, "fsync", eio)
    with pytest.raises(WriteFailed, match="Input/output error"):
        fsutil.atomic_write_text(tmp_path / "x.json", "{}")
    monkeypatch.undo()
    assert os.listdir(tmp_path) == []


def test_an_oserror_that_is_not_about_the_write_passes_through(tmp_path):
    with pytest.raises(PermissionError):
        with fsutil.atomic_path(tmp_path / "x"):
            raise PermissionError(errno.EACCES, "reading a source file")
    assert os.listdir(tmp_path) == []


def test_run_timeline_on_a_full_disk_is_one_message_after_the_program(tmp_path):
    """The program ran (its exit code is lost, the message says why); nothing half-written is left."""
    tl = tmp_path / "out" / "race.json"
    tl.parent.mkdir()
    o = cli("run", "--timeline", str(tl), "--", sys.executable, "-c", "pass", fsize=64, timeout=60, mem=None,
            env=dict(os.environ, TMPDIR=str(tmp_path)))
    one_clear_line(o, words="cannot write")
    assert "File too large" in o.stderr and os.listdir(tl.parent) == []
    assert not [d for d in os.listdir(tmp_path) if d.startswith("compilewatch-run-")]  # run dir removed


@pytest.mark.parametrize("where, words", [
    ("dir", "is a directory"),
    ("under-a-file", "plain is not a directory"),
])
def test_run_report_that_cannot_be_written_refuses_before_running(tmp_path, where, words):
    marker = tmp_path / "ran"
    if where == "dir":
        report = tmp_path / "reports"
        report.mkdir()
    else:
        (tmp_path / "plain").write_text("")
        report = tmp_path / "plain" / "watch.jsonl"
    o = cli("run", "--report", str(report), "--", sys.executable, "-c", f"open({str(marker)!r}, 'w')", timeout=60)
    one_clear_line(o, words=words)
    assert not marker.exists()  # the program never ran: no hour-long run whose report is then lost


def test_run_of_a_file_that_is_not_executable_is_bad_input(tmp_path):
    prog = tmp_path / "train.py"
    prog.write_text("print('hi')\n")
    prog.chmod(0o644)
    o = cli("run", "--", str(prog), timeout=60, cwd=tmp_path)
    one_clear_line(o, words="is not executable")
    assert "-- python" in o.stderr and "chmod +x" in o.stderr
