"""What docs/cache.md promises while a training job writes the cache, checked deterministically.

The "job" writes the way torch and triton do: a temp file (`.<pid>.<tid>.tmp`) in the target folder,
then a rename onto the final name. No sleeps: each step happens at a chosen point.
"""

from __future__ import annotations

import os

from compilewatch.cache.archive import load as archive_load
from compilewatch.cache.archive import save as archive_save
from compilewatch.cache.content import fingerprint as fp_mod
from compilewatch.cache.content import verify as verify_mod
from tests.cache_helpers import make_cache, tree


def torch_style_write(path, data: bytes, *, finish: bool = True):
    """Write like torch's write_atomic: temp file beside the target, then rename (if `finish`)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{os.getpid()}.777.tmp"
    tmp.write_bytes(data)
    if finish:
        os.rename(tmp, path)
    return tmp


def test_half_written_entries_are_invisible_until_renamed(tmp_path):
    root = make_cache(tmp_path / "c")
    base = fp_mod.fingerprint(root)
    target = root / "fxgraph" / "zz" / "fzznew" / "entry"
    tmp = torch_style_write(target, b"\x80\x04half", finish=False)  # the job is mid-write
    during = fp_mod.fingerprint(root)
    assert during.content_hash == base.content_hash and during.in_flight == 1
    assert verify_mod.verify(root).ok  # a young temp file is not a finding
    res = archive_save.save(tmp_path / "during.tar", root)
    assert res.content_hash == base.content_hash  # the archive holds no half entry
    os.rename(tmp, target)  # the job finishes the write
    after = fp_mod.fingerprint(root)
    assert after.in_flight == 0 and after.files == base.files + 1 and after.content_hash != base.content_hash


def test_a_file_replaced_during_save_is_archived_whole(tmp_path, monkeypatch):
    root = make_cache(tmp_path / "c")
    victim = sorted(root.glob("*/c01*.cpp"))[0]
    old, new = victim.read_bytes(), b"// recompiled by the training job\n" * 50
    real = archive_save._add_file
    seen = {"n": 0}

    def add_file(tar, r, f):
        if f.rel == str(victim.relative_to(root)):
            seen["n"] += 1
            torch_style_write(victim, new)  # the job replaces the file just before it is read
        return real(tar, r, f)

    monkeypatch.setattr(archive_save, "_add_file", add_file)
    archive_save.save(tmp_path / "a.tar", root)
    assert seen["n"] == 1
    monkeypatch.setattr(archive_save, "_add_file", real)
    archive_load.load(tmp_path / "a.tar", tmp_path / "loaded")  # checks every file against the manifest
    got = (tmp_path / "loaded" / victim.relative_to(root)).read_bytes()
    assert got in (old, new)


def test_load_under_a_reader_keeps_its_open_file_intact(tmp_path):
    root = make_cache(tmp_path / "c")
    archive_save.save(tmp_path / "a.tar", make_cache(tmp_path / "other", n_fx=1, triton=False))
    entry = sorted(root.glob("fxgraph/*/*/*"))[0]
    before = entry.read_bytes()
    with open(entry, "rb") as held:  # the job has this entry open while the cache is swapped
        res = archive_load.load(tmp_path / "a.tar", root)
        assert held.read() == before
    assert tree(tmp_path / os.path.basename(res.backup))[str(entry.relative_to(root))] == before
