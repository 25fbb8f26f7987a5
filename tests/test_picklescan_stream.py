"""Pickles scanned as they stream (picklescan.scan_file): `cache load` scans each extracted file without
reading it in one piece, and `cache verify ARCHIVE` scans members too large to hold in memory straight
from the archive (provenance.MemberStream) instead of reporting them unscanned."""

from __future__ import annotations

import io
import os
import pickle

import pytest

from compilewatch.cache.archive import check as archive_check
from compilewatch.cache.archive import load as archive_load
from compilewatch.cache.archive import reader as provenance
from compilewatch.cache.archive import save as archive_save
from compilewatch.cache.trust import picklescan
from compilewatch.errors import BadInput
from tests.cache_helpers import entry_pickle, make_cache, noise, tar_members, write, write_tar
from tests.test_cache_untrusted import _forge  # a member replaced, the manifest made to match, signed again


class _RunsCode:
    def __reduce__(self):
        return (os.system, ("true",))


PICKLES = {
    "entry": entry_pickle("k" * 64, "t" * 10, pad=5000),
    "protocol-0 dict": pickle.dumps({"a": [1, 2.5, "s"], "b": (None, True)}, protocol=0),
    "runs code": pickle.dumps(_RunsCode(), protocol=4),
    "runs code, protocol 0": pickle.dumps(_RunsCode(), protocol=0),
    "truncated": entry_pickle("k" * 64)[:-7],
    "no STOP": pickle.dumps([1, 2, 3], protocol=2)[:-1],
    "noise": noise(3000, seed=5),
}


@pytest.fixture(params=["read whole", "streamed"])
def read_whole(request, monkeypatch):
    """scan_file both ways: reading the pickle at once (up to READ_WHOLE), and as its opcodes ask."""
    if request.param == "streamed":
        monkeypatch.setattr(picklescan, "READ_WHOLE", 0)
    return request.param


@pytest.mark.parametrize("name", sorted(PICKLES))
def test_scan_file_says_what_scan_says(tmp_path, name, read_whole):
    data = PICKLES[name]
    f = tmp_path / "p"
    f.write_bytes(data + b"trailing bytes after the pickle")  # a file holds more than the pickle
    with open(f, "rb") as fh:
        streamed = picklescan.scan_file(fh, len(data))
    assert streamed == picklescan.scan(data)


def test_a_length_field_claiming_more_than_the_file_is_malformed_not_a_huge_read(tmp_path, read_whole):
    """BINBYTES8 claiming 2**62 bytes in a 20-byte file: reading is capped at the file's size."""
    data = b"\x80\x04\x8e" + (1 << 62).to_bytes(8, "little") + b"abc."
    f = tmp_path / "p"
    f.write_bytes(data)
    with open(f, "rb") as fh:
        res = picklescan.scan_file(fh, len(data))
    assert not res.ok and "only 4 remain" in res.problem


@pytest.fixture
def small_memory(monkeypatch):
    """Every cache member counts as large: verify_archive streams all of them, and scans them streamed."""
    monkeypatch.setattr(provenance, "IN_MEMORY", 64)
    monkeypatch.setattr(picklescan, "READ_WHOLE", 0)


def test_verify_scans_large_members_as_they_stream(tmp_path, monkeypatch):
    saved = tmp_path / "a.tar.gz"
    archive_save.save(saved, make_cache(tmp_path / "src"), mega=False)
    in_memory = archive_check.verify_archive(saved)
    monkeypatch.setattr(provenance, "IN_MEMORY", 64)
    monkeypatch.setattr(picklescan, "READ_WHOLE", 0)
    streamed = archive_check.verify_archive(saved)
    assert in_memory.ok and streamed.ok and not streamed.findings
    assert streamed.pickles_scanned == in_memory.pickles_scanned == 6  # 3 fxgraph + 3 aotautograd entries
    assert streamed.provenance.verdict == "own"  # every streamed byte was hashed against the signature


def test_a_large_pickle_that_runs_code_is_found_and_named(tmp_path, small_memory):
    saved = archive_save.save(tmp_path / "a.tar", make_cache(tmp_path / "src"), mega=False).archive
    fx = next(n for n, _ in tar_members(saved) if n.startswith("cache/fxgraph/"))
    # signed with its manifest matching (a stale manifest is a `refused` finding of its own)
    evil = _forge(saved, tmp_path / "evil.tar", replace={fx[len("cache/"):]: pickle.dumps(_RunsCode(), protocol=4)})
    rep = archive_check.verify_archive(evil)
    assert not rep.ok and rep.provenance.verdict == "own"
    assert [(f.member, f.kind) for f in rep.findings] == [(fx, "untrusted")]
    assert "posix.system" in rep.findings[0].detail or "os.system" in rep.findings[0].detail


def test_a_large_member_changed_after_signing_is_foreign(tmp_path, small_memory):
    saved = archive_save.save(tmp_path / "a.tar", make_cache(tmp_path / "src"), mega=False).archive
    members = tar_members(saved)
    fx = next(n for n, _ in members if n.startswith("cache/fxgraph/"))
    changed = write_tar(tmp_path / "changed.tar", [(n, entry_pickle("z" * 64) if n == fx else d)
                                                   for n, d in members])  # the signature kept
    rep = archive_check.verify_archive(changed)
    assert not rep.ok and rep.provenance.verdict == "foreign" and fx in rep.provenance.reason


def test_a_damaged_or_cut_large_member_is_never_ok(tmp_path, small_memory):
    """A gzip archive whose large member is damaged: changed bytes are caught by the hash (foreign); an
    archive cut inside the member is BadInput (the decompressor's error, raised to the scan, is kept)."""
    saved = archive_save.save(tmp_path / "a.tar", make_cache(tmp_path / "src"), mega=False).archive
    fx = next(n for n, _ in tar_members(saved) if n.startswith("cache/fxgraph/"))
    big = pickle.dumps({"blob": noise(400_000, seed=9)}, protocol=4)  # incompressible: the middle of the file is in it
    path = _forge(saved, tmp_path / "big.tar.gz", replace={fx[len("cache/"):]: big})  # manifest to match, signed
    assert archive_check.verify_archive(path).ok
    raw = path.read_bytes()
    flipped = tmp_path / "flipped.tar.gz"
    flipped.write_bytes(raw[:len(raw) // 2] + bytes([raw[len(raw) // 2] ^ 0xFF]) + raw[len(raw) // 2 + 1:])
    rep = archive_check.verify_archive(flipped)
    assert not rep.ok and rep.provenance.verdict == "foreign" and fx in rep.provenance.reason
    cut = tmp_path / "cut.tar.gz"
    cut.write_bytes(raw[:len(raw) // 2])
    with pytest.raises(BadInput, match="not a readable compilewatch cache archive"):
        archive_check.verify_archive(cut)


def test_load_scans_extracted_files_streamed(tmp_path, monkeypatch):
    """`cache load` scans each extracted file with scan_file: streamed (as for a file over READ_WHOLE),
    a pickle that runs code is still refused by name and nothing is changed."""
    monkeypatch.setattr(picklescan, "READ_WHOLE", 0)
    src = make_cache(tmp_path / "src")
    archive_load.load(archive_save.save(tmp_path / "ok.tar", src, mega=False).archive, tmp_path / "loaded")
    assert (tmp_path / "loaded" / "fxgraph").is_dir()
    evil = "fxgraph/ee/fee" + "e" * 49 + "/entry"
    write(src, evil, pickle.dumps(_RunsCode(), protocol=4))
    saved = archive_save.save(tmp_path / "evil.tar", src, mega=False).archive
    with pytest.raises(BadInput, match=f"refused cache/{evil}"):
        archive_load.load(saved, tmp_path / "dst")
    assert not (tmp_path / "dst").exists()


def test_what_a_scan_holds_is_bounded(tmp_path, monkeypatch):
    """A pickle over MAX_SCAN is not scanned (a problem, so refused like a malformed one) and a text
    argument over MAX_LINE makes the pickle malformed: a crafted member cannot make the scan hold more."""
    monkeypatch.setattr(picklescan, "READ_WHOLE", 0)
    monkeypatch.setattr(picklescan, "MAX_LINE", 100)
    f = tmp_path / "p"
    data = b"cos\n" + b"s" * 500 + b"\n)R."  # protocol 0: GLOBAL with a 500-byte name, no newline within 101
    f.write_bytes(data)
    with open(f, "rb") as fh:
        res = picklescan.scan_file(fh, len(data))
    assert not res.ok and "no newline" in res.problem
    ok = PICKLES["entry"]
    f.write_bytes(ok)
    monkeypatch.setattr(picklescan, "MAX_SCAN", len(ok) - 1)
    with open(f, "rb") as fh:
        res = picklescan.scan_file(fh, len(ok))
    assert not res.ok and f"a pickle of {len(ok)} bytes" in res.problem and "not scanned" in res.problem
    # in an archive: a finding naming the member; cache load refuses it (unless --trust)
    monkeypatch.setattr(provenance, "IN_MEMORY", 0)
    saved = archive_save.save(tmp_path / "a.tar", make_cache(tmp_path / "src"), mega=False).archive
    monkeypatch.setattr(picklescan, "MAX_SCAN", 150)  # make_cache's fx entries are 100-300 bytes
    rep = archive_check.verify_archive(saved)
    assert not rep.ok and rep.findings and all(x.kind == "unloadable" and "not scanned" in x.detail for x in rep.findings)
    with pytest.raises(BadInput, match="not scanned"):
        archive_load.load(saved, tmp_path / "dst")
    assert not (tmp_path / "dst").exists()


@pytest.mark.parametrize("peek", range(6))
def test_member_stream_reads_as_a_file_does_and_hashes_every_byte(peek):
    """MemberStream serves what `peek` took before reading on: any mix of read / readline (with or
    without a limit) returns what io.BytesIO returns, and drain() hashes every byte exactly once."""
    import hashlib

    data = b"ab\ncdef\ngh"
    for limit in (-1, 0, 1, 2, 3, 4, 10):
        ref = io.BytesIO(data)
        ms = provenance.MemberStream(io.BufferedReader(io.BytesIO(data)), hashlib.sha256(), len(data))
        assert ms.peek(peek) == data[:peek]
        for _ in range(6):
            assert ms.readline(limit) == ref.readline(limit)
            assert ms.read(2) == ref.read(2)
        assert ms.drain() == len(data) and ms.h.hexdigest() == hashlib.sha256(data).hexdigest()
