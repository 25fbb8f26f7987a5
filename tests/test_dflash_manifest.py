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
