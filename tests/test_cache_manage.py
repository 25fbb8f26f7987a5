"""cache clear / prune / ls / du / diff and the inter-process lock, on synthetic caches."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import pytest

from compilewatch.cache.archive import diff as cache_diff
from compilewatch.cache.archive import load as archive_load
from compilewatch.cache.archive import save as archive_save
from compilewatch.cache.content import fingerprint as fp_mod
from compilewatch.cache.local import lock as lock_mod
from compilewatch.cache.local import manage
from compilewatch.errors import BadInput
from compilewatch.serialize import to_jsonable
from tests.cache_helpers import big_cache, make_cache, tar_members, tree, write, write_tar


# --- clear ----------------------------------------------------------------------------------------
def test_clear_moves_to_a_backup_and_says_how_to_restore(tmp_path):
    root = make_cache(tmp_path / "c")
    before = tree(root)
    r = manage.clear(root)
    assert not root.exists() and not r.deleted
    backup = tmp_path / os.path.basename(r.backup)
    assert backup.name.startswith("c.backup-") and tree(backup) == before
    assert r.restore_command == f"compilewatch cache load {backup} --dir {root}"
    assert r.files == len(before)
    archive_load.load(backup, root)  # the printed restore works
    assert tree(root) == before


def test_clear_without_backup_needs_yes(tmp_path):
    root = make_cache(tmp_path / "c")
    before = tree(root)
    with pytest.raises(BadInput, match="--yes"):
        manage.clear(root, backup=False)
    assert tree(root) == before
    r = manage.clear(root, backup=False, yes=True)
    assert r.deleted and r.backup is None and not root.exists()
    assert not [n for n in os.listdir(tmp_path) if n.startswith("c.")]


def test_clear_missing_or_foreign_dir_is_bad_input(tmp_path):
    with pytest.raises(BadInput, match="does not exist"):
        manage.clear(tmp_path / "nope")
    write(tmp_path / "home", "notes.txt", "mine")
    with pytest.raises(BadInput, match="does not look like"):
        manage.clear(tmp_path / "home")
    assert (tmp_path / "home" / "notes.txt").exists()


# --- prune ----------------------------------------------------------------------------------------
def _aged_cache(tmp_path):
    root = make_cache(tmp_path / "c", n_fx=3, n_codegen=0, triton=False)
    # three fxgraph entries of known age: f00 oldest, f02 newest; each 1-2 KB
    for i, p in enumerate(sorted(root.glob("fxgraph/*/*/*"))):
        p.write_bytes(p.read_bytes() + b"\0" * 1000)
        os.utime(p, (1_700_000_000 + i * 1000, 1_700_000_000 + i * 1000))
    for p in root.glob("aotautograd/*/*"):
        os.utime(p, (1_800_000_000, 1_800_000_000))  # recently used
    return root


def test_prune_removes_least_recently_used_first(tmp_path):
    root = _aged_cache(tmp_path)
    total = sum(p.stat().st_size for p in root.rglob("*") if p.is_file())
    f00 = next(root.glob("fxgraph/*/f00*/*")).stat().st_size
    f01 = next(root.glob("fxgraph/*/f01*/*")).stat().st_size
    r = manage.prune(total - f00 - 1, root)
    assert [e.name.split("/")[-1][:3] for e in r.removed] == ["f00", "f01"]
    assert r.bytes_after == total - f00 - f01 and r.bytes_after <= r.max_bytes
    moved = tmp_path / os.path.basename(r.moved_to)
    assert len(list(moved.glob("fxgraph/*/*/*"))) == 2  # kept aside, not deleted
    assert len(list(root.glob("fxgraph/*/*/*"))) == 1 and len(list(root.glob("aotautograd/*/*"))) == 3


def test_prune_dry_run_and_delete(tmp_path):
    root = _aged_cache(tmp_path)
    before = tree(root)
    r = manage.prune(0, root, dry_run=True)
    assert r.dry_run and len(r.removed) == 6 and tree(root) == before and r.moved_to is None
    with pytest.raises(BadInput, match="--yes"):
        manage.prune(0, root, delete=True)
    r = manage.prune("1K", root, delete=True, yes=True)
    assert r.deleted and r.bytes_after <= 1024
    assert not [n for n in os.listdir(tmp_path) if ".pruned-" in n or ".deleting-" in n]


def test_prune_keeps_generated_module_files_together(tmp_path):
    root = make_cache(tmp_path / "c", n_fx=0, n_codegen=2, triton=False)
    stem0 = next(root.glob("00/c00*.py")).stem
    for p in root.glob(f"00/{stem0}.*"):
        os.utime(p, (1_600_000_000, 1_600_000_000))
    r = manage.prune(manage.parse_size("1"), root)
    assert r.removed[0].name == f"00/{stem0}" and r.removed[0].files == 3


@pytest.mark.parametrize("text, n", [("100", 100), ("1K", 1024), ("1.5MB", 1572864), ("2G", 2 << 30),
                                     ("3 GiB", 3 << 30), ("1t", 1 << 40)])
def test_parse_size(text, n):
    assert manage.parse_size(text) == n


@pytest.mark.parametrize("text", ["", "big", "-1G", "1X", "1.2.3M"])
def test_parse_size_rejects(text):
    with pytest.raises(BadInput, match="not a size"):
        manage.parse_size(text)


# --- ls / du --------------------------------------------------------------------------------------
def test_ls_groups_entries_and_sorts(tmp_path):
    root = make_cache(tmp_path / "c")
    r = manage.ls(root)
    names = [e.name for e in r.entries]
    assert r.total_entries == 3 + 3 + 4 + 1 + 1  # fx, aot, codegen modules, triton folder, locks
    assert [e.bytes for e in r.entries] == sorted((e.bytes for e in r.entries), reverse=True)
    assert "locks" in names and any(n.startswith("triton/0/") for n in names)
    fx = manage.ls(root, subcache="fxgraph", sort="name", limit=2)
    assert len(fx.entries) == 2 and fx.total_entries == 3 and all(e.subcache == "fxgraph" for e in fx.entries)
    with pytest.raises(BadInput, match="unknown sub-cache"):
        manage.ls(root, subcache="nope")


def test_du_totals_match_the_files(tmp_path):
    root = big_cache(tmp_path / "big", 400)
    u = manage.du(root, top=3)
    assert u.files == 400 and u.bytes == sum(p.stat().st_size for p in root.rglob("*") if p.is_file())
    assert sum(s.bytes for s in u.subcaches) == u.bytes
    assert len(u.largest) == 3


# --- diff -----------------------------------------------------------------------------------------
def test_diff_dirs_fingerprints_and_archives(tmp_path):
    a = make_cache(tmp_path / "a", triton=False)
    fa = fp_mod.fingerprint(a, files=True)
    (tmp_path / "a.json").write_text(json.dumps(to_jsonable(fa)))
    archive_save.save(tmp_path / "a.tar", a)
    write(a, "fxgraph/zz/fzznew/e", b"\x80new.")
    next(a.glob("aotautograd/a00*/*")).unlink()
    p = next(a.glob("*/c01*.cpp"))
    p.write_text("// changed\n")
    for old in (tmp_path / "a.json", tmp_path / "a.tar"):
        d = cache_diff.diff(old, a)
        assert not d.same and d.per_file
        subs = {s.name: s for s in d.subcaches}
        assert subs["fxgraph"].added == ("fxgraph/zz/fzznew/e",)
        assert len(subs["aotautograd"].removed) == 1
        assert subs["codegen"].changed == (str(p.relative_to(a)),)
        assert subs["locks"].same
    assert cache_diff.diff(tmp_path / "a.json", tmp_path / "a.tar").same


def test_diff_says_what_each_side_is_and_that_a_foreign_manifest_is_only_a_claim(tmp_path, monkeypatch):
    """An archive is read whole for diff: own when every member matches what this machine signed;
    foreign (from another machine, or changed after signing) when its manifest is only its maker's word."""
    from cli.main import app
    from tests.helpers import invoke, invoke_json

    a = make_cache(tmp_path / "a", triton=False)
    (tmp_path / "a.json").write_text(json.dumps(to_jsonable(fp_mod.fingerprint(a, files=True))))
    own = archive_save.save(tmp_path / "a.tar", a).archive
    d = cache_diff.diff(tmp_path / "a.json", own)
    assert d.same and (d.source_a, d.source_b) == ("fingerprint", "own") and d.source_reason_b
    assert (cache_diff.diff(a, a).source_a, cache_diff.diff(a, a).source_b) == ("dir", "dir")
    # the same archive with one member swapped and the manifest left as it was: the manifest still says
    # "same", and the diff says it is only a claim
    members = tar_members(own)
    fx = next(n for n, _ in members if n.startswith("cache/fxgraph/"))
    lying = write_tar(tmp_path / "lying.tar", [(n, b"\x80\x04N." if n == fx else d) for n, d in members])
    d = cache_diff.diff(a, lying)
    assert d.same and d.source_b == "foreign" and fx in d.source_reason_b
    out = invoke(app, ["cache", "diff", str(a), str(lying)])
    assert out.exit_code == 0 and "B is a foreign archive" in out.stdout and "only what its maker claims" in out.stdout
    j = invoke_json(app, ["cache", "diff", str(a), str(lying)])
    assert j["source_b"] == "foreign" and j["source_a"] == "dir"
    # from another machine (another config dir, so another signing key)
    mine = os.environ["COMPILEWATCH_CONFIG_DIR"]
    monkeypatch.setenv("COMPILEWATCH_CONFIG_DIR", str(tmp_path.parent / f"{tmp_path.name}-other-config"))
    theirs = archive_save.save(tmp_path / "theirs.tar", a).archive
    monkeypatch.setenv("COMPILEWATCH_CONFIG_DIR", mine)
    assert cache_diff.diff(own, theirs).source_b == "foreign"


def test_diff_without_per_file_entries_compares_hashes(tmp_path):
    a = make_cache(tmp_path / "a", triton=False)
    (tmp_path / "a.json").write_text(json.dumps(to_jsonable(fp_mod.fingerprint(a))))
    d = cache_diff.diff(tmp_path / "a.json", a)
    assert d.same and not d.per_file


def test_diff_bad_inputs(tmp_path):
    a = make_cache(tmp_path / "a")
    (tmp_path / "x.json").write_text('{"hello": 1}')
    (tmp_path / "broken.json").write_text('{"hello": ')
    with pytest.raises(BadInput, match="not a compilewatch fingerprint"):
        cache_diff.diff(tmp_path / "x.json", a)
    with pytest.raises(BadInput, match="broken.json:1: invalid JSON"):
        cache_diff.diff(tmp_path / "broken.json", a)
    with pytest.raises(BadInput, match="does not exist"):
        cache_diff.diff(tmp_path / "missing", a)


# --- lock -----------------------------------------------------------------------------------------
def test_a_held_lock_blocks_mutations_and_says_who(tmp_path, monkeypatch):
    root = make_cache(tmp_path / "c")
    monkeypatch.setattr(lock_mod, "DEFAULT_TIMEOUT_S", 0.0)
    before = tree(root)
    holding, release, done = threading.Event(), threading.Event(), threading.Event()

    def holder():
        with lock_mod.cache_lock(root):
            holding.set()
            release.wait()
        done.set()

    t = threading.Thread(target=holder)
    t.start()
    holding.wait()
    try:
        with pytest.raises(lock_mod.CacheLocked, match=f"pid {os.getpid()}"):
            manage.clear(root)
        with pytest.raises(lock_mod.CacheLocked):
            manage.prune(0, root)
        assert tree(root) == before
        # readers take no lock
        assert manage.ls(root).total_entries > 0
    finally:
        release.set()
        t.join()
    assert done.is_set()
    assert manage.clear(root).backup  # free again


def test_shared_locks_overlap_exclusive_waits(tmp_path):
    root = make_cache(tmp_path / "c")
    with lock_mod.cache_lock(root, shared=True):
        with lock_mod.cache_lock(root, shared=True, timeout=0):
            pass
        with pytest.raises(lock_mod.CacheLocked):
            with lock_mod.cache_lock(root, timeout=0):
                pass


def test_lock_file_that_cannot_be_created(tmp_path, monkeypatch):
    root = make_cache(tmp_path / "c")
    real_open = os.open

    def no_create(path, *a, **k):
        if str(path).endswith(".compilewatch.lock"):
            raise PermissionError(13, "Permission denied")
        return real_open(path, *a, **k)

    monkeypatch.setattr(lock_mod.os, "open", no_create)
    with lock_mod.cache_lock(root, shared=True) as held:
        assert held is None  # readers go ahead
    with pytest.raises(BadInput, match="cannot create the lock file"):
        manage.clear(root)
    assert root.is_dir()


def test_where_lists_what_compilewatch_kept_beside_the_cache(tmp_path):
    from compilewatch.cache.local import layout

    root = make_cache(tmp_path / "c")
    r = manage.clear(root)
    make_cache(root)
    (tmp_path / ".c.load-abc123").mkdir()  # a load that was killed mid-extraction
    (tmp_path / "c.unrelated").mkdir()
    loc = layout.locate(root)
    assert loc.siblings == tuple(sorted([r.backup, str(tmp_path / ".c.load-abc123")]))


def test_pruned_entries_go_back_with_the_command_prune_prints(tmp_path):
    """prune says how to restore, and that command works: `cache load DIR.pruned-...` moves the entries
    back into the live cache (no --trust: prune recorded the dir), leaving what the cache has again."""
    from cli.main import app
    from tests.helpers import invoke

    c = make_cache(tmp_path / "cache", n_fx=6, triton=False)
    before = tree(c)
    r = invoke(app, ["cache", "prune", "--max-size", "1", "--dir", str(c)])
    assert r.exit_code == 0, r.stderr
    restore = r.stdout.split("to put them back: ", 1)[1].split(" (delete", 1)[0]
    pruned = Path(restore.split()[3])
    assert restore == f"compilewatch cache load {pruned} --dir {c}" and pruned.is_dir()
    (c / "fxgraph" / "00").mkdir(parents=True, exist_ok=True)
    again = next(p for p in before if p.startswith("fxgraph/00/"))
    (c / again).parent.mkdir(parents=True, exist_ok=True)
    (c / again).write_bytes(before[again])  # recompiled meanwhile: the cache has it again
    r = invoke(app, restore.split()[1:])
    assert r.exit_code == 0, r.stderr
    assert "entries compilewatch pruned from" in r.stdout and "stayed in" in r.stderr
    assert tree(c) == before
    assert (pruned / again).exists() and not [p for p in pruned.rglob("*") if p.is_file() and p != pruned / again]
