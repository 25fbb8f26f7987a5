"""`cache load DIR`: a directory is not signed, so it is trusted only as a backup compilewatch recorded
making on this machine (compilewatch/cache/backups.py); any other dir needs --trust, and every pickle
in a dir is scanned before it is renamed into place, as an archive's are."""

from __future__ import annotations

import os
import pickle
import shutil
from pathlib import Path

import pytest

from cli.main import app
from compilewatch.cache.archive import load as archive_load
from compilewatch.cache.archive import save as archive_save
from compilewatch.cache.local import manage
from compilewatch.cache.trust import backups, provenance
from compilewatch.errors import BadInput
from tests.cache_helpers import make_cache, moved, tree, write
from tests.helpers import invoke


class _RunsCode:
    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _backup(tmp_path, name="old") -> tuple[Path, dict]:
    """A backup made by `cache clear` (recorded), and the tree it held."""
    made = make_cache(tmp_path / name, triton=False)
    t = tree(made)
    return Path(manage.clear(made).backup), t


def _untouched(cur: Path, before: dict, src: Path, src_before: dict) -> None:
    assert tree(cur) == before and src.is_dir() and tree(src) == src_before


def test_a_backup_compilewatch_made_is_own_and_restores(tmp_path):
    old, t = _backup(tmp_path)
    cur = make_cache(tmp_path / "cache", n_fx=1, triton=False)
    res = archive_load.load(old, cur)
    assert res.provenance.verdict == "own" and res.provenance.kind == "dir" and not res.provenance.trusted_by_flag
    assert res.provenance.summary.startswith("made here: a backup of") and res.trusted_pickles == ()
    assert tree(cur) == t and not old.exists()


def test_the_cache_a_load_moved_aside_is_recorded_too(tmp_path):
    src = make_cache(tmp_path / "src", triton=False)
    archive_save.save(tmp_path / "a.tar", src)
    cur = make_cache(tmp_path / "cache", n_fx=1, triton=False)
    before = tree(cur)
    res = archive_load.load(tmp_path / "a.tar", cur)
    assert backups.recorded(res.backup) is not None
    back = archive_load.load(res.backup, cur)  # undo the load: no --trust needed
    assert back.provenance.verdict == "own" and tree(cur) == before


def test_a_dir_compilewatch_did_not_make_is_foreign_unless_trust(tmp_path):
    other = make_cache(tmp_path / "someone-elses", triton=False)
    cur = make_cache(tmp_path / "cache", n_fx=1, triton=False)
    before, other_before = tree(cur), tree(other)
    with pytest.raises(BadInput, match="is foreign .*not a backup compilewatch made on this machine") as e:
        archive_load.load(other, cur)
    assert "--trust" in e.value.hint
    _untouched(cur, before, other, other_before)
    res = archive_load.load(other, cur, trust=True)
    assert res.provenance.verdict == "foreign" and res.provenance.trusted_by_flag
    assert provenance.CODE_WARNING in res.warnings and tree(cur) == other_before


def test_a_copy_of_a_backup_is_not_the_backup(tmp_path):
    old, _ = _backup(tmp_path)
    copy = tmp_path / "copied.backup"
    shutil.copytree(old, copy)  # same content, another inode: nothing says who filled it
    with pytest.raises(BadInput, match="not a backup compilewatch made"):
        archive_load.load(copy, tmp_path / "cache")
    assert archive_load.load(old, tmp_path / "cache").provenance.verdict == "own"


def test_a_new_dir_at_a_recorded_path_is_not_the_backup(tmp_path):
    old, _ = _backup(tmp_path)
    shutil.rmtree(old)
    make_cache(old, triton=False)  # someone puts a dir where the backup was
    with pytest.raises(BadInput, match="not a backup compilewatch made"):
        archive_load.load(old, tmp_path / "cache")


def test_a_backup_others_can_write_is_foreign(tmp_path):
    old, _ = _backup(tmp_path)
    f = next(old.glob("fxgraph/*/*/*"))
    os.chmod(f, 0o666)
    with pytest.raises(BadInput, match="others can change it: .*writable by everyone"):
        archive_load.load(old, tmp_path / "cache")


def test_a_pickle_planted_in_a_backup_is_refused_before_the_rename(tmp_path):
    old, _ = _backup(tmp_path)
    marker = tmp_path / "ran"
    key = "fevil" + "e" * 47
    write(old, f"fxgraph/{key[1:3]}/{key}/entry", pickle.dumps(_RunsCode(marker)))
    cur = make_cache(tmp_path / "cache", n_fx=1, triton=False)
    before, old_before = tree(cur), tree(old)
    with pytest.raises(BadInput, match=f"refused fxgraph/{key[1:3]}/{key}/entry: it names posix.system"):
        archive_load.load(old, cur)
    _untouched(cur, before, old, old_before)
    res = archive_load.load(old, cur, trust=True)  # the user's call: loaded, and said
    assert res.trusted_pickles and res.trusted_pickles[0].startswith(f"fxgraph/{key[1:3]}/{key}/entry")
    assert not marker.exists()  # nothing was ever unpickled


def test_a_backup_whose_record_could_not_be_written_needs_trust(tmp_path, monkeypatch):
    cfg = tmp_path / "cfg-is-a-file"
    cfg.write_text("")
    monkeypatch.setenv("COMPILEWATCH_CONFIG_DIR", str(cfg))
    made = make_cache(tmp_path / "old", triton=False)
    old = Path(manage.clear(made).backup)  # the backup itself is made
    assert old.is_dir() and not made.exists()
    with pytest.raises(BadInput, match="record of backups compilewatch made .* cannot be read|not a backup"):
        archive_load.load(old, tmp_path / "cache")
    assert archive_load.load(old, tmp_path / "cache", trust=True).provenance.trusted_by_flag


def test_cli_names_who_made_the_dir(tmp_path):
    old, _ = _backup(tmp_path)
    cur = tmp_path / "cache"
    r = invoke(app, ["cache", "load", str(old), "--dir", str(cur)])
    assert r.exit_code == 0 and "made here: a backup of" in r.stdout, r.stdout + r.stderr
    other = make_cache(tmp_path / "other", triton=False)
    r = invoke(app, ["cache", "load", str(other), "--dir", str(cur)])
    assert r.exit_code == 2 and "is foreign" in r.stderr and "Traceback" not in r.stderr
    r = invoke(app, ["cache", "load", str(other), "--dir", str(cur), "--trust"])
    assert r.exit_code == 0 and "this dir is code" in r.stdout


def test_a_backup_owned_by_another_user_is_foreign(tmp_path, monkeypatch):
    old, _ = _backup(tmp_path)
    real = os.getuid()
    monkeypatch.setattr(os, "getuid", lambda: real + 1)  # restoring as another user than the dir's owner
    p = backups.judge(old)
    assert p.verdict == "foreign" and "owned by another user" in p.reason and str(old) in p.reason


def test_the_record_stays_small(tmp_path, monkeypatch):
    monkeypatch.setattr(backups, "COMPACT_AT", 2000)
    kept, _ = _backup(tmp_path, "kept")
    for i in range(12):  # backups that are restored (or removed) leave stale lines behind
        gone, _ = _backup(tmp_path, f"c{i}")
        shutil.rmtree(gone)
    lines = backups.record_path().read_text().splitlines()
    assert len(lines) < 12 and backups.recorded(kept) is not None


def test_a_refused_load_leaves_a_backup_as_it_was_and_still_restorable(tmp_path, monkeypatch):
    """A refusal (here: a record others can change, so the backup is foreign for now) must not touch the
    dir: the fingerprint's stat index would add .compilewatch/ and change its ctime, and the recorded
    backup would be a stranger for good once the record is safe again."""
    old, t = _backup(tmp_path)
    cur = make_cache(tmp_path / "cache", n_fx=1, triton=False)
    before_ctime = os.stat(old).st_ctime_ns
    record = backups.record_path()
    mode = record.stat().st_mode & 0o777
    os.chmod(record, 0o666)
    try:
        with pytest.raises(BadInput, match="others can change"):
            archive_load.load(old, cur)
    finally:
        os.chmod(record, mode)
    assert tree(old) == t and os.stat(old).st_ctime_ns == before_ctime and not (old / ".compilewatch").exists()
    assert archive_load.load(old, cur).provenance.verdict == "own"
