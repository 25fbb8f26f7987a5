"""Red team, session 14: `cache remote` against a shared Redis someone else also writes to (a real
redis-server, tests/redis_helpers.py; mocks only to inject a fault)."""

from __future__ import annotations

import pickle
import unittest.mock

from cli.main import app
from compilewatch.cache.remote import keyspace as remote_keys
from compilewatch.cache.remote import server as remote
from compilewatch.cache.remote import signatures as sigs
from compilewatch.cache.remote import sync as remote_sync
from tests.helpers import invoke, invoke_json

GOOD = remote_keys.encode_pickled(pickle.dumps({"a": (1, 2.0, "x")}, protocol=4))


def test_a_signature_key_of_the_wrong_type_is_a_bad_signature_not_a_failed_command(tmp_path, redis_url, redis_server):
    c = redis_server.client()
    key = remote_keys.redis_key("fxgraph", "f" + "c" * 52)
    c.set(key, GOOD)
    c.hset(remote_keys.signature_key(key), "a", "b")  # WRONGTYPE for GETRANGE: it ended status, verify and pull
    r = invoke_json(app, ["cache", "remote", "verify", redis_url], expect_code=1)
    assert any(f["kind"] == "bad-signature" and f["key"] == key for f in r["findings"])
    assert invoke_json(app, ["cache", "remote", "status", redis_url])["by_signature"] == {"bad-signature": 1}
    res = invoke(app, ["cache", "remote", "pull", redis_url, "--dir", str(tmp_path / "ic"), "--allow-unsigned"])
    assert res.exit_code == 0 and "Traceback" not in res.stderr and not (tmp_path / "ic").exists()


def test_a_planted_key_too_long_for_a_file_name_is_skipped_by_pull(tmp_path, redis_url, redis_server):
    c = redis_server.client()
    key = f"pt2:fx-graph-v1::f{'b' * 300}:c1"  # was an OSError traceback (ENAMETOOLONG) in the staging dir
    c.set(key, GOOD)
    c.set(remote_keys.signature_key(key), sigs.Signer.load().sign(key, GOOD))
    r = invoke_json(app, ["cache", "remote", "pull", redis_url, "--dir", str(tmp_path / "ic")])
    assert r["pulled"] == {} and [s["what"] for s in r["skipped"]] == [key]
    assert remote_keys.redis_key("fxgraph", "f" + "a" * 52)  # torch's own length still a key


def test_verify_names_a_bounded_number_of_foreign_keys_and_counts_them_all(redis_url, redis_server):
    c = redis_server.client()
    n = remote.MAX_NAMED_FOREIGN + 50
    c.eval(f"for i=1,{n} do redis.call('SET','session:'..i,'x') end return 1", 0)
    c.rpush(remote_keys.redis_key("aotautograd", "a" + "e" * 52), "x")  # a torch key that is no string
    r = invoke_json(app, ["cache", "remote", "verify", redis_url], expect_code=1)
    foreign = [f for f in r["findings"] if f["kind"] == "foreign-key"]
    assert len(foreign) == remote.MAX_NAMED_FOREIGN + 1 and "50 more" in foreign[-1]["detail"]
    assert r["counts"]["foreign-key"] == n
    assert any(f["kind"] == "malformed" and "WRONGTYPE" in f["detail"] for f in r["findings"])


def test_odd_urls_are_bad_input_with_the_password_hidden(redis_url):
    port = redis_url.rsplit(":", 1)[1].split("/")[0]
    for url, said in ((f"redis://:s3cret@127.0.0.1:abc/0", "Port could not be cast"),
                      (f"redis://127.0.0.1:{port}/0?foo=bar", "'foo'")):
        for cmd in ("status", "verify"):
            res = invoke(app, ["cache", "remote", cmd, url])
            assert res.exit_code == 2 and said in res.stderr and "Traceback" not in res.stderr, (cmd, res.stderr)
            assert "s3cret" not in res.stderr
    assert remote.redact("redis://:pw@[::1]:6379/0") == "redis://:***@[::1]:6379/0"


def test_local_paths_that_cannot_be_used_are_bad_input(tmp_path, redis_url, redis_server):
    c = redis_server.client()
    c.set(remote_keys.redis_key("fxgraph", "f" + "d" * 52), GOOD)
    long = tmp_path / ("n" * 300)
    (tmp_path / "afile").write_text("x")
    for args in (["pull", redis_url, "--dir", str(long)], ["pull", redis_url, "--dir", str(tmp_path / "afile" / "s")],
                 ["push", str(long), redis_url], ["clear", redis_url, "--backup", f"{long}.jsonl"]):
        res = invoke(app, ["cache", "remote", *args])
        assert res.exit_code == 2 and "Traceback" not in res.stderr and "error:" in res.stderr, (args, res.stderr)
    assert c.dbsize() == 1  # clear deleted nothing without its backup


def test_clear_deletes_nothing_when_a_value_grows_past_the_cap_after_scan(tmp_path, redis_url, redis_server):
    c = redis_server.client()
    key = remote_keys.redis_key("fxgraph", "f" + "g" * 52)
    c.set(key, b"x" * 5000)
    real_scan = remote.scan

    def stale_scan(client, **kw):  # a writer grew the value between SCAN/STRLEN and the read
        for ki in real_scan(client, **kw):
            yield remote.KeyInfo(ki.key, ki.kind, 10)

    with unittest.mock.patch.object(remote, "scan", stale_scan):
        res = invoke(app, ["cache", "remote", "clear", redis_url, "--backup", str(tmp_path / "b.jsonl"),
                           "--max-value", "1KB"])
    assert res.exit_code == 2 and "nothing was deleted" in res.stderr and "Traceback" not in res.stderr
    assert c.exists(key) and not (tmp_path / "b.jsonl").exists()
    assert remote_sync.BACKUP_SUFFIX == ".jsonl"
