"""`compilewatch cache ...` through CliRunner: --json output, exit codes 0 / 1 / 2, nothing lost."""

from __future__ import annotations

import json
import os

import pytest

from cli.main import app
from compilewatch import torchinfo
from compilewatch.cache.archive import save as archive
from tests.cache_helpers import OTHER_KEY, entry_pickle, make_cache, noise, tree, write
from tests.helpers import invoke, invoke_json

COMMANDS = ["where", "fingerprint", "verify", "save", "load", "clear", "prune", "ls", "du", "diff"]


def test_every_command_is_wired_and_has_help():
    r = invoke(app, ["cache", "--help"])
    assert r.exit_code == 0
    for c in COMMANDS:
        assert c in r.stdout
        assert invoke(app, ["cache", c, "--help"]).exit_code == 0


def test_where_json_uses_torch_env(tmp_path):
    d = invoke_json(app, ["cache", "where"])
    assert d["path"] == str(tmp_path / "inductor-cache") and d["source"] == "TORCHINDUCTOR_CACHE_DIR"
    assert d["exists"] is False and d["triton_source"] == "TRITON_CACHE_DIR"
    assert {s["name"] for s in d["subcaches"]} >= {"fxgraph", "aotautograd", "codegen", "triton", "locks"}


def test_default_dir_is_torchs(tmp_path):
    make_cache(tmp_path / "inductor-cache")
    d = invoke_json(app, ["cache", "fingerprint"])
    assert d["path"] == str(tmp_path / "inductor-cache") and d["files"] > 0
    assert d["entries"] is None and d["system_key"] == torchinfo.system_key()


def test_fingerprint_output_file_then_diff(tmp_path):
    root = make_cache(tmp_path / "c")
    r = invoke(app, ["cache", "fingerprint", "--dir", str(root), "-o", str(tmp_path / "fp.json")])
    assert r.exit_code == 0 and "content hash" in r.stdout
    saved = json.loads((tmp_path / "fp.json").read_text())
    assert len(saved["entries"]) == saved["files"]
    assert invoke_json(app, ["cache", "diff", str(tmp_path / "fp.json"), str(root)])["same"] is True
    write(root, "fxgraph/zz/fzz/e", b"\x80x.")
    d = invoke_json(app, ["cache", "diff", str(tmp_path / "fp.json"), str(root)], expect_code=1)
    assert {s["name"]: s["added"] for s in d["subcaches"]}["fxgraph"] == ["fxgraph/zz/fzz/e"]
    r = invoke(app, ["cache", "diff", str(tmp_path / "fp.json"), str(root)])
    assert r.exit_code == 1 and "+ fxgraph/zz/fzz/e" in r.stdout


def test_verify_exit_codes(tmp_path):
    root = make_cache(tmp_path / "c")
    assert invoke_json(app, ["cache", "verify", "--dir", str(root)])["ok"] is True
    write(root, "aotautograd/aforeign/e", entry_pickle(OTHER_KEY))
    d = invoke_json(app, ["cache", "verify", "--dir", str(root)], expect_code=1)
    assert d["foreign"] is True and d["counts"] == {"foreign-system": 1}
    r = invoke(app, ["cache", "verify", "--dir", str(root)])
    assert r.exit_code == 1 and "foreign-system" in r.stdout and "--fix" in r.stderr
    d = invoke_json(app, ["cache", "verify", "--dir", str(root), "--fix"], expect_code=0)
    assert len(d["moved"]) == 1 and os.path.isdir(d["quarantine"])
    assert invoke_json(app, ["cache", "verify", "--dir", str(root), "--quick"])["ok"] is True


def test_save_load_clear_prune_ls_du_json(tmp_path):
    root = make_cache(tmp_path / "c")
    before = tree(root)
    s = invoke_json(app, ["cache", "save", str(tmp_path / "a.tar.gz"), "--dir", str(root), "--no-mega"])
    assert s["files"] == len(before) and s["mega_cache"] is None
    c = invoke_json(app, ["cache", "clear", "--dir", str(root)])
    assert c["backup"] and "compilewatch cache load" in c["restore_command"] and not root.exists()
    ld = invoke_json(app, ["cache", "load", str(tmp_path / "a.tar.gz"), "--dir", str(root)])
    assert ld["backup"] is None and tree(root) == before
    assert invoke_json(app, ["cache", "ls", "--dir", str(root), "-n", "3"])["total_entries"] == 12
    assert invoke_json(app, ["cache", "du", "--dir", str(root)])["files"] == len(before)
    p = invoke_json(app, ["cache", "prune", "--dir", str(root), "--max-size", "1K", "--dry-run"])
    assert p["dry_run"] and p["removed"] and tree(root) == before


def test_clear_prints_the_restore_command(tmp_path):
    root = make_cache(tmp_path / "c")
    r = invoke(app, ["cache", "clear", "--dir", str(root)])
    assert r.exit_code == 0 and "restore with: compilewatch cache load" in r.stdout


def _foreign_archive(tmp_path, monkeypatch):
    src = make_cache(tmp_path / "src")
    with monkeypatch.context() as m:
        m.setattr(torchinfo, "system_key", lambda: OTHER_KEY)
        archive.save(tmp_path / "foreign.tar.gz", src)
    return tmp_path / "foreign.tar.gz"


@pytest.mark.parametrize("case", [
    "missing-dir", "not-a-cache", "corrupt-archive", "foreign-archive", "bad-size", "bad-suffix",
    "no-backup-without-yes", "missing-archive", "unknown-sort", "gzip-level-99", "gzip-level-0", "level-on-plain-tar",
])
def test_bad_input_exits_2_with_a_message_and_changes_nothing(tmp_path, monkeypatch, case):
    root = make_cache(tmp_path / "c")
    before = tree(root)
    proj = tmp_path / "proj"
    write(proj, "README.md", "mine")
    (tmp_path / "junk.tar.gz").write_bytes(b"\x1f\x8b" + noise(300, seed=11))
    args = {
        "missing-dir": ["cache", "fingerprint", "--dir", str(tmp_path / "nope")],
        "not-a-cache": ["cache", "clear", "--dir", str(proj)],
        "corrupt-archive": ["cache", "load", str(tmp_path / "junk.tar.gz"), "--dir", str(root)],
        "foreign-archive": ["cache", "load", "ARCHIVE", "--dir", str(root)],
        "bad-size": ["cache", "prune", "--max-size", "lots", "--dir", str(root)],
        "bad-suffix": ["cache", "save", str(tmp_path / "a.zip"), "--dir", str(root)],
        "no-backup-without-yes": ["cache", "clear", "--no-backup", "--dir", str(root)],
        "missing-archive": ["cache", "load", str(tmp_path / "nope.tar.gz"), "--dir", str(root)],
        "unknown-sort": ["cache", "ls", "--sort", "age", "--dir", str(root)],
        "gzip-level-99": ["cache", "save", str(tmp_path / "a.tar.gz"), "--level", "99", "--dir", str(root)],  # once zlib's traceback
        "gzip-level-0": ["cache", "save", str(tmp_path / "a.tar.gz"), "--level", "0", "--dir", str(root)],  # once quietly 3
        "level-on-plain-tar": ["cache", "save", str(tmp_path / "a.tar"), "--level", "5", "--dir", str(root)],
    }[case]
    if case == "foreign-archive":
        args[2] = str(_foreign_archive(tmp_path, monkeypatch))
    r = invoke(app, args)
    assert r.exit_code == 2, (r.stdout, r.stderr)
    assert r.stderr.startswith("error:") and "Traceback" not in r.stderr
    assert tree(root) == before and (proj / "README.md").read_text() == "mine"
    assert not [n for n in os.listdir(tmp_path) if ".load-" in n or ".backup-" in n or n.endswith(".tmp")]
    assert not [n for n in os.listdir(tmp_path) if n.startswith("a.")]  # no archive written


def test_json_is_the_only_stdout(tmp_path):
    root = make_cache(tmp_path / "c")
    r = invoke(app, ["cache", "save", str(tmp_path / "a.tar"), "--dir", str(root), "--json"])
    assert r.exit_code == 0
    assert json.loads(r.stdout)["archive"] == str(tmp_path / "a.tar")


def test_json_schemas_are_frozen(tmp_path):
    """The --json top-level keys other tools (lock, doctor, scripts) read; change them on purpose only."""
    root = make_cache(tmp_path / "c")
    d = str(root)
    want = {
        ("where",): {"path", "source", "exists", "looks_like_cache", "triton_dir", "triton_source", "triton_inside",
                     "subcaches", "lock_file", "siblings"},
        ("fingerprint",): {"path", "files", "bytes", "content_hash", "subcaches", "system_key", "torch_version",
                           "entry_system_keys", "entry_torch_hashes", "foreign_entries", "created_at", "duration_s", "hashed", "reused",
                           "in_flight", "warnings", "entries", "format"},
        ("verify",): {"path", "ok", "foreign", "system_key", "torch_version", "torch_hash", "files", "checked",
                      "entry_system_keys", "findings", "counts", "not_checked", "deep", "quarantine", "moved",
                      "paths_rewritten"},
        ("ls",): {"path", "entries", "total_entries", "total_files", "total_bytes"},
        ("du",): {"path", "files", "bytes", "in_flight", "subcaches", "largest"},
        ("save", str(tmp_path / "a.tar")): {"archive", "source", "files", "bytes", "archive_bytes", "content_hash",
                                            "compression", "mega_cache", "duration_s", "warnings", "signed_by",
                                            "left_out"},  # what save left out (precompiled_headers)
        ("prune", "--max-size", "1G"): {"path", "max_bytes", "bytes_before", "bytes_after", "removed", "moved_to", "restore",
                                        "deleted", "dry_run"},
        ("load", str(tmp_path / "a.tar")): {"source", "path", "backup", "files", "bytes", "content_hash",
                                            "archive_system_key", "system_key", "mismatches", "forced", "paths_rewritten", "duration_s",
                                            "warnings", "provenance", "trusted_pickles"},
        ("clear",): {"path", "files", "bytes", "backup", "deleted", "restore_command"},
    }
    for args, keys in want.items():
        assert set(invoke_json(app, ["cache", *args, "--dir", d])) == keys, args
    make_cache(root)
    diff = invoke_json(app, ["cache", "diff", d, d])
    assert set(diff) == {"a", "b", "same", "content_hash_a", "content_hash_b", "system_key_a", "system_key_b",
                         "torch_version_a", "torch_version_b", "per_file", "subcaches", "source_a", "source_b",
                         "source_reason_a", "source_reason_b"}
