"""Red team, session 14: cache archives and who is trusted (crafted archives, the lock beside the
cache, a hand-written trust store). Each test is one finding, fixed; all are fast and offline."""

from __future__ import annotations

import gzip
import io
import json
import logging
import os
import tarfile
import tracemalloc

import pytest

from cli.main import app
from compilewatch.cache.archive import check as archive_check
from compilewatch.cache.archive import load as archive_load
from compilewatch.cache.archive import reader
from compilewatch.cache.archive import save as archive_save
from compilewatch.cache.local.lock import cache_lock, lock_file_for
from compilewatch.cache.trust import keys
from compilewatch.errors import BadInput
from tests.cache_helpers import make_cache, signed_tar, tar_members, tree
from tests.helpers import invoke
from tests.test_cache_trust import other_machine  # noqa: F401 - fixture: run a block as another machine


class _Zeros(io.RawIOBase):
    def __init__(self, n: int) -> None:
        self.n = n

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        k = min(len(b), self.n)
        b[:k] = bytes(k)
        self.n -= k
        return k


def _with_mega(path, saved, size: int):
    """The header of `saved`, then a `mega_cache.bin` of `size` zero bytes (gzip: a few KB per MB)."""
    header = dict(tar_members(saved))[reader.HEADER]
    with gzip.open(path, "wb", compresslevel=1) as gz, tarfile.open(fileobj=gz, mode="w|", format=tarfile.PAX_FORMAT) as t:
        ti = tarfile.TarInfo(reader.HEADER)
        ti.size = len(header)
        t.addfile(ti, io.BytesIO(header))
        ti = tarfile.TarInfo(reader.MEGA)
        ti.size = size
        t.addfile(ti, io.BufferedReader(_Zeros(size), 1 << 20))
    return path


@pytest.fixture
def saved(tmp_path):
    archive_save.save(tmp_path / "a.tar", make_cache(tmp_path / "src", n_fx=1, n_codegen=1, triton=False), mega=False)
    return tmp_path / "a.tar"


def test_a_declared_huge_mega_cache_is_not_read_into_memory(tmp_path, saved):
    """A 2.7 MB archive declaring a 600 MB mega_cache.bin took `cache verify` (and load's, diff's
    provenance pass) to 2.1 GB of memory before any verdict: the Mega-Cache was kept whatever its size.
    Now it is kept only for verify's scan, and only up to MAX_MEGA."""
    bomb = _with_mega(tmp_path / "bomb.tar.gz", saved, 48 << 20)
    tracemalloc.start()
    try:
        assert reader.check_provenance(bomb).verdict == "foreign"
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 24 << 20, peak  # streamed and hashed, never held whole


def test_a_mega_cache_over_the_cap_is_an_unparsed_finding(tmp_path, saved, monkeypatch):
    monkeypatch.setattr(reader, "MAX_MEGA", 1 << 16)
    report = archive_check.verify_archive(_with_mega(tmp_path / "big.tar.gz", saved, 1 << 20))
    assert not report.ok and [(f.member, f.kind) for f in report.findings] == [(reader.MEGA, "unloadable")]
    assert "not parsed" in report.findings[0].detail
    own = signed_tar(tmp_path / "own.tar", tar_members(tmp_path / "big.tar.gz"))  # signed: past provenance
    with pytest.raises(BadInput, match="more than 65536"):
        archive_load.load_mega_cache(own)


def test_an_unparsable_mega_cache_is_a_finding_not_a_logged_traceback(tmp_path, saved, caplog):
    """torch logged "Failed to un-pickle cache artifacts" with a full traceback on stderr, and verify
    reported 0 artifacts scanned and no finding."""
    members = [*tar_members(saved)[:1], (reader.MEGA, b"\0" * 4096), *tar_members(saved)[1:]]
    bad = signed_tar(tmp_path / "bad.tar", members)
    with caplog.at_level(logging.WARNING):
        report = archive_check.verify_archive(bad)
        assert archive_load.load_mega_cache(bad) is None
    assert not report.ok and report.provenance.verdict == "own"
    assert [(f.member, f.kind, f.detail) for f in report.findings] == [
        (reader.MEGA, "unloadable", "not a Mega-Cache torch can parse")]
    assert "Traceback" not in caplog.text and not caplog.records


@pytest.mark.parametrize("kind, linkname, said", [
    (tarfile.SYMTYPE, "/etc/passwd", "a symbolic link"),
    (tarfile.LNKTYPE, "cache/x", "a hard link"),
])
def test_a_link_member_is_named_as_a_link(tmp_path, saved, kind, linkname, said):
    """A link member was 'not a readable archive (StreamError: cannot extract (sym)link as file object)'."""
    members = tar_members(saved)
    out = tmp_path / "link.tar"
    with tarfile.open(out, "w", format=tarfile.PAX_FORMAT) as t:
        for name, data in members[:2]:
            ti = tarfile.TarInfo(name)
            ti.size = len(data)
            t.addfile(ti, io.BytesIO(data))
        ti = tarfile.TarInfo("cache/ln")
        ti.type, ti.linkname = kind, linkname
        t.addfile(ti)
    with pytest.raises(BadInput, match=f"member 'cache/ln' is {said} .compilewatch archives hold regular files only"):
        reader.check_provenance(out)
    r = invoke(app, ["cache", "verify", str(out)])
    assert r.exit_code == 2 and "Traceback" not in r.output and said in r.output, r.output


def test_a_lock_file_that_is_a_symlink_is_not_followed(tmp_path, saved):
    """The exclusive lock truncated and wrote its pid into whatever `.NAME.compilewatch.lock` beside
    the cache pointed to: anyone who can write beside the cache could clobber a file of yours."""
    dst = make_cache(tmp_path / "dst", n_fx=1, triton=False)
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    lock_file_for(dst).symlink_to(victim)
    before = tree(dst)
    with pytest.raises(BadInput, match="is a symbolic link"):
        archive_load.load(saved, dst)
    assert victim.read_text() == "precious\n" and tree(dst) == before
    assert not [p for p in os.listdir(tmp_path) if ".load-" in p or ".backup-" in p]


def test_a_lock_file_that_is_a_fifo_is_one_clear_error(tmp_path, saved):
    """A FIFO there was a traceback (OSError from ftruncate), after the whole archive was extracted."""
    dst = make_cache(tmp_path / "dst", n_fx=1, triton=False)
    os.mkfifo(lock_file_for(dst))
    with pytest.raises(BadInput, match="not a regular file"):
        with cache_lock(dst):
            pass
    r = invoke(app, ["cache", "load", str(saved), "--dir", str(dst)])
    assert r.exit_code == 2 and "not a regular file" in r.output and "Traceback" not in r.output, r.output


def test_trust_remove_removes_the_key_under_every_name(tmp_path, other_machine):
    """A hand-written trust store listing one key as alice and bob: `trust remove alice` said "no
    longer trusted" while the key stayed trusted as bob."""
    with other_machine():
        archive_save.save(tmp_path / "theirs.tar", make_cache(tmp_path / "src", n_fx=1, triton=False), mega=False)
        line = keys.public_key_line(keys.own_public_key())
    added = keys.trust_add(line, name="alice")
    store = keys.trust_path()
    entry = json.loads(store.read_text())["keys"][0]
    keys.write_private(store, json.dumps({"keys": [entry, dict(entry, name="bob")]}).encode())
    assert reader.check_provenance(tmp_path / "theirs.tar").verdict == "trusted"
    r = invoke(app, ["cache", "trust", "remove", "alice"])
    assert r.exit_code == 0 and added.id in r.stdout
    assert json.loads(store.read_text())["keys"] == []
    assert reader.check_provenance(tmp_path / "theirs.tar").verdict == "foreign"
    keys.write_private(store, json.dumps({"keys": [entry, dict(entry, name="bob")]}).encode())
    assert invoke(app, ["cache", "trust", "remove", added.id]).exit_code == 0  # by id: one key, not "more than one"
    assert json.loads(store.read_text())["keys"] == []


def test_a_foreign_archive_refused_creates_nothing_not_even_the_caches_parent(tmp_path, saved):
    """`cache load` said "nothing was changed" after creating the target's parent folders."""
    foreign = _with_mega(tmp_path / "foreign.tar.gz", saved, 16)
    target = tmp_path / "new" / "deeper" / "cache"
    with pytest.raises(BadInput, match="nothing was changed|not signed|foreign"):
        archive_load.load(foreign, target)
    assert not (tmp_path / "new").exists()
