"""dflash `--set cache.remote=redis://...`: every torchrun rank turns torch's remote caches on, and the
rank report shows each rank's remote hits / misses / puts, which rank compiled what the others
fetched, and a rank that could not reach the server (training goes on: torch compiles locally).

On CPU dflash compiles nothing (its compiled paths are CUDA's), so the torchrun runs here show the
configuration and reachability on every rank; the counting and naming is checked on reports built
from torch's counters as a GPU run produces them (benchmarks/gpu_remote_cache.py runs it on the H200).
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from dflash.config import apply_overrides, tiny
from dflash.distributed.rank_report import RemoteRank, cache_verdicts, remote_verdicts
from tests.redis_helpers import free_port
from tests.test_distributed import rank_reports, torchrun  # noqa: F401 - helpers, not tests
from tests.dflash_helpers import write_word_chats


def _rank(rank, counts, reachable=True):
    return SimpleNamespace(rank=rank, host=f"node{rank}", remote=RemoteRank("redis://h:6379/0", ("fxgraph", "aotautograd"),
                                                                          reachable, None if reachable else "refused", counts))


def test_the_report_names_the_rank_that_compiled_what_the_others_fetched():
    put = {"fxgraph": {"hit": 0, "miss": 4, "put": 4, "exception": 0}}
    got = {"fxgraph": {"hit": 4, "miss": 0, "put": 0, "exception": 0}}
    v = remote_verdicts([_rank(0, put), _rank(1, got), _rank(2, got)])
    assert v[0] == "remote cache redis://h:6379/0: rank 0 0 hit / 4 miss / 4 put; rank 1 4 hit / 0 miss / 0 put; " \
                   "rank 2 4 hit / 0 miss / 0 put."
    assert v[1] == "rank 0 compiled what ranks 1,2 fetched from the remote cache (4 entries put, 8 hits)."
    assert "every rank fetched" in remote_verdicts([_rank(0, got), _rank(1, got)])[-1]
    assert "cold for this run" in remote_verdicts([_rank(0, put), _rank(1, put)])[-1]
    down = remote_verdicts([_rank(0, {}, reachable=False), _rank(1, got)])
    assert down[0].startswith("rank 0 (node0): the remote cache redis://h:6379/0 is unreachable (refused)")
    assert remote_verdicts([SimpleNamespace(rank=0, host="a", remote=None)]) == []


def test_cache_remote_must_be_a_redis_url():
    assert apply_overrides(tiny(), {"cache.remote": "redis://h:1/0"}).cache.remote == "redis://h:1/0"
    with pytest.raises(ValueError, match="cache.remote"):
        apply_overrides(tiny(), {"cache.remote": "http://h:1"})


@pytest.fixture(scope="module")
def chat_file(tmp_path_factory):
    return write_word_chats(tmp_path_factory.mktemp("remote-data") / "chat.jsonl")


def test_every_rank_uses_the_remote_cache_set_once(tmp_path, chat_file, redis_url):
    run = tmp_path / "run"
    p = torchrun(["-m", "dflash"], ["--data", str(chat_file), "--out", str(run), "--max-steps", "2", "--device", "cpu",
                                    "--set", f"cache.remote={redis_url}", "--json"])
    assert p.returncode == 0, p.stderr[-4000:]
    for rep in rank_reports(run):
        rem = rep["rank"]["remote"]
        assert rem["url"] == redis_url and rem["reachable"] is True and {"fxgraph", "aotautograd"} <= set(rem["enabled"])
    out = json.loads(p.stdout)
    assert any(v.startswith(f"remote cache {redis_url}: rank 0") for v in out["rank_verdicts"])


def test_a_dead_remote_cache_never_blocks_training_and_is_named(tmp_path, chat_file):
    run = tmp_path / "run"
    url = f"redis://127.0.0.1:{free_port()}/0"
    p = torchrun(["-m", "dflash"], ["--data", str(chat_file), "--out", str(run), "--max-steps", "2", "--device", "cpu",
                                    "--set", f"cache.remote={url}", "--json"])
    assert p.returncode == 0, p.stderr[-4000:]
    out = json.loads(p.stdout)
    assert out["steps"] == 2
    assert sum("is unreachable" in v for v in out["rank_verdicts"]) == 2
