"""Issue 37: what compilewatch trusts because it sits in the user's config dir (the signing key, the
trust store, the backups record) is believed only where nobody else can change it, like OpenSSH's
StrictModes (compilewatch/cache/trust/modes.py). Plus the smaller items: a duplicate signature
member, `trust add` of a key already trusted, trust files that are not plain files.

The tests run as root in CI: root owns everything it makes, so "another user" is made with
os.chown(path, 65534, ...) (root may), and group/world-writable modes with chmod.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from cli.main import app
from compilewatch.cache.archive import load as archive_load
from compilewatch.cache.archive import reader
from compilewatch.cache.archive import save as archive_save
from compilewatch.cache.local import manage
from compilewatch.cache.trust import backups, keys, modes, provenance
from compilewatch.errors import BadInput
from tests.cache_helpers import make_cache, tar_members, write_tar
from tests.helpers import invoke

NOBODY = 65534
as_root = pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0,
                             reason="making a file another user owns needs root (CI runs the tests as root)")


_REAL_PRIVATE_GROUP = modes._private_group


@pytest.fixture(autouse=True)
def _shared_groups(monkeypatch):
    """Every group counts as shared here, so the messages do not depend on whether the test's own
    group is private (root's is, in a container); the private-group rule has its own test."""
    monkeypatch.setattr(modes, "_private_group", lambda gid, owner: False)


@pytest.fixture
def cfg(tmp_path, monkeypatch) -> Path:
    """A config dir of this test's own, under tmp_path (0700, as pytest makes it)."""
    d = tmp_path / "cfg"
    monkeypatch.setenv("COMPILEWATCH_CONFIG_DIR", str(d))
    return d


@pytest.fixture
def theirs(tmp_path, monkeypatch, cfg):
    """An archive signed on another machine (another config dir) and the public-key line of that machine."""
    monkeypatch.setenv("COMPILEWATCH_CONFIG_DIR", str(tmp_path / "other-cfg"))
    archive_save.save(tmp_path / "theirs.tar", make_cache(tmp_path / "src-theirs"))
    line = keys.public_key_line(keys.own_public_key())
    monkeypatch.setenv("COMPILEWATCH_CONFIG_DIR", str(cfg))
    return tmp_path / "theirs.tar", line


def _no_key_anywhere(d: Path) -> bool:
    return not any(p.name.startswith((keys.KEY_FILE, f".{keys.KEY_FILE}")) for p in d.rglob("*"))


# --- the signing key: never made, never used where others can change it ---------------------------
def test_save_refuses_to_make_a_key_in_a_world_writable_config_dir(tmp_path, cfg):
    cfg.mkdir()
    os.chmod(cfg, 0o777)
    src = make_cache(tmp_path / "src")
    with pytest.raises(BadInput) as e:
        archive_save.save(tmp_path / "a.tar", src)
    assert e.value.message == (f"config dir {cfg} is writable by group and others (mode 777); "
                               "no signing key was made there")
    assert e.value.hint.startswith(f"chmod 700 {cfg};")
    assert _no_key_anywhere(cfg) and not (tmp_path / "a.tar").exists()
    r = invoke(app, ["cache", "save", str(tmp_path / "b.tar"), "--dir", str(src)])
    assert r.exit_code == 2 and str(cfg) in r.stderr and f"chmod 700 {cfg}" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and _no_key_anywhere(cfg)
    r = invoke(app, ["cache", "trust", "key"])
    assert r.exit_code == 2 and f"chmod 700 {cfg}" in r.stderr and _no_key_anywhere(cfg)
    os.chmod(cfg, 0o700)  # the fix the message names
    archive_save.save(tmp_path / "a.tar", src)
    assert reader.check_provenance(tmp_path / "a.tar").verdict == "own"


def test_a_group_writable_folder_above_the_config_dir_is_refused_and_named(tmp_path, monkeypatch):
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o775)
    monkeypatch.setenv("COMPILEWATCH_CONFIG_DIR", str(shared / "a" / "cfg"))
    with pytest.raises(BadInput) as e:
        keys.signing_key()
    assert e.value.message == (f"config dir {shared}/a/cfg is not safe: {shared} is writable by its group "
                               "(mode 775); no signing key was made there")
    assert e.value.hint.startswith(f"chmod go-w {shared};")
    assert not (shared / "a").exists()  # nothing made below it either


def test_the_config_dir_is_made_0700_whatever_the_umask(tmp_path, monkeypatch):
    monkeypatch.setenv("COMPILEWATCH_CONFIG_DIR", str(tmp_path / "new" / "deeper" / "cfg"))
    old = os.umask(0)
    try:
        keys.signing_key()
        keys.trust_add("compilewatch-ed25519 " + "QUJD" * 10 + "QUI= friend")
    finally:
        os.umask(old)
    for d in (tmp_path / "new", tmp_path / "new" / "deeper", tmp_path / "new" / "deeper" / "cfg"):
        assert stat.S_IMODE(d.stat().st_mode) == 0o700, d
    assert stat.S_IMODE(keys.key_path().stat().st_mode) == 0o600
    assert stat.S_IMODE(keys.trust_path().stat().st_mode) == 0o600
    assert [k.name for k in keys.trust_store().keys] == ["friend"]  # the store it wrote passes its own check


def test_a_root_owned_sticky_dir_like_tmp_is_accepted(tmp_path, monkeypatch):
    if os.stat(tmp_path).st_uid != 0:
        pytest.skip("needs a root-owned dir (CI runs the tests as root)")
    sticky = tmp_path / "tmp"
    sticky.mkdir()
    os.chmod(sticky, 0o1777)
    monkeypatch.setenv("COMPILEWATCH_CONFIG_DIR", str(sticky / "cfg"))
    archive_save.save(tmp_path / "a.tar", make_cache(tmp_path / "src"))
    assert reader.check_provenance(tmp_path / "a.tar").verdict == "own"


@as_root
def test_a_sticky_world_writable_dir_another_user_owns_is_refused(tmp_path, monkeypatch):
    sticky = tmp_path / "their-tmp"
    sticky.mkdir()
    os.chmod(sticky, 0o1777)
    os.chown(sticky, NOBODY, NOBODY)
    monkeypatch.setenv("COMPILEWATCH_CONFIG_DIR", str(sticky / "cfg"))
    with pytest.raises(BadInput, match=f"{sticky} is owned by uid {NOBODY}"):
        keys.signing_key()
    os.chown(sticky, 0, 0)
    os.chmod(sticky, 0o777)  # root's, world-writable, not sticky: others may rename what is in it
    with pytest.raises(BadInput, match=rf"{sticky} is writable by group and others \(mode 777\)"):
        keys.signing_key()


@as_root
def test_a_config_dir_another_user_owns_is_refused_with_chown(tmp_path, cfg):
    cfg.mkdir(mode=0o700)
    os.chown(cfg, NOBODY, NOBODY)
    with pytest.raises(BadInput) as e:
        keys.signing_key()
    assert e.value.message.startswith(f"config dir {cfg} is owned by uid {NOBODY}")
    assert e.value.message.endswith("not by root; no signing key was made there")
    assert e.value.hint.startswith(f"chown root {cfg};")


@as_root
def test_a_signing_key_another_user_owns_or_can_write_is_not_used(tmp_path, cfg):
    keys.signing_key()
    key = keys.key_path()
    os.chown(key, NOBODY, NOBODY)
    with pytest.raises(BadInput, match=f"signing key {key} is owned by uid {NOBODY}") as e:
        archive_save.save(tmp_path / "a.tar", make_cache(tmp_path / "src"))
    assert "it is not used" in e.value.message and e.value.hint.startswith(f"chown root {key};")
    os.chown(key, 0, 0)
    os.chmod(key, 0o620)
    with pytest.raises(BadInput, match=rf"signing key {key} is writable by other users \(mode 620\)") as e:
        archive_save.save(tmp_path / "a.tar", make_cache(tmp_path / "src"))
    assert e.value.hint.startswith(f"chmod 600 {key};")


def test_an_own_archive_is_foreign_once_the_key_or_its_folder_is_not_safe(tmp_path, cfg):
    archive_save.save(tmp_path / "a.tar", make_cache(tmp_path / "src"))
    key = keys.key_path()
    os.chmod(key, 0o644)
    p = reader.check_provenance(tmp_path / "a.tar")
    assert p.verdict == "foreign" and not p.allowed
    assert f"signing key {key} is readable by other users (mode 644) (fix: chmod 600 {key})" in p.reason
    assert p.reason.startswith("signed by this machine's key ed25519:") and ", but that key cannot be trusted: " in p.reason
    with pytest.raises(BadInput, match="is foreign"):
        archive_load.load(tmp_path / "a.tar", tmp_path / "dst")
    os.chmod(key, 0o600)
    os.chmod(cfg, 0o777)
    p = reader.check_provenance(tmp_path / "a.tar")
    assert p.verdict == "foreign" and f"is not safe: {cfg} is writable by group and others (mode 777) " \
                                      f"(fix: chmod 700 {cfg})" in p.reason
    r = invoke(app, ["cache", "verify", str(tmp_path / "a.tar")])
    assert r.exit_code == 1 and r.stdout.startswith("foreign: signed by this machine's key")
    os.chmod(cfg, 0o700)
    assert reader.check_provenance(tmp_path / "a.tar").verdict == "own"


# --- the trust store -----------------------------------------------------------------------------
def test_a_trust_store_others_can_change_makes_its_keys_foreign(tmp_path, cfg, theirs):
    archive, line = theirs
    assert invoke(app, ["cache", "trust", "add", line, "--name", "colleague"]).exit_code == 0
    assert reader.check_provenance(archive).verdict == "trusted"
    store = keys.trust_path()
    os.chmod(store, 0o666)
    p = reader.check_provenance(archive)
    assert p.verdict == "foreign" and p.reason.startswith("signed by key ed25519:")
    assert p.reason.endswith(f"named 'colleague' in your trust store, but that store cannot be trusted: trust store "
                             f"{store} is writable by group and others (mode 666) (fix: chmod 600 {store})")
    for args in (["cache", "trust", "list"], ["cache", "trust", "add", line, "--name", "x"],
                 ["cache", "trust", "remove", "colleague"]):
        r = invoke(app, args)
        assert r.exit_code == 2 and f"trust store {store} is writable by group and others (mode 666)" in r.stderr
        assert f"chmod 600 {store}" in r.stderr and "Traceback" not in r.stderr, args
    os.chmod(store, 0o644)  # readable by others is fine: it holds public keys
    assert reader.check_provenance(archive).verdict == "trusted"


@as_root
def test_a_trust_store_another_user_owns_is_not_believed(tmp_path, cfg, theirs):
    archive, line = theirs
    keys.trust_add(line, name="colleague")
    os.chown(keys.trust_path(), NOBODY, NOBODY)
    p = reader.check_provenance(archive)
    assert p.verdict == "foreign" and f"is owned by uid {NOBODY}" in p.reason and "chown root" in p.reason


def test_a_stranger_is_still_just_not_in_the_store_when_the_store_is_unsafe(tmp_path, cfg, theirs):
    archive, _ = theirs
    keys.trust_add("compilewatch-ed25519 " + "QUJD" * 10 + "QUI= friend")
    os.chmod(keys.trust_path(), 0o666)
    p = reader.check_provenance(archive)
    assert p.verdict == "foreign" and p.reason.endswith("which is not in your trust store")


@pytest.mark.parametrize("kind", ["dev-zero", "fifo", "directory"])
def test_a_trust_store_that_is_not_a_plain_file_is_named_not_missing(tmp_path, cfg, theirs, kind):
    archive, line = theirs
    cfg.mkdir(exist_ok=True, mode=0o700)
    store = keys.trust_path()
    if kind == "dev-zero":
        store.symlink_to("/dev/zero")
        what = "is a character device (/dev/zero, through a symbolic link), not a regular file"
    elif kind == "fifo":
        os.mkfifo(store, 0o600)
        what = "is a FIFO, not a regular file"
    else:
        store.mkdir(mode=0o700)
        what = "is a directory, not a regular file"
    r = invoke(app, ["cache", "trust", "list"])
    assert r.exit_code == 2 and f"trust store {store} {what}" in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert f"move {store} aside" in r.stderr and "missing" not in r.stderr
    r = invoke(app, ["cache", "trust", "add", line])
    assert r.exit_code == 2 and f"trust store {store} {what}" in r.stderr
    p = reader.check_provenance(archive)  # never blocks, never reads /dev/zero
    assert p.verdict == "foreign" and "could not be checked against your keys" in p.reason and what in p.reason


def test_a_signing_key_that_is_not_a_plain_file_is_named(tmp_path, cfg):
    cfg.mkdir(mode=0o700)
    keys.key_path().symlink_to("/dev/zero")
    with pytest.raises(BadInput, match=r"signing key .*signing-key.pem is a character device \(/dev/zero, through "
                                       r"a symbolic link\), not a regular file"):
        archive_save.save(tmp_path / "a.tar", make_cache(tmp_path / "src"))
    keys.key_path().unlink()
    keys.key_path().symlink_to(tmp_path / "gone.pem")
    with pytest.raises(BadInput, match="is a symbolic link to .*gone.pem, which does not exist"):
        keys.signing_key()


def test_a_symlinked_config_dir_is_checked_where_it_leads(tmp_path, monkeypatch):
    """The folders a link's target is looked up in are checked as the kernel walks them."""
    open_dir = tmp_path / "open"
    (open_dir / "real").mkdir(parents=True, mode=0o700)
    os.chmod(open_dir, 0o777)
    (tmp_path / "link").symlink_to(open_dir / "real")
    monkeypatch.setenv("COMPILEWATCH_CONFIG_DIR", str(tmp_path / "link"))
    with pytest.raises(BadInput, match=f"config dir {tmp_path}/link is not safe: {open_dir} is writable by group "
                                       r"and others \(mode 777\)"):
        keys.signing_key()
    os.chmod(open_dir, 0o755)
    keys.signing_key()
    assert (open_dir / "real" / keys.KEY_FILE).is_file()


@as_root
def test_a_symlink_another_user_owns_is_refused(tmp_path, monkeypatch):
    (tmp_path / "real").mkdir(mode=0o700)
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "real")
    os.lchown(link, NOBODY, NOBODY)
    monkeypatch.setenv("COMPILEWATCH_CONFIG_DIR", str(link))
    with pytest.raises(BadInput, match=f"{link} is a symbolic link owned by uid {NOBODY}") as e:
        keys.signing_key()
    assert e.value.hint.startswith(f"remove {link}")


# --- the backups record --------------------------------------------------------------------------
def _backup(tmp_path) -> Path:
    return Path(manage.clear(make_cache(tmp_path / "old", triton=False)).backup)


def test_a_backups_record_others_can_change_makes_the_backup_foreign(tmp_path, cfg):
    old = _backup(tmp_path)
    assert backups.judge(old).verdict == "own"
    rec = backups.record_path()
    os.chmod(rec, 0o646)
    p = backups.judge(old)
    assert p.verdict == "foreign" and p.reason == (
        f"the record of backups compilewatch made names it, but others can change that record: backups record "
        f"{rec} is writable by others (mode 646) (fix: chmod 600 {rec})")
    # (not `archive_load.load` here: a refused load still fingerprints the dir, which changes its ctime)
    os.chmod(rec, 0o600)
    os.chmod(cfg, 0o770)
    p = backups.judge(old)
    assert p.verdict == "foreign" and f"{cfg} is writable by its group (mode 770) (fix: chmod 700 {cfg})" in p.reason
    os.chmod(cfg, 0o700)
    assert archive_load.load(old, tmp_path / "cache").provenance.verdict == "own"


def test_no_backup_is_recorded_in_a_config_dir_others_can_change(tmp_path, cfg):
    cfg.mkdir()
    os.chmod(cfg, 0o777)
    old = _backup(tmp_path)
    assert old.is_dir() and not backups.record_path().exists()  # the backup is made, the record is not
    assert backups.record(old, tmp_path / "old") is False
    p = backups.judge(old)
    assert p.verdict == "foreign" and f"chmod 700 {cfg}" in p.reason


def test_a_backups_record_that_is_dev_zero_is_named(tmp_path, cfg):
    cfg.mkdir(mode=0o700)
    backups.record_path().symlink_to("/dev/zero")
    old = _backup(tmp_path)
    p = backups.judge(old)
    assert p.verdict == "foreign" and "cannot be read: backups record" in p.reason
    assert "is a character device (/dev/zero, through a symbolic link), not a regular file" in p.reason


# --- the check itself ----------------------------------------------------------------------------
def test_group_writable_is_fine_when_the_group_is_the_owners_alone(tmp_path, monkeypatch):
    """A umask of 002 (Debian, Ubuntu: user-private groups) makes folders 775: harmless when the group
    has one member, the owner, as Debian's OpenSSH decides."""
    import sys
    import types

    monkeypatch.setattr(modes, "_private_group", _REAL_PRIVATE_GROUP)
    d = tmp_path / "ug"
    d.mkdir()
    os.chmod(d, 0o775)
    st = d.stat()
    me = types.SimpleNamespace(pw_name="me", pw_uid=st.st_uid, pw_gid=st.st_gid)
    groups = {"private": [], "shared": ["me", "bob"]}
    which = {"g": "private"}
    others = {"p": []}
    fake_grp = types.SimpleNamespace(getgrgid=lambda gid: types.SimpleNamespace(gr_gid=gid, gr_mem=groups[which["g"]]))
    fake_pwd = types.SimpleNamespace(getpwuid=lambda uid: me, getpwall=lambda: [me, *others["p"]])
    monkeypatch.setitem(sys.modules, "grp", fake_grp)
    monkeypatch.setitem(sys.modules, "pwd", fake_pwd)
    modes._private_group.cache_clear()
    try:
        assert modes.check(d / "f", "x") is None
        which["g"] = "shared"  # a supplementary member besides the owner
        modes._private_group.cache_clear()
        bad = modes.check(d / "f", "x")
        assert bad is not None and bad.why == "is writable by its group (mode 775)" and bad.fix == f"chmod go-w {d}"
        which["g"] = "private"
        others["p"] = [types.SimpleNamespace(pw_name="eve", pw_uid=st.st_uid + 1, pw_gid=st.st_gid)]  # her primary group
        modes._private_group.cache_clear()
        assert modes.check(d / "f", "x") is not None
        os.chmod(d, 0o777)
        others["p"] = []
        modes._private_group.cache_clear()
        assert modes.check(d / "f", "x").why == "is writable by others (mode 777)"  # world-writable: never
    finally:
        monkeypatch.undo()
        modes._private_group.cache_clear()


def test_check_passes_what_does_not_exist_yet_and_reads_nothing(tmp_path):
    assert modes.check(tmp_path / "a" / "b" / "f", "x") is None
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo, 0o600)
    bad = modes.check(fifo, "trust store")
    assert bad is not None and bad.kind == "type" and bad.message == f"trust store {fifo} is a FIFO, not a regular file"
    (tmp_path / "f").write_text("x")
    os.chmod(tmp_path / "f", 0o644)
    assert modes.check(tmp_path / "f", "x") is None
    bad = modes.check(tmp_path / "f", "key", private=True)
    assert bad is not None and bad.why == "is readable by other users (mode 644)"
    loop = tmp_path / "loop"
    loop.symlink_to(loop)
    bad = modes.check(loop, "x")
    assert bad is not None and "Too many levels of symbolic links" in bad.why


def test_check_follows_dotdot_in_link_targets_the_way_the_kernel_does(tmp_path):
    (tmp_path / "safe" / "sub").mkdir(parents=True)
    (tmp_path / "open").mkdir()
    os.chmod(tmp_path / "open", 0o777)
    (tmp_path / "safe" / "f").write_text("x")
    (tmp_path / "open" / "l").symlink_to("../safe/f")
    bad = modes.check(tmp_path / "open" / "l", "x")  # the link lives in a folder anyone can write
    assert bad is not None and bad.path == str(tmp_path / "open")
    (tmp_path / "safe" / "sub" / "l").symlink_to("../f")
    assert modes.check(tmp_path / "safe" / "sub" / "l", "x") is None


# --- archives: a second signature member ---------------------------------------------------------
@pytest.mark.parametrize("order", ["garbage-first", "garbage-last"])
def test_a_duplicate_signature_member_is_corrupt(tmp_path, cfg, order):
    saved = tmp_path / "a.tar"
    archive_save.save(saved, make_cache(tmp_path / "src"))
    members = tar_members(saved)
    body = [(n, d) for n, d in members if n != provenance.SIGNATURE]
    valid = dict(members)[provenance.SIGNATURE]
    garbage = (provenance.SIGNATURE, b'{"statement": "x"}')
    sigs = [garbage, (provenance.SIGNATURE, valid)] if order == "garbage-first" else [(provenance.SIGNATURE, valid), garbage]
    dup = write_tar(tmp_path / "dup.tar", [*body, *sigs])
    with pytest.raises(BadInput, match="member signature.json appears twice"):
        reader.check_provenance(dup)
    r = invoke(app, ["cache", "load", str(dup), "--dir", str(tmp_path / "dst")])
    assert r.exit_code == 2 and "appears twice" in r.stderr and not (tmp_path / "dst").exists()
    r = invoke(app, ["cache", "load", str(dup), "--dir", str(tmp_path / "dst"), "--trust"])
    assert r.exit_code == 2 and "appears twice" in r.stderr  # corrupt, not foreign: --trust does not help


# --- trust add: one key, one name; not this machine's own ----------------------------------------
def test_trust_add_refuses_a_key_it_already_holds_under_another_name(tmp_path, cfg, theirs):
    archive, line = theirs
    assert invoke(app, ["cache", "trust", "add", line, "--name", "alice"]).exit_code == 0
    r = invoke(app, ["cache", "trust", "add", line, "--name", "bob"])
    assert r.exit_code == 2 and "is already trusted, as 'alice'; nothing was added" in r.stderr, r.stderr
    assert "trust remove alice" in r.stderr
    assert invoke(app, ["cache", "trust", "add", line, "--name", "alice"]).exit_code == 0  # the same: no change
    assert [k.name for k in keys.trust_store().keys] == ["alice"]
    assert reader.check_provenance(archive).key_name == "alice"
    data = json.loads(keys.trust_path().read_text())
    assert len(data["keys"]) == 1


def test_trust_add_refuses_this_machines_own_key(tmp_path, cfg):
    own = keys.own_public_key(create=True)
    r = invoke(app, ["cache", "trust", "add", keys.public_key_line(own), "--name", "me"])
    assert r.exit_code == 2 and f"key {own.id} is this machine's own signing key" in r.stderr
    assert "already trusted, as made here" in r.stderr and not keys.trust_path().exists()
