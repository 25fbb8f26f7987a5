"""A Mega-Cache artifact's key is a path (session 16): torch's `populate_caches` writes each artifact under
it, so an autotune artifact keyed `../x.best_config` or an absolute path wrote outside the cache dir when
`load_mega_cache` preloaded a signed (or --trust) archive. Keys are now held to the form torch makes, in
`load_mega_cache` (refused whatever --trust says, as a member name is) and in `cache verify`."""

from __future__ import annotations

import json

import pytest

from compilewatch.cache.archive import check as archive_check
from compilewatch.cache.archive import load as archive_load
from compilewatch.cache.archive import reader
from compilewatch.cache.archive import save as archive_save
from compilewatch.cache.trust import paths
from compilewatch.errors import BadInput
from tests.cache_helpers import make_cache, signed_tar, tar_members

BEST = "ab/" + "0" * 64 + ".best_config"
CONFIG = {"XBLOCK": 64, "num_warps": 4, "num_stages": 1, "configs_hash": "h"}  # torch encodes it as JSON


def _mega(records: list[tuple[str, str, bytes]]) -> bytes:
    from torch.compiler._cache import CacheArtifactManager

    with CacheArtifactManager.with_fresh_cache():
        for kind, key, content in records:
            CacheArtifactManager.record_artifact(kind, key, content)
        blob, _ = CacheArtifactManager.serialize()
    return blob


def test_torch_writes_an_autotune_artifact_where_its_key_says(tmp_path, monkeypatch):
    """The harm, shown with torch's own code: a key with '..' lands beside the cache dir, not in it."""
    from torch._inductor.runtime.autotune_cache import AutotuneCacheArtifact

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "cache"))
    AutotuneCacheArtifact("../escaped.best_config", json.dumps(CONFIG).encode()).populate_cache()  # as deserialized
    assert json.loads((tmp_path / "escaped.best_config").read_text()) == CONFIG


@pytest.mark.parametrize("kind, key", [
    ("autotune", "../escaped.best_config"), ("autotune", "/tmp/x/" + "0" * 64 + ".best_config"),
    ("autotune", "ab/../" + "0" * 64 + ".best_config"), ("inductor", "/abs/fkey"), ("inductor", "f../.."),
    ("aot_autograd", "a/b"), ("precompile", "../pkg"), ("precompile", "/abs"),
])
def test_a_key_outside_torchs_form_is_refused_by_preload_and_verify(tmp_path, kind, key):
    content = CONFIG if kind == "autotune" else b"\x80\x04N."
    saved = tmp_path / "a.tar"
    archive_save.save(saved, make_cache(tmp_path / "src"), mega=False)
    evil = signed_tar(tmp_path / "evil.tar", [*tar_members(saved), (reader.MEGA, _mega([(kind, key, content)]))])
    for trust in (False, True):
        with pytest.raises(BadInput, match="not a key torch makes"):
            archive_load.load_mega_cache(evil, trust=trust)
    rep = archive_check.verify_archive(evil)
    assert not rep.ok
    assert any(f.kind == "refused" and f.member == f"{reader.MEGA}: {kind}" and "not a key torch makes" in f.detail
               for f in rep.findings), rep.findings


def test_torchs_own_keys_pass(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "cache"))
    for kind, key in (("autotune", BEST), ("inductor", "f" + "a1" * 26), ("aot_autograd", "a" + "b2" * 26),
                      ("pgo", "code_state_key:/x/y.py:12"), ("precompile", "0123abcdef"), ("a_future_kind", "k.1")):
        assert paths.mega_key_refused(kind, key) is None, (kind, key)
    assert "not a string" in paths.mega_key_refused("autotune", None)
    for key in ("../x", "/abs", "a/b", "..", ""):  # a kind torch may add later: one plain path component
        assert paths.mega_key_refused("a_future_kind", key) is not None, key
    saved = tmp_path / "a.tar"
    archive_save.save(saved, make_cache(tmp_path / "src"), mega=False)
    good = signed_tar(tmp_path / "good.tar", [*tar_members(saved), (reader.MEGA, _mega([("autotune", BEST, CONFIG)]))])
    assert archive_load.load_mega_cache(good) == {"autotune": 1}
    assert (tmp_path / "cache" / BEST).is_file()
    assert archive_check.verify_archive(good).ok
