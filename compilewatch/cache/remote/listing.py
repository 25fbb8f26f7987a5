"""Listing a Redis remote cache's keys and reading its values, every byte bounded.

A key name can be as long as a value (512 MB, Redis's `proto-max-bulk-len`), and SCAN hands names over
whole: a database shared with another application (or written by someone hostile) could make a
listing of 500 keys take gigabytes. So SCAN runs inside a server-side script (`_SCAN_SHORT`, Lua:
SCAN is allowed in scripts since Redis 5) that returns the names up to `MAX_KEY_NAME` bytes and only
the lengths of longer ones; those are listed as foreign keys, never read. torch's own key names are
short (`pt2:<cache_id>::<key>:c1`, under 300 bytes: `keyspace`). A server that refuses scripts (an ACL
without `@scripting`, a Redis-compatible server without Lua) is listed with plain SCAN, names whole,
as before; `scan(..., unbounded=[])` records that it happened.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

from compilewatch.cache.remote import keyspace as remote_keys

SCAN_BATCH = 500
MAX_KEY_NAME = 4096  # bytes; longer names are counted, not read

_SCAN_SHORT = """
local r = redis.call('SCAN', ARGV[1], 'MATCH', ARGV[2], 'COUNT', ARGV[3])
local keep, long, cap = {}, {}, tonumber(ARGV[4])
for _, k in ipairs(r[2]) do
  if #k <= cap then keep[#keep + 1] = k else long[#long + 1] = #k end
end
return {r[1], keep, long}
"""


@dataclass(frozen=True, slots=True)
class KeyInfo:
    key: str
    kind: str  # remote_keys.ParsedKey.kind
    size: int | None  # STRLEN; None for a key that is not a string (not torch's) or whose name was not read


def long_name(length: int) -> str:
    """What a key whose name was too long to read is listed as."""
    return f"(a key name of {length} bytes: longer than {MAX_KEY_NAME}, not read)"


def scan(client, *, match: str | None = None, unbounded: list[str] | None = None) -> Iterator[KeyInfo]:
    """Every key (SCAN, in batches) with its kind and STRLEN (pipelined); names over `MAX_KEY_NAME` bytes
    are listed as foreign, unread. `unbounded` gets the server's refusal when it runs no scripts."""
    redis = _redis()
    batch: list[bytes] = []

    def flush() -> Iterator[KeyInfo]:
        pipe = client.pipeline(transaction=False)
        for k in batch:
            pipe.strlen(k)
        sizes = pipe.execute(raise_on_error=False)
        for k, n in zip(batch, sizes):
            name = k.decode("utf-8", "replace") if isinstance(k, bytes) else str(k)
            size = n if isinstance(n, int) and not isinstance(n, redis.exceptions.ResponseError) else None
            yield KeyInfo(name, remote_keys.parse_key(k).kind if size is not None else "foreign", size)
        batch.clear()

    for k in _names(client, match, unbounded):
        if isinstance(k, int):
            yield KeyInfo(long_name(k), "foreign", None)
            continue
        batch.append(k)
        if len(batch) >= SCAN_BATCH:
            yield from flush()
    if batch:
        yield from flush()


def _names(client, match: str | None, unbounded: list[str] | None) -> Iterator[bytes | int]:
    """Key names (bytes), or the length (int) of a name too long to read."""
    redis = _redis()
    script = client.register_script(_SCAN_SHORT)
    cursor: bytes | int = 0
    while True:
        try:
            cursor, keep, long = script(args=[cursor, match or "*", SCAN_BATCH, MAX_KEY_NAME])
        except redis.exceptions.ResponseError as e:  # no scripts here: plain SCAN from the start
            if unbounded is not None:
                unbounded.append(str(e)[:200])
            yield from client.scan_iter(match=match, count=SCAN_BATCH)
            return
        yield from keep
        yield from (int(n) for n in long)
        if int(cursor) == 0:
            return


def read_capped(client, key: str, max_value: int) -> bytes | None:
    """The value of `key`, at most `max_value` bytes read; None when it vanished; ValueError when larger."""
    data = client.getrange(key, 0, max_value)  # at most max_value + 1 bytes cross the wire
    if len(data) > max_value:
        raise ValueError(f"larger than the {max_value} byte cap")
    if not data and not client.exists(key):
        return None
    return data


def _redis():
    import redis

    return redis
