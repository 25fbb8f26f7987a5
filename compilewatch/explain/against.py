"""`cache explain --against OTHER`: why the entries of another cache dir, archive or Redis server would not
be hit here.

Two sources, best first:
- OTHER's key store (the lookups a watched run recorded there): each of its keys is looked for among the
  keys recorded here; a key not recorded here is compared, part by part, with the closest entry recorded
  here (same graph code, else same function), as a miss is (compilewatch.explain.explain);
- the debug lines torch stamps into OTHER's FX-graph entries (`_fx_graph_cache_debug_lines`, see
  compilewatch.cache.content.stamps), read as bytes, never unpickled: their settings and config parts are
  compared with the newest entry recorded here, else only the system key and torch build with this machine's.

OTHER may be an archive (`compilewatch cache save`): it is read in one pass by the archive reader
(compilewatch.cache.archive.reader.inspect_archive: every member checked by tarsafe and hashed against
what was signed; nothing extracted, unpickled or run), its `cache/fxgraph/` entries' stamps read from the
bytes as they stream by. An archive holds no key store (the store lives beside a cache dir), so its
entries are read by their stamps; a foreign archive's stamps are only what its maker claims, and the
report says so.

OTHER may be a Redis server (`redis://`, `rediss://`, `unix://`): torch's remote FX-graph entries, read
through the remote cache's reader (compilewatch.cache.remote.server.entries: every value capped and its
JSON shape bounded, base64-decoded, never unpickled), judged by their stamps like an archive's (a cluster's
cold node: why the shared cache's entries would not hit this machine).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from compilewatch.errors import BadInput
from compilewatch.explain import parts as P
from compilewatch.explain import store as S
from compilewatch.explain.explain import Diff, diff_parts

_STAMP_LINE = re.compile(rb"\[([a-z0-9]{40,64})\] ([A-Za-z_][\w.]*(?:\[[^\]\n]{0,200}\])?): ([\x20-\x7e]{0,400})")
ENTRY_LIMIT = 64 << 20


@dataclass(frozen=True, slots=True)
class AgainstEntry:
    key: str
    name: str | None
    would_hit: bool
    cause: str
    diffs: tuple[Diff, ...]
    text: str


@dataclass(frozen=True, slots=True)
class AgainstReport:
    other: str
    here: str
    source: str  # "key store" | "entry stamps"
    entries: int
    would_hit: int
    results: tuple[AgainstEntry, ...]
    causes: dict[str, int]
    warnings: tuple[str, ...] = ()


def _without_graph(parts: dict[str, list]) -> dict[str, list]:
    return {k: v for k, v in parts.items() if P.group_of(k) in ("settings", "config") and not k.startswith("env")
            and k not in ("torch.__version__", "cache dir", P.ENV_MARK)}


def stamped_parts(content: bytes) -> dict[str, list]:
    out: dict[str, list] = {}
    for m in _STAMP_LINE.finditer(content):
        name, value = m.group(2).decode(), m.group(3).decode()
        out.setdefault(name, [m.group(1).decode()[:P.DIGEST_CHARS], P.short_value(name, value)])
    return out


REMOTE_SCHEMES = ("redis://", "rediss://", "unix://")
MAX_REMOTE_ENTRIES = 10_000  # FX-graph entries read from a Redis server (each capped by the remote reader)


def explain_against(other: str | os.PathLike[str], here: str | os.PathLike[str]) -> AgainstReport:
    """Why `other`'s entries (a cache dir, a `cache save` archive, or a Redis server's URL) would not
    be hit by the cache dir `here`."""
    if isinstance(other, str) and other.startswith(REMOTE_SCHEMES):
        return _from_remote(other, Path(os.path.abspath(here)))
    other_p, here_p = Path(os.path.abspath(other)), Path(os.path.abspath(here))
    if other_p.is_file():
        return _from_archive(other_p, here_p)
    if not other_p.is_dir():
        raise BadInput(f"{other_p} is neither a directory nor a regular file: not a cache dir or archive"
                       if os.path.lexists(other_p) else f"no cache dir or archive at {other_p}",
                       hint="give the inductor cache dir or the `compilewatch cache save` archive whose entries you "
                            "want explained")
    mine = S.read(S.store_dir(here_p))
    theirs = S.read(S.store_dir(other_p))
    fx_mine = [r for r in mine.lookups if r.get("kind") == "fxgraph"]
    if theirs.lookups:
        return _from_store(other_p, here_p, theirs, mine, fx_mine)
    from compilewatch.cache.local import layout

    if not layout.looks_like_cache(other_p):  # a repo, a home folder: not "0 of 0 entries would hit"
        raise layout.not_a_cache(other_p)
    return _from_stamps(other_p, here_p, mine, fx_mine)


def _closest(parts: dict[str, list], rec: dict | None, mine: S.StoreData, fx_mine: list[dict]) -> tuple[list[Diff], dict | None]:
    gm = (parts.get("gm") or [None])[0]
    back = rec.get("backward") if rec else None
    same_code = [r for r in fx_mine if (mine.parts_of(r) or {}).get("gm", [None])[0] == gm and gm]
    same_name = [r for r in fx_mine if rec and rec.get("name") and r.get("name") == rec.get("name")
                 and r.get("backward") == back]
    best = None
    for r in (same_code or same_name):
        mp = mine.parts_of(r)
        if mp is None:
            continue
        d = diff_parts({k: v for k, v in parts.items() if k != "cache dir"}, {k: v for k, v in mp.items() if k != "cache dir"})
        if best is None or len(d) <= len(best[0]):
            best = (d, r)
    return best if best else ([], None)


def _from_store(other: Path, here: Path, theirs: S.StoreData, mine: S.StoreData, fx_mine: list[dict]) -> AgainstReport:
    keys_here = {r["key"] for r in mine.lookups}
    latest: dict[str, dict] = {}
    for r in theirs.lookups:
        if r.get("kind") == "fxgraph":
            latest[r["key"]] = r
    results = []
    for key, r in latest.items():
        label = f"{r.get('name') or 'graph'}{' backward' if r.get('backward') else ' forward'}"
        if key in keys_here:
            results.append(AgainstEntry(key, r.get("name"), True, "same key recorded here", (),
                                        f"{label} {key[:12]}: would hit (the same key was recorded here)"))
            continue
        parts = theirs.parts_of(r) or {}
        diffs, _ = _closest(parts, r, mine, fx_mine)
        if not fx_mine:
            cause, text = "nothing recorded here", f"{label} {key[:12]}: no run recorded here yet to compare with"
        elif not diffs:
            cause, text = "new graph", f"{label} {key[:12]}: would miss: no entry of this code or name recorded here"
        else:
            cause = "input dtype/shape/stride/device" if diffs[0].part.startswith("example_inputs[") else diffs[0].words
            text = f"{label} {key[:12]}: would miss: " + "; ".join(d.text for d in diffs[:3]) + \
                (f"; {len(diffs) - 3} other parts differ" if len(diffs) > 3 else "")
        results.append(AgainstEntry(key, r.get("name"), False, cause, tuple(diffs), text))
    return _report(other, here, "key store", results, [])


class _StampJudge:
    """One FX-graph entry's stamps against what was recorded here (or, with no run here, this machine)."""

    def __init__(self, mine: S.StoreData, fx_mine: list[dict]) -> None:
        self.ref = mine.parts_of(fx_mine[-1]) if fx_mine else None
        self._here: tuple[str | None, str | None] | None = None

    def here(self) -> tuple[str | None, str | None]:
        if self._here is None:
            from compilewatch.cache.content import stamps

            try:
                from compilewatch import torchinfo

                cur_sys = torchinfo.system_key()
            except Exception:  # noqa: BLE001
                cur_sys = None
            self._here = (stamps.current_torch_hash(), cur_sys)
        return self._here

    def entry(self, key: str, rel: str, content: bytes) -> AgainstEntry:
        from compilewatch.cache.content import stamps

        parts = stamped_parts(content)
        if not parts:
            return AgainstEntry(key, None, False, "not recorded", (),
                                f"{key[:12]}: the entry carries no key parts (written by a torch that does not stamp them)")
        if self.ref is not None:
            diffs = diff_parts(_without_graph(parts), _without_graph(self.ref))
        else:
            diffs = []
            st = stamps.stamp_of(rel, content)
            cur_torch, cur_sys = self.here()
            if st.torch_hash and cur_torch and st.torch_hash != cur_torch:
                diffs.append(Diff("torch_version", P.words("torch_version"), st.torch_hash[:8], cur_torch[:8],
                                  f"{P.words('torch_version')} [{st.torch_hash[:8]}] → [{cur_torch[:8]}]"))
            if st.system_key and cur_sys and st.system_key != cur_sys:
                diffs.append(Diff("system_info[hash]", "system hash", st.system_key[:12], cur_sys[:12],
                                  f"system hash {st.system_key[:12]} → {cur_sys[:12]}"))
        if diffs:
            return AgainstEntry(key, None, False, diffs[0].words, tuple(diffs),
                                f"{key[:12]}: would miss: " + "; ".join(d.text for d in diffs[:3]))
        return AgainstEntry(key, None, True, "settings match", (),
                            f"{key[:12]}: its torch build, system and config match here"
                            + ("" if self.ref is not None else " (torch build and system key only: no run recorded here)"))


def _from_stamps(other: Path, here: Path, mine: S.StoreData, fx_mine: list[dict]) -> AgainstReport:
    from compilewatch.inputs import read_bytes

    judge = _StampJudge(mine, fx_mine)
    warnings: list[str] = []
    results = []
    fx = other / "fxgraph"
    for dirpath, _dirs, files in os.walk(fx):
        for fn in files:
            p = Path(dirpath) / fn
            try:
                content = read_bytes(p, limit=ENTRY_LIMIT, what="cache entry")
            except BadInput as e:
                warnings.append(f"{p}: {e.message}")
                continue
            results.append(judge.entry(p.parent.name, p.relative_to(other).as_posix(), content))
    return _report(other, here, "entry stamps", results, warnings)


def _from_archive(archive: Path, here: Path) -> AgainstReport:
    """An archive's FX-graph entries by their stamps, read as the verified one-pass reader streams them."""
    from compilewatch.cache.archive import reader

    mine = S.read(S.store_dir(here))
    judge = _StampJudge(mine, [r for r in mine.lookups if r.get("kind") == "fxgraph"])
    results: list[AgainstEntry] = []
    warnings: list[str] = []
    prefix = reader.PREFIX + "fxgraph/"

    def on_member(name: str, data) -> None:
        if not name.startswith(prefix):
            return
        rel = name[len(reader.PREFIX):]
        parts = rel.split("/")
        if rel.startswith("/") or any(p in ("", ".", "..") for p in parts):  # what `cache load` never extracts
            from compilewatch.inputs import one_line

            raise BadInput(f"{archive}: member {one_line(name, 200)} is not a plain relative path: refused",
                           hint="make archives with `compilewatch cache save`; check this one with "
                                "`compilewatch cache verify`")
        if len(parts) < 4:  # fxgraph/<xx>/<key>/<file>
            return
        if isinstance(data, (bytes, bytearray)) and len(data) <= ENTRY_LIMIT:
            results.append(judge.entry(rel.split("/")[-2], rel, bytes(data)))
        else:  # over ENTRY_LIMIT (or streamed): left out, as a dir's oversized entry is
            warnings.append(f"{archive}:{name}: more than {ENTRY_LIMIT} bytes for a cache entry: left out")

    verdict, _ = reader.inspect_archive(archive, on_member=on_member)
    if verdict.verdict == "foreign":
        warnings.insert(0, f"{archive} is foreign ({verdict.reason}): its entries' stamps are only what its maker "
                           f"claims")
    return _report(archive, here, "archive entry stamps", results, warnings)


def _from_remote(url: str, here: Path) -> AgainstReport:
    """A Redis server's FX-graph entries (torch's remote cache) by their stamps: every value read through
    the remote reader's caps (size, JSON shape) and base64-decoded, never unpickled."""
    from compilewatch.cache.remote import keyspace, server

    mine = S.read(S.store_dir(here))
    judge = _StampJudge(mine, [r for r in mine.lookups if r.get("kind") == "fxgraph"])
    results: list[AgainstEntry] = []
    warnings = [f"{server.redact(url)}: a remote entry's stamps are what its writer claims (`compilewatch cache "
                "remote verify` checks the entries' signatures)"]
    client = server.connect(url)  # BadInput (exit 2) when it cannot be used
    try:
        for e in server.entries(client, kinds=("fxgraph",), deep=False, keep=True):
            key = keyspace.parse_key(e.key).key or e.key
            if e.problem is not None or e.content is None:
                warnings.append(f"{key}: {e.problem or 'unreadable'}: {e.detail or 'no content'}: left out")
                continue
            results.append(judge.entry(key, f"fxgraph/{key[1:3]}/{key}/entry", e.content))
            if len(results) >= MAX_REMOTE_ENTRIES:
                warnings.append(f"read the first {MAX_REMOTE_ENTRIES} FX-graph entries; the rest were not read")
                break
    finally:
        client.close()
    return _report(server.redact(url), here, "remote entry stamps", results, warnings)


def _report(other: Path | str, here: Path, source: str, results: list[AgainstEntry], warnings: list[str]) -> AgainstReport:
    causes: dict[str, int] = {}
    for r in results:
        if not r.would_hit:
            causes[r.cause] = causes.get(r.cause, 0) + 1
    causes = dict(sorted(causes.items(), key=lambda kv: -kv[1]))
    if not results:  # "0 of 0 entries would hit" says nothing: say why
        warnings = [f"{other} holds no FX-graph entries ({'recorded lookups' if source == 'key store' else 'fxgraph/'}"
                    f"): nothing to compare; is it the cache that was used?", *warnings]
    return AgainstReport(str(other), str(here), source, len(results), sum(r.would_hit for r in results),
                         tuple(results), causes, tuple(warnings))
