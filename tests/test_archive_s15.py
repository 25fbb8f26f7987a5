"""Red team, session 15: cache archives (`cache save|load|verify|diff`) and `cache trust`. Each test is
one finding, reproduced first and then fixed; all are fast and offline."""

from __future__ import annotations

import gzip
import io
import json
import os
import tarfile
import time

import pytest

from cli.main import app
from compilewatch.cache.archive import check as archive_check
from compilewatch.cache.archive import diff as archive_diff
from compilewatch.cache.archive import load as archive_load
from compilewatch.cache.archive import reader
from compilewatch.cache.archive import save as archive_save
from compilewatch.cache.trust import keys, provenance
from compilewatch.errors import BadInput
from tests.cache_helpers import make_cache, tar_members, write_tar
from tests.helpers import invoke, invoke_json
from tests.test_cache_trust import other_machine  # noqa: F401 - fixture: run a block as another machine
from tests.test_cache_untrusted import _forge, _RunsCode


@pytest.fixture
def saved(tmp_path):
    archive_save.save(tmp_path / "a.tar", make_cache(tmp_path / "src", n_fx=1, n_codegen=1, triton=False), mega=False)
    return tmp_path / "a.tar"


def _offsets(path) -> dict[str, int]:
    """Member name -> where its headers start in the (uncompressed) tar."""
    with tarfile.open(path) as t:
        return {m.name: m.offset for m in t.getmembers()}


def _cut(src, dst, at: int):
    dst.write_bytes(src.read_bytes()[:at])
    return dst


# --- 1. an archive cut short is named so, not "not signed" ---------------------------------------------
@pytest.mark.parametrize("before", [provenance.SIGNATURE, reader.MANIFEST, "cache/"])
def test_an_archive_cut_between_members_is_cut_short_not_unsigned(tmp_path, saved, before):
    """Cut exactly at a member boundary, `cache verify` said "foreign: it is not signed" (exit 1):
    tarfile ends a stream that runs out between two members without a word. A finished tar ends with
    an end-of-archive marker (zero blocks); without it the archive was cut short."""
    offsets = _offsets(saved)
    at = next(off for name, off in offsets.items() if name.startswith(before))
    cut = _cut(saved, tmp_path / "cut.tar", at)
    with pytest.raises(BadInput, match="was cut short") as e:
        reader.check_provenance(cut)
    assert "not signed" not in e.value.message and "not an unsigned one" in e.value.message
    r = invoke(app, ["cache", "verify", str(cut)])
    assert r.exit_code == 2 and "was cut short" in r.stderr and "not signed" not in r.output, r.output
    assert "Traceback" not in r.output
    with pytest.raises(BadInput, match="was cut short"):
        archive_diff.diff(cut, saved)
    with pytest.raises(BadInput, match="was cut short"):
        archive_load.load(cut, tmp_path / "new" / "cache")
    assert not (tmp_path / "new").exists()


def test_a_damaged_header_block_is_named_damaged_not_unsigned(tmp_path, saved):
    """A block that is not a tar header in the middle (bad checksum): tarfile stopped there silently and
    every member after it, the signature included, looked absent: "not signed"."""
    data = bytearray(saved.read_bytes())
    at = _offsets(saved)[reader.MANIFEST]
    data[at:at + 512] = b"garbage!" * 64
    bad = tmp_path / "bad.tar"
    bad.write_bytes(bytes(data))
    with pytest.raises(BadInput, match=f"is damaged: at byte {at} of its tar stream") as e:
        reader.check_provenance(bad)
    assert "its manifest and signature included" in e.value.message


def test_an_unsigned_finished_archive_is_still_not_signed_and_a_lost_tail_after_the_signature_is_fine(tmp_path, saved):
    members = [(n, d) for n, d in tar_members(saved) if n != provenance.SIGNATURE]
    unsigned = write_tar(tmp_path / "unsigned.tar", members)
    p = reader.check_provenance(unsigned)
    assert p.verdict == "foreign" and "not signed" in p.reason
    r = invoke(app, ["cache", "verify", str(unsigned)])
    assert r.exit_code == 1 and "not signed" in r.stdout
    # cut after the signature (only the end marker and padding lost): everything signed is there
    offsets = _offsets(saved)
    end = offsets[provenance.SIGNATURE] + 512 * 3 + len(dict(tar_members(saved))[provenance.SIGNATURE])
    tail = _cut(saved, tmp_path / "tail.tar", -(-end // 512) * 512)
    assert reader.check_provenance(tail).verdict == "own"


def test_a_gzip_archive_of_a_cut_tar_is_cut_short_too(tmp_path, saved):
    at = _offsets(saved)[provenance.SIGNATURE]
    gz = tmp_path / "cut.tar.gz"
    gz.write_bytes(gzip.compress(saved.read_bytes()[:at]))
    with pytest.raises(BadInput, match="was cut short"):
        reader.check_provenance(gz)


# --- 2. a compression bomb is stopped in proportion to the archive's size ------------------------------
from tests.test_redteam_archive_s14 import _Zeros  # noqa: E402 - a stream of n zero bytes


def _bomb(path, saved, name: str, size: int, head: bytes = b""):
    """The header of `saved`, then member `name`: `head` and zeros up to `size` bytes (gzip: ~1 KB a MB)."""
    header = dict(tar_members(saved))[reader.HEADER]
    with gzip.open(path, "wb", compresslevel=9) as gz, tarfile.open(fileobj=gz, mode="w|", format=tarfile.PAX_FORMAT) as t:
        ti = tarfile.TarInfo(reader.HEADER)
        ti.size = len(header)
        t.addfile(ti, io.BytesIO(header))
        ti = tarfile.TarInfo(name)
        ti.size = size
        t.addfile(ti, io.BufferedReader(io.BufferedReader(_Zeros(size - len(head)), 1 << 20)) if not head else
                  io.BufferedReader(_Chain(head, size - len(head)), 1 << 20))
    return path


class _Chain(_Zeros):
    def __init__(self, head: bytes, n: int) -> None:
        super().__init__(n)
        self.head = head

    def readinto(self, b) -> int:
        if self.head:
            k = min(len(b), len(self.head))
            b[:k], self.head = self.head[:k], self.head[k:]
            return k
        return super().readinto(b)


def test_a_gzip_bomb_is_stopped_at_a_multiple_of_its_size_on_disk(tmp_path, saved, monkeypatch):
    """A 0.5 MB .tar.gz holding one 512 MiB member of zeros took `cache verify` 1.3 s (2.4 s per GiB
    inflated, nothing bounded it but the tar's size field: a 100 MB file would have taken ~4 min);
    `diff` and `load` read it the same way. Now a stream may inflate to MAX_RATIO times the file's
    size on disk (at least MIN_INFLATE): past that, one clear BadInput, exit 2, in a fraction of the time."""
    monkeypatch.setattr(reader, "MIN_INFLATE", 1 << 20)
    bomb = _bomb(tmp_path / "bomb.tar.gz", saved, "cache/zz/czz.cpp", 16 << 20)
    on_disk = bomb.stat().st_size
    assert 16 << 20 > reader.MAX_RATIO * on_disk  # what gzip does to zeros: ~1000x
    t0 = time.perf_counter()
    with pytest.raises(BadInput, match="compression bomb") as e:
        archive_check.verify_archive(bomb)
    assert time.perf_counter() - t0 < 5
    assert "uncompressed *.tar" in e.value.hint and "nothing was changed" in e.value.hint
    r = invoke(app, ["cache", "verify", str(bomb)])
    assert r.exit_code == 2 and "compression bomb" in r.stderr and "Traceback" not in r.output, r.output
    with pytest.raises(BadInput, match="compression bomb"):
        archive_diff.diff(bomb, saved)
    with pytest.raises(BadInput, match="compression bomb"):
        archive_load.load(bomb, tmp_path / "dst")
    assert not (tmp_path / "dst").exists()


def test_a_bomb_inside_a_streamed_pickle_scan_is_the_same_clear_error(tmp_path, saved, monkeypatch):
    """A member over IN_MEMORY is scanned as it streams (picklescan reads it): the bound firing inside
    that scan must still be the one clear error, not a traceback out of the scanner."""
    monkeypatch.setattr(reader, "MIN_INFLATE", 1 << 20)
    monkeypatch.setattr(reader, "IN_MEMORY", 1 << 16)
    head = b"\x80\x04" + b"N0" * 1000
    bomb = _bomb(tmp_path / "p.tar.gz", saved, "cache/fxgraph/ab/fabc/entry", 8 << 20, head=head)
    with pytest.raises(BadInput, match="compression bomb"):
        archive_check.verify_archive(bomb)


def test_a_sparse_uncompressed_archive_counts_its_holes_as_nothing(tmp_path, saved, monkeypatch):
    """An uncompressed .tar whose member data is a hole: 0 bytes on disk, any size read back as zeros."""
    monkeypatch.setattr(reader, "MIN_INFLATE", 1 << 20)
    header = dict(tar_members(saved))[reader.HEADER]
    sparse = tmp_path / "sparse.tar"
    with open(sparse, "wb") as fh:
        ti = tarfile.TarInfo(reader.HEADER)
        ti.size = len(header)
        fh.write(ti.tobuf(tarfile.PAX_FORMAT) + header + bytes(-len(header) % 512))
        ti = tarfile.TarInfo("cache/zz/czz.cpp")
        ti.size = 64 << 20
        fh.write(ti.tobuf(tarfile.PAX_FORMAT))
        fh.truncate(fh.tell() + (64 << 20) + 1024)  # its data and the end marker: one hole
    if sparse.stat().st_blocks * 512 >= 8 << 20:
        pytest.skip("this filesystem does not keep holes")
    with pytest.raises(BadInput, match="compression bomb"):
        reader.check_provenance(sparse)


def test_a_real_archive_is_far_inside_the_bound(tmp_path):
    """What the bound is calibrated on: compilewatch's own archive of a synthetic cache (repetitive
    files, so more compressible than a real one) inflates well under MAX_RATIO."""
    src = make_cache(tmp_path / "src", n_fx=8, n_codegen=8)
    res = archive_save.save(tmp_path / "a.tar.gz", src)
    assert res.bytes / res.archive_bytes < reader.MAX_RATIO / 4
    assert archive_check.verify_archive(tmp_path / "a.tar.gz").ok


# --- 3. a refused load leaves nothing behind, not even the parent folder ---------------------------------
@pytest.mark.parametrize("how", ["manifest", "pickle"])
def test_a_load_refused_after_the_verdict_leaves_no_parent_folder(tmp_path, saved, how):
    """`cache load` made the cache's parent folders before extracting; a refusal from there on (a
    member the manifest does not match, a pickle the scanner refuses) said "nothing was changed" and
    left them behind."""
    if how == "manifest":
        members = tar_members(saved)
        members = [(n, d + b"x" if n.startswith("cache/fxgraph/") else d) for n, d in members]
        from tests.cache_helpers import signed_tar

        bad = signed_tar(tmp_path / "bad.tar", members)  # own, but its manifest no longer matches
        match = "the manifest says"
    else:
        fx = next(n[len(reader.PREFIX):] for n, _ in tar_members(saved) if n.startswith("cache/fxgraph/"))
        import pickle

        bad = _forge(saved, tmp_path / "bad.tar", replace={fx: pickle.dumps(_RunsCode(tmp_path / "ran"))})
        match = "refused"
    assert reader.check_provenance(bad).verdict == "own"
    target = tmp_path / "new" / "deeper" / "cache"
    with pytest.raises(BadInput, match=match) as e:
        archive_load.load(bad, target)
    assert "nothing was changed" in e.value.message + (e.value.hint or "")
    assert not (tmp_path / "new").exists() and not (tmp_path / "ran").exists()
    r = invoke(app, ["cache", "load", str(bad), "--dir", str(target)])
    assert r.exit_code == 2 and not (tmp_path / "new").exists()


def test_a_load_into_a_folder_under_a_file_is_one_clear_error(tmp_path, saved):
    """`--dir FILE/deeper/cache` was a NotADirectoryError traceback from mkdir."""
    (tmp_path / "afile").write_text("x")
    r = invoke(app, ["cache", "load", str(saved), "--dir", str(tmp_path / "afile" / "deeper" / "cache")])
    assert r.exit_code == 2 and "Traceback" not in r.output and "Not a directory" in r.stderr, r.output
    assert (tmp_path / "afile").read_text() == "x"


def test_a_successful_load_still_makes_the_parent_folders(tmp_path, saved):
    target = tmp_path / "new" / "deeper" / "cache"
    res = archive_load.load(saved, target)
    assert res.files > 0 and target.is_dir()


# --- 4. save says which key signed ---------------------------------------------------------------------
def test_save_names_the_key_from_the_environment_not_this_machines(tmp_path, monkeypatch, other_machine):
    """With COMPILEWATCH_SIGNING_KEY (a CI key), `cache save` said "signed by this machine's key" and
    `cache verify` "made here": any machine holding that key could have made it."""
    with other_machine("ci"):
        keys.signing_key()
        ci_key = tmp_path / "ci-key.pem"
        ci_key.write_bytes(keys.key_path().read_bytes())
    os.chmod(ci_key, 0o600)
    src = make_cache(tmp_path / "src", n_fx=1, triton=False)
    plain = archive_save.save(tmp_path / "mine.tar", src, mega=False)
    assert keys.describe_own(plain.signed_by) == f"this machine's key {plain.signed_by}"
    monkeypatch.setenv("COMPILEWATCH_SIGNING_KEY", str(ci_key))
    r = invoke(app, ["cache", "save", str(tmp_path / "ci.tar"), "--dir", str(src), "--no-mega"])
    assert r.exit_code == 0, r.output
    line = next(x for x in r.stdout.splitlines() if x.startswith("signed by"))
    assert "this machine's key" not in line and f"from COMPILEWATCH_SIGNING_KEY ({ci_key})" in line, line
    data = invoke_json(app, ["cache", "save", str(tmp_path / "ci2.tar"), "--dir", str(src), "--no-mega"])
    assert data["signed_by"] != plain.signed_by and data["signed_by"] in line
    assert keys.describe_own(data["signed_by"]) == f"key {data['signed_by']} from COMPILEWATCH_SIGNING_KEY ({ci_key})"
    p = reader.check_provenance(tmp_path / "ci.tar")
    assert p.verdict == "own" and not p.summary.startswith("made here") and "COMPILEWATCH_SIGNING_KEY" in p.summary
    r = invoke(app, ["cache", "verify", str(tmp_path / "ci.tar")])
    assert r.exit_code == 0 and r.stdout.startswith("signed by your own key: key ed25519:"), r.stdout
    r = invoke(app, ["cache", "trust", "list"])
    assert r.exit_code == 0 and "from COMPILEWATCH_SIGNING_KEY" in r.stdout and "this machine:" not in r.stdout
    monkeypatch.delenv("COMPILEWATCH_SIGNING_KEY")
    assert reader.check_provenance(tmp_path / "mine.tar").summary.startswith("made here: signed by this machine's key")


# --- 5. trust list flags what `trust add` never makes -------------------------------------------------
def test_trust_list_flags_one_key_under_two_names_and_two_keys_under_one(tmp_path, other_machine):
    """A hand-edited (or merged) trust store listing one key as alice and bob was listed without a
    word; so were two different keys both named alice."""
    with other_machine("a"):
        a = keys.public_key_line(keys.own_public_key(create=True))
    with other_machine("b"):
        b = keys.public_key_line(keys.own_public_key(create=True))
    keys.trust_add(a, name="alice")
    assert keys.trust_store().notes == ()
    store = keys.trust_path()
    entry = json.loads(store.read_text())["keys"][0]
    other = keys.parse_public_key(b)
    twin = dict(entry, name="bob")
    clash = dict(entry, id=other.id, public_key=other.public_key, name="alice")
    keys.write_private(store, json.dumps({"keys": [entry, twin, clash]}).encode())
    notes = keys.trust_store().notes
    assert len(notes) == 2
    assert notes[0].startswith(f"key {entry['id']} is trusted under 2 names ('alice', 'bob')")
    assert notes[1].startswith("2 different keys are named 'alice'")
    r = invoke(app, ["cache", "trust", "list"])
    assert r.exit_code == 0 and r.stderr.count("warning:") == 2 and "under 2 names" in r.stderr, r.output
    assert invoke_json(app, ["cache", "trust", "list"])["notes"] == list(notes)


def test_trust_list_flags_this_machines_own_key_in_the_store(tmp_path):
    own = keys.own_public_key(create=True)
    keys.write_private(keys.trust_path(), json.dumps({"keys": [
        {"id": own.id, "public_key": own.public_key, "name": "me", "added_at": "2026-01-01T00:00:00+00:00"}]}).encode())
    (note,) = keys.trust_store().notes
    assert note.startswith(f"this machine's own key {own.id} is also listed, as 'me'")


# --- red team: verify said "ok" for archives load refuses ---------------------------------------------
@pytest.mark.parametrize("extra, said", [
    ({"/etc/evil": b"x"}, "a member `cache load` never writes"),
    ({"cache/../../evil": b"x"}, "a member `cache load` never writes"),
    ({"notcache/x": b"x"}, "a member `cache load` never writes"),
])
def test_verify_flags_a_member_name_load_never_writes(tmp_path, saved, extra, said):
    """A signed archive holding `/etc/evil`, `cache/../../evil` or `notcache/x`: `cache verify` said ok
    (exit 0, "the one `cache load` takes without --trust") and `cache load` then refused it."""
    from tests.cache_helpers import signed_tar

    members = tar_members(saved)
    bad = signed_tar(tmp_path / "bad.tar", [*members[:1], *extra.items(), *members[1:]])
    report = archive_check.verify_archive(bad)
    assert report.provenance.verdict == "own" and not report.ok
    assert [(f.member, f.kind) for f in report.findings] == [(next(iter(extra)), "refused")]
    assert said in report.findings[0].detail
    r = invoke(app, ["cache", "verify", str(bad)])
    assert r.exit_code == 1 and "cache load refuses it, with --trust too" in r.stdout, r.stdout
    with pytest.raises(BadInput, match="unexpected member"):
        archive_load.load(bad, tmp_path / "dst", trust=True)


def test_verify_checks_members_against_the_manifest_as_load_does(tmp_path, saved, monkeypatch):
    """Unlisted and missing members and a file where a folder must go, in a signed archive: each was
    "ok" in verify and refused by load. Large members (scanned as they stream) are listed the same way."""
    from tests.cache_helpers import signed_tar

    members = tar_members(saved)
    fx = next(n for n, _ in members if n.startswith("cache/fxgraph/"))
    changed = [(n, d) for n, d in members if n != fx]  # listed in the manifest, not in the archive
    changed[1:1] = [("cache/unlisted.cpp", b"//"), ("cache/qq", b"x"), ("cache/qq/child", b"y")]
    bad = signed_tar(tmp_path / "bad.tar", changed)
    report = archive_check.verify_archive(bad)
    assert report.provenance.verdict == "own" and not report.ok
    got = {(f.member, f.detail.split(":")[0]) for f in report.findings}
    assert got == {(fx, "listed in the manifest, not in the archive"), ("cache/unlisted.cpp", "not in the manifest"),
                   ("cache/qq", "not in the manifest"), ("cache/qq/child", "not in the manifest"),
                   ("cache/qq/child", "needs a folder where the archive holds the file cache/qq")}
    with pytest.raises(BadInput, match="is not in the manifest"):
        archive_load.load(bad, tmp_path / "dst", trust=True)
    no_manifest = signed_tar(tmp_path / "nm.tar", [(n, d) for n, d in members if n != reader.MANIFEST])
    assert [(f.member, f.kind) for f in archive_check.verify_archive(no_manifest).findings] == [
        (reader.MANIFEST, "refused")]
    monkeypatch.setattr(reader, "IN_MEMORY", 16)  # every cache member streams through the scan
    report = archive_check.verify_archive(saved)
    assert report.ok and report.findings == (), report.findings


# --- red team: cache diff waited forever on a FIFO ---------------------------------------------------
def test_diff_refuses_a_fifo_side_instead_of_waiting_for_a_writer(tmp_path, saved):
    from tests.helpers import time_limit

    fifo = tmp_path / "side"
    os.mkfifo(fifo)
    with time_limit(10):
        r = invoke(app, ["cache", "diff", str(fifo), str(saved)])
    assert r.exit_code == 2 and "a FIFO" in r.stderr and "Traceback" not in r.output, r.output


# --- red team: trust store and `trust add` messages ----------------------------------------------------
def test_a_bad_entry_in_the_trust_store_names_the_file_and_the_entry(tmp_path, other_machine):
    """`cache trust list` said only "key name 'bob smith' is not 1-64 letters..." (which key? where?)."""
    with other_machine():
        line = keys.public_key_line(keys.own_public_key(create=True))
    keys.trust_add(line, name="alice")
    store = keys.trust_path()
    entry = json.loads(store.read_text())["keys"][0]
    for bad in (dict(entry, name="bob smith"), dict(entry, public_key="AAAA")):
        keys.write_private(store, json.dumps({"keys": [entry, bad]}).encode())
        r = invoke(app, ["cache", "trust", "list"])
        assert r.exit_code == 2 and r.stderr.startswith(f"error: {store}: keys[1] ("), r.stderr
        assert "fix or remove that entry" in r.stderr


def test_trust_add_reads_a_pipe_and_names_a_directory_fifo_or_empty_file(tmp_path, other_machine):
    """`trust add DIR` and `trust add FIFO` said "not an Ed25519 public key: 'DIR'"; an empty file "no public
    key given"; `trust add <(ssh ci compilewatch cache trust key)` (a pipe) was refused the same way."""
    from tests.helpers import time_limit

    (tmp_path / "d").mkdir()
    os.mkfifo(tmp_path / "f")
    (tmp_path / "e").write_text("")
    for path, said in (("d", "is a directory"), ("f", "FIFO"), ("e", "is empty")):
        with time_limit(10):
            r = invoke(app, ["cache", "trust", "add", str(tmp_path / path)])
        assert r.exit_code == 2 and said in r.stderr and "Ed25519" not in r.stderr, (path, r.stderr)
    with other_machine():
        line = keys.public_key_line(keys.own_public_key(create=True))
    rd, wr = os.pipe()
    os.write(wr, line.encode() + b"\n")
    os.close(wr)
    try:
        added = keys.trust_add(f"/dev/fd/{rd}", name="ci")
    finally:
        os.close(rd)
    assert added.name == "ci" and keys.trust_store().keys == (added,)


def test_trust_add_of_your_own_env_key_says_which_key(tmp_path, monkeypatch, other_machine):
    with other_machine("ci"):
        keys.signing_key()
        ci_key = tmp_path / "ci-key.pem"
        ci_key.write_bytes(keys.key_path().read_bytes())
    os.chmod(ci_key, 0o600)
    monkeypatch.setenv("COMPILEWATCH_SIGNING_KEY", str(ci_key))
    line = keys.public_key_line(keys.own_public_key())
    with pytest.raises(BadInput, match=r"is your own signing key, from COMPILEWATCH_SIGNING_KEY \("):
        keys.trust_add(line)


def test_a_filesystem_that_reports_no_blocks_does_not_make_every_archive_a_bomb(monkeypatch):
    """Some FUSE mounts (object stores) report st_blocks 0 for every file: the archive's size counts."""
    st = os.stat_result((0o100644, 0, 0, 1, 0, 0, 1 << 30, 0, 0, 0))  # 1 GiB, st_blocks unset
    assert reader.inflate_limit(st) == reader.MAX_RATIO << 30
    zero = os.stat_result((0o100644, 0, 0, 1, 0, 0, 1 << 30, 0, 0, 0), {"st_blocks": 0})
    assert reader.inflate_limit(zero) == reader.MAX_RATIO << 30
    sparse = os.stat_result((0o100644, 0, 0, 1, 0, 0, 1 << 30, 0, 0, 0), {"st_blocks": 8})
    assert reader.inflate_limit(sparse) == reader.MIN_INFLATE
