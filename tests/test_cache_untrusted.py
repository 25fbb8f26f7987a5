"""Issue 18, cache side: crafted archives and dirs are refused with exit 2 and the cache untouched.

Each test is one case from the issue (S1-S4 and the listed tracebacks), named after it. Archives are
forged the way an attacker would: a real `cache save` archive with members replaced or added and the
manifest's sizes and hashes updated to match, so only the check under test can catch them.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import shutil
import tarfile
from pathlib import Path

import pytest
import xxhash

from compilewatch.cache.archive import load as archive_load
from compilewatch.cache.archive import reader
from compilewatch.cache.archive import save as archive_save
from compilewatch.cache.content import fingerprint as fp_mod
from compilewatch.cache.content import verify as verify_mod
from compilewatch.cache.local import manage
from compilewatch.cache.trust import provenance
from compilewatch.errors import BadInput
from tests.cache_helpers import make_cache, tar_members, tree, write, write_tar
from tests.helpers import invoke


class _RunsCode:
    """A pickle that runs a shell command when unpickled (S1)."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _forge(src_tar, dst_tar, *, replace=None, add=None, manifest_edit=None, header_edit=None, sign=True):
    """Copy a saved archive with cache members replaced/added; the manifest is updated to match and,
    with `sign`, the archive is signed again by this machine's key: what a trusted machine that was
    compromised (or a trusted colleague's mistake) would produce, so that only the second-line check
    under test can catch it. `sign=False` leaves the original signature, which no longer matches."""
    replace, add = replace or {}, add or {}
    members = tar_members(src_tar)
    out = []
    manifest = None
    for name, data in members:
        rel = name[len(reader.PREFIX):] if name.startswith(reader.PREFIX) else None
        if name == reader.MANIFEST:
            manifest = json.loads(data)
            continue
        if name == provenance.SIGNATURE:
            old_signature = data
            continue
        if name == reader.HEADER and header_edit:
            data = json.dumps(header_edit(json.loads(data))).encode()
        if rel is not None and rel in replace:
            data = replace[rel]
        out.append((name, data))
    out += [(reader.PREFIX + rel, data) for rel, data in add.items()]
    entries = {e["rel"]: e for e in manifest["entries"]}
    for name, data in out:
        if name.startswith(reader.PREFIX):
            rel = name[len(reader.PREFIX):]
            e = entries.setdefault(rel, {"rel": rel, "mtime_ns": 0})
            e["size"], e["hash"] = len(data), xxhash.xxh3_128_hexdigest(data)
    manifest["entries"] = list(entries.values())
    manifest["files"] = len(entries)
    manifest["bytes"] = sum(e["size"] for e in entries.values())
    if manifest_edit:
        manifest_edit(manifest)
    out.append((reader.MANIFEST, json.dumps(manifest).encode()))
    if sign:
        rec = provenance.Recorder()
        for name, data in out:
            rec.add_bytes(name, data)
        out.append((provenance.SIGNATURE, rec.signature_member()))
    else:
        out.append((provenance.SIGNATURE, old_signature))
    return write_tar(dst_tar, out)


@pytest.fixture
def saved(tmp_path):
    src = make_cache(tmp_path / "src")
    archive_save.save(tmp_path / "a.tar", src)
    return tmp_path / "a.tar"


def _fx_rel(tar):
    with tarfile.open(tar) as t:
        return next(m.name for m in t.getmembers() if m.name.startswith("cache/fxgraph/"))[len(reader.PREFIX):]


def _refused_untouched(tmp_path, bad, match, **kw):
    dst = make_cache(tmp_path / "dst", n_fx=1, triton=False)
    before = tree(dst)
    names = set(os.listdir(tmp_path))
    with pytest.raises(BadInput, match=match) as info:
        archive_load.load(bad, dst, **kw)
    assert tree(dst) == before and set(os.listdir(tmp_path)) == names  # no temp dir left, no backup made
    return info.value


def test_s1_archive_with_a_code_running_pickle_is_refused_and_never_run(tmp_path, saved):
    marker = tmp_path / "ran"
    rel = _fx_rel(saved)
    bad = _forge(saved, tmp_path / "evil.tar", replace={rel: pickle.dumps(_RunsCode(marker), protocol=4)})
    err = _refused_untouched(tmp_path, bad, "refused")
    assert f"cache/{rel}" in err.message and "system" in err.message and "--trust" in err.hint
    assert not marker.exists()
    # --trust loads it (nothing is unpickled by loading); verify then names it and still runs nothing
    dst2 = tmp_path / "trusted"
    archive_load.load(bad, dst2, trust=True)
    report = verify_mod.verify(dst2)
    assert report.counts.get("untrusted") == 1 and not marker.exists()


def test_s1_cli_load_exits_2_naming_member_and_global(tmp_path, saved):
    from cli.main import app

    bad = _forge(saved, tmp_path / "evil.tar", replace={_fx_rel(saved): pickle.dumps(_RunsCode(tmp_path / "x"))})
    r = invoke(app, ["cache", "load", str(bad), "--dir", str(tmp_path / "dst")])
    assert r.exit_code == 2 and "refused cache/fxgraph/" in r.stderr and "Traceback" not in r.stderr


def test_s2_load_reports_the_hash_it_extracted_not_the_manifests_claim(tmp_path, saved):
    lying = _forge(saved, tmp_path / "lying.tar",
                   manifest_edit=lambda m: m.update(content_hash="xxh3-128:" + "0" * 32))
    res = archive_load.load(lying, tmp_path / "dst")
    assert res.content_hash != "xxh3-128:" + "0" * 32
    # the bytes extracted are the saved cache's (triton paths are rewritten after that, for the new place)
    assert res.content_hash == fp_mod.fingerprint(tmp_path / "src").content_hash


def test_s3_member_larger_than_the_manifest_says_is_refused_before_writing(tmp_path, saved):
    rel = _fx_rel(saved)
    big = _forge(saved, tmp_path / "big.tar", replace={rel: b"\x80" + b"\0" * (8 << 20) + b"."},
                 manifest_edit=lambda m: [e.update(size=10) for e in m["entries"] if e["rel"] == rel])
    _refused_untouched(tmp_path, big, "the manifest says 10")


def test_s3_members_listed_larger_than_the_free_disk_are_refused_first(tmp_path, saved):
    rel = _fx_rel(saved)
    huge = _forge(saved, tmp_path / "huge.tar",
                  manifest_edit=lambda m: [e.update(size=1 << 60) for e in m["entries"] if e["rel"] == rel])
    _refused_untouched(tmp_path, huge, "free")


def test_s3_free_space_counts_the_members_not_the_manifests_total(tmp_path, saved, monkeypatch):
    """Issue 29: a manifest saying 0 bytes passed the free-space check. The check adds up the members'
    sizes (what extraction may write), whatever the manifest's `bytes` claims."""
    lying = _forge(saved, tmp_path / "zero.tar", manifest_edit=lambda m: m.update(bytes=0))
    real = sum(e.size for e in reader.read_manifest(lying).entries)
    assert real > 0 and reader.read_manifest(lying).bytes == 0
    free = archive_load.DISK_MARGIN + real // 2  # enough for the claim, not for the members
    usage = type(shutil.disk_usage("/"))
    monkeypatch.setattr(archive_load.shutil, "disk_usage", lambda p: usage(1 << 40, (1 << 40) - free, free))
    err = _refused_untouched(tmp_path, lying, "free")
    assert f"holds {real} bytes" in err.message


def test_s3_extraction_stops_and_cleans_up_when_the_disk_fills_meanwhile(tmp_path, saved, monkeypatch):
    """Bytes are counted as they are written: when the real free space falls below the margin during
    extraction (another writer), the load stops, removes what it wrote, and changes nothing."""
    usage = type(shutil.disk_usage("/"))
    calls = {"n": 0}

    def shrinking(p):
        calls["n"] += 1
        free = (1 << 40) if calls["n"] <= 2 else 1024  # fine for the checks before writing, then full
        return usage(1 << 40, (1 << 40) - free, free)

    monkeypatch.setattr(archive_load._SpaceBudget, "_RECHECK", 1)
    monkeypatch.setattr(archive_load.shutil, "disk_usage", shrinking)
    _refused_untouched(tmp_path, saved, "running out of space")


def test_s3_members_the_manifest_does_not_list_are_refused(tmp_path, saved):
    extra = _forge(saved, tmp_path / "extra.tar", add={"ab/cabextra.py": b"x = 1\n"},
                   manifest_edit=lambda m: m.update(entries=[e for e in m["entries"] if e["rel"] != "ab/cabextra.py"]))
    _refused_untouched(tmp_path, extra, "not in the manifest")


def test_header_system_key_an_int_is_bad_input(tmp_path, saved):
    bad = _forge(saved, tmp_path / "h.tar", header_edit=lambda h: {**h, "system_key": 12})
    _refused_untouched(tmp_path, bad, "system_key: expected a string")


def test_header_system_info_a_string_is_bad_input(tmp_path, saved):
    bad = _forge(saved, tmp_path / "h.tar", header_edit=lambda h: {**h, "system_info": "gpu"})
    _refused_untouched(tmp_path, bad, "system_info: expected an object")


def test_manifest_not_json_is_bad_input(tmp_path, saved):
    out = tmp_path / "m.tar"
    with tarfile.open(saved) as tin, tarfile.open(out, "w") as tout:
        for m in tin.getmembers():
            data = b"{not json" if m.name == reader.MANIFEST else tin.extractfile(m).read()
            m.size = len(data)
            tout.addfile(m, io.BytesIO(data))
    _refused_untouched(tmp_path, out, "foreign")
    _refused_untouched(tmp_path, out, "invalid JSON", trust=True)


def test_member_file_then_child_of_it_is_bad_input(tmp_path, saved):
    bad = _forge(saved, tmp_path / "qq.tar", add={"qq": b"a", "qq/child": b"b"})
    _refused_untouched(tmp_path, bad, "cannot write member qq/child")


def test_member_name_of_300_characters_is_bad_input(tmp_path, saved):
    bad = _forge(saved, tmp_path / "long.tar", add={"ab/" + "c" * 300: b"x"})
    _refused_untouched(tmp_path, bad, "path component longer than 255 bytes")


def test_loading_an_empty_dir_is_bad_input(tmp_path):
    (tmp_path / "empty").mkdir()
    dst = make_cache(tmp_path / "dst", n_fx=1, triton=False)
    before = tree(dst)
    with pytest.raises(BadInput, match="it is empty"):
        archive_load.load(tmp_path / "empty", dst)
    assert tree(dst) == before and (tmp_path / "empty").is_dir()


def test_loading_a_dir_that_is_not_a_cache_is_bad_input(tmp_path):
    write(tmp_path / "proj", "README.md", "mine")
    with pytest.raises(BadInput, match="does not look like an inductor cache"):
        archive_load.load(tmp_path / "proj", tmp_path / "dst")
    assert (tmp_path / "proj" / "README.md").read_text() == "mine"


def _s4_dir(root):
    for rel in ("cache/x", "db/prod.sqlite", "go/main.go", "logs/a.log", "notes.txt"):
        write(root, rel, "precious")
    return root


def test_s4_clear_refuses_a_dir_of_two_letter_folders_without_force(tmp_path):
    d = _s4_dir(tmp_path / "data")
    before = tree(d)
    with pytest.raises(BadInput, match="does not look like an inductor cache"):
        manage.clear(d, backup=False, yes=True)
    with pytest.raises(BadInput, match="does not look like an inductor cache"):
        manage.prune(0, d)
    assert tree(d) == before
    res = manage.clear(d, force=True)  # --force: still a backup, never a delete unless asked
    assert res.backup and tree(Path(res.backup)) == before


def test_s4_cli_clear_no_backup_exits_2(tmp_path, monkeypatch):
    from cli.main import app

    d = _s4_dir(tmp_path / "data")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(d))
    r = invoke(app, ["cache", "clear", "--no-backup", "--yes"])
    assert r.exit_code == 2 and "--force" in r.stderr and (d / "db" / "prod.sqlite").exists()


def test_a_cache_only_dir_is_not_a_cache(tmp_path):
    write(tmp_path / "c", "cache/abc", "{}")
    with pytest.raises(BadInput, match="does not look like an inductor cache"):
        manage.clear(tmp_path / "c")
