"""compilewatch's key store: what each cache lookup was keyed on, kept beside the cache dir.

`<parent>/.<cache dir name>.compilewatch-keys/keys.jsonl` (never inside torch's entries, so torch,
`cache save` and `cache verify` never see it). One JSON object per line, each with `"v": 1`:

    {"v":1,"type":"group","id":"<16 hex>","group":"config","parts":{"inductor_config[max_autotune]":["esstihe2nyydk4mh","False"], ...}}
    {"v":1,"type":"lookup","t":1733.1,"pid":42,"run":"...","kind":"fxgraph","key":"f...","hit":false,
     "name":"f","backward":false,"compile_id":"0/0","cache_dir":"/tmp/x","torch":"2.13.0+cpu","groups":{"graph":"<id>",...}}
    {"v":1,"type":"timing","t":1733.9,"pid":42,"run":"...","torch":"2.13.0+cpu","total_s":1.8,"wall_s":1.8,
     "threads":1,"phases":{"kernel load":1.41,...},"unavailable":[],"unmeasured":[],"top":[...],"lookups":{...}}

(a `timing` line: where one watched process's compile time went, by phase: compilewatch.explain.timing.)

A group is written once per store (content addressed), a lookup refers to its groups: ~0.3-0.6 KB a
lookup. An append is one `write` of one line on an O_APPEND descriptor (whole, even with several
processes appending), under a shared `flock`; compaction (keep the newest `KEEP` lookups and the groups
they use) takes the lock exclusively and replaces the file by a temp file + rename. Lines of a newer
format (`v` > 1) or that do not parse are skipped and counted, never guessed at.

A store that other users can write is refused (BadInput, exit 2): its records would decide what
compilewatch tells you about your cache.
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from compilewatch.errors import BadInput

FORMAT_VERSION = 1
FILE = "keys.jsonl"
LOCK = "lock"
SUFFIX = ".compilewatch-keys"
MAX_LOOKUPS = 4000  # compact when a store holds more lookups than this ...
KEEP = 2000  # ... down to the newest this many
MAX_BYTES = 8 << 20  # or when the file grows past this
READ_LIMIT = 64 << 20


def store_dir(cache_dir: str | os.PathLike[str]) -> Path:
    p = Path(os.path.abspath(cache_dir))
    return p.parent / f".{p.name}{SUFFIX}"


def cache_dir_of(store: Path) -> Path:
    name = store.name
    return store.parent / name[1:-len(SUFFIX)]


def sibling_stores(cache_dir: str | os.PathLike[str]) -> list[Path]:
    """The other key stores in the same parent folder: other cache dirs this machine used there."""
    own = store_dir(cache_dir)
    try:
        names = os.listdir(own.parent)
    except OSError:
        return []
    return sorted(own.parent / n for n in names if n.startswith(".") and n.endswith(SUFFIX) and n != own.name)


def untrusted_reason(path: Path) -> str | None:
    """Why `path` (the store dir or a file in it) may not be trusted, or None."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    except OSError as e:
        return f"cannot be checked: {e.strerror}"
    if stat.S_ISLNK(st.st_mode):
        return "is a symbolic link"
    if hasattr(os, "getuid") and st.st_uid != os.getuid():
        return f"is owned by another user (uid {st.st_uid})"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"is writable by other users (mode {stat.S_IMODE(st.st_mode):04o})"
    return None


def check_trusted(store: Path) -> None:
    for p in (store, store / FILE):
        why = untrusted_reason(p)
        if why is not None:
            raise BadInput(f"refusing the key store {store}: {p} {why}",
                           hint=f"its records could be forged; remove it (rm -r {store}) or make it yours "
                                f"(chown, chmod go-w)")


@dataclass(slots=True)
class StoreData:
    path: Path
    groups: dict[str, dict[str, list]] = field(default_factory=dict)  # id -> parts
    lookups: list[dict] = field(default_factory=list)
    timings: list[dict] = field(default_factory=list)  # a watched process's compile time by phase (explain.timing)
    skipped: int = 0  # lines of a newer format or that did not parse
    newer: int = 0

    def parts_of(self, rec: dict) -> dict[str, list] | None:
        """Every part of a lookup (None where a group is missing from the store)."""
        out: dict[str, list] = {}
        for gid in (rec.get("groups") or {}).values():
            g = self.groups.get(gid)
            if g is None:
                return None
            out.update(g)
        if rec.get("cache_dir"):
            out["cache dir"] = ["", rec["cache_dir"]]
        return out


def read(store: Path, *, must_exist: bool = False) -> StoreData:
    data = StoreData(store)
    if not store.exists():
        if must_exist:
            raise BadInput(f"no key store at {store}: no watched run has compiled with cache dir {cache_dir_of(store)}",
                           hint="run the program under `compilewatch run -- ...` (or compilewatch.watch()) first")
        return data
    check_trusted(store)
    from compilewatch.inputs import read_bytes

    try:
        raw = read_bytes(store / FILE, limit=READ_LIMIT, what="key store")
    except BadInput as e:
        if not (store / FILE).exists():
            return data
        raise BadInput(e.message, hint=e.hint or f"{store / FILE} should be the key store's JSON-lines file; remove "
                                                 f"the store (rm -r {store}) and run the program again under "
                                                 f"`compilewatch run -- ...`") from None
    for line in raw.split(b"\n"):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except (ValueError, RecursionError):  # RecursionError: a line nested too deeply to read
            data.skipped += 1
            continue
        if not isinstance(obj, dict) or not isinstance(obj.get("v"), int) or isinstance(obj["v"], bool):
            data.skipped += 1
            continue
        if obj["v"] > FORMAT_VERSION:
            data.newer += 1
            continue
        if obj.get("type") == "group" and isinstance(obj.get("id"), str) and _valid_parts(obj.get("parts")):
            data.groups[obj["id"]] = obj["parts"]
        elif obj.get("type") == "lookup" and _valid_lookup(obj):
            data.lookups.append(obj)
        elif obj.get("type") == "timing" and _valid_timing(obj):
            data.timings.append(obj)
        else:
            data.skipped += 1
    return data


# what the recorder writes, field by field: a line of another shape is skipped and counted, never used
def _is(v, *types) -> bool:
    """isinstance, where True/False count as bool only (not as int)."""
    return isinstance(v, types) and (bool in types or not isinstance(v, bool))


def _opt(obj: dict, name: str, *types) -> bool:
    return obj.get(name) is None or _is(obj[name], *types)


def _valid_parts(parts) -> bool:
    return isinstance(parts, dict) and all(
        isinstance(k, str) and isinstance(v, list) and len(v) == 2 and isinstance(v[0], str)
        and (v[1] is None or isinstance(v[1], str)) for k, v in parts.items())


def _valid_lookup(o: dict) -> bool:
    groups = o.get("groups")
    return (isinstance(o.get("key"), str) and _opt(o, "t", int, float) and _opt(o, "pid", int)
            and all(_opt(o, f, str) for f in ("run", "kind", "name", "compile_id", "cache_dir", "torch"))
            and _opt(o, "hit", bool) and _opt(o, "backward", bool)
            and (groups is None or (isinstance(groups, dict)
                                    and all(isinstance(k, str) and isinstance(v, str) for k, v in groups.items()))))


def _valid_timing(o: dict) -> bool:
    num = (int, float)
    return (isinstance(o.get("phases"), dict) and all(isinstance(k, str) and _is(v, *num) for k, v in o["phases"].items())
            and _opt(o, "t", *num) and _opt(o, "pid", int) and _opt(o, "run", str) and _opt(o, "torch", str)
            and _opt(o, "total_s", *num) and _opt(o, "wall_s", *num) and _opt(o, "threads", int)
            and all(o.get(f) is None or (isinstance(o[f], list) and all(isinstance(x, str) for x in o[f]))
                    for f in ("unavailable", "unmeasured"))
            and (o.get("top") is None or (isinstance(o["top"], list) and all(
                isinstance(e, list) and len(e) == 4 and isinstance(e[0], str) and isinstance(e[1], str)
                and _is(e[2], *num) and _is(e[3], int) for e in o["top"])))
            and (o.get("lookups") is None or (isinstance(o["lookups"], dict)
                                              and all(_is(v, int) for v in o["lookups"].values()))))


class Writer:
    """Appends to one store; opened by the recorder for each cache dir a watched process uses."""

    def __init__(self, cache_dir: str | os.PathLike[str]) -> None:
        self.store = store_dir(cache_dir)
        os.makedirs(self.store, mode=0o700, exist_ok=True)
        check_trusted(self.store)
        self.file = self.store / FILE
        self._lock_fd = os.open(self.store / LOCK, os.O_RDWR | os.O_CREAT, 0o600)
        self.known: set[str] = set()
        try:
            with open(self.file, "rb") as f:
                for line in f:
                    if line.startswith(b'{"v":1,"type":"group"'):
                        with contextlib.suppress(ValueError, KeyError, TypeError, RecursionError):
                            self.known.add(json.loads(line)["id"])
        except FileNotFoundError:
            pass

    @contextlib.contextmanager
    def _locked(self, how: int) -> Iterator[None]:
        import fcntl

        fcntl.flock(self._lock_fd, how)
        try:
            yield
        finally:
            fcntl.flock(self._lock_fd, fcntl.LOCK_UN)

    def append(self, lines: list[dict]) -> None:
        import fcntl

        data = "".join(json.dumps(o, separators=(",", ":")) + "\n" for o in lines).encode()
        with self._locked(fcntl.LOCK_SH):
            fd = os.open(self.file, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
            try:
                os.write(fd, data)
            finally:
                os.close(fd)

    def compact_if_needed(self, *, max_lookups: int = MAX_LOOKUPS, keep: int = KEEP,
                          max_bytes: int = MAX_BYTES) -> bool:
        """Keep the newest `keep` lookups and the groups they use, when the store is over its bounds."""
        import fcntl

        try:
            size = os.stat(self.file).st_size
        except FileNotFoundError:
            return False
        with self._locked(fcntl.LOCK_EX):
            data = read(self.store)
            if len(data.lookups) <= max_lookups and size <= max_bytes:
                return False
            kept = data.lookups[-keep:]
            used = {gid for rec in kept for gid in (rec.get("groups") or {}).values()}
            out = [{"v": FORMAT_VERSION, "type": "group", "id": gid, "parts": parts}
                   for gid, parts in data.groups.items() if gid in used]
            runs = {rec.get("run") for rec in kept}
            timings = [t for t in data.timings if t.get("run") in runs][-keep:]
            from compilewatch.fsutil import atomic_write_text

            atomic_write_text(self.file, "".join(json.dumps(o, separators=(",", ":")) + "\n"
                                                 for o in out + kept + timings))
            os.chmod(self.file, 0o600)
            self.known = used
        return True

    def close(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self._lock_fd)
