"""A remote cache entry signed with the key COMPILEWATCH_SIGNING_KEY names (a CI or cluster key) is said to
be signed by that key, not by "this machine": any machine holding the key could have written it (as `cache
save` and `cache verify` say of archives)."""

from __future__ import annotations

import os

from compilewatch.cache.remote import signatures as sigs
from compilewatch.cache.trust import keys
from tests.test_cache_trust import other_machine  # noqa: F401 - fixture: run a block as another machine
from tests.test_remote_verified import GOOD, KEY


def test_an_entry_signed_with_the_environments_key_names_that_key(tmp_path, monkeypatch, other_machine):
    with other_machine("ci"):
        keys.signing_key()
        ci_key = tmp_path / "ci-key.pem"
        ci_key.write_bytes(keys.key_path().read_bytes())
    os.chmod(ci_key, 0o600)
    mine = sigs.Signer.load()
    v = sigs.Trust().check(KEY, GOOD, mine.sign(KEY, GOOD))
    assert (v.state, v.signer) == ("own", "this machine") and v.detail.startswith("signed by this machine's key ed25519:")
    monkeypatch.setenv("COMPILEWATCH_SIGNING_KEY", str(ci_key))
    ci = sigs.Signer.load()
    v = sigs.Trust().check(KEY, GOOD, ci.sign(KEY, GOOD))
    assert v.state == "own" and v.signer == f"COMPILEWATCH_SIGNING_KEY ({ci_key})"
    assert v.detail.startswith("signed by key ed25519:") and f"from COMPILEWATCH_SIGNING_KEY ({ci_key})" in v.detail
    assert "this machine" not in v.detail
