"""torch's remote-cache reads, verified before torch unpickles them (in processes compilewatch watches).

torch (`torch/_inductor/remote_cache.py`) reads every remote entry through one Redis backend class and
unpickles what it returns (`keyspace`: fxgraph, aotautograd, pgo values are base64 pickles). `install()`
wraps that backend's read and write in this process, through one patch point chosen per torch release
by probing (`PATCH_POINTS`):

| torch | patch point | what it wraps |
|---|---|---|
| 2.11 - 2.15 | `RedisRemoteCacheBackend._get` / `._put` (the class every `Remote*Cache` of `create_cache` builds; `self._redis` is its `redis.Redis`, made lazily, `None` after a connection error) | the bytes of one Redis key, before `RemoteCacheJsonSerde.decode` and the caches' `pickle.loads` |

Reads: torch's own `_get` fetches the value (its connection handling kept), then the sibling signature
key is read and the value admitted only if (1) it is signed by this machine's key or a trusted one
(`signatures`), (2) it decodes within the JSON bounds (`keyspace.decode_value`) and (3) for a pickled
kind, `picklescan.scan` passes its pickle (`scan_artifact` for the JSON kinds). Anything else is a
miss (torch compiles, and counts a miss), counted here per kind and reason (`counts()`; reported where
torch's own remote counters are, `remote_usage`), never returned to torch. Any error in the check is a
refusal too ("error"): the check fails closed and never breaks the compile.

Writes: torch's `_put` writes the value, then its signature by this machine's key is written beside it
(`signatures.Signer`; a key that cannot be used leaves the entry unsigned, counted "put-unsigned").

A torch with no known patch point gets its remote caches turned off in this process (`install` says
why): reads compilewatch cannot verify are not made. Without compilewatch in the process (a plain
`python train.py`), torch reads Redis directly and none of this applies.
"""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable

from compilewatch.cache.remote import keyspace as remote_keys
from compilewatch.cache.remote import signatures as sigs

REASONS = ("unsigned", "foreign", "bad-signature", "malformed", "unscannable", "error")

_lock = threading.Lock()
_counts: dict[str, Counter[str]] = {}
_state: dict[str, Any] = {"point": None, "why": None, "orig": None, "trust": None, "signer": None,
                          "signer_why": None}


@dataclass(frozen=True, slots=True)
class Installed:
    point: str | None  # the patch point in use, None: none (then remote caches are off here)
    why: str  # how, or why not


# --- the decision -------------------------------------------------------------------------------------
def _trust() -> sigs.Trust:
    t = _state["trust"]
    if t is None:
        t = _state["trust"] = sigs.Trust()
    else:
        t.refresh()
    return t


def refusal(key: str, value: object, sig: bytes | None, trust: sigs.Trust | None = None) -> tuple[str, str] | None:
    """(reason, detail) when torch must not get `value` read under Redis key `key`; None to admit it."""
    from compilewatch.cache.trust import picklescan

    if not isinstance(value, (bytes, bytearray)):
        return "malformed", f"a {type(value).__name__}, not bytes"
    value = bytes(value)
    v = (trust or _trust()).check(key, value, sig)
    if not v.ok:
        return v.state, v.detail
    kind = remote_keys.parse_key(key).kind
    spec = remote_keys.KINDS.get(kind)
    try:
        data = remote_keys.decode_value(value)
    except ValueError as e:
        return "malformed", str(e)
    pickled = spec.pickled if spec is not None else isinstance(data, dict) and isinstance(data.get("data"), str)
    if not pickled:
        return None if isinstance(data, dict) else ("malformed", f"JSON {type(data).__name__}, torch expects an object")
    try:
        content = remote_keys.decode_pickled(value)
    except ValueError as e:
        return "malformed", str(e)
    scan = picklescan.scan_artifact(kind, content)
    if not scan.ok:
        return "unscannable", scan.problem or f"names {', '.join(scan.refused[:3])}"
    return None


def _count(key: str, what: str) -> None:
    kind = remote_keys.parse_key(key).kind
    with _lock:
        _counts.setdefault(kind, Counter())[what] += 1


def counts() -> dict[str, dict[str, int]]:
    """What the verifying backend did in this process, per kind: refused_<reason> (reads that became
    misses), admitted (reads returned to torch), signed / put-unsigned (writes)."""
    with _lock:
        return {k: dict(c) for k, c in _counts.items() if c}


def reset_counts() -> None:
    with _lock:
        _counts.clear()


def _signer() -> sigs.Signer | None:
    if _state["signer"] is None and _state["signer_why"] is None:
        try:
            _state["signer"] = sigs.Signer.load(create=True)
        except Exception as e:  # noqa: BLE001 - a key we cannot use: entries stay unsigned, the compile goes on
            _state["signer_why"] = f"{type(e).__name__}: {getattr(e, 'message', e)}"
    return _state["signer"]


# --- the patch: RedisRemoteCacheBackend (2.11 - 2.15) ---------------------------------------------------
def _redis_errors():
    try:
        import redis

        return (redis.exceptions.ConnectionError,)
    except ImportError:
        return ()


def _verified_get(orig: Callable) -> Callable:
    def _get(self, key: str):
        value = orig(self, key)  # torch's own read, its connection handling kept
        if value is None:
            return None
        try:
            client = getattr(self, "_redis", None)
            if client is None:
                _count(key, "refused_error")
                return None
            try:
                sig = client.get(remote_keys.signature_key(key))
            except _redis_errors():
                self._redis = None  # as torch's backend does: the server is gone for this process
                _count(key, "refused_error")
                return None
            why = refusal(key, value, sig)
        except Exception:  # noqa: BLE001 - the check fails closed, and never breaks the compile
            _count(key, "refused_error")
            return None
        if why is not None:
            _count(key, f"refused_{why[0]}")
            return None
        _count(key, "admitted")
        return value

    _get.__compilewatch_verified__ = True  # type: ignore[attr-defined]
    _get.__wrapped__ = orig  # type: ignore[attr-defined]
    return _get


def _signing_put(orig: Callable) -> Callable:
    def _put(self, key: str, data) -> None:
        orig(self, key, data)  # the value first: between the two, readers see an unsigned entry (a miss)
        try:
            client = getattr(self, "_redis", None)
            signer = _signer()
            if client is None or signer is None or not isinstance(data, (bytes, bytearray)):
                _count(key, "put-unsigned")
                return
            client.set(remote_keys.signature_key(key), signer.sign(key, bytes(data)))
            _count(key, "signed")
        except Exception:  # noqa: BLE001 - an unsigned entry is a miss for others, never a failed compile
            _count(key, "put-unsigned")

    _put.__compilewatch_verified__ = True  # type: ignore[attr-defined]
    _put.__wrapped__ = orig  # type: ignore[attr-defined]
    return _put


def _backend_point(rc) -> str | None:
    """Why `RedisRemoteCacheBackend._get/_put` is not the patch point on this torch, None when it is."""
    cls = getattr(rc, "RedisRemoteCacheBackend", None)
    if cls is None:
        return "torch._inductor.remote_cache has no RedisRemoteCacheBackend"
    for name in ("_get", "_put"):
        fn = cls.__dict__.get(name)
        if not callable(fn):
            return f"RedisRemoteCacheBackend defines no {name}"
        code = getattr(getattr(fn, "__wrapped__", fn), "__code__", None)
        if code is None or "_redis" not in code.co_names:
            return f"RedisRemoteCacheBackend.{name} does not read self._redis (a backend this patch does not know)"
    return None


def _install_backend(rc) -> None:
    cls = rc.RedisRemoteCacheBackend
    if getattr(cls.__dict__["_get"], "__compilewatch_verified__", False):
        return
    _state["orig"] = (cls, cls.__dict__["_get"], cls.__dict__["_put"])
    cls._get = _verified_get(cls.__dict__["_get"])
    cls._put = _signing_put(cls.__dict__["_put"])


PATCH_POINTS = (
    # (name, torch releases seen, why-not probe, install)
    ("RedisRemoteCacheBackend._get/_put", "2.11-2.15", _backend_point, _install_backend),
)


def _turn_off_remote_caches() -> None:
    import sys

    for mod, attrs in (("torch._inductor.config", ("fx_graph_remote_cache", "autotune_remote_cache",
                                                   "bundled_autotune_remote_cache")),
                       ("torch._functorch.config", ("enable_remote_autograd_cache",)),
                       ("torch._dynamo.config", ("automatic_dynamic_remote_pgo",))):
        m = sys.modules.get(mod)
        for a in attrs:
            if m is not None and hasattr(m, a):
                try:
                    setattr(m, a, False)
                except Exception:  # noqa: BLE001 - a config that refuses: nothing else to do here
                    pass


def install() -> Installed:
    """Verify every remote-cache read (and sign every write) of torch in this process. Imports
    torch._inductor.remote_cache (call it after torch is imported, e.g. from an import hook on that
    module). Idempotent; never raises."""
    with _lock:
        if _state["point"]:
            return Installed(_state["point"], _state["why"])
    try:
        import torch._inductor.remote_cache as rc
    except Exception as e:  # noqa: BLE001 - no remote caches in this torch: nothing reads Redis
        return Installed(None, f"torch._inductor.remote_cache cannot be imported ({type(e).__name__})")
    reasons = []
    for name, releases, why_not, do in PATCH_POINTS:
        why = why_not(rc)
        if why is None:
            try:
                do(rc)
            except Exception as e:  # noqa: BLE001 - fall through to turning the caches off
                reasons.append(f"{name}: {type(e).__name__}: {e}")
                continue
            with _lock:
                _state["point"], _state["why"] = name, f"torch's remote-cache reads verified at {name} ({releases})"
            return Installed(name, _state["why"])
        reasons.append(why)
    _turn_off_remote_caches()
    _state["why"] = ("no patch point compilewatch knows on this torch (" + "; ".join(reasons)
                     + "): torch's remote caches turned off in this process")
    return Installed(None, _state["why"])


def installed() -> Installed | None:
    """The state of this process: None when install() was never called."""
    if _state["point"] is None and _state["why"] is None:
        return None
    return Installed(_state["point"], _state["why"] or "")


def uninstall() -> None:
    """Put torch's backend back (tests)."""
    with _lock:
        orig = _state["orig"]
        if orig is not None:
            cls, get, put = orig
            cls._get, cls._put = get, put
        _state.update(point=None, why=None, orig=None, trust=None, signer=None, signer_why=None)


def arm(after_import: Callable[[str, Callable[[], None]], None]) -> None:
    """`install()` now if torch's remote_cache module is loaded, else right after it loads (`after_import`:
    compilewatch.tracing.importhook's, passed in: this room does not import tracing)."""
    after_import("torch._inductor.remote_cache", install)
