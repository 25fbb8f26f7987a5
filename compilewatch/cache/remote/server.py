"""torch's Redis remote caches, seen from outside torch: where they are, whether they answer, what they hold.

torch (2.11-2.15, `torch/_inductor/remote_cache.py`) connects with `redis.Redis.from_url(
TORCHINDUCTOR_REDIS_URL)` when that variable is set, else `redis.Redis(host=TORCHINDUCTOR_REDIS_HOST
or "localhost", port=TORCHINDUCTOR_REDIS_PORT or 6379)`, lazily, on the first get. On a
`redis.exceptions.ConnectionError` it sets its client to `None` and from then on every get and put
silently does nothing: a cache that is down looks exactly like a cache that misses. Hence `probe`
(used by `doctor`, `run` and dflash's rank report) and `status`.

Everything read from the server is untrusted: keys are listed with SCAN (never KEYS), their names
capped (`listing`), every value's size is asked with STRLEN first and read with GETRANGE capped at
`max_value`, so a huge or crafted value never lands in memory whole; pickles are parsed by
`picklescan`, never unpickled.

`verify` also reports the server's security posture, because a writable Redis is code execution on
every node that reads it (docs/security.md): no password / ACL, bound to every interface, plain-text
traffic to another host.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Iterator, Mapping
from urllib.parse import urlsplit, urlunsplit

from compilewatch.cache.content import stamps
from compilewatch.cache.remote import keyspace as remote_keys
from compilewatch.cache.remote import signatures as sigs
from compilewatch.cache.remote.deadline import Deadline
from compilewatch.cache.remote.listing import MAX_KEY_NAME, SCAN_BATCH, KeyInfo, read_capped, scan  # noqa: F401 - re-exported
from compilewatch.cache.trust import picklescan
from compilewatch.errors import BadInput

MAX_VALUE = 256 << 20  # the largest entry read (bytes); CUDA FX-graph entries are a few MB
CONNECT_TIMEOUT_S = 3.0
SOCKET_TIMEOUT_S = 30.0  # a backstop per socket operation; the bound is DEADLINE_S per command
DEADLINE_S = 60.0  # network waiting per command, connect + every read and write (remote.deadline)
_LOOPBACK = {"localhost", "127.0.0.1", "::1", "[::1]"}


# --- where: torch's own rule ------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class RemoteConfig:
    """What torch in this environment would use."""

    url: str  # password replaced by "***"
    source: str  # "argument", "TORCHINDUCTOR_REDIS_URL", "TORCHINDUCTOR_REDIS_HOST/PORT" or "default"
    enabled: dict[str, bool | None]  # kind -> its env variable: True "1", False "0", None unset (off outside fbcode)

    @property
    def any_enabled(self) -> bool:
        return any(v for v in self.enabled.values())


def _raw_url(url: str | None, env: Mapping[str, str]) -> tuple[str, str]:
    if url:
        return url, "argument"
    if "TORCHINDUCTOR_REDIS_URL" in env:
        return env["TORCHINDUCTOR_REDIS_URL"], "TORCHINDUCTOR_REDIS_URL"
    host = env.get("TORCHINDUCTOR_REDIS_HOST", "localhost")
    port = env.get("TORCHINDUCTOR_REDIS_PORT", "6379")
    source = "TORCHINDUCTOR_REDIS_HOST/PORT" if ("TORCHINDUCTOR_REDIS_HOST" in env or
                                                 "TORCHINDUCTOR_REDIS_PORT" in env) else "default"
    return f"redis://{host}:{port}", source


def redact(url: str) -> str:
    """`url` with its password (and a user's name kept) replaced by ***."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<unparseable URL>"
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.netloc.rpartition("@")[2]  # as written: an IPv6 host keeps its brackets, a bad port is shown, not parsed
    return urlunsplit((parts.scheme, f"{user}:***@{host}", parts.path, parts.query, parts.fragment))


def _tristate(value: str | None) -> bool | None:
    return True if value == "1" else False if value == "0" else None


def config(url: str | None = None, env: Mapping[str, str] | None = None) -> RemoteConfig:
    """The URL torch would use (or `url`) and which remote caches the environment turns on."""
    env = os.environ if env is None else env
    raw, source = _raw_url(url, env)
    enabled = {k.name: _tristate(env.get(k.env)) for k in remote_keys.KINDS.values()}
    return RemoteConfig(redact(raw), source, enabled)


# --- connecting -------------------------------------------------------------------------------------
def _redis():
    try:
        import redis
    except ImportError:  # a dependency of compilewatch: only a broken install lacks it
        raise BadInput("the `redis` package is not installed (torch's remote caches need it too)",
                       hint="pip install 'redis>=5,<9'") from None
    return redis


_SCHEMES = ("redis", "rediss", "unix")


def check_url(raw: str, source: str = "argument") -> None:
    """BadInput (exit 2) for a URL redis-py (and so torch) cannot use: a scheme other than redis://,
    rediss:// or unix:// (`http://host:port`), or one that does not parse."""
    try:
        parts = urlsplit(raw)
        parts.port  # noqa: B018 - raises ValueError for a port that is not a number
    except ValueError as e:
        raise BadInput(f"not a Redis URL: {redact(raw)} ({e})",
                       hint="write redis://[:PASSWORD@]HOST:PORT[/DB] (rediss:// for TLS)") from None
    if parts.scheme not in _SCHEMES:
        where = "" if source == "argument" else f" (from {source})"
        raise BadInput(f"not a Redis URL: {redact(raw)!r}{where}: the scheme is "
                       f"{(parts.scheme + '://') if parts.scheme else 'missing'}",
                       hint="write redis://[:PASSWORD@]HOST:PORT[/DB] (rediss:// for TLS, unix:///path for a socket)")
    try:  # redis-py turns every ?name=value into a connection argument; an unknown one fails at connect
        _redis().ConnectionPool.from_url(raw).make_connection()
    except (ValueError, TypeError) as e:
        where = "" if source == "argument" else f" (from {source})"
        raise BadInput(f"not a Redis URL: {redact(raw)}{where}: {str(e)[:200]}",
                       hint="leave out query options redis-py does not know (?db=N, ?socket_timeout=S, ... are "
                            "known); write redis://[:PASSWORD@]HOST:PORT[/DB]") from None


def check_db(raw: str) -> None:
    """BadInput for a typed URL whose database is not a number (`redis://host:6379/cache`): redis-py,
    and so torch, ignores such a database and uses database 0, not the one the URL seems to name. Only
    for URLs given on the command line: one in the environment is used by torch as it is."""
    try:
        parts = urlsplit(raw)
    except ValueError:
        return  # check_url says why
    db = parts.path.replace("/", "")
    if parts.scheme in ("redis", "rediss") and db and not (db.isascii() and db.isdigit()):
        raise BadInput(f"not a Redis URL: {redact(raw)}: the database {parts.path!r} is not a number (redis-py "
                       "and torch would quietly use database 0)",
                       hint="write redis://HOST:PORT/DB with DB a number (0 when left out)")


def _has_password(url: str) -> bool:
    try:
        parts = urlsplit(url)
    except ValueError:
        return False
    return bool(parts.password) or "password=" in (parts.query or "")


def why_failed(exc: BaseException, url: str) -> str:
    """One sentence on why talking to `url` failed (redacted), for people."""
    redis = _redis()
    safe = redact(url)
    text = str(exc)
    if "without any password configured" in text or "no password is set" in text:
        return f"{safe} has no password set, but the URL gives one (remove it from the URL, or set requirepass)"
    if ("NOAUTH" in text or "Authentication required" in text
            or isinstance(exc, getattr(redis.exceptions, "AuthenticationRequiredError", ()))
            or (isinstance(exc, redis.exceptions.AuthenticationError) and not _has_password(url))):
        return f"{safe}: the server wants a password; none was given (redis://:PASSWORD@host:port)"
    if isinstance(exc, redis.exceptions.AuthenticationError) or "WRONGPASS" in text or "invalid password" in text:
        return f"{safe} refused the password (wrong password or user)"
    if isinstance(exc, redis.exceptions.TimeoutError):
        if "network deadline" in text:
            return (f"{safe} sent no complete answer within this command's network deadline "
                    f"({text.split('within the ', 1)[-1].split(' network', 1)[0]}; a server that hangs or drips "
                    "bytes, a firewall, a wrong host; --timeout raises it)")
        return f"{safe} did not answer in time (a firewall, a wrong host, or a server that hangs)"
    if isinstance(exc, (redis.exceptions.InvalidResponse,)) or "Protocol" in text:
        return f"{safe} answered, but not as a Redis server ({text[:120]}): is this the right port?"
    if isinstance(exc, redis.exceptions.ConnectionError):
        if "Connection closed by server" in text:
            return (f"{safe} closed the connection (not a Redis server, one that rejects this client, or one that "
                    "went away mid-command)")
        return f"{safe} is unreachable: {text[:200]}"
    if isinstance(exc, redis.exceptions.ResponseError):
        return f"{safe} refused a command: {text[:200]}"
    return f"{safe}: {type(exc).__name__}: {text[:200]}"


def connect(url: str | None = None, *, env: Mapping[str, str] | None = None, timeout: float = CONNECT_TIMEOUT_S,
            socket_timeout: float = SOCKET_TIMEOUT_S, deadline=DEADLINE_S):
    """A `redis.Redis` client for `url` (default: what torch would use), checked with PING.

    Every connect, read and write of the client counts against one network deadline of `deadline`
    seconds (or the `Deadline` given, shared by every client of one command; `remote.deadline`), not a
    timeout per byte; no retries. BadInput (exit 2) with the
    reason when the server cannot be used: unreachable, not Redis, wrong or missing password, a bad URL."""
    redis = _redis()
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    raw, source = _raw_url(url, os.environ if env is None else env)
    check_url(raw, source)
    d = deadline if isinstance(deadline, Deadline) else Deadline(deadline, redact(raw))
    try:
        client = redis.Redis.from_url(raw, socket_connect_timeout=min(timeout, d.seconds),
                                      socket_timeout=min(socket_timeout, d.seconds), retry=Retry(NoBackoff(), 0))
    except ValueError as e:
        raise BadInput(f"not a Redis URL: {redact(raw)} ({e})",
                       hint="write redis://[:PASSWORD@]HOST:PORT[/DB] (rediss:// for TLS)") from None
    d.bind(client)
    client.compilewatch_deadline = d
    try:
        client.ping()
    except redis.exceptions.RedisError as e:
        client.close()
        raise BadInput(why_failed(e, raw), hint="check the URL (TORCHINDUCTOR_REDIS_URL) and that redis-server "
                       "runs there; nothing was read or written") from None
    except OSError as e:
        client.close()
        raise BadInput(f"{redact(raw)} is unreachable: {e}") from None
    return client


@dataclass(frozen=True, slots=True)
class Reachability:
    url: str  # redacted
    source: str
    reachable: bool
    why: str  # "answered PING in 0.4 ms" or the reason it did not
    server_version: str | None
    keys: int | None  # DBSIZE: every key in the database, torch's or not


def probe(url: str | None = None, *, env: Mapping[str, str] | None = None,
          timeout: float = CONNECT_TIMEOUT_S, deadline=None) -> Reachability:
    """Whether the remote cache at `url` (default: torch's) answers, all of it (connect, PING, INFO,
    DBSIZE) within `deadline` (default: 2 x `timeout`, at least 2 s). Never raises."""
    env = os.environ if env is None else env
    raw, source = _raw_url(url, env)
    t0 = time.perf_counter()
    try:
        client = connect(raw, env=env, timeout=timeout, socket_timeout=max(timeout, 1.0),
                         deadline=deadline if deadline is not None else max(2 * timeout, 2.0))
        dt = time.perf_counter() - t0
        info = client.info("server")
        keys = int(client.dbsize())
        client.close()
    except BadInput as e:
        return Reachability(redact(raw), source, False, e.message, None, None)
    except Exception as e:  # noqa: BLE001 - a probe reports, it never raises
        return Reachability(redact(raw), source, False, f"{type(e).__name__}: {str(e)[:200]}", None, None)
    return Reachability(redact(raw), source, True, f"answered PING in {dt * 1000:.1f} ms",
                        str(info.get("redis_version")) if isinstance(info, dict) else None, keys)


@contextlib.contextmanager
def failing_server(url: str | None, what: str, hint: str = "run it again when the server is back"):
    """A server that fails mid-command (it died, it was restarted, a key changed type) as BadInput."""
    redis = _redis()
    try:
        yield
    except redis.exceptions.RedisError as e:
        raise BadInput(f"the server failed during {what}: {why_failed(e, _raw_url(url, os.environ)[0])}",
                       hint=hint) from None


# --- one entry ------------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class EntryCheck:
    key: str
    kind: str
    size: int
    system_key: str | None  # the stamp inside a fxgraph / aotautograd pickle (None: it does not say)
    torch_hash: str | None
    problem: str | None  # finding kind: malformed, unloadable, untrusted, oversized
    detail: str | None
    content: bytes | None = None  # the decoded pickle (fxgraph / aotautograd / pgo), when asked for
    signature: str | None = None  # signatures.Verdict.state (own, trusted, unsigned, foreign, bad-signature), when asked
    signature_detail: str | None = None


def check_value(key: str, kind: str, value: bytes, *, deep: bool, keep: bool = False) -> EntryCheck:
    """What torch would make of `value`: can it decode it, which system made it, and (deep) does its
    pickle name only globals torch's caches use."""
    spec = remote_keys.KINDS.get(kind)
    if spec is None:
        return EntryCheck(key, kind, len(value), None, None, None, None)
    if not spec.pickled:
        try:
            data = remote_keys.decode_value(value)
        except ValueError as e:
            return EntryCheck(key, kind, len(value), None, None, "malformed", f"torch cannot decode it: {e}")
        if not isinstance(data, dict):
            return EntryCheck(key, kind, len(value), None, None, "malformed",
                              f"JSON {type(data).__name__}, torch expects an object")
        return EntryCheck(key, kind, len(value), None, None, None, None)
    try:
        content = remote_keys.decode_pickled(value)
    except ValueError as e:
        return EntryCheck(key, kind, len(value), None, None, "malformed", f"torch cannot decode it: {e}")
    st = stamps.stamp_of(f"{kind}/x", content) if kind in stamps.STAMPED_SUBCACHES else stamps.NO_STAMP
    if deep:
        scan_ = picklescan.scan(content)
        if scan_.problem:
            return EntryCheck(key, kind, len(value), st.system_key, st.torch_hash, "unloadable", scan_.problem)
        if scan_.refused:
            return EntryCheck(key, kind, len(value), st.system_key, st.torch_hash, "untrusted",
                              f"the pickle calls {', '.join(scan_.refused[:3])}, which torch's caches never do: "
                              "every node that reads it would run that code (it was not unpickled)")
    return EntryCheck(key, kind, len(value), st.system_key, st.torch_hash, None, None, content if keep else None)


def entries(client, *, kinds: tuple[str, ...] | None = None, deep: bool, keep: bool = False,
            max_value: int = MAX_VALUE, trust: sigs.Trust | None = None) -> Iterator[EntryCheck]:
    """`check_value` of every torch-shaped key (of `kinds`, default all), oversized ones unread; with
    `trust`, each entry's signature checked too (its sibling key read with a cap)."""
    import dataclasses

    for ki in scan(client, match=f"{remote_keys.PREFIX}*"):
        if ki.kind not in remote_keys.KINDS or (kinds is not None and ki.kind not in kinds):
            continue
        if ki.size is not None and ki.size > max_value:
            yield EntryCheck(ki.key, ki.kind, ki.size, None, None, "oversized",
                             f"{ki.size} bytes, over the {max_value} byte cap: not read")
            continue
        try:
            value = read_capped(client, ki.key, max_value)
        except ValueError as e:
            yield EntryCheck(ki.key, ki.kind, ki.size or 0, None, None, "oversized", str(e))
            continue
        if value is None:
            continue
        e = check_value(ki.key, ki.kind, value, deep=deep, keep=keep)
        if trust is not None:
            v = signature_of(client, trust, ki.key, value)
            e = dataclasses.replace(e, signature=v.state, signature_detail=v.detail)
        yield e


def signature_of(client, trust: sigs.Trust, key: str, value: bytes) -> sigs.Verdict:
    """The verdict on `value` of `key` from its signature key (read with a cap)."""
    redis = _redis()
    try:
        sig = read_capped(client, remote_keys.signature_key(key), sigs.MAX_SIGNATURE)
    except ValueError:
        return sigs.Verdict("bad-signature", None, f"a signature value over {sigs.MAX_SIGNATURE} bytes")
    except redis.exceptions.ResponseError as e:  # WRONGTYPE: anyone who can write planted a list or hash there
        return sigs.Verdict("bad-signature", None, f"the signature key is not a string ({str(e)[:80]})")
    return trust.check(key, value, sig)


def here() -> tuple[str, str | None, str]:
    """This machine's system key, torch-build hash (what entries stamp) and torch version."""
    from compilewatch import torchinfo

    return torchinfo.system_key(), stamps.current_torch_hash(), str(torchinfo.torch_module().__version__)


def would_hit(e: EntryCheck, system_key: str, torch_hash: str | None) -> bool | None:
    """True when an entry's stamp says this machine's torch builds the same key; None: cannot tell."""
    if e.system_key is None or e.torch_hash is None or torch_hash is None:
        return None
    return e.system_key == system_key and e.torch_hash == torch_hash


# --- status -------------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class KindCount:
    kind: str
    entries: int
    bytes: int
    description: str


@dataclass(frozen=True, slots=True)
class RemoteStatus:
    reach: Reachability
    config: RemoteConfig
    keys: int  # every key in the database
    torch_keys: int  # torch-shaped keys (pt2:...)
    foreign_keys: int  # keys that are not torch's (another application shares the database)
    bytes: int  # bytes of torch's values
    kinds: tuple[KindCount, ...]
    by_system_key: dict[str, int]  # stamped system key -> fxgraph/aotautograd entries ("unknown": no stamp)
    by_torch_hash: dict[str, int]
    system_key: str | None  # this machine's
    torch_hash: str | None
    torch_version: str | None
    would_hit: int  # entries stamped for this machine's system key and torch build
    cannot_hit: int  # entries stamped for another system key or torch build
    unknown: int  # entries whose value does not say (autotune, pgo, unstamped)
    problems: dict[str, int]  # finding kind -> entries (malformed, oversized)
    quick: bool  # values not read: no stamps, no would_hit
    signature_keys: int = 0  # compilewatch's signature keys (pt2:compilewatch-sig::...), not counted in torch_keys
    by_signature: dict[str, int] = field(default_factory=dict)  # own/trusted/unsigned/foreign/bad-signature -> entries
    problem_keys: tuple[tuple[str, str, str], ...] = ()  # (key, problem, detail) of the first problems found


MAX_NAMED = 20  # problem entries named in a status
MAX_NAMED_FOREIGN = 100  # keys that are not torch's named in a verify (the rest counted in one finding)


def status(url: str | None = None, *, quick: bool = False, max_value: int = MAX_VALUE,
           timeout: float = DEADLINE_S) -> RemoteStatus:
    """What the remote cache at `url` (default: torch's) holds; `reach.reachable` False says why not.
    BadInput for a URL that is not a Redis URL. All of it within one network deadline of `timeout` s."""
    raw, source = _raw_url(url, os.environ)
    check_url(raw, source)
    cfg = config(url)
    d = Deadline(timeout, redact(raw))
    reach = probe(url, deadline=d)
    empty = RemoteStatus(reach, cfg, 0, 0, 0, 0, (), {}, {}, None, None, None, 0, 0, 0, {}, quick)
    if not reach.reachable:
        return empty
    with failing_server(url, "status"):
        client = connect(url, deadline=d)
        return _status(client, reach, cfg, quick, max_value)


def _status(client, reach: Reachability, cfg: RemoteConfig, quick: bool, max_value: int) -> RemoteStatus:
    sk, th, tv = (None, None, None) if quick else here()
    per: dict[str, list[int]] = {}
    by_sys: Counter[str] = Counter()
    by_torch: Counter[str] = Counter()
    problems: Counter[str] = Counter()
    by_sig: Counter[str] = Counter()
    named: list[tuple[str, str, str]] = []
    keys = foreign = nsig = nbytes = hit = miss = unknown = 0
    if quick:
        for ki in scan(client):
            keys += 1
            if ki.kind == remote_keys.SIGNATURE:
                nsig += 1
                continue
            if ki.kind not in remote_keys.KINDS:
                foreign += 1
                continue
            a = per.setdefault(ki.kind, [0, 0])
            a[0] += 1
            a[1] += ki.size or 0
            nbytes += ki.size or 0
            unknown += 1
    else:
        for ki in scan(client):
            keys += 1
            if ki.kind == remote_keys.SIGNATURE:
                nsig += 1
            elif ki.kind not in remote_keys.KINDS:
                foreign += 1
        for e in entries(client, deep=False, max_value=max_value, trust=sigs.Trust()):
            a = per.setdefault(e.kind, [0, 0])
            a[0] += 1
            a[1] += e.size
            nbytes += e.size
            if e.signature:
                by_sig[e.signature] += 1
            if e.problem:
                problems[e.problem] += 1
                if len(named) < MAX_NAMED:
                    named.append((e.key, e.problem, e.detail or ""))
            if e.kind in stamps.STAMPED_SUBCACHES and not e.problem:
                by_sys[e.system_key or "unknown"] += 1
                by_torch[e.torch_hash or "unknown"] += 1
            w = would_hit(e, sk, th) if sk else None
            if w is True:
                hit += 1
            elif w is False:
                miss += 1
            else:
                unknown += 1
    client.close()
    kinds = tuple(KindCount(k, n, b, remote_keys.KINDS[k].description)
                  for k, (n, b) in sorted(per.items(), key=lambda kv: -kv[1][1]))
    return RemoteStatus(reach, cfg, keys, keys - foreign - nsig, foreign, nbytes, kinds, dict(by_sys), dict(by_torch),
                        sk, th, tv, hit, miss, unknown, dict(problems), quick, nsig, dict(by_sig), tuple(named))


# --- verify: every entry, and the server's posture -------------------------------------------------------
@dataclass(frozen=True, slots=True)
class RemoteFinding:
    kind: str  # untrusted, unloadable, malformed, oversized, foreign-system, foreign-torch, no-auth, open-bind, plain-text,
    # unbounded-names (the server runs no scripts: key names read whole)
    severity: str  # "error" (torch would run or choke on it / the server is open), "foreign" (never hits here), "warning"
    key: str  # the Redis key, or "server"
    detail: str


@dataclass(frozen=True, slots=True)
class SecurityPosture:
    auth: str  # "none" (anyone who reaches the port can write), "password", "acl", "unknown"
    default_user: str | None  # the default user's ACL rule, when ACL LIST is allowed
    bind: str | None  # CONFIG GET bind ("* -::*": every interface)
    protected_mode: str | None
    tls: bool  # the URL is rediss://
    notes: tuple[str, ...]  # what could not be read (CONFIG / ACL refused)


@dataclass(frozen=True, slots=True)
class RemoteVerifyReport:
    url: str
    ok: bool  # no finding of severity "error" (entries for other machines are normal in a shared cache)
    entries: int
    checked: dict[str, int]  # entries per kind
    findings: tuple[RemoteFinding, ...]
    counts: dict[str, int]
    security: SecurityPosture
    system_key: str
    torch_version: str


_SEVERITY = {"untrusted": "error", "unloadable": "error", "malformed": "error", "oversized": "error",
             "bad-signature": "error", "no-auth": "error", "open-bind": "error", "foreign-system": "foreign",
             "foreign-torch": "foreign", "unsigned": "warning", "foreign-signed": "warning", "plain-text": "warning",
             "foreign-key": "warning", "unbounded-names": "warning"}
_WATCHED = "a process compilewatch watches (run, warm, CompileGuard, dflash cache.remote) does not load it"


def _config_get(client, name: str) -> str | None:
    got = client.config_get(name)
    if isinstance(got, dict):
        v = got.get(name, got.get(name.encode()) if got else None)
        return v.decode() if isinstance(v, bytes) else v
    return None


def security_posture(client, url: str) -> tuple[SecurityPosture, list[RemoteFinding]]:
    """Who can write to this server, and from where (docs/security.md says what to set)."""
    redis = _redis()
    notes: list[str] = []
    findings: list[RemoteFinding] = []
    requirepass = default_user = bind = protected = None
    try:
        requirepass = _config_get(client, "requirepass")
        bind = _config_get(client, "bind")
        protected = _config_get(client, "protected-mode")
    except redis.exceptions.ResponseError as e:
        notes.append(f"CONFIG GET refused ({str(e)[:80]}): bind and password not read")
    try:
        for rule in client.acl_list():
            rule = rule.decode() if isinstance(rule, bytes) else str(rule)
            if rule.startswith("user default "):
                default_user = rule
    except redis.exceptions.ResponseError as e:
        notes.append(f"ACL LIST refused ({str(e)[:80]})")
    if default_user is not None:
        words = default_user.split()
        open_default = "on" in words and "nopass" in words
        auth = "none" if open_default else ("password" if requirepass else "acl")
    elif requirepass is not None:
        auth = "password" if requirepass else "none"
    else:
        auth = "unknown"
    if auth == "none":
        findings.append(RemoteFinding("no-auth", "error", "server", "no password or ACL: anyone who reaches this port "
                                      "can write entries that every node unpickles and runs"))
    every = bind is not None and any(b in ("*", "0.0.0.0", "::", "-::*", "::*") for b in bind.split())
    if every:
        guard = (" (protected-mode keeps non-loopback clients out only while no password is set)"
                 if protected == "yes" else "")
        findings.append(RemoteFinding("open-bind", "error", "server", f"bound to every interface (bind {bind!r})"
                                      f"{guard}: bind it to the cluster's private interface"))
    host = urlsplit(url).hostname or "localhost"
    tls = url.startswith("rediss://")
    if not tls and host not in _LOOPBACK:
        findings.append(RemoteFinding("plain-text", "warning", "server", f"redis:// to {host}: entries and the "
                                      "password cross the network in plain text (rediss:// uses TLS)"))
    return SecurityPosture(auth, default_user, bind, protected, tls, tuple(notes)), findings


def verify(url: str | None = None, *, max_value: int = MAX_VALUE, timeout: float = DEADLINE_S) -> RemoteVerifyReport:
    """Scan every entry of the remote cache (pickles parsed, never unpickled, signatures checked) and
    the server's posture, within one network deadline of `timeout` s."""
    raw, _ = _raw_url(url, os.environ)
    client = connect(url, deadline=timeout)
    with failing_server(url, "verify"):
        return _verify(client, raw, max_value)


def _verify(client, raw: str, max_value: int) -> RemoteVerifyReport:
    sk, th, tv = here()
    findings: list[RemoteFinding] = []
    checked: Counter[str] = Counter()
    n = foreign = 0
    unbounded: list[str] = []
    for ki in scan(client, unbounded=unbounded):
        if ki.size is None and remote_keys.parse_key(ki.key).kind in remote_keys.KINDS:
            findings.append(RemoteFinding("malformed", "error", ki.key, "a torch key holding a Redis list, hash, set "
                                          "or stream, not a string: torch's read of it fails (WRONGTYPE)"))
        elif ki.kind == "foreign" or ki.kind == "pt2-unknown":
            foreign += 1  # counted, and named up to MAX_NAMED_FOREIGN: millions of them must not become a report
            if foreign <= MAX_NAMED_FOREIGN:
                findings.append(RemoteFinding("foreign-key", "warning", ki.key, "not a key torch writes (another "
                                              "application shares this database?): not read"))
    if foreign > MAX_NAMED_FOREIGN:
        findings.append(RemoteFinding("foreign-key", "warning", f"({foreign - MAX_NAMED_FOREIGN} more)",
                                      f"{foreign - MAX_NAMED_FOREIGN} more keys that are not torch's, not named "
                                      f"(the first {MAX_NAMED_FOREIGN} are): not read"))
    if unbounded:
        findings.append(RemoteFinding("unbounded-names", "warning", "server", f"the server runs no scripts "
                                      f"({unbounded[0]}): key names were listed with plain SCAN, each read whole "
                                      f"however long (with scripts, names over {MAX_KEY_NAME} bytes are not read)"))
    for e in entries(client, deep=True, max_value=max_value, trust=sigs.Trust()):
        n += 1
        checked[e.kind] += 1
        if e.problem:
            findings.append(RemoteFinding(e.problem, _SEVERITY[e.problem], e.key, e.detail or ""))
        elif e.system_key and e.system_key != sk:
            findings.append(RemoteFinding("foreign-system", "foreign", e.key, f"built for system key "
                                          f"{e.system_key[:12]}…, this machine is {sk[:12]}…: it never hits here"))
        elif e.torch_hash and th and e.torch_hash != th:
            findings.append(RemoteFinding("foreign-torch", "foreign", e.key, "built by another torch build: it never "
                                          "hits here"))
        if not e.problem and e.signature in ("unsigned", "foreign", "bad-signature"):
            kind = "foreign-signed" if e.signature == "foreign" else e.signature
            findings.append(RemoteFinding(kind, _SEVERITY[kind], e.key, f"{e.signature_detail}: {_WATCHED}; "
                                          "torch without compilewatch loads it"))
    posture, sec = security_posture(client, raw)
    client.close()
    findings = sec + findings
    order = list(_SEVERITY)
    findings.sort(key=lambda f: order.index(f.kind))
    bad = any(f.severity == "error" for f in findings)
    counts = Counter(f.kind for f in findings)
    if foreign:
        counts["foreign-key"] = foreign  # every one, named or not
    return RemoteVerifyReport(redact(raw), not bad, n, dict(checked), tuple(findings), dict(counts), posture, sk, tv)

