"""cache verify on synthetic caches: each kind of damage, foreign entries, --fix moving aside."""

from __future__ import annotations

import json
import os
import time

import pytest

from compilewatch import torchinfo
from compilewatch.cache.content import verify as verify_mod
from tests.cache_helpers import OTHER_KEY, entry_pickle, make_cache, tree, write

KDIR = "triton/0/KERNELAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA"


def kinds(report) -> dict[str, int]:
    return dict(report.counts)


def test_clean_cache_is_ok(tmp_path):
    r = verify_mod.verify(make_cache(tmp_path / "c"))
    assert r.ok and not r.foreign and r.findings == ()
    assert r.entry_system_keys == {torchinfo.system_key(): 6}
    assert r.checked["locks"] == 4  # empty lock files are normal
    assert any("triton kernel targets" in n and "cuda:90" in n for n in r.not_checked)  # no GPU here


def test_torch_215_load_ok_markers_are_not_empty_entries(tmp_path):
    """torch 2.14/2.15's cpu_vec_isa.py writes a zero-byte `<probe>.so.load_ok` on purpose once the probe .so
    dlopen'ed; an empty .so is still an error."""
    root = make_cache(tmp_path / "c")
    so = next(root.glob("*/c02*.so"))
    (so.parent / (so.name + ".load_ok")).write_bytes(b"")
    assert verify_mod.verify(root).findings == ()
    so.write_bytes(b"")
    r = verify_mod.verify(root)
    assert [(f.kind, f.path) for f in r.findings] == [("empty", str(so.relative_to(root)))]


@pytest.mark.parametrize("damage, kind", [
    (lambda root: (root / "01" / ("c01" + "x" * 49 + ".cpp")).write_bytes(b""), "empty"),
    (lambda root: _truncate(next(root.glob("fxgraph/*/*/*")), 20), "truncated"),
    (lambda root: _truncate(next(root.glob("*/c02*.so")), 100), "truncated"),
    (lambda root: next(root.glob("*/c03*.py")).write_text("def call(args):\n    return (\n"), "truncated"),
    (lambda root: (root / KDIR / "triton_poi_0.cubin").unlink(), "missing-binary"),
    (lambda root: (root / KDIR / "triton_poi_0.json").write_text('{"name": '), "truncated"),
])
def test_damage_is_found(tmp_path, damage, kind):
    root = make_cache(tmp_path / "c")
    damage(root)
    r = verify_mod.verify(root)
    assert not r.ok
    assert kind in r.counts, r.findings
    assert all(f.severity == "error" for f in r.findings if f.kind == kind)


def _truncate(p, keep):
    p.write_bytes(p.read_bytes()[:keep])


def test_unloadable_pickle_is_found_in_deep_mode_only(tmp_path):
    root = make_cache(tmp_path / "c")
    # pickle framing (0x80 ... '.') around opcodes that do not parse
    p = next(root.glob("fxgraph/*/*/*"))
    p.write_bytes(b"\x80\x04\x95\x1d\x00\x00\x00\x00\x00\x00\x00\xff\xfe.")
    deep = verify_mod.verify(root)
    assert deep.counts == {"unloadable": 1}
    quick = verify_mod.verify(root, deep=False)
    assert quick.ok and any("quick mode" in n for n in quick.not_checked)


def test_pickle_naming_a_foreign_global_is_untrusted_and_never_unpickled(tmp_path):
    """S1: an entry whose pickle calls os.system; verify names it and does not run it."""
    import pickle

    marker = tmp_path / "ran"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    root = make_cache(tmp_path / "c")
    p = next(root.glob("fxgraph/*/*/*"))
    p.write_bytes(pickle.dumps(Evil(), protocol=4))
    r = verify_mod.verify(root)
    assert r.counts == {"untrusted": 1}
    assert "posix.system" in r.findings[0].detail or "os.system" in r.findings[0].detail
    assert not marker.exists()
    # the same pickle naming a class that does not exist: also untrusted, not a crash
    p.write_bytes(b"\x80\x04\x95\x14\x00\x00\x00\x00\x00\x00\x00\x8c\x06nosuch\x94\x8c\x05Thing\x94\x93\x94.")  # a frame of its 20 bytes
    assert verify_mod.verify(root).counts == {"untrusted": 1}
    # a frame declaring more bytes than the pickle holds (29 of 20) does not load: unloadable, not scanned on
    p.write_bytes(b"\x80\x04\x95\x1d\x00\x00\x00\x00\x00\x00\x00\x8c\x06nosuch\x94\x8c\x05Thing\x94\x93\x94.")
    assert verify_mod.verify(root).counts == {"unloadable": 1}


def test_metadata_without_binary_and_no_group_file(tmp_path):
    root = make_cache(tmp_path / "c")
    (root / KDIR / "__grp__triton_poi_0.json").unlink()
    (root / KDIR / "triton_poi_0.cubin").unlink()
    r = verify_mod.verify(root)
    assert r.counts == {"missing-binary": 1}
    assert r.findings[0].entry == KDIR


def test_entries_for_another_system_key_are_foreign(tmp_path):
    root = make_cache(tmp_path / "c", system_key=OTHER_KEY)
    write(root, "cache/" + OTHER_KEY, json.dumps({"system": {"device": {"name": "NVIDIA H200"}}, "cache": {}}))
    r = verify_mod.verify(root)
    assert not r.ok and r.foreign
    assert r.counts == {"foreign-system": 7}
    assert r.entry_system_keys == {OTHER_KEY: 7}
    assert any("NVIDIA H200" in f.detail for f in r.findings)


def test_entries_from_another_torch_build_are_foreign(tmp_path):
    root = make_cache(tmp_path / "c", torch_hash="z" * 51)
    r = verify_mod.verify(root)
    assert r.counts == {"foreign-torch": 6} and r.foreign


def test_unstamped_entries_are_unknown_not_foreign(tmp_path):
    root = make_cache(tmp_path / "c")
    for p in root.glob("fxgraph/*/*/*"):
        p.write_bytes(entry_pickle(None))
    r = verify_mod.verify(root)
    assert r.ok and r.entry_system_keys["unknown"] == 3


def test_moved_triton_folder_is_a_relocated_warning(tmp_path):
    root = make_cache(tmp_path / "c")
    moved = tmp_path / "moved"
    os.rename(root, moved)
    r = verify_mod.verify(moved)
    assert r.ok  # warnings do not fail
    assert r.counts == {"relocated": 2}


def test_stale_temp_files_are_warned_young_ones_ignored(tmp_path):
    root = make_cache(tmp_path / "c")
    old = write(root, "fxgraph/f0/.1.2.tmp", b"x")
    os.utime(old, (time.time() - 7200, time.time() - 7200))
    write(root, "fxgraph/f1/.3.4.tmp", b"y")
    r = verify_mod.verify(root)
    assert r.ok and r.counts == {"stale-temp": 1}


def test_fix_moves_bad_entries_aside_and_deletes_nothing(tmp_path):
    root = make_cache(tmp_path / "c")
    bad_fx = next(root.glob("fxgraph/*/*/*"))
    _truncate(bad_fx, 10)
    (root / KDIR / "triton_poi_0.cubin").unlink()
    write(root, "aotautograd/aforeign/entry", entry_pickle(OTHER_KEY))
    before = tree(root)
    r = verify_mod.verify(root, fix=True)
    assert not r.ok and r.quarantine
    quarantine = tmp_path / os.path.basename(r.quarantine)
    assert quarantine.is_dir() and quarantine.name.startswith("c.quarantine-")
    after, aside = tree(root), tree(quarantine)
    assert set(after) | set(aside) == set(before) and not set(after) & set(aside)
    assert {**after, **aside} == before  # every byte still exists somewhere
    assert str(bad_fx.relative_to(root)) in aside
    assert any(k.startswith(KDIR) for k in aside)
    assert "aotautograd/aforeign/entry" in aside
    again = verify_mod.verify(root)
    assert again.ok and again.findings == ()


def test_broken_local_cache_json_is_truncated(tmp_path):
    root = make_cache(tmp_path / "c")
    write(root, "cache/" + torchinfo.system_key(), '{"system": {}, "cache": {')
    r = verify_mod.verify(root)
    assert r.counts == {"truncated": 1} and r.findings[0].path.startswith("cache/")


def test_rebase_triton_paths_fixes_a_moved_cache(tmp_path):
    from compilewatch.cache.local.relocate import rebase_triton_paths

    root = make_cache(tmp_path / "c")
    grp = root / KDIR / "__grp__triton_poi_0.json"
    os.chmod(grp, 0o640)
    mtime = grp.stat().st_mtime_ns
    moved_root = tmp_path / "moved"
    os.rename(root, moved_root)
    assert verify_mod.verify(moved_root).counts == {"relocated": 2}
    assert rebase_triton_paths(moved_root, moved_root) == 1
    grp = moved_root / KDIR / "__grp__triton_poi_0.json"
    assert all(p.startswith(str(moved_root / KDIR)) for p in json.loads(grp.read_text())["child_paths"].values())
    assert grp.stat().st_mode & 0o777 == 0o640 and grp.stat().st_mtime_ns == mtime
    assert verify_mod.verify(moved_root).counts == {}
    assert rebase_triton_paths(moved_root, moved_root) == 0  # idempotent


def test_fix_rewrites_relocated_paths(tmp_path):
    root = make_cache(tmp_path / "c")
    moved_root = tmp_path / "moved"
    os.rename(root, moved_root)
    r = verify_mod.verify(moved_root, fix=True)
    assert r.counts == {"relocated": 2} and r.paths_rewritten == 1 and r.moved == () and r.quarantine is None
    assert verify_mod.verify(moved_root).counts == {}


def test_a_file_too_large_to_read_is_unloadable_and_a_fifo_never_blocks(tmp_path, monkeypatch):
    """verify reads each file once, bounded (picklescan.MAX_SCAN, what cache load would scan), and
    opens it non-blocking: a cache from elsewhere can hold a huge pickle or a FIFO where a file was."""
    from compilewatch.cache.trust import picklescan
    from tests.helpers import time_limit

    root = make_cache(tmp_path / "c")
    big = next(root.glob("fxgraph/*/*/entry2"))  # the largest entry (pad 200)
    limit = picklescan.MAX_SCAN
    monkeypatch.setattr(picklescan, "MAX_SCAN", big.stat().st_size - 1)
    r = verify_mod.verify(root)
    assert [(f.kind, f.path) for f in r.findings] == [("unloadable", str(big.relative_to(root)))]
    assert "not checked" in r.findings[0].detail
    monkeypatch.setattr(picklescan, "MAX_SCAN", limit)
    fifo = next(root.glob("aotautograd/*/entry0"))
    real_read = verify_mod._Checker.read

    def swap_then_read(self, rel):  # the file becomes a FIFO after the walk listed it as a file
        if rel == str(fifo.relative_to(root)):
            fifo.unlink()
            os.mkfifo(fifo)
        return real_read(self, rel)

    monkeypatch.setattr(verify_mod._Checker, "read", swap_then_read)
    with time_limit(30):
        r = verify_mod.verify(root)
    assert any(str(fifo.relative_to(root)) in n and "not a regular file" in n for n in r.not_checked), r.not_checked
