"""Did this process use torch's remote caches, and did they answer? (`doctor`, `run`, dflash's rank report)

torch counts every remote get and put per cache class (`torchcompat.remote_cache_stats`); a server
it cannot reach counts as misses, because its backend swallows the connection error. So hits and
misses alone cannot tell "the cache is cold" from "the cache is down": `usage` adds a probe of the
URL when a remote cache is on, and calls a configured but unreachable cache what it is.

In a process compilewatch watches (`compilewatch run`, `warm`, `CompileGuard`, `enable`: dflash's
`cache.remote`), torch's remote reads go through the verifying backend (`cache.remote.verified`):
entries that are unsigned, signed by a key nobody here trusts, or whose pickle does not scan are
misses. Its counts join torch's per kind: `refused` (all refusals) and `refused_<reason>`
(unsigned, foreign, bad-signature, malformed, unscannable, error), `admitted`, `signed`,
`put-unsigned`.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Mapping

from compilewatch.cache.remote import keyspace as remote_keys
from compilewatch.cache.remote import server as remote

PROBE_TIMEOUT_S = 1.0  # a process reporting at exit must not hang on a dead host


@dataclass(frozen=True, slots=True)
class RemoteUsage:
    url: str  # redacted
    source: str
    enabled: tuple[str, ...]  # kinds the environment turns on
    reachable: bool | None  # None: not probed (nothing turned on)
    why: str | None
    counts: dict[str, dict[str, int]]  # kind -> {hit, miss, put, exception} (torch's) + the verifier's counts
    verified: str | None = None  # how reads are verified in this process (the patch point), None: they are not

    @property
    def refused(self) -> int:
        """Remote entries the verifying backend kept from torch (each also a miss in torch's counters)."""
        return sum(c.get("refused", 0) for c in self.counts.values())

    @property
    def hits(self) -> int:
        return sum(c.get("hit", 0) for c in self.counts.values())

    @property
    def misses(self) -> int:
        return sum(c.get("miss", 0) for c in self.counts.values())

    @property
    def down(self) -> bool:
        return bool(self.enabled) and self.reachable is False


def counts_by_kind(stats: Mapping[str, Mapping[str, int]] | None) -> dict[str, dict[str, int]]:
    """torch's per-class counters keyed by remote_keys kind (fxgraph, aotautograd, ...), remote only."""
    by_class = {k.torch_class: k.name for k in remote_keys.KINDS.values()}
    out: dict[str, dict[str, int]] = {}
    for cls, st in (stats or {}).items():
        kind = by_class.get(cls)
        if kind is not None and any(st.values()):
            out[kind] = {f: int(st.get(f, 0)) for f in ("hit", "miss", "put", "exception")}
    return out


def with_verifier_counts(counts: dict[str, dict[str, int]],
                         verifier: dict[str, dict[str, int]]) -> dict[str, dict[str, int]]:
    """torch's counters per kind with the verifying backend's added (`refused` = all its refusals)."""
    out = {k: dict(v) for k, v in counts.items()}
    for kind, c in verifier.items():
        if kind not in remote_keys.KINDS:
            continue
        row = out.setdefault(kind, {f: 0 for f in ("hit", "miss", "put", "exception")})
        row.update(c)
        refused = sum(n for f, n in c.items() if f.startswith("refused_"))
        if refused:
            row["refused"] = refused
    return out


def current_counts() -> dict[str, dict[str, int]]:
    """This process's remote-cache counters by kind ({} when torch has not loaded its remote caches)."""
    if "torch._inductor.remote_cache" not in sys.modules:
        return {}
    from compilewatch.cache.remote import verified
    from compilewatch.tracing import torchcompat

    return with_verifier_counts(counts_by_kind(torchcompat.remote_cache_stats()), verified.counts())


def verify_remote_reads() -> None:
    """Verify torch's remote-cache reads (and sign its writes) in this process from now on: at once if
    torch's remote_cache module is loaded, else right after it is (`cache.remote.verified`)."""
    from compilewatch.cache.remote import verified
    from compilewatch.tracing.importhook import after_import

    verified.arm(after_import)


def usage(env: Mapping[str, str] | None = None, *, counts: dict[str, dict[str, int]] | None = None,
          probe: bool = True) -> RemoteUsage | None:
    """This environment's remote caches: which are on, whether the server answers, torch's counters.
    None when none is on and torch counted nothing."""
    env = os.environ if env is None else env
    cfg = remote.config(env=env)
    counts = current_counts() if counts is None else counts
    enabled = tuple(k for k, v in cfg.enabled.items() if v)
    if not enabled and not counts:
        return None
    reachable = why = None
    if enabled and probe:
        r = remote.probe(env=env, timeout=PROBE_TIMEOUT_S)
        reachable, why = r.reachable, r.why
    from compilewatch.cache.remote import verified

    state = verified.installed()
    return RemoteUsage(cfg.url, cfg.source, enabled, reachable, why, counts,
                       state.point if state is not None else None)


def down_message(u: RemoteUsage) -> str:
    return (f"torch's remote caches ({', '.join(u.enabled)}) are on but the server does not answer: {u.why}; torch "
            "says nothing, it stops using the cache and compiles everything itself")


_SCHEMES = ("redis://", "rediss://", "unix://")


def enable(url: str) -> dict[str, str]:
    """Turn on torch's FX-graph and AOTAutograd remote caches at `url` for this process and the ones it
    starts (compile workers, a trainer's children): the environment variables torch reads, and, where
    torch already read them at import, its config; and verify every remote read of this process
    (`verify_remote_reads`). Call it before the first compile. Nothing is contacted: a server that is
    down makes torch compile locally, and `usage()` reports it.
    Returns the variables set. BadInput for a URL that is not redis://, rediss:// or unix://."""
    from compilewatch.errors import BadInput

    if not isinstance(url, str) or not url.startswith(_SCHEMES):
        raise BadInput(f"not a Redis URL: {remote.redact(str(url))!r}",
                       hint="write redis://[:PASSWORD@]HOST:PORT[/DB] (rediss:// for TLS)")
    verify_remote_reads()
    env = {remote_keys.KINDS["fxgraph"].env: "1", remote_keys.KINDS["aotautograd"].env: "1",
           "TORCHINDUCTOR_REDIS_URL": url}
    os.environ.update(env)
    if "torch._inductor.config" in sys.modules:  # defaults were read from the environment at import
        sys.modules["torch._inductor.config"].fx_graph_remote_cache = True
    if "torch._functorch.config" in sys.modules:
        sys.modules["torch._functorch.config"].enable_remote_autograd_cache = True
    return env
