"""cache save / load: round trips, compatibility refusal, corrupt archives, interrupted save and load."""

from __future__ import annotations

import io
import json
import os
import tarfile
from pathlib import Path

import pytest

from compilewatch import torchinfo
from compilewatch.cache.archive import load as archive_load
from compilewatch.cache.archive import reader
from compilewatch.cache.archive import save as archive_save
from compilewatch.cache.content import fingerprint as fp_mod
from compilewatch.cache.content import verify as verify_mod
from compilewatch.cache.trust import provenance
from compilewatch.errors import BadInput
from tests.cache_helpers import OTHER_KEY, make_cache, moved, noise, tree, write


def siblings(path) -> set[str]:
    return set(os.listdir(path))


def test_round_trip_keeps_content_and_mtimes(tmp_path):
    src = make_cache(tmp_path / "src")
    res = archive_save.save(tmp_path / "a.tar.gz", src)
    assert res.files == fp_mod.fingerprint(src).files and res.compression == "gzip"
    assert res.content_hash == fp_mod.fingerprint(src).content_hash
    assert oct(os.stat(tmp_path / "a.tar.gz").st_mode & 0o777) != "0o600"
    loaded = archive_load.load(tmp_path / "a.tar.gz", tmp_path / "dst")
    assert loaded.backup is None and loaded.files == res.files
    assert loaded.paths_rewritten == 1  # the triton group file now names dst's kernel folder
    assert tree(tmp_path / "dst") == moved(tree(src), src, tmp_path / "dst")
    f = next((tmp_path / "dst").glob("fxgraph/*/*/*"))
    assert int(f.stat().st_mtime) == 1_700_000_000
    dst_fp = fp_mod.fingerprint(tmp_path / "dst")
    assert [s.content_hash for s in dst_fp.subcaches if s.name != "triton"] == \
        [s.content_hash for s in fp_mod.fingerprint(src).subcaches if s.name != "triton"]
    assert verify_mod.verify(tmp_path / "dst").counts == {}  # no `relocated` warnings


def test_loading_at_the_same_path_changes_no_byte(tmp_path):
    src = make_cache(tmp_path / "src")
    before = fp_mod.fingerprint(src).content_hash
    archive_save.save(tmp_path / "a.tar", src)
    res = archive_load.load(tmp_path / "a.tar", src)
    assert res.paths_rewritten == 0 and fp_mod.fingerprint(src).content_hash == before


def test_header_and_manifest(tmp_path):
    src = make_cache(tmp_path / "src")
    archive_save.save(tmp_path / "a.tar", src)
    h = reader.read_header(tmp_path / "a.tar")
    assert h.system_key == torchinfo.system_key() and h.compression == "none"
    assert h.env["torch"]["version"] == torchinfo.torch_module().__version__
    m = reader.read_manifest(tmp_path / "a.tar")
    assert m.entries is not None and len(m.entries) == m.files
    with tarfile.open(tmp_path / "a.tar") as t:
        names = t.getnames()
    assert names[0] == reader.HEADER and names[-2:] == [reader.MANIFEST, provenance.SIGNATURE]
    assert not any(".compilewatch" in n for n in names)


def test_load_over_existing_cache_keeps_a_backup(tmp_path):
    src = make_cache(tmp_path / "src")
    archive_save.save(tmp_path / "a.tar.gz", src)
    dst = make_cache(tmp_path / "dst", n_fx=1, n_codegen=1, triton=False)
    old = tree(dst)
    res = archive_load.load(tmp_path / "a.tar.gz", dst)
    assert res.backup and os.path.basename(res.backup).startswith("dst.backup-")
    assert tree(tmp_path / os.path.basename(res.backup)) == old
    assert tree(dst) == moved(tree(src), src, dst)


def test_archive_for_another_system_is_refused_unless_forced(tmp_path, monkeypatch):
    src = make_cache(tmp_path / "src")
    with monkeypatch.context() as m:
        m.setattr(torchinfo, "system_key", lambda: OTHER_KEY)
        archive_save.save(tmp_path / "foreign.tar.gz", src)
    dst = make_cache(tmp_path / "dst", n_fx=1, triton=False)
    before = tree(dst)
    with pytest.raises(BadInput, match="system key differs"):
        archive_load.load(tmp_path / "foreign.tar.gz", dst)
    assert tree(dst) == before and siblings(tmp_path) == {"src", "dst", "foreign.tar.gz", ".src.compilewatch.lock"}
    res = archive_load.load(tmp_path / "foreign.tar.gz", dst, force=True)
    assert res.forced and any("system key differs" in m for m in res.mismatches)
    assert tree(dst) == moved(tree(src), src, dst)


@pytest.mark.parametrize("make_bad, match", [
    (lambda p: p.write_bytes(noise(5000, seed=41)), "not a readable"),
    (lambda p: p.write_bytes(b""), "not a"),
    (lambda p: _plain_tar(p, {"hello.txt": b"hi"}), "no compilewatch-archive.json"),
])
def test_unreadable_archives_are_bad_input(tmp_path, make_bad, match):
    bad = tmp_path / "bad.tar.gz"
    make_bad(bad)
    dst = make_cache(tmp_path / "dst", n_fx=1, triton=False)
    before = tree(dst)
    with pytest.raises(BadInput, match=match):
        archive_load.load(bad, dst)
    assert tree(dst) == before


def _plain_tar(path, members: dict[str, bytes]):
    with tarfile.open(path, "w:gz") as t:
        for name, data in members.items():
            ti = tarfile.TarInfo(name)
            ti.size = len(data)
            t.addfile(ti, io.BytesIO(data))


def _rewrite(src, dst, edit):
    """Copy archive `src` to `dst` (plain tar), passing each member's bytes through edit(name, data)."""
    with tarfile.open(src) as tin, tarfile.open(dst, "w") as tout:
        for m in tin.getmembers():
            data = tin.extractfile(m).read()
            new = edit(m.name, data)
            if new is None:
                continue
            m.size = len(new)
            tout.addfile(m, io.BytesIO(new))


@pytest.mark.parametrize("edit, match", [
    (lambda n, d: d[:-1] + b"!" if n.startswith("cache/fxgraph") else d, "damaged"),
    (lambda n, d: None if n == reader.MANIFEST else d, "cut short"),
    (lambda n, d: None if n.startswith("cache/aotautograd") else d, "missing"),
])
def test_tampered_archives_are_refused_and_leave_no_temp_dir(tmp_path, edit, match):
    src = make_cache(tmp_path / "src")
    archive_save.save(tmp_path / "a.tar", src)
    _rewrite(tmp_path / "a.tar", tmp_path / "bad.tar", edit)
    dst = make_cache(tmp_path / "dst", n_fx=1, triton=False)
    before, before_sib = tree(dst), siblings(tmp_path)
    with pytest.raises(BadInput, match="foreign"):  # what was signed no longer matches: provenance first
        archive_load.load(tmp_path / "bad.tar", dst)
    with pytest.raises(BadInput, match=match):  # with --trust, the structural checks still hold
        archive_load.load(tmp_path / "bad.tar", dst, trust=True)
    assert tree(dst) == before and siblings(tmp_path) == before_sib


def test_path_traversal_member_is_refused(tmp_path):
    src = make_cache(tmp_path / "src")
    archive_save.save(tmp_path / "a.tar", src)

    with tarfile.open(tmp_path / "a.tar") as tin, tarfile.open(tmp_path / "evil.tar", "w") as tout:
        for m in tin.getmembers():
            tout.addfile(m, tin.extractfile(m))
            if m.name == reader.HEADER:
                evil = tarfile.TarInfo("cache/../../escaped")
                evil.size = 3
                tout.addfile(evil, io.BytesIO(b"bad"))
    with pytest.raises(BadInput, match="foreign"):
        archive_load.load(tmp_path / "evil.tar", tmp_path / "dst")
    with pytest.raises(BadInput, match="unexpected member"):
        archive_load.load(tmp_path / "evil.tar", tmp_path / "dst", trust=True)
    assert not (tmp_path / "escaped").exists() and not (tmp_path.parent / "escaped").exists()
    assert not (tmp_path / "dst").exists()


def test_interrupted_save_leaves_no_half_archive(tmp_path, monkeypatch):
    src = make_cache(tmp_path / "src")
    calls = {"n": 0}
    real = archive_save._add_file

    def flaky(tar, root, f):
        calls["n"] += 1
        if calls["n"] == 5:
            raise KeyboardInterrupt  # Ctrl-C in the middle of writing
        return real(tar, root, f)

    monkeypatch.setattr(archive_save, "_add_file", flaky)
    before = siblings(tmp_path)
    with pytest.raises(KeyboardInterrupt):
        archive_save.save(tmp_path / "a.tar.gz", src)
    assert siblings(tmp_path) == before | {".src.compilewatch.lock"}  # no archive, no temp file
    # an existing archive is not touched by a failed overwrite either
    monkeypatch.setattr(archive_save, "_add_file", real)
    archive_save.save(tmp_path / "a.tar.gz", src)
    good = (tmp_path / "a.tar.gz").read_bytes()
    calls["n"] = 0
    monkeypatch.setattr(archive_save, "_add_file", flaky)
    with pytest.raises(KeyboardInterrupt):
        archive_save.save(tmp_path / "a.tar.gz", src, overwrite=True)
    assert (tmp_path / "a.tar.gz").read_bytes() == good


def test_interrupted_extraction_leaves_cache_untouched(tmp_path, monkeypatch):
    src = make_cache(tmp_path / "src")
    archive_save.save(tmp_path / "a.tar.gz", src)
    dst = make_cache(tmp_path / "dst", n_fx=1, triton=False)
    before, before_sib = tree(dst), siblings(tmp_path)
    calls = {"n": 0}
    real_utime = os.utime

    def flaky_utime(*a, **k):
        calls["n"] += 1
        if calls["n"] == 4:
            raise KeyboardInterrupt
        return real_utime(*a, **k)

    monkeypatch.setattr(archive_load.os, "utime", flaky_utime)
    with pytest.raises(KeyboardInterrupt):
        archive_load.load(tmp_path / "a.tar.gz", dst)
    monkeypatch.setattr(archive_load.os, "utime", real_utime)
    assert tree(dst) == before
    assert siblings(tmp_path) == before_sib  # the temp extraction dir is gone


def test_failed_swap_puts_the_old_cache_back(tmp_path, monkeypatch):
    src = make_cache(tmp_path / "src")
    archive_save.save(tmp_path / "a.tar.gz", src)
    dst = make_cache(tmp_path / "dst", n_fx=1, triton=False)
    before = tree(dst)
    real_rename = os.rename

    def rename(a, b):
        if ".load-" in str(a):  # the step that moves the extracted dir into place
            raise OSError(28, "No space left on device")
        return real_rename(a, b)

    monkeypatch.setattr(archive_load.os, "rename", rename)
    with pytest.raises(OSError):
        archive_load.load(tmp_path / "a.tar.gz", dst)
    monkeypatch.setattr(archive_load.os, "rename", real_rename)
    assert tree(dst) == before
    assert not [n for n in os.listdir(tmp_path) if ".load-" in n or ".backup-" in n]


def test_save_bad_inputs(tmp_path):
    src = make_cache(tmp_path / "src")
    with pytest.raises(BadInput, match="unknown archive type"):
        archive_save.save(tmp_path / "a.zip", src)
    archive_save.save(tmp_path / "a.tgz", src)
    with pytest.raises(BadInput, match="already exists"):
        archive_save.save(tmp_path / "a.tgz", src)
    with pytest.raises(BadInput, match="inside the cache"):
        archive_save.save(src / "x.tar", src)
    with pytest.raises(BadInput, match="does not exist"):
        archive_save.save(tmp_path / "b.tar", tmp_path / "missing")
    if reader._zstd_module()[0] is None:
        with pytest.raises(BadInput, match="zstd"):
            archive_save.save(tmp_path / "a.tar.zst", src)
    else:
        archive_save.save(tmp_path / "a.tar.zst", src)
        assert reader.read_header(tmp_path / "a.tar.zst").compression == "zstd"


def test_load_refuses_a_target_that_is_not_a_cache(tmp_path):
    src = make_cache(tmp_path / "src")
    archive_save.save(tmp_path / "a.tar", src)
    proj = tmp_path / "project"
    write(proj, "README.md", "mine")
    write(proj, "src/main.py", "print()")
    with pytest.raises(BadInput, match="does not look like an inductor cache"):
        archive_load.load(tmp_path / "a.tar", proj)
    assert (proj / "README.md").read_text() == "mine"


def test_restore_backup_dir_by_rename(tmp_path):
    from compilewatch.cache.local import manage

    made = make_cache(tmp_path / "old")
    made_tree = tree(made)
    old = Path(manage.clear(made).backup)  # a backup compilewatch made (a dir is trusted by that record)
    cur = make_cache(tmp_path / "cache", n_fx=1, triton=False)
    res = archive_load.load(old, cur)
    assert tree(cur) == moved(made_tree, made, cur) and not old.exists() and res.paths_rewritten == 1
    assert res.backup and tree(tmp_path / os.path.basename(res.backup))
    assert res.provenance.verdict == "own" and res.provenance.kind == "dir"


def test_restore_dir_with_foreign_entries_is_refused(tmp_path):
    old = make_cache(tmp_path / "old", system_key=OTHER_KEY)
    with pytest.raises(BadInput, match="no entry was built for this machine"):
        archive_load.load(old, tmp_path / "cache")
    assert old.is_dir() and not (tmp_path / "cache").exists()


def test_manifest_json_is_valid_fingerprint(tmp_path):
    src = make_cache(tmp_path / "src")
    archive_save.save(tmp_path / "a.tar", src)
    with tarfile.open(tmp_path / "a.tar") as t:
        data = json.loads(t.extractfile(reader.MANIFEST).read())
    assert fp_mod.from_json(data).content_hash == fp_mod.fingerprint(src).content_hash


def test_restore_refuses_nested_dirs(tmp_path):
    cur = make_cache(tmp_path / "cache")
    inner = make_cache(cur / "fxgraph" / "nested")
    before = tree(cur)
    with pytest.raises(BadInput, match="nested"):
        archive_load.load(inner, cur)
    assert tree(cur) == before


def test_a_failing_mega_cache_does_not_fail_the_save(tmp_path, monkeypatch):
    src = make_cache(tmp_path / "src")

    def boom(root, entries):
        raise RuntimeError("torch internals changed")

    monkeypatch.setattr(archive_save, "mega_cache_from_dir", boom)
    res = archive_save.save(tmp_path / "a.tar", src)
    assert res.mega_cache is None and any("Mega-Cache left out" in w for w in res.warnings)
    assert archive_load.load(tmp_path / "a.tar", tmp_path / "dst").files == res.files


def test_a_job_recreating_the_dir_mid_swap_keeps_the_old_cache_safe(tmp_path, monkeypatch):
    from compilewatch.errors import CompilewatchError

    src = make_cache(tmp_path / "src")
    archive_save.save(tmp_path / "a.tar", src)
    dst = make_cache(tmp_path / "dst", n_fx=1, triton=False)
    before = tree(dst)
    real_rename = os.rename

    def rename(a, b):
        if ".load-" in str(a):  # between the two renames, a training job writes into a fresh dst/
            write(dst, "fxgraph/zz/fnew/e", b"\x80new.")
        return real_rename(a, b)

    monkeypatch.setattr(archive_load.os, "rename", rename)
    with pytest.raises(CompilewatchError, match="recreated by another process") as e:
        archive_load.load(tmp_path / "a.tar", dst)
    monkeypatch.setattr(archive_load.os, "rename", real_rename)
    backup = [n for n in os.listdir(tmp_path) if n.startswith("dst.backup-")]
    assert len(backup) == 1 and tree(tmp_path / backup[0]) == before
    assert backup[0] in e.value.message
    assert not [n for n in os.listdir(tmp_path) if ".load-" in n]
