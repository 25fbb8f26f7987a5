"""dflash/checkpoint/manifest.py: sizes and xxh3-128 checksums recorded at save, checked at load.
Every lie a manifest or a file can tell (a bit flip, a truncation, a missing or non-regular file, a
manifest of the wrong shape) is BadInput naming the file; nothing else escapes, nothing blocks."""

from __future__ import annotations

import json
import os

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from compilewatch.errors import BadInput
from dflash.checkpoint import manifest
from tests.cache_helpers import noise
from tests.helpers import time_limit


def _files(d, **contents):
    for name, data in contents.items():
        (d / name).write_bytes(data)
    return list(contents)


def test_record_then_check_round_trips(tmp_path):
    names = _files(tmp_path, **{"a.bin": noise(3000, seed=21), "config.json": b"{}"})
    man = manifest.record(tmp_path, names)
    assert set(man["files"]) == set(names) and man["files"]["a.bin"]["bytes"] == 3000
    assert json.loads((tmp_path / manifest.MANIFEST).read_text()) == man
    assert manifest.check(tmp_path) is None
    assert manifest.check(tmp_path, ["config.json"]) is None


@pytest.mark.parametrize("damage, words", [
    (lambda p: p.write_bytes(b"\x01" + p.read_bytes()[1:]), "checksum"),  # same size, one byte changed
    (lambda p: p.write_bytes(p.read_bytes()[:-1]), "bytes"),  # truncated
    (lambda p: p.unlink(), "missing"),
    (lambda p: (p.unlink(), p.mkdir()), "directory"),
    (lambda p: (p.unlink(), os.mkfifo(p)), "FIFO"),  # refused without blocking (O_NONBLOCK)
])
def test_a_damaged_file_is_bad_input_naming_it(tmp_path, damage, words):
    names = _files(tmp_path, **{"model.safetensors": noise(5000, seed=22), "other": b"x"})
    manifest.record(tmp_path, names)
    damage(tmp_path / "model.safetensors")
    with pytest.raises(BadInput, match=words) as e:
        manifest.check(tmp_path)
    assert "model.safetensors" in e.value.message
    assert manifest.check(tmp_path, ["other"]) is None  # only the damaged file is refused


def test_a_bit_flip_anywhere_is_caught(tmp_path):
    data = bytearray(noise(1 << 16, seed=23))
    (tmp_path / "f").write_bytes(data)
    manifest.record(tmp_path, ["f"])
    for bit in (0, 7, 8 * 40000 + 3, 8 * len(data) - 1):
        flipped = bytearray(data)
        flipped[bit // 8] ^= 1 << (bit % 8)
        (tmp_path / "f").write_bytes(flipped)
        with pytest.raises(BadInput, match="checksum"):
            manifest.check(tmp_path)


def test_no_manifest_is_accepted_with_a_note(tmp_path):
    _files(tmp_path, f=b"x")
    note = manifest.check(tmp_path)
    assert note and "not verified" in note


def test_a_name_the_manifest_does_not_list_is_bad_input(tmp_path):
    manifest.record(tmp_path, _files(tmp_path, f=b"x"))
    (tmp_path / "g").write_bytes(b"y")
    with pytest.raises(BadInput, match="not listed"):
        manifest.check(tmp_path, ["g"])


def test_record_refuses_paths_and_non_files(tmp_path):
    with pytest.raises(BadInput, match="not a file name"):
        manifest.record(tmp_path, ["../escape"])
    with pytest.raises(BadInput, match="missing"):
        manifest.record(tmp_path, ["nope"])
    assert not (tmp_path / manifest.MANIFEST).exists()


@pytest.mark.parametrize("body", [
    b"", b"{", b"[]", b'{"format": "x"}', b"\xff\xfe",
    json.dumps({"format": manifest.FORMAT, "version": 1, "algorithm": "xxh3_128", "files": []}).encode(),
    json.dumps({"format": manifest.FORMAT, "version": 1, "algorithm": "xxh3_128",
                "files": {"../../etc/passwd": {"bytes": 1, "xxh3_128": "0" * 32}}}).encode(),
    json.dumps({"format": manifest.FORMAT, "version": 1, "algorithm": "xxh3_128",
                "files": {"f": {"bytes": -1, "xxh3_128": "0" * 32}}}).encode(),
    json.dumps({"format": manifest.FORMAT, "version": 1, "algorithm": "xxh3_128",
                "files": {"f": {"bytes": 1, "xxh3_128": "zz"}}}).encode(),
    json.dumps({"format": manifest.FORMAT, "version": 2, "algorithm": "xxh3_128", "files": {}}).encode(),
])
def test_a_malformed_manifest_is_bad_input(tmp_path, body):
    (tmp_path / manifest.MANIFEST).write_bytes(body)
    with pytest.raises(BadInput):
        manifest.check(tmp_path)


def test_a_manifest_that_is_a_fifo_or_huge_is_refused_without_reading_it(tmp_path):
    os.mkfifo(tmp_path / manifest.MANIFEST)
    with pytest.raises(BadInput, match="FIFO"):
        manifest.check(tmp_path)
    os.unlink(tmp_path / manifest.MANIFEST)
    with open(tmp_path / manifest.MANIFEST, "wb") as fh:
        fh.truncate(manifest.MAX_MANIFEST_BYTES + 10)  # sparse: no disk used
    with pytest.raises(BadInput, match="larger than"):
        manifest.check(tmp_path)


_json = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=40),
                     lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=12), kids, max_size=4),
                     max_leaves=20)
_entries = st.dictionaries(st.sampled_from(["f", "g", "", "..", "a/b", "manifest.json"]),
                           st.fixed_dictionaries({"bytes": _json | st.integers(-2, 3), "xxh3_128": _json | st.just("0" * 32)}),
                           max_size=3)


@settings(max_examples=150, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))
@given(body=st.one_of(
    st.binary(max_size=300),
    _json.map(lambda v: json.dumps(v).encode()),
    _entries.map(lambda f: json.dumps({"format": manifest.FORMAT, "version": 1, "algorithm": "xxh3_128",
                                       "files": f}).encode()),
))
def test_property_any_manifest_checks_or_is_bad_input(tmp_path, body):
    (tmp_path / "f").write_bytes(b"x")
    (tmp_path / manifest.MANIFEST).write_bytes(body)
    try:
        with time_limit(10):  # a hang or a blow-up fails the example
            out = manifest.check(tmp_path)
    except BadInput as e:
        assert "\n" not in e.message
    else:
        assert out is None


# ---------------------------------------------------------------- large files: per-piece digests, checked in parallel
@pytest.fixture
def small_pieces(monkeypatch):
    """Pieces of 8 KiB (the recipe's are 256 MiB): the same code paths on files of a few pieces."""
    monkeypatch.setattr(manifest, "SEGMENT", 8 << 10)
    monkeypatch.setattr(manifest, "CHUNK", 3000)  # reads that do not line up with the pieces
    return 8 << 10


def test_a_large_file_records_one_digest_per_piece_beside_the_whole_files(tmp_path, small_pieces):
    import xxhash

    data = noise(5 * small_pieces + 123, seed=31)
    man = manifest.record(tmp_path, _files(tmp_path, big=data, small=b"tiny"))
    big = man["files"]["big"]
    assert big["xxh3_128"] == xxhash.xxh3_128(data).hexdigest()  # older readers check the whole file
    assert big["segments"]["bytes"] == small_pieces
    assert big["segments"]["xxh3_128"] == [xxhash.xxh3_128(data[i:i + small_pieces]).hexdigest()
                                           for i in range(0, len(data), small_pieces)]  # 6 pieces, the last short
    assert "segments" not in man["files"]["small"]
    assert manifest.check(tmp_path) is None


@pytest.mark.parametrize("size_in_pieces", [2, 3, 7])
def test_a_bit_flip_in_any_piece_is_caught_and_located(tmp_path, small_pieces, size_in_pieces):
    data = bytearray(noise(size_in_pieces * small_pieces, seed=32))  # whole pieces: the last is full
    (tmp_path / "f").write_bytes(data)
    manifest.record(tmp_path, ["f"])
    for byte in (0, small_pieces - 1, small_pieces, len(data) - 1):
        flipped = bytearray(data)
        flipped[byte] ^= 0x10
        (tmp_path / "f").write_bytes(flipped)
        piece = byte // small_pieces
        with pytest.raises(BadInput, match=f"at bytes {piece * small_pieces}\\.\\.") as e:
            manifest.check(tmp_path)
        assert "'" + str(tmp_path / "f") + "'" in e.value.message
    (tmp_path / "f").write_bytes(data)
    assert manifest.check(tmp_path) is None


def test_pieces_are_checked_in_parallel_threads_and_agree_with_one(tmp_path, small_pieces, monkeypatch):
    """Several threads hash pieces at once (pread: no shared offset); one thread gives the same verdicts."""
    import threading

    data = bytearray(noise(9 * small_pieces, seed=33))
    (tmp_path / "f").write_bytes(data)
    manifest.record(tmp_path, ["f"])
    seen = set()
    real = os.pread

    def pread(fd, n, off):
        seen.add(threading.current_thread().name)
        return real(fd, n, off)

    monkeypatch.setattr(manifest.os, "pread", pread)
    monkeypatch.setattr(manifest.os, "cpu_count", lambda: 4)
    assert manifest.check(tmp_path) is None
    assert len({n for n in seen if n.startswith("manifest-check")}) >= 1 and len(seen) <= 4
    data[5 * small_pieces + 7] ^= 1
    (tmp_path / "f").write_bytes(data)
    for threads in (1, 4):
        monkeypatch.setattr(manifest, "CHECK_THREADS", threads)
        with pytest.raises(BadInput, match=f"at bytes {5 * small_pieces}\\."):
            manifest.check(tmp_path)


def test_a_manifest_without_pieces_is_checked_by_the_whole_digest(tmp_path, small_pieces):
    """Checkpoints written before pieces existed: the whole file's digest, as then."""
    data = bytearray(noise(4 * small_pieces, seed=34))
    (tmp_path / "f").write_bytes(data)
    man = manifest.record(tmp_path, ["f"])
    del man["files"]["f"]["segments"]
    (tmp_path / manifest.MANIFEST).write_text(json.dumps(man))
    assert manifest.check(tmp_path) is None
    data[-1] ^= 1
    (tmp_path / "f").write_bytes(data)
    with pytest.raises(BadInput, match="checksum"):
        manifest.check(tmp_path)


@pytest.mark.parametrize("segments", [
    {"bytes": 8 << 10, "xxh3_128": ["0" * 32] * 3},  # too few digests for the size
    {"bytes": 8 << 10, "xxh3_128": ["0" * 32] * 5},  # too many
    {"bytes": 100, "xxh3_128": ["0" * 32] * 328},  # pieces under the minimum (a huge list)
    {"bytes": True, "xxh3_128": ["0" * 32] * 4},
    {"bytes": 8 << 10, "xxh3_128": ["zz"] * 4},
    {"bytes": 8 << 10, "xxh3_128": "0" * 32},
    [],
    {"bytes": 32 << 10, "xxh3_128": ["0" * 32]},  # one piece: the whole digest says it all
])
def test_malformed_pieces_are_bad_input_before_any_read(tmp_path, segments, monkeypatch):
    (tmp_path / "f").write_bytes(noise(32 << 10, seed=35))
    man = manifest.record(tmp_path, ["f"])
    man["files"]["f"]["segments"] = segments
    (tmp_path / manifest.MANIFEST).write_text(json.dumps(man))
    monkeypatch.setattr(manifest.os, "pread", lambda *a: pytest.fail("read before the manifest was checked"))
    with pytest.raises(BadInput, match="segments"):
        manifest.check(tmp_path)


def test_a_forged_piece_digest_does_not_pass_a_file_whose_whole_digest_also_differs(tmp_path, small_pieces):
    """The pieces are what is checked when present: a manifest that lists the true pieces of other bytes is
    refused for those pieces (every byte is compared with what the manifest recorded)."""
    (tmp_path / "f").write_bytes(noise(3 * small_pieces, seed=36))
    man = manifest.record(tmp_path, ["f"])
    other = tmp_path / "other"
    other.mkdir()
    (other / "f").write_bytes(noise(3 * small_pieces, seed=37))
    forged = manifest.record(other, ["f"])
    man["files"]["f"]["segments"] = forged["files"]["f"]["segments"]
    (tmp_path / manifest.MANIFEST).write_text(json.dumps(man))
    with pytest.raises(BadInput, match="at bytes 0\\.\\."):
        manifest.check(tmp_path)
