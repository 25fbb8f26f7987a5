"""What each rank of a distributed run saw: its inductor cache, its prewarm's cache hits, its weights.

Every rank fingerprints its inductor cache (compilewatch.cache.content.fingerprint) before it compiles
anything, so a rank that starts cold (no cache dir, an empty one) or with a cache built for another
machine type (foreign system key) is named in rank 0's report instead of being "the slow node".
After training, every rank's parameter digest shows whether the replicas on every rank ended bit-for-bit
identical. `cache_verdicts` compares the ranks; `RankReport` is what each rank writes to
`RUN/ranks/rank-N/report.json`.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any, Literal, Sequence

import torch

CacheStatus = Literal["warm", "empty", "missing", "unreadable"]


@dataclass(frozen=True, slots=True)
class CacheState:
    """One rank's inductor cache before its first compile."""

    path: str  # the inductor cache dir torch will use in this process
    status: CacheStatus  # warm: has files; empty; missing: no dir (cold); unreadable: see error
    files: int
    bytes: int
    content_hash: str | None  # compilewatch's content fingerprint (equal hashes = the same files)
    system_key: str | None  # this machine's cache key (GPU, CUDA, triton): entries built for another never hit
    foreign_entries: int  # entries stamped with another system key (copied from another machine type)
    seconds: float  # time the fingerprint took
    error: str | None = None


def cache_state(path: str | None = None) -> CacheState:
    """Fingerprint the inductor cache this process will use (or `path`). Never raises: a missing or
    unreadable cache is a status, not an error. Call it before anything compiles (and before
    torch._dynamo is imported, which creates the default dir)."""
    from compilewatch import BadInput, fingerprint, inductor_cache_dir, system_key

    where = str(path or inductor_cache_dir())
    t0 = time.perf_counter()
    try:
        key: str | None = system_key()
    except Exception:  # noqa: BLE001 - a broken triton install still gets a report row
        key = None
    if not os.path.isdir(where):
        return CacheState(where, "missing", 0, 0, None, key, 0, time.perf_counter() - t0)
    try:
        fp = fingerprint(where)
    except BadInput as e:  # exists but not a cache yet (e.g. only an empty dir)
        empty = os.path.isdir(where) and not os.listdir(where)
        return CacheState(where, "empty" if empty else "unreadable", 0, 0, None, key, 0, time.perf_counter() - t0,
                          None if empty else e.message)
    except OSError as e:
        return CacheState(where, "unreadable", 0, 0, None, key, 0, time.perf_counter() - t0, str(e))
    return CacheState(where, "warm" if fp.files else "empty", fp.files, fp.bytes, fp.content_hash, fp.system_key,
                      fp.foreign_entries, time.perf_counter() - t0)


@dataclass(frozen=True, slots=True)
class PrewarmCache:
    """What this rank's prewarm compiled, and how much of it came from the inductor cache."""

    ok: bool
    seconds: float
    frames_compiled: int
    fxgraph_hits: int
    fxgraph_misses: int
    autograd_hits: int
    autograd_misses: int


def prewarm_cache(prewarm: Any) -> PrewarmCache | None:
    """From the engine's PrewarmResult (None when prewarm was off)."""
    if prewarm is None:
        return None
    reports = getattr(prewarm, "reports", ()) or ((prewarm.report,) if prewarm.report is not None else ())
    runs = [r for rep in reports for r in (getattr(rep, "warm", ()) or ())]

    def total(name: str) -> int:
        return sum(int(getattr(r.counters, name, 0)) for r in runs)

    return PrewarmCache(prewarm.ok, prewarm.wall_s, sum(r.frames_compiled for r in runs), total("fxgraph_cache_hit"),
                        total("fxgraph_cache_miss"), total("autograd_cache_hit"), total("autograd_cache_miss"))


@torch.no_grad()
def params_digest(module: torch.nn.Module) -> str:
    """xxh3-128 over every parameter's bytes, in order: equal digests = bit-identical weights."""
    import xxhash

    h = xxhash.xxh3_128()
    for name, p in module.named_parameters():
        h.update(name.encode())
        h.update(p.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


@dataclass(frozen=True, slots=True)
class RankCache:
    """One rank's cache as the others see it at the start (before prewarm)."""

    rank: int
    host: str
    cache: CacheState
    prewarm: PrewarmCache | None = None


@dataclass(frozen=True, slots=True)
class RemoteRank:
    """torch's remote caches on this rank at the end of the run (torch's own counters, by kind)."""

    url: str  # password redacted
    enabled: tuple[str, ...]
    reachable: bool | None
    why: str | None
    counts: dict[str, dict[str, int]]  # kind (fxgraph, aotautograd, ...) -> {hit, miss, put, exception}


def remote_rank() -> RemoteRank | None:
    """This process's remote-cache use, None when no remote cache is on or used. Never raises."""
    from compilewatch import remote_cache_usage

    try:
        u = remote_cache_usage()
    except Exception:  # noqa: BLE001 - a report row, never a failed run
        return None
    return None if u is None else RemoteRank(u.url, u.enabled, u.reachable, u.why, u.counts)


def _count(r: Any, field: str) -> int:
    rem = getattr(r, "remote", None)
    return sum(int(c.get(field, 0)) for c in rem.counts.values()) if rem is not None else 0


def remote_verdicts(reports: Sequence[Any]) -> list[str]:
    """Remote hits per rank, a rank that compiled what the others fetched, a rank that could not reach it."""
    rows = [r for r in reports if getattr(r, "remote", None) is not None]
    if not rows:
        return []
    out: list[str] = []
    for r in rows:
        if r.remote.enabled and r.remote.reachable is False:
            out.append(f"rank {r.rank} ({r.host}): the remote cache {r.remote.url} is unreachable ({r.remote.why}): "
                       "this rank compiled everything itself (torch says nothing when it cannot reach it).")
    per = "; ".join(f"rank {r.rank} {_count(r, 'hit')} hit / {_count(r, 'miss')} miss / {_count(r, 'put')} put"
                    for r in rows)
    out.append(f"remote cache {rows[0].remote.url}: {per}.")
    putters = [r.rank for r in rows if _count(r, "put")]
    fetchers = [r.rank for r in rows if _count(r, "hit") and not _count(r, "put")]
    if putters and fetchers:
        out.append(f"{_ranks(putters)} compiled what {_ranks(fetchers)} fetched from the remote cache "
                   f"({sum(_count(r, 'put') for r in rows if r.rank in putters)} entries put, "
                   f"{sum(_count(r, 'hit') for r in rows if r.rank in fetchers)} hits).")
    elif putters and len(putters) == len(rows):
        out.append("every rank compiled and put its entries: the remote cache was cold for this run "
                   "(the next job's ranks fetch them).")
    elif fetchers and len(fetchers) == len(rows):
        out.append("every rank fetched from the remote cache and compiled nothing it held.")
    return out


@dataclass(frozen=True, slots=True)
class RankReport:
    rank: int
    world_size: int
    local_rank: int
    node_rank: int
    host: str
    backend: str
    target_devices: tuple[str, ...]
    drafter_devices: tuple[str, ...]
    cache: CacheState
    prewarm: PrewarmCache | None
    outcome: str  # the engine's outcome on this rank
    steps_done: int
    params_digest: str | None  # after the run (None when it failed)
    watch_report: str | None  # this rank's compilewatch watcher events (JSONL)
    engine_verdicts: tuple[str, ...]
    remote: RemoteRank | None = None  # torch's remote caches on this rank (cache.remote, or the environment)


def _ranks(xs: Sequence[int]) -> str:
    return ("rank " if len(xs) == 1 else "ranks ") + ",".join(str(x) for x in xs)


def cache_verdicts(reports: Sequence[Any]) -> list[str]:
    """Compare every rank's cache (and prewarm hits, when known): cold, foreign or mismatched caches.
    `reports`: RankReports, or RankCaches at the start."""
    out: list[str] = []
    cold = [r for r in reports if r.cache.status in ("missing", "empty")]
    warm = [r for r in reports if r.cache.status == "warm"]
    bad = [r for r in reports if r.cache.status == "unreadable"]
    if cold and warm:
        for r in cold:
            out.append(f"rank {r.rank} ({r.host}): inductor cache {r.cache.path} is {r.cache.status}: this rank "
                       "compiles everything from scratch while the others load from their caches; its prewarm "
                       "is the slow one. Copy a warm cache there (compilewatch cache save / load).")
    elif cold and len(cold) == len(reports):
        out.append("every rank starts with a cold inductor cache: whatever this run compiles with inductor, every "
                   "rank compiles from scratch in its prewarm (first run on these machines, or the caches were deleted).")
    for r in bad:
        out.append(f"rank {r.rank} ({r.host}): inductor cache {r.cache.path} is unreadable: {r.cache.error}")
    keys: dict[str, list[int]] = {}
    for r in reports:
        if r.cache.system_key:
            keys.setdefault(r.cache.system_key, []).append(r.rank)
    if len(keys) > 1:
        groups = "; ".join(f"{_ranks(v)}: {k[:12]}" for k, v in keys.items())
        out.append(f"the ranks run on different machine types (cache system keys differ: {groups}): GPU, CUDA or "
                   "triton differ, so compiled artifacts are not interchangeable between them.")
    for r in reports:
        if r.cache.foreign_entries:
            out.append(f"rank {r.rank} ({r.host}): {r.cache.foreign_entries} cache entries were built for another "
                       "system key (copied from another machine type): they never hit here.")
    nodes: dict[tuple[str, str], Any] = {}
    for r in warm:
        nodes.setdefault((r.host, r.cache.path), r.cache)
    hashes = {c.content_hash for c in nodes.values()}
    if len(hashes) > 1:
        detail = "; ".join(f"{h}: {c.files} files {c.content_hash[:12]}" for (h, _), c in nodes.items())
        out.append(f"the nodes' caches differ ({detail}): fine if they compiled different things; compare the "
                   "ranks' prewarm cache misses to see which one is cold for this run.")
    pre = [(r, r.prewarm) for r in reports if getattr(r, "prewarm", None) is not None]
    misses = [r.rank for r, p in pre if p.fxgraph_misses or p.autograd_misses]
    if misses and len(misses) < len(pre):
        out.append(f"{_ranks(misses)} missed the inductor cache in prewarm while the others hit: "
                   "their caches are cold or do not match this run.")
    return out + remote_verdicts(reports)
