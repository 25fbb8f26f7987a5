"""Keys and values of torch's Redis remote caches, exactly as torch writes and reads them.

Read from `torch/_inductor/remote_cache.py` and its callers in torch 2.11.0, 2.13.0 and 2.15.0
(`_inductor/codecache.py` FxGraphCache, `_functorch/_aot_autograd/autograd_cache.py`,
`_inductor/runtime/autotune_cache.py`, `_dynamo/pgo.py`). The three releases agree on everything
below; what differs between them is type annotations, `assert` turned into `raise AssertionError`
(2.15) and local-cache statistics (2.13+ count `LocalFxGraphCache`, 2.11 does not), none of which
changes a key or a value. `LAYOUTS` keeps one row per range of releases, so a torch that changes
the format adds a row here and a CI column, nothing else.

Every key is `RedisRemoteCache._key_fmt`: `pt2:<cache_id>::<key>:c1` (`version = 1`), the value
bytes of `RemoteCacheJsonSerde` (JSON, ASCII). Per cache:

| kind | cache_id | key | value (JSON) |
|---|---|---|---|
| fxgraph | `fx-graph-v1` | the FX-graph key `f<base32>` (the local `fxgraph/<2>/<key>/` folder) | `{"data": base64(pickled CompiledFxGraph), "time_taken_ms": int}` |
| aotautograd | `autograd-experimental` | the AOTAutograd key `a<base32>` (local `aotautograd/<key>/`) | `{"data": base64(pickled AOTAutogradResult), "time_taken_ms": int}` |
| autotune | a 64-hex hash of (torch_key, triton backend hash, configs hash, salt) | the kernel's autotune key | the best config: `{"num_warps": .., "num_stages": .., "configs_hash": .., ...}` |
| bundled-autotune | `bundled-autotune-v1` | a hash of the compiled code + backend hash | `{basename: best config, ...}` |
| pgo | `dynamo-pgo` | the PGO key of a code object (+ a rank suffix) | `{"data": base64(pickled code state)}` |

Which processes hit an entry. The FX-graph key leaves the remote-cache flags out (inductor's config
lists `fx_graph_remote_cache` among the settings its cache key ignores), so a local cache's FX-graph
entries hit a process that has the remote cache on. The AOTAutograd key hashes functorch's whole
saved config (`AOTAutogradCacheDetails.autograd_config = config.save_config()`), and that includes
`enable_remote_autograd_cache`: an AOTAutograd entry hits only processes with the same
TORCHINDUCTOR_AUTOGRAD_REMOTE_CACHE setting as the one that wrote it (seen on 2.13; the same code in
2.11 and 2.15).

Reading (FxGraphCache / AOTAutogradCache `iterate_over_candidates`): `json.loads`, then
`base64.b64decode(value["data"])`, then `pickle.loads`: a remote entry is code on every node that
reads it (docs/security.md). A local cache holds several entries per key (one per guard set); the
remote cache one, the last one written.

Signatures (compilewatch's, not torch's): beside an entry `K` that `cache remote push` or a watched
process wrote, `signature_key(K)` = `pt2:compilewatch-sig::K:c1` holds its signature
(`remote.signatures`). torch never reads it (no torch cache id is `compilewatch-sig`); it stays under
`pt2:`, so an ACL `~pt2:*` covers it.

Every value is decoded with bounds (`decode_value`): at most `MAX_JSON_DEPTH` levels and
`MAX_JSON_CONTAINERS` arrays/objects, checked by a linear pass before `json.loads` (`'[' * 100000` is a
malformed value, never a RecursionError).
"""

from __future__ import annotations

import base64
import binascii
import json
import re
from dataclasses import dataclass

KEY_VERSION = 1  # RedisRemoteCache: "consistency between various types of keys"
PREFIX = "pt2:"
SIG_CACHE_ID = "compilewatch-sig"  # the sibling key holding an entry's signature (never a torch cache id)
SIGNATURE = "signature"  # ParsedKey.kind of a signature key
MAX_JSON_DEPTH = 32  # torch's values nest 1 (fxgraph, aotautograd, pgo) to 3 (bundled autotune) levels
MAX_JSON_CONTAINERS = 100_000  # arrays + objects in one value; a real one has a few dozen at most


@dataclass(frozen=True, slots=True)
class RemoteKind:
    name: str  # fxgraph, aotautograd, autotune, bundled-autotune, pgo
    cache_id: str | None  # None: the cache id is a per-kernel hash (autotune)
    torch_class: str  # the RemoteCache subclass torch counts hits under (remote_cache.cache_stats)
    env: str  # the environment variable that turns it on
    config: str  # the torch config that decides it
    pickled: bool  # the value's "data" is a base64 pickle
    description: str


@dataclass(frozen=True, slots=True)
class RemoteLayout:
    """How a range of torch releases names and encodes remote cache entries."""

    torch_min: tuple[int, int]
    torch_max: tuple[int, int]
    key_format: str
    kinds: tuple[RemoteKind, ...]


_KINDS = (
    RemoteKind("fxgraph", "fx-graph-v1", "RemoteFxGraphCache", "TORCHINDUCTOR_FX_GRAPH_REMOTE_CACHE",
               "torch._inductor.config.fx_graph_remote_cache", True,
               "FX graph cache: compiled graphs (generated code + kernels)"),
    RemoteKind("aotautograd", "autograd-experimental", "RemoteAOTAutogradCache",
               "TORCHINDUCTOR_AUTOGRAD_REMOTE_CACHE", "torch._functorch.config.enable_remote_autograd_cache", True,
               "AOTAutograd cache: forward/backward results pointing at FX-graph keys"),
    RemoteKind("autotune", None, "RemoteAutotuneCache", "TORCHINDUCTOR_AUTOTUNE_REMOTE_CACHE",
               "torch._inductor.config.autotune_remote_cache", False, "triton autotuning: best config per kernel"),
    RemoteKind("bundled-autotune", "bundled-autotune-v1", "RemoteBundledAutotuneCache",
               "TORCHINDUCTOR_BUNDLED_AUTOTUNE_REMOTE_CACHE", "torch._inductor.config.bundled_autotune_remote_cache",
               False, "bundled autotuning: every best config of one compiled graph"),
    RemoteKind("pgo", "dynamo-pgo", "RemoteDynamoPGOCache", "TORCH_DYNAMO_AUTOMATIC_DYNAMIC_REMOTE_PGO",
               "torch._dynamo.config.automatic_dynamic_remote_pgo", True,
               "dynamo profile-guided dynamic shapes (which inputs went dynamic)"),
)

LAYOUTS: tuple[RemoteLayout, ...] = (
    RemoteLayout((2, 11), (2, 15), "pt2:{cache_id}::{key}:c1", _KINDS),
)
KINDS: dict[str, RemoteKind] = {k.name: k for k in _KINDS}
PUSHABLE = ("fxgraph", "aotautograd")  # the kinds whose local entries map 1:1 onto remote keys
_BY_ID = {k.cache_id: k for k in _KINDS if k.cache_id}
_KEY_RE = re.compile(r"^pt2:(?P<cache_id>[^:]+)::(?P<key>.+):c(?P<version>\d+)$")
_HEX64 = re.compile(r"^[0-9a-f]{64}$")
# torch's keys are "f"/"a" + 52 base32 characters; the bound keeps a planted key a valid file name (pull makes a
# folder of it: 300 characters was an OSError traceback)
_LOCAL_KEY = {"fxgraph": re.compile(r"^f[a-z0-9]{40,128}$"), "aotautograd": re.compile(r"^a[a-z0-9]{40,128}$")}


def layout_for(version: tuple[int, int]) -> RemoteLayout | None:
    """The layout of torch `version` (major, minor), None for a release no row covers."""
    for lay in LAYOUTS:
        if lay.torch_min <= version <= lay.torch_max:
            return lay
    return None


@dataclass(frozen=True, slots=True)
class ParsedKey:
    kind: str  # a RemoteKind name, "pt2-unknown" (torch-shaped, unknown cache id) or "foreign" (not torch's)
    cache_id: str | None
    key: str | None


def parse_key(raw: bytes | str) -> ParsedKey:
    """Which of torch's remote caches a Redis key belongs to."""
    if isinstance(raw, bytes):
        try:
            raw = raw.decode("ascii")
        except UnicodeDecodeError:
            return ParsedKey("foreign", None, None)
    m = _KEY_RE.match(raw)
    if not m or int(m.group("version")) != KEY_VERSION:
        return ParsedKey("foreign", None, None)
    cid, key = m.group("cache_id"), m.group("key")
    if cid == SIG_CACHE_ID:
        return ParsedKey(SIGNATURE, cid, key) if _KEY_RE.match(key) else ParsedKey("foreign", None, None)
    kind = _BY_ID.get(cid)
    if kind is not None:
        return ParsedKey(kind.name, cid, key)
    if _HEX64.match(cid):
        return ParsedKey("autotune", cid, key)
    return ParsedKey("pt2-unknown", cid, key)


def redis_key(kind: str, key: str) -> str:
    """The Redis key torch reads for local entry `key` of sub-cache `kind` (fxgraph / aotautograd)."""
    cid = KINDS[kind].cache_id
    if cid is None or not _LOCAL_KEY[kind].match(key):
        raise ValueError(f"{key!r} is not a {kind} key")
    return f"pt2:{cid}::{key}:c{KEY_VERSION}"


def signature_key(key: str) -> str:
    """The sibling key holding the signature of entry `key` (a full Redis key, `pt2:...:c1`)."""
    return f"{PREFIX}{SIG_CACHE_ID}::{key}:c{KEY_VERSION}"


def encode_pickled(content: bytes, time_taken_ms: int = 0) -> bytes:
    """The value torch writes for a pickled entry (fxgraph / aotautograd `_save_graph` / `save`)."""
    return json.dumps({"data": base64.b64encode(content).decode("ascii"),
                       "time_taken_ms": int(time_taken_ms)}).encode("ascii")


# a JSON string (escapes included) or one bracket: the strings are skipped whole (one C-speed match),
# so the pass below looks at structure only
_JSON_TOKEN = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"|[\[\]{}]')
_OPEN = frozenset(b"[{")
_CLOSE = frozenset(b"]}")


def json_shape_problem(value: bytes, *, max_depth: int = MAX_JSON_DEPTH,
                       max_containers: int = MAX_JSON_CONTAINERS) -> str | None:
    """Why `value` nests deeper or holds more arrays/objects than a torch value can, else None. Linear
    in its size and never recursive (json.loads recurses once per level)."""
    opens = value.count(b"[") + value.count(b"{")  # bytes.count: fast, and base64 holds no brackets
    if opens <= max_depth:
        return None
    depth = containers = 0
    for m in _JSON_TOKEN.finditer(value):
        c = value[m.start()]
        if c in _OPEN:
            depth += 1
            containers += 1
            if depth > max_depth:
                return f"JSON nested deeper than {max_depth} levels"
            if containers > max_containers:
                return f"more than {max_containers} JSON arrays/objects"
        elif c in _CLOSE:
            depth -= 1
    return None


def decode_value(value: bytes) -> object:
    """`RemoteCacheJsonSerde.decode`: the JSON torch stores; ValueError with the reason if it is not
    (including a value nested or repeated past the bounds above)."""
    if not isinstance(value, (bytes, bytearray)):
        raise ValueError(f"a {type(value).__name__}, not bytes")
    problem = json_shape_problem(bytes(value))
    if problem:
        raise ValueError(problem)
    try:
        return json.loads(value)
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise ValueError(f"not JSON ({type(e).__name__})") from None


def decode_pickled(value: bytes) -> bytes:
    """The pickle inside a fxgraph / aotautograd / pgo value, as torch extracts it; ValueError if torch
    would fail to (not JSON, not an object, no "data" string, bad base64)."""
    data = decode_value(value)
    if not isinstance(data, dict):
        raise ValueError(f"JSON {type(data).__name__}, torch expects an object")
    payload = data.get("data")
    if not isinstance(payload, str):
        raise ValueError('no "data" string')
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError('"data" is not base64') from None
