"""Issue 29: an archive is trusted by who made it. Each test plays one side: this machine, a trusted
colleague, a stranger, someone who alters a signed archive, a file name that attacks the terminal.

"Another machine" is another COMPILEWATCH_CONFIG_DIR (its own signing key and trust store).
"""

from __future__ import annotations

import json
import os
import pickle
import stat
from pathlib import Path

import pytest

from cli.main import app
from compilewatch.cache.archive import check as archive_check
from compilewatch.cache.archive import load as archive_load
from compilewatch.cache.archive import reader
from compilewatch.cache.archive import save as archive_save
from compilewatch.cache.trust import keys, provenance
from compilewatch.errors import BadInput
from tests.cache_helpers import make_cache, signed_tar, tar_members, tree, write, write_tar
from tests.helpers import invoke, invoke_json


@pytest.fixture
def other_machine(tmp_path, monkeypatch):
    """Run a block as another machine: `with other_machine(): ...` uses its own config dir."""
    import contextlib

    mine = os.environ["COMPILEWATCH_CONFIG_DIR"]

    @contextlib.contextmanager
    def as_other(name="other"):
        monkeypatch.setenv("COMPILEWATCH_CONFIG_DIR", str(tmp_path.parent / f"{tmp_path.name}-{name}-config"))
        try:
            yield
        finally:
            monkeypatch.setenv("COMPILEWATCH_CONFIG_DIR", mine)

    return as_other


def test_own_archive_is_made_here_and_the_key_is_private(tmp_path):
    src = make_cache(tmp_path / "src")
    saved = archive_save.save(tmp_path / "a.tar", src)
    key_file = keys.key_path()
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600 and stat.S_IMODE(key_file.parent.stat().st_mode) == 0o700
    p = reader.check_provenance(tmp_path / "a.tar")
    assert p.verdict == "own" and p.allowed and p.key_id == saved.signed_by and p.summary.startswith("made here")
    res = archive_load.load(tmp_path / "a.tar", tmp_path / "dst")
    assert res.provenance.verdict == "own" and res.warnings == ()
    r = invoke(app, ["cache", "load", str(tmp_path / "a.tar"), "--dir", str(tmp_path / "dst2")])
    assert r.exit_code == 0 and r.stdout.splitlines()[0].startswith("made here"), r.stdout


def test_foreign_archive_is_refused_first_and_changes_nothing(tmp_path, other_machine):
    with other_machine():
        archive_save.save(tmp_path / "theirs.tar", make_cache(tmp_path / "src"))
    dst = make_cache(tmp_path / "dst", n_fx=1, triton=False)
    before = tree(dst)
    p = reader.check_provenance(tmp_path / "theirs.tar")
    assert p.verdict == "foreign" and not p.allowed and "not in your trust store" in p.reason
    with pytest.raises(BadInput, match="is foreign") as e:
        archive_load.load(tmp_path / "theirs.tar", dst)
    assert "--trust" in e.value.hint and tree(dst) == before
    r = invoke(app, ["cache", "load", str(tmp_path / "theirs.tar"), "--dir", str(dst)])
    assert r.exit_code == 2 and "is foreign" in r.stderr.splitlines()[0] and tree(dst) == before
    r = invoke(app, ["cache", "verify", str(tmp_path / "theirs.tar")])
    assert r.exit_code == 1 and r.stdout.startswith("foreign: signed by key")


def test_trusting_a_key_makes_its_archives_load_and_removing_it_undoes_that(tmp_path, other_machine):
    with other_machine():
        archive_save.save(tmp_path / "theirs.tar", make_cache(tmp_path / "src"))
        line = invoke(app, ["cache", "trust", "key"]).stdout.strip()
    assert line.startswith(keys.KEY_TYPE)
    added = invoke_json(app, ["cache", "trust", "add", line, "--name", "colleague"])
    assert added["name"] == "colleague"
    listed = invoke_json(app, ["cache", "trust", "list"])
    assert [k["name"] for k in listed["keys"]] == ["colleague"]
    p = reader.check_provenance(tmp_path / "theirs.tar")
    assert p.verdict == "trusted" and p.key_name == "colleague"
    r = invoke(app, ["cache", "load", str(tmp_path / "theirs.tar"), "--dir", str(tmp_path / "dst")])
    assert r.exit_code == 0 and r.stdout.startswith("signed by a trusted key: colleague"), r.stdout
    assert invoke(app, ["cache", "trust", "remove", "colleague"]).exit_code == 0
    assert reader.check_provenance(tmp_path / "theirs.tar").verdict == "foreign"
    assert invoke(app, ["cache", "trust", "remove", "colleague"]).exit_code == 2  # nothing left to remove


def test_a_foreign_archive_with_trust_is_loaded_as_code(tmp_path):
    saved = tmp_path / "a.tar"
    archive_save.save(saved, make_cache(tmp_path / "src"))
    unsigned = write_tar(tmp_path / "unsigned.tar", [(n, d) for n, d in tar_members(saved) if n != provenance.SIGNATURE])
    assert "not signed" in reader.check_provenance(unsigned).reason
    r = invoke(app, ["cache", "load", str(unsigned), "--dir", str(tmp_path / "dst"), "--trust"])
    assert r.exit_code == 0
    first, second = r.stdout.splitlines()[:2]
    assert first.startswith("foreign: it is not signed") and "this archive is code" in second
    j = invoke_json(app, ["cache", "load", str(unsigned), "--dir", str(tmp_path / "dst3"), "--trust"])
    assert j["provenance"]["verdict"] == "foreign" and j["provenance"]["trusted_by_flag"]
    assert provenance.CODE_WARNING in j["warnings"]


def test_altering_a_signed_archive_makes_it_foreign(tmp_path):
    saved = tmp_path / "a.tar"
    archive_save.save(saved, make_cache(tmp_path / "src"))
    members = tar_members(saved)
    # a member changed (the manifest updated to match, the signature kept)
    fx = next(n for n, _ in members if n.startswith("cache/fxgraph/"))
    changed = [(n, pickle.dumps({"x": 1}) if n == fx else d) for n, d in members]
    p = reader.check_provenance(write_tar(tmp_path / "changed.tar", changed))
    assert p.verdict == "foreign" and "differs from what was signed" in p.reason and fx in p.reason
    # the statement edited (a member's hash replaced): the signature no longer verifies
    sig = json.loads(dict(members)[provenance.SIGNATURE])
    sig["statement"] = sig["statement"].replace('"members":{', '"members":{"cache/extra":[1,"00"],', 1)
    forged = [(n, json.dumps(sig).encode() if n == provenance.SIGNATURE else d) for n, d in members]
    p = reader.check_provenance(write_tar(tmp_path / "forged.tar", forged))
    assert p.verdict == "foreign" and "does not verify" in p.reason
    # garbage where the signature goes
    garbage = [(n, b"\x00{" if n == provenance.SIGNATURE else d) for n, d in members]
    assert "malformed" in reader.check_provenance(write_tar(tmp_path / "g.tar", garbage)).reason


def test_an_archive_changed_between_the_check_and_the_extraction_is_refused(tmp_path, monkeypatch):
    """The file may be replaced after its provenance was checked: extraction hashes every member again."""
    saved = tmp_path / "a.tar"
    archive_save.save(saved, make_cache(tmp_path / "src"))
    verdict, _ = reader.inspect_archive(saved)
    members = tar_members(saved)
    fx = next(n for n, _ in members if n.startswith("cache/fxgraph/"))
    new = pickle.dumps({"_fx_graph_cache_debug_lines": [], "evil": 1}, protocol=4)
    manifest = json.loads(dict(members)[reader.MANIFEST])
    import xxhash

    for e in manifest["entries"]:
        if "cache/" + e["rel"] == fx:
            e["size"], e["hash"] = len(new), xxhash.xxh3_128_hexdigest(new)
    swapped = [(n, new if n == fx else json.dumps(manifest).encode() if n == reader.MANIFEST else d) for n, d in members]
    write_tar(saved, swapped)
    real = reader.inspect_archive
    monkeypatch.setattr(reader, "inspect_archive", lambda *a, **k: (verdict, real(*a, **k)[1]))
    with pytest.raises(BadInput, match="differs from what was signed"):
        archive_load.load(saved, tmp_path / "dst")
    assert not (tmp_path / "dst").exists()


def test_signing_key_from_the_environment_and_its_checks(tmp_path, monkeypatch, other_machine):
    """COMPILEWATCH_SIGNING_KEY: one key shared by a cluster's CI (from its secret store) signs everywhere."""
    shared = tmp_path / "ci-key.pem"
    monkeypatch.setenv("COMPILEWATCH_SIGNING_KEY", str(shared))
    with pytest.raises(BadInput, match="does not exist"):
        archive_save.save(tmp_path / "x.tar", make_cache(tmp_path / "src"))
    monkeypatch.delenv("COMPILEWATCH_SIGNING_KEY")
    with other_machine("ci"):
        keys.signing_key()  # made in the CI config dir; copy it out as the shared secret
        shared.write_bytes(keys.key_path().read_bytes())
    os.chmod(shared, 0o644)
    monkeypatch.setenv("COMPILEWATCH_SIGNING_KEY", str(shared))
    with pytest.raises(BadInput, match="readable by other users"):
        archive_save.save(tmp_path / "x.tar", make_cache(tmp_path / "src"))
    os.chmod(shared, 0o600)
    archive_save.save(tmp_path / "x.tar", make_cache(tmp_path / "src"))
    assert reader.check_provenance(tmp_path / "x.tar").verdict == "own"


def test_trust_add_refuses_what_is_not_a_key(tmp_path):
    for bad in ("", "compilewatch-ed25519 notbase64!", "compilewatch-ed25519 " + "QUJD" * 3):
        r = invoke(app, ["cache", "trust", "add", bad])
        assert r.exit_code == 2 and "Traceback" not in r.stderr, bad
    pk = keys.own_public_key(create=True)
    r = invoke(app, ["cache", "trust", "add", keys.public_key_line(pk), "--name", "bad name\x1b[2J"])
    assert r.exit_code == 2 and "\x1b" not in r.stderr


def test_mega_cache_preload_checks_provenance_and_scans_every_artifact(tmp_path, other_machine):
    """Red team: torch's populate_caches unpickles artifacts inside load_mega_cache. A foreign archive is
    refused before anything is read; a pickle artifact that runs code (protocol 0: no 0x80 first byte)
    is refused before populate_caches, in an archive this machine signed."""
    from torch.compiler._cache import CacheArtifactManager

    marker = tmp_path / "ran"

    class RunsCode:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    with CacheArtifactManager.with_fresh_cache():
        CacheArtifactManager.record_artifact("inductor", "fevil", pickle.dumps(RunsCode(), protocol=0))
        blob, _ = CacheArtifactManager.serialize()
    saved = tmp_path / "a.tar"
    archive_save.save(saved, make_cache(tmp_path / "src"), mega=False)
    evil = signed_tar(tmp_path / "evil.tar", [*tar_members(saved), (reader.MEGA, blob)])
    with pytest.raises(BadInput, match="refused mega_cache.bin: inductor fevil"):
        archive_load.load_mega_cache(evil)
    with other_machine():
        with pytest.raises(BadInput, match="is foreign"):
            archive_load.load_mega_cache(evil)
    assert not marker.exists()
    rep = archive_check.verify_archive(evil)
    assert not rep.ok and rep.provenance.verdict == "own" and rep.findings[0].member.startswith(reader.MEGA)


def test_names_from_files_never_reach_the_terminal_raw(tmp_path):
    """An archive member / cache file named with escape sequences (clear screen, colours, a forged line,
    rich markup) is shown escaped by every command, and --json carries no raw control character."""
    src = make_cache(tmp_path / "src", n_fx=1)
    evil = "fevil\x1b[2J\x1b[31mFORGED\nok [bold]x[/bold]\u202e" + "q" * 40
    write(src, f"fxgraph/ev/{evil}/entry", b"\x80\x04N.")
    write(src, "dynamo/code_state_\x1b]0;title\x07.pkl", pickle.dumps(os.system, protocol=0))
    for args in (["cache", "ls", "--dir", str(src), "-n", "0"], ["cache", "verify", "--dir", str(src)],
                 ["cache", "save", str(tmp_path / "a.tar"), "--dir", str(src)],
                 ["cache", "verify", str(tmp_path / "a.tar")]):
        r = invoke(app, args)
        assert r.exit_code in (0, 1), (args, r.stderr)
        for text in (r.stdout, r.stderr):
            assert "\x1b" not in text and "\x07" not in text and "\u202e" not in text, (args, text)
            assert "\nok [bold]" not in text and "FORGED\n" not in text, args
        assert "\\x1b" in r.stdout or "\\x1b" in r.stderr or args[1] == "save", args
        j = invoke(app, [*args, "--json"]) if args[1] != "save" else None
        if j is not None:
            assert all(ch not in j.stdout for ch in "\x1b\x07\u202e") and json.loads(j.stdout) is not None


def test_diff_env_package_names_are_escaped(tmp_path):
    """Issue 29: `diff-env` printed lock package names raw."""
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text("torch==2.11.0\nevil\x1b[2Jname==1.0\n")
    b.write_text("torch==2.13.0\nevil\x1b[2Jname==2.0\n\x1b]0;pwned\x07==1\n")
    r = invoke(app, ["diff-env", str(a), str(b)])
    for text in (r.stdout, r.stderr):
        assert "\x1b" not in text and "\x07" not in text, text
    assert "Traceback" not in r.stderr and r.exit_code in (0, 1, 2)
    j = invoke(app, ["diff-env", str(a), str(b), "--json"])
    assert "\x1b" not in j.stdout
