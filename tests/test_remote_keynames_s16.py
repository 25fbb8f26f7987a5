"""Key names are bounded too (session 16): SCAN hands names over whole and a key name can be 512 MB, so a
database shared with another application could make `cache remote status/verify/clear` read gigabytes.
Names are now listed by a server-side script that returns those up to `MAX_KEY_NAME` bytes and only the
lengths of longer ones (a real redis-server: tests/redis_helpers.py)."""

from __future__ import annotations

import pickle
import tracemalloc

from cli.main import app
from compilewatch.cache.remote import keyspace as remote_keys
from compilewatch.cache.remote import listing
from compilewatch.cache.remote import server as remote
from tests.helpers import invoke_json

GOOD = remote_keys.encode_pickled(pickle.dumps({"a": (1, 2.0, "x")}, protocol=4))
BIG = 8 << 20  # an 8 MiB key name


def _peak(fn) -> tuple[object, int]:
    tracemalloc.start()
    try:
        out = fn()
        return out, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_a_huge_key_name_is_counted_not_read(redis_url, redis_server):
    c = redis_server.client()
    torch_key = remote_keys.redis_key("fxgraph", "f" + "a" * 52)
    c.set(torch_key, GOOD)
    c.set(b"k" * BIG, b"v")  # another application's (or someone's) key
    c.set(b"e" * listing.MAX_KEY_NAME, b"v")  # exactly the cap: read
    client = remote.connect(redis_url)
    got, peak = _peak(lambda: list(remote.scan(client)))
    assert peak < BIG // 4, peak  # the name never crossed the wire
    names = sorted(k.key for k in got)
    assert torch_key in names and "e" * listing.MAX_KEY_NAME in names
    assert listing.long_name(BIG) in names and all(len(n) <= listing.MAX_KEY_NAME for n in names)
    long = next(k for k in got if k.key == listing.long_name(BIG))
    assert long.kind == "foreign" and long.size is None
    client.close()
    v = invoke_json(app, ["cache", "remote", "verify", redis_url], expect_code=1)
    assert [f["key"] for f in v["findings"] if f["kind"] == "foreign-key"].count(listing.long_name(BIG)) == 1
    assert not any(f["kind"] == "unbounded-names" for f in v["findings"])
    s = invoke_json(app, ["cache", "remote", "status", redis_url])
    assert s["keys"] == 3 and s["foreign_keys"] == 2
    assert c.exists(b"k" * BIG)  # nothing deleted


def test_a_server_that_runs_no_scripts_is_listed_whole_and_said(redis_url, redis_server):
    c = redis_server.client()
    c.execute_command("ACL", "SETUSER", "noscripts", "on", ">pw", "~*", "&*", "+@all", "-@scripting")
    torch_key = remote_keys.redis_key("fxgraph", "f" + "b" * 52)
    c.set(torch_key, GOOD)
    c.set(b"k" * 5000, b"v")
    url = redis_url.replace("redis://", "redis://noscripts:pw@")
    client = remote.connect(url)
    refused: list[str] = []
    got = list(remote.scan(client, unbounded=refused))
    client.close()
    assert refused and "permission" in refused[0].lower()
    assert sorted(k.key for k in got) == sorted([torch_key, "k" * 5000])  # as before: whole
    v = invoke_json(app, ["cache", "remote", "verify", url], expect_code=1)
    said = [f for f in v["findings"] if f["kind"] == "unbounded-names"]
    assert len(said) == 1 and said[0]["severity"] == "warning" and "plain SCAN" in said[0]["detail"]


def test_match_and_many_batches_list_every_key_once(redis_url, redis_server):
    c = redis_server.client()
    n = listing.SCAN_BATCH * 3 + 7
    c.eval(f"for i=1,{n} do redis.call('SET','pt2:fx-graph-v1::f'..i..':c1','x') end return 1", 0)
    c.eval("for i=1,50 do redis.call('SET','session:'..i,'x') end return 1", 0)
    client = remote.connect(redis_url)
    every = [k.key for k in remote.scan(client)]
    only = [k.key for k in remote.scan(client, match=f"{remote_keys.PREFIX}*")]
    client.close()
    assert len(every) == len(set(every)) == n + 50
    assert len(only) == len(set(only)) == n and all(k.startswith(remote_keys.PREFIX) for k in only)
