"""`cache save` leaves torch's precompiled C++ headers out unless --headers (they sit in the cache dir
only when it is torch's default dir, weigh hundreds of MB, and only the same host compiler can use them)."""

from __future__ import annotations

import tarfile

from cli.main import app
from compilewatch.cache.archive import load as archive_load
from compilewatch.cache.archive import reader
from compilewatch.cache.archive import save as archive_save
from tests.cache_helpers import make_cache, tree, write
from tests.helpers import invoke, invoke_json

HEADERS = {  # what torch 2.11-2.15 write there (layout.KINDS): a header, its .gch, a lock
    "precompiled_headers/c3f2a9d1e0b4c5a6f7e8d9c0b1a2f3e4d5c6b7a8f9e0d1c2b3a4f5e6d7c8b9a0.h": b"// cpp_prefix.h\n" * 64,
    "precompiled_headers/c3f2a9d1e0b4c5a6f7e8d9c0b1a2f3e4d5c6b7a8f9e0d1c2b3a4f5e6d7c8b9a0.h.gch": b"gpch" + bytes(4000),
    "precompiled_headers/locks/c3f2a9d1e0b4c5a6f7e8d9c0b1a2f3e4d5c6b7a8f9e0d1c2b3a4f5e6d7c8b9a0.h.gch.lock": b"",
}


def _default_dir_cache(root):
    """A cache as torch's default dir holds it: the usual entries plus precompiled_headers/."""
    make_cache(root)
    for rel, data in HEADERS.items():
        write(root, rel, data)
    return root


def _members(path) -> list[str]:
    with tarfile.open(path) as t:
        return t.getnames()


def test_save_leaves_the_precompiled_headers_out_and_says_so(tmp_path):
    src = _default_dir_cache(tmp_path / "torchinductor_me")
    res = archive_save.save(tmp_path / "a.tar", src)
    assert not [m for m in _members(tmp_path / "a.tar") if "precompiled_headers" in m]
    assert res.left_out == {"precompiled_headers": {"files": 3, "bytes": sum(len(d) for d in HEADERS.values())}}
    assert res.files == len(tree(src)) - 3 and not [e for e in reader.read_manifest(tmp_path / "a.tar").entries
                                                     if e.rel.startswith("precompiled_headers")]
    loaded = archive_load.load(tmp_path / "a.tar", tmp_path / "dst")  # manifest and signature agree with what was left
    assert loaded.files == res.files and not (tmp_path / "dst" / "precompiled_headers").exists()


def test_headers_true_archives_them(tmp_path):
    src = _default_dir_cache(tmp_path / "torchinductor_me")
    res = archive_save.save(tmp_path / "a.tar", src, headers=True)
    assert {reader.PREFIX + rel for rel in HEADERS} <= set(_members(tmp_path / "a.tar"))
    assert res.left_out is None and res.files == len(tree(src))


def test_a_cache_without_headers_reports_nothing_left_out(tmp_path):
    res = archive_save.save(tmp_path / "a.tar", make_cache(tmp_path / "c"))
    assert res.left_out is None


def test_cli_says_what_it_left_out_and_headers_keeps_them(tmp_path):
    src = _default_dir_cache(tmp_path / "torchinductor_me")
    r = invoke(app, ["cache", "save", str(tmp_path / "a.tar"), "--dir", str(src)])
    assert r.exit_code == 0 and "left out precompiled_headers/: 3 files" in r.stdout and "--headers" in r.stdout
    data = invoke_json(app, ["cache", "save", str(tmp_path / "b.tar"), "--dir", str(src), "--headers"])
    assert data["left_out"] is None and data["files"] == len(tree(src))
