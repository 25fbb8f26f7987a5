"""`cache remote`: torch's Redis remote caches on a real redis-server (tests/redis_helpers.py).

The proof that keys and values are torch's own: a cache compiled by a real torch process is pushed,
then a fresh process with an empty local cache and the remote cache on compiles the same function
and torch counts FX-graph and AOTAutograd hits, no FX-graph miss (run under whatever torch the suite
runs with: CI runs 2.13, 2.15 and 2.11).
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from cli.main import app
from compilewatch.cache.local import layout
from compilewatch.cache.remote import keyspace as remote_keys
from compilewatch.cache.remote import server as remote
from compilewatch.cache.remote import sync as remote_sync
from compilewatch.errors import BadInput
from tests.cache_helpers import tree
from tests.helpers import invoke, invoke_json
from tests.redis_helpers import RedisServer, free_port

PROG = Path(__file__).with_name("remote_compile_prog.py")
REPO = PROG.parent.parent
# torch 2.15 precompiles C++ headers into the cache dir (600+ MB per fresh cache, docs/cache.md): off in
# every process here, producer and consumer alike (the setting is part of the FX-graph key)
NO_PCH = "0"
_REMOTE_ENV = [k.env for k in remote_keys.KINDS.values()] + ["TORCHINDUCTOR_REDIS_URL", "TORCHINDUCTOR_REDIS_HOST",
                                                             "TORCHINDUCTOR_REDIS_PORT"]


def compile_in_fresh_process(cache_dir: Path, url: str | None = None, timeout: float = 600) -> dict:
    """Run tests/remote_compile_prog.py in a new process with its own local cache (and `url` as the
    remote FX-graph + AOTAutograd cache when given); its counters as a dict."""
    env = {k: v for k, v in os.environ.items() if k not in _REMOTE_ENV}
    env.update(TORCHINDUCTOR_CACHE_DIR=str(cache_dir), TRITON_CACHE_DIR=str(cache_dir / "triton"),
               PYTHONPATH=str(REPO), TORCHINDUCTOR_CPP_CACHE_PRECOMPILE_HEADERS=NO_PCH)
    if url is not None:
        env.update(TORCHINDUCTOR_FX_GRAPH_REMOTE_CACHE="1", TORCHINDUCTOR_AUTOGRAD_REMOTE_CACHE="1",
                   TORCHINDUCTOR_REDIS_URL=url)
    p = subprocess.run([sys.executable, str(PROG)], env=env, capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="session")
def real_cache(tmp_path_factory) -> Path:
    """A cache a real torch process wrote (forward + backward of one small function) with the remote
    caches turned on, as a cluster job writes it, but no server (torch goes on without one). The flag
    matters: functorch's config, TORCHINDUCTOR_AUTOGRAD_REMOTE_CACHE included, is part of the
    AOTAutograd key (test_aotautograd_keys_hash_the_remote_flag)."""
    root = tmp_path_factory.mktemp("real") / "cache"
    c = compile_in_fresh_process(root, f"redis://127.0.0.1:{free_port()}")
    assert c["inductor"].get("fxgraph_cache_miss", 0) >= 1 and c["aot_autograd"].get("autograd_cache_saved", 0) >= 1
    return root


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst, symlinks=True, ignore=shutil.ignore_patterns("precompiled_headers"))
    return dst


class _RunsCode:
    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


FX_KEY = "f" + "a" * 51


# --- keys -------------------------------------------------------------------------------------------
def test_keys_are_torchs_and_local_keys_are_checked():
    assert remote_keys.redis_key("fxgraph", FX_KEY) == f"pt2:fx-graph-v1::{FX_KEY}:c1"
    assert remote_keys.parse_key(f"pt2:fx-graph-v1::{FX_KEY}:c1").kind == "fxgraph"
    assert remote_keys.parse_key("pt2:autograd-experimental::a123:c1").kind == "aotautograd"
    assert remote_keys.parse_key("pt2:" + "0" * 64 + "::k:c1").kind == "autotune"
    assert remote_keys.parse_key("pt2:bundled-autotune-v1::k:c1").kind == "bundled-autotune"
    assert remote_keys.parse_key("pt2:dynamo-pgo::k:c1").kind == "pgo"
    assert remote_keys.parse_key("session:42").kind == "foreign"
    assert remote_keys.parse_key(b"\xff\xfe").kind == "foreign"
    for bad in ("f../../etc", "a" * 52, "", "f" + "A" * 51):
        with pytest.raises(ValueError):
            remote_keys.redis_key("fxgraph", bad)
    v = remote_keys.encode_pickled(b"\x80\x04N.")
    assert remote_keys.decode_pickled(v) == b"\x80\x04N." and json.loads(v)["time_taken_ms"] == 0
    with pytest.raises(ValueError, match="base64"):
        remote_keys.decode_pickled(b'{"data": "%%%"}')


def test_config_follows_torchs_rule():
    assert remote.config(env={}).url == "redis://localhost:6379" and remote.config(env={}).source == "default"
    c = remote.config(env={"TORCHINDUCTOR_REDIS_HOST": "h", "TORCHINDUCTOR_REDIS_PORT": "7"})
    assert c.url == "redis://h:7" and c.source == "TORCHINDUCTOR_REDIS_HOST/PORT"
    c = remote.config(env={"TORCHINDUCTOR_REDIS_URL": "redis://:pw@h:1/2", "TORCHINDUCTOR_REDIS_HOST": "x",
                           "TORCHINDUCTOR_FX_GRAPH_REMOTE_CACHE": "1"})
    assert c.url == "redis://:***@h:1/2" and c.enabled["fxgraph"] is True and c.enabled["aotautograd"] is None


# --- the proof: torch hits what push wrote ----------------------------------------------------------
def test_push_then_a_fresh_torch_process_hits_it(tmp_path, redis_url, real_cache):
    r = invoke_json(app, ["cache", "remote", "push", str(real_cache), "--url", redis_url])
    assert r["pushed"].get("fxgraph", 0) >= 1 and r["pushed"].get("aotautograd", 0) >= 1 and not r["skipped"]
    s = invoke_json(app, ["cache", "remote", "status", redis_url])
    assert s["reach"]["reachable"] and s["would_hit"] == s["torch_keys"] == sum(r["pushed"].values())
    c = compile_in_fresh_process(tmp_path / "empty", redis_url)
    assert c["inductor"].get("fxgraph_cache_hit", 0) >= 1 and c["inductor"].get("fxgraph_cache_miss", 0) == 0
    assert c["aot_autograd"].get("autograd_cache_hit", 0) >= 1
    assert c["remote"]["RemoteFxGraphCache"]["hit"] >= 1 and c["remote"]["RemoteFxGraphCache"]["miss"] == 0
    # pushing again changes nothing: every key is there already
    again = invoke_json(app, ["cache", "remote", "push", str(real_cache), "--url", redis_url])
    assert again["pushed"] == {} and again["already"] == sum(r["pushed"].values())


def test_aotautograd_keys_hash_the_remote_flag(tmp_path, redis_url):
    """A cache made with the remote caches off: its FX-graph entries hit a remote-on process, its
    AOTAutograd entries cannot (functorch's saved config, which the key hashes, differs); push says so."""
    local_only = tmp_path / "local-only"
    compile_in_fresh_process(local_only)
    r = remote_sync.push(local_only, redis_url)
    assert r.pushed.get("aotautograd", 0) >= 1 and any("TORCHINDUCTOR_AUTOGRAD_REMOTE_CACHE" in n for n in r.notes)
    c = compile_in_fresh_process(tmp_path / "empty", redis_url)
    assert c["inductor"].get("fxgraph_cache_hit", 0) >= 1 and c["inductor"].get("fxgraph_cache_miss", 0) == 0
    assert c["aot_autograd"].get("autograd_cache_hit", 0) == 0 and c["aot_autograd"].get("autograd_cache_miss", 0) >= 1


def test_pull_fills_an_empty_local_cache_that_torch_then_hits(tmp_path, redis_url, real_cache):
    remote_sync.push(real_cache, redis_url)
    target = tmp_path / "pulled"
    r = invoke_json(app, ["cache", "remote", "pull", "--url", redis_url, "--dir", str(target)])
    assert r["pulled"].get("fxgraph", 0) >= 1 and r["backup"] is None
    c = compile_in_fresh_process(target)  # remote off: only what pull wrote can hit
    assert c["inductor"].get("fxgraph_cache_hit", 0) >= 1 and c["inductor"].get("fxgraph_cache_miss", 0) == 0
    # a second pull finds everything there: no swap, no backup
    again = remote_sync.pull(redis_url, target)
    assert again.pulled == {} and again.already_local >= 1 and again.backup is None


def test_pull_into_an_existing_cache_keeps_it_and_backs_it_up(tmp_path, redis_url, real_cache):
    remote_sync.push(real_cache, redis_url)
    target = tmp_path / "local"
    target.mkdir()
    (target / "ab").mkdir()
    (target / "ab" / ("cab" + "1" * 50 + ".py")).write_text("x = 1\n")
    before = tree(target)
    r = remote_sync.pull(redis_url, target)
    assert r.backup and tree(Path(r.backup)) == before  # the previous cache, untouched
    after = tree(target)
    assert all(after[k] == v for k, v in before.items())  # kept, plus what was pulled
    assert any(k.startswith("fxgraph/") for k in after)


# --- only what verifies -----------------------------------------------------------------------------
def test_push_from_a_dir_leaves_out_what_does_not_verify(tmp_path, redis_url, real_cache, redis_server):
    src = _copy(real_cache, tmp_path / "src")
    evil_key, cut_key = "f" + "b" * 51, "f" + "c" * 51
    (src / "fxgraph" / "bb" / evil_key).mkdir(parents=True)
    (src / "fxgraph" / "bb" / evil_key / "e").write_bytes(pickle.dumps(_RunsCode(tmp_path / "ran"), protocol=4))
    (src / "fxgraph" / "cc" / cut_key).mkdir(parents=True)
    (src / "fxgraph" / "cc" / cut_key / "e").write_bytes(b"\x80\x04\x95 cut sho")
    r = remote_sync.push(src, redis_url)
    skipped = {s.what for s in r.skipped}
    assert f"fxgraph/bb/{evil_key}/e" in skipped and f"fxgraph/cc/{cut_key}/e" in skipped
    c = redis_server.client()
    assert not c.exists(remote_keys.redis_key("fxgraph", evil_key), remote_keys.redis_key("fxgraph", cut_key))
    assert r.pushed.get("fxgraph", 0) >= 1 and not (tmp_path / "ran").exists()


def test_push_from_an_archive_goes_through_cache_load(tmp_path, redis_url, real_cache, monkeypatch):
    from compilewatch.cache.archive import load as archive_load
    from compilewatch.cache.archive import save as archive_save

    arch = tmp_path / "warm.tar.gz"
    archive_save.save(arch, real_cache)
    calls = []
    real_load = archive_load.load
    monkeypatch.setattr(archive_load, "load", lambda *a, **k: calls.append(a) or real_load(*a, **k))
    r = remote_sync.push(arch, redis_url)
    assert calls and Path(calls[0][0]) == arch and r.source_kind == "archive" and r.pushed.get("fxgraph", 0) >= 1
    cut = tmp_path / "cut.tar.gz"
    cut.write_bytes(arch.read_bytes()[: arch.stat().st_size // 2])
    res = invoke(app, ["cache", "remote", "push", str(cut), "--url", redis_url])
    assert res.exit_code == 2 and "error:" in res.stderr and "Traceback" not in res.stderr


# --- verify: entries and the server ------------------------------------------------------------------
def test_verify_finds_crafted_malformed_oversized_and_foreign_entries(tmp_path, redis_url, redis_server):
    c = redis_server.client()
    evil = remote_keys.encode_pickled(pickle.dumps(_RunsCode(tmp_path / "ran"), protocol=4))
    c.set(remote_keys.redis_key("fxgraph", "f" + "d" * 51), evil)
    c.set(remote_keys.redis_key("aotautograd", "a" + "e" * 51), b"not json")
    c.set("pt2:bundled-autotune-v1::k:c1", b"[1, 2]")
    c.set(remote_keys.redis_key("fxgraph", "f" + "g" * 51), remote_keys.encode_pickled(b"\x80\x04N." + b" " * 4096))
    c.set("session:1", b"someone else's")
    r = invoke_json(app, ["cache", "remote", "verify", redis_url, "--max-value", "2KB"], expect_code=1)
    kinds = {f["kind"] for f in r["findings"]}
    assert {"untrusted", "malformed", "oversized", "foreign-key", "no-auth"} <= kinds
    assert not (tmp_path / "ran").exists()
    s = remote.status(redis_url, max_value=2048)
    assert s.problems.get("oversized") == 1 and s.foreign_keys == 1


def test_read_capped_never_reads_past_the_cap(redis_url, redis_server):
    c = redis_server.client()
    c.set("pt2:fx-graph-v1::fbig:c1", b"x" * 100_000)
    with pytest.raises(ValueError, match="cap"):
        remote.read_capped(c, "pt2:fx-graph-v1::fbig:c1", 1000)
    assert remote.read_capped(c, "pt2:fx-graph-v1::fbig:c1", 100_000) == b"x" * 100_000
    assert remote.read_capped(c, "missing", 10) is None


def test_security_posture_with_a_password_and_wrong_passwords(tmp_path):
    srv = RedisServer.start(tmp_path / "pw", password="s3cret")
    try:
        r = remote.verify(srv.url)
        assert r.security.auth in ("password", "acl") and "no-auth" not in r.counts and "open-bind" not in r.counts
        assert r.ok and ":***@" in r.url and "s3cret" not in json.dumps(invoke_json(
            app, ["cache", "remote", "status", srv.url])["reach"])
        wrong = invoke(app, ["cache", "remote", "verify", srv.url.replace("s3cret", "nope")])
        assert wrong.exit_code == 2 and "refused the password" in wrong.stderr and "nope" not in wrong.stderr
        none = invoke(app, ["cache", "remote", "push", str(tmp_path), "--url", f"redis://127.0.0.1:{srv.port}"])
        assert none.exit_code == 2
    finally:
        srv.stop()


def test_open_bind_is_a_finding(tmp_path):
    srv = RedisServer.start(tmp_path / "open", "--bind", "* -::*")  # protected-mode stays on: loopback only
    try:
        r = invoke_json(app, ["cache", "remote", "verify", srv.url], expect_code=1)
        assert {"open-bind", "no-auth"} <= {f["kind"] for f in r["findings"]}
    finally:
        srv.stop()


# --- faults -----------------------------------------------------------------------------------------
def test_unreachable_is_a_finding_for_status_and_bad_input_for_the_rest(tmp_path, real_cache):
    url = f"redis://127.0.0.1:{free_port()}"
    s = invoke_json(app, ["cache", "remote", "status", url], expect_code=1)
    assert not s["reach"]["reachable"] and "unreachable" in s["reach"]["why"]
    for args in (["push", str(real_cache), "--url", url], ["pull", "--url", url, "--dir", str(tmp_path / "x")],
                 ["verify", url], ["clear", url]):
        res = invoke(app, ["cache", "remote", *args])
        assert res.exit_code == 2 and "unreachable" in res.stderr and "Traceback" not in res.stderr, args
    assert not (tmp_path / "x").exists()


def test_wrong_protocol_says_it_is_not_redis(tmp_path):
    import http.server
    import threading

    httpd = http.server.HTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)
    t = threading.Thread(target=httpd.serve_forever, daemon=True)
    t.start()
    try:
        res = invoke(app, ["cache", "remote", "verify", f"redis://127.0.0.1:{httpd.server_port}"])
        assert res.exit_code == 2 and ("not as a Redis server" in res.stderr or "closed the connection" in res.stderr)
        bad = invoke(app, ["cache", "remote", "verify", "http://127.0.0.1:1"])
        assert bad.exit_code == 2 and "not a Redis URL" in bad.stderr
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_a_server_that_dies_mid_push_is_a_clean_error(tmp_path, real_cache):
    srv = RedisServer.start(tmp_path / "dies")
    real_set = remote_sync._set
    writes = []

    def set_then_die(client, key, value, overwrite):
        if writes:
            try:
                client.shutdown(nosave=True)
            except Exception:  # noqa: BLE001 - the server drops the connection as it goes
                pass
        writes.append(key)
        return real_set(client, key, value, overwrite)

    try:
        import unittest.mock

        with unittest.mock.patch.object(remote_sync, "_set", set_then_die):
            res = invoke(app, ["cache", "remote", "push", str(real_cache), "--url", srv.url])
        assert res.exit_code == 2 and "failed during push" in res.stderr and "Traceback" not in res.stderr
        assert len(writes) == 2 and srv.proc.wait(timeout=10) is not None
    finally:
        srv.stop()


def test_pull_refuses_a_crafted_entry_and_changes_nothing(tmp_path, redis_url, redis_server, real_cache):
    local = _copy(real_cache, tmp_path / "local")
    before = tree(local)
    names = set(os.listdir(tmp_path))
    evil = remote_keys.encode_pickled(pickle.dumps(_RunsCode(tmp_path / "ran"), protocol=4))
    redis_server.client().set(remote_keys.redis_key("fxgraph", "f" + "h" * 51), evil)
    res = invoke(app, ["cache", "remote", "pull", "--url", redis_url, "--dir", str(local)])
    assert res.exit_code == 2 and "refused" in res.stderr and "system" in res.stderr
    assert tree(local) == before and set(os.listdir(tmp_path)) == names and not layout.siblings_of(local)
    assert not (tmp_path / "ran").exists()


def test_clear_backs_up_first_and_push_restores(tmp_path, redis_url, redis_server, real_cache):
    pushed = remote_sync.push(real_cache, redis_url)
    c = redis_server.client()
    c.set("session:1", b"not torch's")
    n = sum(pushed.pushed.values())
    backup = tmp_path / "before.jsonl"
    r = invoke_json(app, ["cache", "remote", "clear", redis_url, "--backup", str(backup)])
    assert r["deleted"] == n and r["left_alone"] == 1 and Path(r["backup"]) == backup and c.dbsize() == 1
    back = remote_sync.push(backup, redis_url)
    assert sum(back.pushed.values()) == n and remote.status(redis_url).would_hit == n
    again = invoke(app, ["cache", "remote", "clear", redis_url, "--backup", str(backup)])
    assert again.exit_code == 2 and "already exists" in again.stderr and c.dbsize() == 2 * n + 1  # nothing deleted
    bad = tmp_path / "x.jsonl"
    bad.write_text('{"format": "something else"}\n')
    assert invoke(app, ["cache", "remote", "push", str(bad), "--url", redis_url]).exit_code == 2


def test_training_is_not_blocked_by_a_dead_remote_cache(tmp_path):
    """torch's backend swallows the connection error: the compile goes on (this is why doctor/run report it)."""
    c = compile_in_fresh_process(tmp_path / "c", f"redis://127.0.0.1:{free_port()}")
    assert c["inductor"].get("fxgraph_cache_miss", 0) >= 1
    assert c["remote"]["RemoteFxGraphCache"]["hit"] == 0
