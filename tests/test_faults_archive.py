"""Issue 31, archives: crafted tar headers and member metadata are refused fast, in bounded memory.

Each CLI case runs in a child process under a time and address-space limit (tests/limits.py), so
the quadratic PAX parsing of Python < 3.11.10 (CVE-2024-6232), a header read whole into memory or a
metadata value that overflows fails that case instead of hanging the suite. The property tests
check the guard (compilewatch/cache/tarsafe.py) against tarfile itself: on archives tarfile writes,
the guard sees the same members; on archives with any mtime, it answers a value or BadInput.
"""

from __future__ import annotations

import gzip
import io
import json
import math
import struct
import tarfile
import zlib

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from compilewatch.cache.archive import load as archive_load
from compilewatch.cache.archive import reader, tarsafe
from compilewatch.cache.archive import save as archive_save
from compilewatch.errors import BadInput
from tests.cache_helpers import make_cache, tree
from tests.limits import MiB, cli, one_clear_line

PROPS = settings(max_examples=40, deadline=5000, derandomize=True, database=None,
                 suppress_health_check=list(HealthCheck))


# --- raw tar construction (what an attacker writes; tarfile would refuse to write most of it) ------
def _block(data: bytes) -> bytes:
    return data + b"\0" * (-len(data) % 512)


def _header(name: str, size: int, kind: bytes = b"0", mtime: int = 0, fmt: int = tarfile.USTAR_FORMAT) -> bytes:
    ti = tarfile.TarInfo(name)
    ti.size, ti.type, ti.mtime = size, kind, mtime
    return ti.tobuf(format=fmt)


def _record(key: str, value: bytes) -> bytes:
    body = b" " + key.encode() + b"=" + value + b"\n"
    n = len(body) + 1
    while len(str(n)) + len(body) != n:
        n += 1
    return str(n).encode() + body


def _pax(payload: bytes) -> bytes:
    return _header("././@PaxHeader", len(payload), tarfile.XHDTYPE) + _block(payload)


def _member(name: str, data: bytes, *, pax: bytes | None = None, mtime: int = 0) -> bytes:
    head = _pax(pax) if pax is not None else b""
    return head + _header(name if len(name) < 100 else "longname", len(data), mtime=mtime) + _block(data)


def _tar(*parts: bytes) -> bytes:
    return b"".join(parts) + b"\0" * 1024


_HEADER = {"format": reader.FORMAT, "created_at": "2026-12-01T00:00:00+00:00", "source_path": "/c", "system_key": "k",
           "system_info": {}, "torch_version": "0", "torch_hash": None, "compression": "none", "env": {}}


def _header_member() -> bytes:
    return _member(reader.HEADER, json.dumps(_HEADER).encode())


def _manifest_member() -> bytes:
    return _member(reader.MANIFEST, b"{}")


@pytest.fixture
def real_cache(tmp_path):
    return make_cache(tmp_path / "dst", n_fx=1, triton=False)


# --- CVE-2024-6232 and oversized extended headers -------------------------------------------------
def test_quadratic_pax_header_80kb_is_refused_fast(tmp_path, real_cache):
    """80 KB of digits in one PAX header: > 60 s in tarfile before 3.11.10; refused before it parses."""
    bad = tmp_path / "cve.tar"
    bad.write_bytes(_tar(_member(reader.HEADER, b"{}", pax=b"1" * 80_000)))
    before = tree(real_cache)
    for args in (["cache", "diff", str(bad), str(bad)], ["cache", "load", str(bad), "--dir", str(real_cache)]):
        one_clear_line(cli(*args, timeout=60, mem=1536 * MiB), words="extended header of 80000 bytes")
    assert tree(real_cache) == before


def test_quadratic_digits_within_the_size_cap_are_refused(tmp_path):
    """A 15 KB header under the size cap but made of digit runs (what makes the regex backtrack)."""
    bad = tmp_path / "digits.tar"
    bad.write_bytes(_tar(_member(reader.HEADER, b"{}", pax=_record("comment", b"7" * 15_000))))
    one_clear_line(cli("cache", "diff", str(bad), str(bad), timeout=30), words="run of more than 20 digits")


def test_gigabyte_pax_header_in_a_small_gzip_is_refused_in_bounded_memory(tmp_path):
    """A header that claims 1 GiB (compressed to ~1 MB): tarfile would read it whole; refused first,
    under a 768 MiB address-space limit."""
    bad = tmp_path / "bomb.tar.gz"
    size = 1 << 30
    head, chunk = _header("././@PaxHeader", size, tarfile.XHDTYPE), b"0" * (4 * MiB)
    z = zlib.compressobj(1, zlib.DEFLATED, 31)  # gzip framing
    with open(bad, "wb") as fh:
        fh.write(z.compress(head) + z.flush(zlib.Z_FULL_FLUSH))
        block = z.compress(chunk) + z.flush(zlib.Z_FULL_FLUSH)  # after a full flush: the same bytes each time
        crc = zlib.crc32(head)
        for _ in range(size // len(chunk)):
            fh.write(block)
            crc = zlib.crc32(chunk, crc)
        fh.write(z.flush()[:-8] + struct.pack("<II", crc, (len(head) + size) & 0xFFFFFFFF))
    assert bad.stat().st_size < 9 * MiB
    with gzip.open(bad) as gz:  # a valid gzip stream of the header and 1 GiB
        assert gz.read(512) == head
    one_clear_line(cli("cache", "diff", str(bad), str(bad), timeout=60, mem=768 * MiB),
                   words=f"extended header of {size} bytes")


def test_extended_headers_adding_up_past_the_total_cap_are_refused(monkeypatch):
    monkeypatch.setattr(tarsafe, "MAX_EXTENDED_TOTAL", 64 << 10)
    rec = _record("comment", b"x" * 8000)
    data = _tar(*[_member(f"m{i}", b"", pax=rec) for i in range(12)])
    with pytest.raises(tarsafe.UnsafeTar, match="add up to more than"):
        with tarfile.open(fileobj=tarsafe.GuardedStream(io.BytesIO(data)), mode="r|") as t:
            list(t)


@pytest.mark.parametrize("parts, words", [
    ((_header("g", 10, b"g") + _block(_record("path", b"x")),), "global PAX header"),
    ((_header("s", 0, b"S"),), "GNU sparse member"),
    ((_pax(_record("GNU.sparse.size", b"10")), _header("s", 0)), "GNU sparse file"),
    ((_pax(_record("path", b"a")), _pax(_record("path", b"b")), _header("s", 0)), "two extended headers in a row"),
    ((_pax(b"12 path=a\n"), _header("s", 0)), "length does not match"),
    ((_pax(b"garbage without records"), _header("s", 0)), "does not start with its length"),
    ((_pax(_record("size", b"1_000")), _header("s", 0)), "size record is not a decimal"),
])
def test_headers_compilewatch_never_writes_are_refused(parts, words):
    data = _tar(*parts)
    with pytest.raises(tarsafe.UnsafeTar, match=words):
        with tarfile.open(fileobj=tarsafe.GuardedStream(io.BytesIO(data)), mode="r|") as t:
            list(t)


# --- member metadata --------------------------------------------------------------------------------
@pytest.mark.parametrize("value, words", [
    (b"1e30", "timestamp out of range"),
    (b"inf", "mtime record is not a decimal"),
    (b"nan", "mtime record is not a decimal"),
    (b"99999999999999999999", "timestamp out of range"),
    (b"-5", "timestamp out of range"),
])
def test_pax_timestamp_out_of_range_is_bad_input(tmp_path, value, words):
    bad = tmp_path / "t.tar"
    bad.write_bytes(_tar(_header_member(), _member("cache/ab/x", b"x", pax=_record("mtime", value)), _manifest_member()))
    with pytest.raises(BadInput, match=words):
        reader.read_manifest(bad)


def test_base256_timestamp_in_a_plain_header_is_bad_input(tmp_path):
    """GNU base-256 numbers: an mtime of 2**80 needs no PAX header at all; os.utime would overflow."""
    bad = tmp_path / "t.tar"
    bad.write_bytes(_tar(_header_member(), _header("cache/ab/x", 1, mtime=2 ** 80, fmt=tarfile.GNU_FORMAT)
                         + _block(b"x"), _manifest_member()))
    o = cli("cache", "diff", str(bad), str(bad), timeout=30)
    one_clear_line(o, words="timestamp out of range")


def test_member_path_of_2000_components_is_bad_input(tmp_path, real_cache):
    name = "cache/" + "a/" * 2000 + "f"
    bad = tmp_path / "deep.tar"
    bad.write_bytes(_tar(_header_member(), _member(name, b"x", pax=_record("path", name.encode())), _manifest_member()))
    before = tree(real_cache)
    one_clear_line(cli("cache", "diff", str(bad), str(bad), timeout=30), words="2002 components")
    with pytest.raises(BadInput, match="components"):
        reader.read_manifest(bad)
    assert tree(real_cache) == before


@pytest.mark.parametrize("name, words", [
    ("cache/" + "n" * 300, "component longer than 255"),
    ("cache/" + "/".join(["d" * 200] * 25), "name of"),
    ("cache/a\0b", "NUL"),
])
def test_member_names_out_of_bounds(name, words):
    ti = tarfile.TarInfo(name)
    assert words in (tarsafe.check_member(ti) or "")


# --- the guard agrees with tarfile on what tarfile writes ----------------------------------------
names = st.text(st.characters(codec="utf-8", exclude_characters="\0/"), min_size=1, max_size=40)
paths = st.lists(names, min_size=1, max_size=6).map("/".join)


@PROPS
@given(st.lists(st.tuples(paths, st.binary(max_size=700), st.floats(0, 4e9), st.booleans()), min_size=1, max_size=8),
       st.sampled_from([tarfile.PAX_FORMAT, tarfile.GNU_FORMAT, tarfile.USTAR_FORMAT]))
def test_guard_sees_the_members_tarfile_sees(members, fmt):
    buf = io.BytesIO()
    written = []
    with tarfile.open(fileobj=buf, mode="w", format=fmt) as t:
        for name, data, mtime, comment in members:
            ti = tarfile.TarInfo(name)
            ti.size, ti.mtime = len(data), mtime if fmt == tarfile.PAX_FORMAT else int(mtime)
            if comment and fmt == tarfile.PAX_FORMAT:
                ti.pax_headers = {"comment": "x" * len(data)}
            try:
                t.addfile(ti, io.BytesIO(data))
            except ValueError:  # a name USTAR cannot hold
                continue
            written.append(name)
    raw = buf.getvalue()
    plain = [(m.name, m.size) for m in tarfile.open(fileobj=io.BytesIO(raw), mode="r|")]
    guard = tarsafe.GuardedStream(io.BytesIO(raw))
    guarded = [(m.name, m.size) for m in tarfile.open(fileobj=guard, mode="r|")]
    assert guarded == plain and len(plain) == len(written)
    assert guard.members == len(plain)


@PROPS
@given(st.one_of(st.floats(allow_nan=True, allow_infinity=True).map(lambda f: repr(f).encode()),
                 st.integers(-(2 ** 70), 2 ** 70).map(lambda i: str(i).encode()),
                 st.binary(max_size=30)))
def test_any_pax_mtime_is_a_value_or_bad_input(value):
    raw = _tar(_header_member(), _member("cache/ab/x", b"x", pax=_record("mtime", value)), _manifest_member())
    import os
    import tempfile

    fd, p = tempfile.mkstemp(suffix=".tar")
    try:
        os.write(fd, raw)
        os.close(fd)
        try:
            reader.read_manifest(p)
        except BadInput:
            pass
    finally:
        os.unlink(p)


def test_a_real_archive_with_long_and_unicode_names_round_trips(tmp_path):
    src = make_cache(tmp_path / "src")
    long_rel = "other/" + "/".join(["päth-" + "x" * 90] * 3) + "/ünïcode-" + "y" * 150
    (src / long_rel).parent.mkdir(parents=True)
    (src / long_rel).write_bytes(b"payload")
    archive_save.save(tmp_path / "a.tar.gz", src)
    res = archive_load.load(tmp_path / "a.tar.gz", tmp_path / "dst")
    assert (tmp_path / "dst" / long_rel).read_bytes() == b"payload" and res.files == len(tree(src))
    assert math.isfinite((tmp_path / "dst" / long_rel).stat().st_mtime)
