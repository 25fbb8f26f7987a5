"""What torch reads from Redis is verified before torch unpickles it, in processes compilewatch watches
(issue 37, items 1 and 4): entries are signed beside them (`cache remote push`, and torch's own writes
from a watched process), and the verifying backend turns unsigned, foreign-signed, tampered and
unscannable entries into misses, counted per kind. A poisoned Redis end to end on a real redis-server:
a crafted pickle (`os.system("touch MARKER")`) under the exact FX-graph key a compile looks up."""

from __future__ import annotations

import base64
import json
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from cli.main import app
from compilewatch.cache.remote import keyspace as remote_keys
from compilewatch.cache.remote import server as remote
from compilewatch.cache.remote import signatures as sigs
from compilewatch.cache.remote import sync as remote_sync
from compilewatch.cache.remote import verified
from compilewatch.cache.trust import keys as trust_keys
from tests.helpers import invoke, invoke_json

PROG = Path(__file__).with_name("remote_compile_prog.py")
REPO = PROG.parent.parent
KEY = remote_keys.redis_key("fxgraph", "f" + "k" * 51)
_REMOTE_ENV = [k.env for k in remote_keys.KINDS.values()] + ["TORCHINDUCTOR_REDIS_URL", "TORCHINDUCTOR_REDIS_HOST",
                                                             "TORCHINDUCTOR_REDIS_PORT"]


class _RunsCode:
    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _evil(marker: Path) -> bytes:
    return remote_keys.encode_pickled(pickle.dumps(_RunsCode(marker), protocol=4))


GOOD = remote_keys.encode_pickled(pickle.dumps({"a": (1, 2.0, "x")}, protocol=4))


def _other_signer() -> sigs.Signer:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    return sigs.Signer(Ed25519PrivateKey.generate())


# --- the decision ----------------------------------------------------------------------------------
def test_only_trusted_signed_scannable_values_are_admitted(tmp_path):
    own = sigs.Signer.load()
    trust = sigs.Trust()
    assert verified.refusal(KEY, GOOD, own.sign(KEY, GOOD), trust) is None
    assert verified.refusal(KEY, GOOD, None, trust)[0] == "unsigned"
    other = _other_signer()
    assert verified.refusal(KEY, GOOD, other.sign(KEY, GOOD), trust)[0] == "foreign"
    changed = GOOD.replace(b"time_taken_ms", b"time_taken_MS")
    assert verified.refusal(KEY, changed, own.sign(KEY, GOOD), trust) == (
        "bad-signature", "signed for other bytes: the value changed after it was signed")
    moved = remote_keys.redis_key("fxgraph", "f" + "m" * 51)  # a signed value copied under another key
    assert verified.refusal(moved, GOOD, own.sign(KEY, GOOD), trust)[0] == "bad-signature"
    forged = json.loads(own.sign(KEY, GOOD))
    forged["public_key"] = base64.b64encode(other.raw).decode()
    assert verified.refusal(KEY, GOOD, json.dumps(forged).encode(), trust)[0] == "bad-signature"
    assert verified.refusal(KEY, GOOD, b"x" * 10_000, trust)[0] == "bad-signature"
    evil = _evil(tmp_path / "ran")
    why = verified.refusal(KEY, evil, own.sign(KEY, evil), trust)  # signed by us, still never unpickled
    assert why[0] == "unscannable" and "system" in why[1]
    deep = b"[" * 100_000
    assert verified.refusal(KEY, deep, own.sign(KEY, deep), trust)[0] == "malformed"
    # a key the user adds to the trust store is trusted from then on (the store is read again)
    (tmp_path / "other.pub").write_text(trust_keys.public_key_line(trust_keys.PublicKey(
        other.key_id, base64.b64encode(other.raw).decode(), "ci")) + "\n")
    trust_keys.trust_add(str(tmp_path / "other.pub"))
    trust.refresh()
    assert verified.refusal(KEY, GOOD, other.sign(KEY, GOOD), trust) is None
    assert not (tmp_path / "ran").exists()


# --- the backend inside torch, in this process ------------------------------------------------------
@pytest.fixture
def verifying(monkeypatch, redis_url):
    for k in _REMOTE_ENV:
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("TORCHINDUCTOR_REDIS_URL", redis_url)
    got = verified.install()
    verified.reset_counts()
    yield got
    verified.uninstall()


def test_torchs_backend_refuses_what_does_not_verify_and_signs_what_it_writes(verifying, redis_server, tmp_path):
    from torch._inductor.remote_cache import RemoteFxGraphCache, cache_stats

    from compilewatch import remote_usage

    assert verifying.point == "RedisRemoteCacheBackend._get/_put"
    c = redis_server.client()
    marker = tmp_path / "ran"
    c.set(KEY, _evil(marker))  # what an attacker with write access plants: no signature
    other = remote_keys.redis_key("fxgraph", "f" + "o" * 51)
    c.set(other, GOOD)
    c.set(remote_keys.signature_key(other), _other_signer().sign(other, GOOD))
    cache = RemoteFxGraphCache("fx-graph-v1")
    before = dict(vars(cache_stats._stats["RemoteFxGraphCache"]))
    assert cache.get("f" + "k" * 51) is None and cache.get("f" + "o" * 51) is None
    value = json.loads(GOOD)
    cache.put("f" + "w" * 51, value)  # torch writing from a watched process: signed beside it
    written = remote_keys.redis_key("fxgraph", "f" + "w" * 51)
    assert sigs.Trust().check(written, c.get(written), c.get(remote_keys.signature_key(written))).state == "own"
    assert cache.get("f" + "w" * 51) == value
    after = vars(cache_stats._stats["RemoteFxGraphCache"])
    assert after["miss"] - before["miss"] == 2 and after["hit"] - before["hit"] == 1  # refusals are misses to torch
    assert verified.counts()["fxgraph"] == {"refused_unsigned": 1, "refused_foreign": 1, "signed": 1, "admitted": 1}
    row = remote_usage.current_counts()["fxgraph"]  # where doctor, run and dflash's rank report read them
    assert row["refused"] == 2 and row["refused_unsigned"] == 1 and row["hit"] >= 1
    assert not marker.exists()


# --- end to end: a poisoned Redis and real compiles -----------------------------------------------------
def _env(cache_dir: Path, url: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _REMOTE_ENV}
    env.update(TORCHINDUCTOR_CACHE_DIR=str(cache_dir), TRITON_CACHE_DIR=str(cache_dir / "triton"), PYTHONPATH=str(REPO),
               TORCHINDUCTOR_CPP_CACHE_PRECOMPILE_HEADERS="0", TORCHINDUCTOR_FX_GRAPH_REMOTE_CACHE="1",
               TORCHINDUCTOR_AUTOGRAD_REMOTE_CACHE="1", TORCHINDUCTOR_REDIS_URL=url)
    return env


def _watched(cache_dir: Path, url: str, monkeypatch):
    """`compilewatch run -- python remote_compile_prog.py` (through the runner), its summary."""
    from compilewatch.tracing import runner

    for k, v in _env(cache_dir, url).items():
        monkeypatch.setenv(k, v)
    r = runner.run_watched([sys.executable, str(PROG)])
    assert r.exit_code == 0
    return r.summary


def _fx_keys(c) -> list[str]:
    return sorted(k.decode() for k in c.scan_iter(match="pt2:fx-graph-v1::*"))


def test_a_poisoned_redis_end_to_end(tmp_path, redis_url, redis_server, monkeypatch):
    c = redis_server.client()
    marker = tmp_path / "ran"
    # 1. a watched job compiles with the remote cache on: torch's writes are signed beside them
    s1 = _watched(tmp_path / "c1", redis_url, monkeypatch)
    fx = _fx_keys(c)
    assert fx and s1.remote_cache["fxgraph"].get("signed", 0) == len(fx)
    trust = sigs.Trust()
    assert all(trust.check(k, c.get(k), c.get(remote_keys.signature_key(k))).state == "own" for k in fx)
    # 2. push from that cache, with a crafted local entry planted in it: never sent, the rest signed
    src = tmp_path / "src"
    shutil.copytree(tmp_path / "c1", src, symlinks=True, ignore=shutil.ignore_patterns("precompiled_headers"))
    evil_key = "f" + "b" * 51
    (src / "fxgraph" / "bb" / evil_key).mkdir(parents=True)
    (src / "fxgraph" / "bb" / evil_key / "e").write_bytes(pickle.dumps(_RunsCode(marker), protocol=4))
    c.flushall()
    p = remote_sync.push(src, redis_url)
    assert any(evil_key in sk.what for sk in p.skipped) and not c.exists(remote_keys.redis_key("fxgraph", evil_key))
    assert p.signed == sum(p.pushed.values()) >= 2 and _fx_keys(c) == fx
    st = invoke_json(app, ["cache", "remote", "status", redis_url])
    assert st["by_signature"] == {"own": sum(p.pushed.values())} and st["torch_keys"] == sum(p.pushed.values())
    # 3. a fresh watched process hits the signed entries
    s2 = _watched(tmp_path / "c2", redis_url, monkeypatch)
    assert s2.remote_cache["fxgraph"].get("admitted", 0) >= 1 and s2.remote_cache["fxgraph"]["hit"] >= 1
    assert not s2.remote_cache["fxgraph"].get("refused")
    # 4. poison: the crafted pickle under the exact FX-graph keys it looks up, one keeping its old
    # signature (tampered), the others unsigned
    for k in fx:
        c.set(k, _evil(marker))
    for k in fx[1:]:
        c.delete(remote_keys.signature_key(k))
    v = invoke_json(app, ["cache", "remote", "verify", redis_url], expect_code=1)
    assert set(fx) <= {f["key"] for f in v["findings"] if f["kind"] == "untrusted"}
    pulled = invoke(app, ["cache", "remote", "pull", "--url", redis_url, "--dir", str(tmp_path / "c9")])
    assert pulled.exit_code == 2 and "refused" in pulled.stderr and not (tmp_path / "c9").exists()
    # 5. a watched process with the remote cache on does not load them: it compiles, the marker never appears
    s3 = _watched(tmp_path / "c3", redis_url, monkeypatch)
    row = s3.remote_cache["fxgraph"]
    assert row.get("refused", 0) >= 1 and not row.get("admitted") and row["hit"] == 0
    assert set(row) & {"refused_bad-signature", "refused_unsigned"}
    assert not marker.exists()
    # 6. the control: torch without compilewatch reads Redis directly and runs the planted code (planted
    # again: step 5's compile wrote its own entries over them, signed)
    assert all(c.get(k) != _evil(marker) for k in fx)
    for k in fx:
        c.set(k, _evil(marker))
    subprocess.run([sys.executable, str(PROG)], env=_env(tmp_path / "c4", redis_url), capture_output=True,
                   timeout=600)
    assert marker.exists(), "the planted entry was not under the key torch looks up: steps 4-5 proved nothing"
