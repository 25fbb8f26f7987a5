"""cache layout + fingerprint on synthetic caches: Merkle hash, stat index reuse, stamps, bad input."""

from __future__ import annotations

import json
import os

import pytest

from compilewatch import torchinfo
from compilewatch.cache.content import fingerprint as fp_mod
from compilewatch.cache.local import layout
from compilewatch.errors import BadInput
from tests.cache_helpers import OTHER_KEY, big_cache, make_cache, write


@pytest.mark.parametrize("rel, sub, entry", [
    ("fxgraph/ab/fabc/entry", "fxgraph", "fxgraph/ab/fabc"),
    ("aotautograd/akey/entry", "aotautograd", "aotautograd/akey"),
    ("ab/cabc.py", "codegen", "ab/cabc"),
    ("ab/cabc.main.cpp", "codegen", "ab/cabc"),
    ("triton/0/KEY/k.cubin", "triton", "triton/0/KEY"),
    ("locks/cabc.lock", "locks", "locks"),
    ("cache/" + "0" * 64, "cache", "cache/" + "0" * 64),
    ("gcc/x/y.o", "gcc", "gcc/x"),
    ("precompiled_headers/cabc.h", "precompiled_headers", "precompiled_headers/cabc"),
    ("precompiled_headers/cabc.h.gch", "precompiled_headers", "precompiled_headers/cabc"),
    ("precompiled_headers/locks/cabc.lock", "precompiled_headers", "precompiled_headers/locks"),
    ("memoizer_cache.json", "memoizer", "memoizer_cache.json"),
    ("configs_abc.json", "cutlass", "configs_abc.json"),
    ("torch_cutlass/x.py", "cutlass", "torch_cutlass/x.py"),
    ("halide-runtime-host-abc/done", "halide", "halide-runtime-host-abc/done"),
    ("dynamo/code_state_f.pkl", "dynamo", "dynamo/code_state_f.pkl"),
    ("README", "other", "README"),
    ("configs_x/y", "other", "configs_x/y"),
])
def test_subcache_and_entry_of(rel, sub, entry):
    assert layout.subcache_of(rel) == sub
    assert layout.entry_of(rel) == (sub, entry)


def test_locate_follows_torch_and_triton_env(tmp_path, monkeypatch):
    loc = layout.locate()
    assert loc.path == tmp_path / "inductor-cache" and loc.source == "TORCHINDUCTOR_CACHE_DIR"
    assert not loc.exists
    assert loc.triton_dir == tmp_path / "triton-cache" and not loc.triton_inside
    monkeypatch.delenv("TRITON_CACHE_DIR")
    make_cache(tmp_path / "inductor-cache")
    loc = layout.locate()
    assert loc.exists and loc.looks_like_cache and loc.triton_inside
    assert loc.triton_dir == loc.path / "triton"
    assert {s.name: s.exists for s in loc.subcaches}["fxgraph"] is True
    assert {s.name: s.exists for s in loc.subcaches}["dynamo"] is False
    assert loc.lock_file == tmp_path / ".inductor-cache.compilewatch.lock"


def test_walk_skips_in_flight_temp_files_and_sidecar(tmp_path):
    root = make_cache(tmp_path / "c")
    write(root, "fxgraph/ab/fabc/.1234.5678.tmp", b"half")
    write(root, "triton/0/K/tmp.pid_1_abc/k.cubin", b"half")
    write(root, ".compilewatch/fingerprint-index.json", b"{}")
    w = layout.walk(root)
    rels = {f.rel for f in w.files}
    assert not any(".tmp" in r or "tmp.pid_" in r or ".compilewatch" in r for r in rels)
    assert set(w.in_flight) == {"fxgraph/ab/fabc/.1234.5678.tmp", "triton/0/K/tmp.pid_1_abc"}


def test_same_content_same_hash_and_one_change_moves_only_its_subcache(tmp_path):
    a = make_cache(tmp_path / "a")
    b = make_cache(tmp_path / "b")
    # triton group files hold absolute paths, which differ between a and b: align them
    for root in (a, b):
        for g in root.rglob("__grp__*"):
            g.write_text("{}")
    fa, fb = fp_mod.fingerprint(a), fp_mod.fingerprint(b)
    assert fa.content_hash == fb.content_hash and fa.content_hash.startswith("xxh3-128:")
    assert fa.files == fb.files == 3 * 2 + 4 * 4 + 3
    (b / "01" / ("c01" + "x" * 49 + ".cpp")).write_text("// changed\n")
    fb2 = fp_mod.fingerprint(b)
    assert fb2.content_hash != fa.content_hash
    changed = {s.name for s in fb2.subcaches if s.content_hash != fa.subcache(s.name).content_hash}
    assert changed == {"codegen"}


def test_lock_files_do_not_change_the_content_hash(tmp_path):
    root = make_cache(tmp_path / "c")
    before = fp_mod.fingerprint(root)
    write(root, "locks/cnew.lock", b"")
    after = fp_mod.fingerprint(root)
    assert after.content_hash == before.content_hash
    assert after.subcache("locks").files == before.subcache("locks").files + 1


def test_stat_index_is_reused_for_unchanged_files(tmp_path):
    root = make_cache(tmp_path / "c")  # mtimes far in the past
    first = fp_mod.fingerprint(root)
    assert first.hashed == first.files and first.reused == 0
    assert (root / layout.SIDECAR / fp_mod.INDEX_NAME).is_file()
    second = fp_mod.fingerprint(root)
    assert second.hashed == 0 and second.reused == second.files
    assert second.content_hash == first.content_hash
    # rewrite one file with the same size and an explicit later mtime: only it is hashed again
    p = next(root.glob("*/c00*.cpp"))
    p.write_text(p.read_text().replace("0", "9"))
    os.utime(p, (1_700_000_100, 1_700_000_100))
    third = fp_mod.fingerprint(root)
    assert third.hashed == 1 and third.content_hash != first.content_hash


def test_racily_clean_files_are_hashed_again(tmp_path):
    root = make_cache(tmp_path / "c", mtime=None)  # written just now
    fp_mod.fingerprint(root)
    again = fp_mod.fingerprint(root)
    assert again.hashed == again.files  # too recent to trust the index (RACY_NS)


def test_corrupt_index_is_ignored(tmp_path):
    root = make_cache(tmp_path / "c")
    good = fp_mod.fingerprint(root, use_index=False)
    write(root, f"{layout.SIDECAR}/{fp_mod.INDEX_NAME}", b"{not json")
    fp = fp_mod.fingerprint(root)
    assert fp.content_hash == good.content_hash and fp.hashed == fp.files


def test_large_synthetic_cache_thread_pool_matches_serial(tmp_path):
    root = big_cache(tmp_path / "big", 3000)
    serial = fp_mod.fingerprint(root, use_index=False, workers=1)
    pooled = fp_mod.fingerprint(root, use_index=False, workers=4)
    assert serial.content_hash == pooled.content_hash
    assert pooled.files == 3000
    assert pooled.subcache("fxgraph").files == 750
    assert pooled.bytes == sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


def test_entry_stamps_are_counted(tmp_path):
    root = make_cache(tmp_path / "c", system_key=OTHER_KEY)
    write(root, "cache/" + torchinfo.system_key(), json.dumps({"system": {}, "cache": {}}))
    fp = fp_mod.fingerprint(root)
    assert fp.system_key == torchinfo.system_key()
    assert fp.entry_system_keys == {OTHER_KEY: 6, torchinfo.system_key(): 1}
    assert fp.foreign_entries == 6
    assert fp.torch_version == torchinfo.torch_module().__version__


def test_files_and_json_roundtrip(tmp_path):
    from compilewatch.serialize import to_jsonable

    root = make_cache(tmp_path / "c")
    fp = fp_mod.fingerprint(root, files=True)
    assert fp.entries is not None and len(fp.entries) == fp.files
    back = fp_mod.from_json(json.loads(json.dumps(to_jsonable(fp))))
    assert back == fp
    with pytest.raises(BadInput):
        fp_mod.from_json({"format": 1, "path": "x"})


def test_missing_and_foreign_dirs_are_bad_input(tmp_path):
    with pytest.raises(BadInput, match="does not exist"):
        fp_mod.fingerprint(tmp_path / "nope")
    (tmp_path / "project" / "src").mkdir(parents=True)
    (tmp_path / "project" / "README.md").write_text("hi")
    with pytest.raises(BadInput, match="does not look like an inductor cache"):
        fp_mod.fingerprint(tmp_path / "project")
    (tmp_path / "afile").write_text("x")
    with pytest.raises(BadInput, match="not a directory"):
        fp_mod.fingerprint(tmp_path / "afile")


def test_in_flight_files_are_counted_not_hashed(tmp_path):
    root = make_cache(tmp_path / "c")
    base = fp_mod.fingerprint(root)
    write(root, "fxgraph/f0/.99.99.tmp", b"being written")
    fp = fp_mod.fingerprint(root)
    assert fp.in_flight == 1 and fp.content_hash == base.content_hash


def test_a_cache_holding_only_precompiled_headers_is_a_cache(tmp_path):
    """What torch leaves in the default dir after CPU compiles elsewhere: only precompiled_headers/
    (`c<hash>.h` + `.h.gch`). It is torch's, so it is fingerprinted, not called "not a cache"."""
    from compilewatch.cache.local import layout

    root = tmp_path / "torchinductor_user"
    name = "c2wne2o555rbgtohkgbuxoo64pc5rm5kbakdbsm7q6hiphbew3ng"
    write(root, f"precompiled_headers/{name}.h", b"#include <x>\n")
    write(root, f"precompiled_headers/{name}.h.gch", b"\0gch")
    assert layout.cache_evidence(root) == ("precompiled_headers/c<hash>.h",)
    assert layout.looks_like_cache(root) and layout.unknown_entries(root) == ()
    assert fp_mod.fingerprint(root).files == 2
    # a folder of that name holding anything else is no evidence
    other = tmp_path / "project"
    write(other, "precompiled_headers/stdafx.h", b"")
    assert layout.cache_evidence(other) == () and not layout.looks_like_cache(other)


def test_a_cuda_code_folder_with_autotune_results_is_torchs(tmp_path):
    """On CUDA, triton's autotuning writes `<sha256 hex>.best_config` beside the kernel's c<hash>.py in the
    same two-character folder (torch/_inductor/runtime/autotune_cache.py). Such folders are torch's: a
    real GPU cache was called "not an inductor cache (it holds 2q/, 3f/, ... which torch does not write)"."""
    from compilewatch.cache.local import layout

    root = tmp_path / "gpu_cache"
    write(root, "2q/c2q" + "a" * 49 + ".py", b"# kernel\n")
    write(root, "2q/" + "0123456789abcdef" * 4 + ".best_config", b'{"XBLOCK": 128}')
    write(root, "fxgraph/ab/f" + "b" * 50 + "/entry", b"\x80\x04N.")
    assert layout.unknown_entries(root) == () and layout.looks_like_cache(root)
    assert fp_mod.fingerprint(root).files == 3
    # other names in a code folder are still not torch's
    write(root, "2q/notes.txt", b"mine")
    assert layout.unknown_entries(root) == ("2q/",)
