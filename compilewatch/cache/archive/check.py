"""`cache verify ARCHIVE`: what an archive is before anything of it is used. Nothing is extracted,
unpickled or run.

First its provenance (`provenance.check_provenance`: made here, signed by a trusted key, or foreign;
every member's SHA-256 against what was signed), then, in the same pass, every member torch would
unpickle (`picklescan.is_pickle_file`) and every artifact of its Mega-Cache (`picklescan.scan_artifact`)
scanned, and every member checked the way `cache load` checks it: a name it would write
(`reader.cache_rel`), listed in the manifest, every listed file there, no file where a folder must go,
and each cache member exactly its manifest entry's size and xxh3-128 `hash` (hashed as it streams by,
with `reader.MemberHash`, what load's extraction hashes with: a signed archive whose manifest is stale
or edited is refused, as load refuses it). A member that appears twice is BadInput, as for `load`.
`ok` is True only for an archive that is own or trusted, whose pickles all pass and whose members
`load` takes: the one `cache load` takes without `--trust` (its system key and torch version aside:
`cache load` checks those, `--force` overrides them).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from compilewatch.cache.archive import reader
from compilewatch.cache.trust import paths, picklescan, provenance
from compilewatch.errors import BadInput
from compilewatch.inputs import one_line


@dataclass(frozen=True, slots=True)
class ArchiveFinding:
    member: str
    kind: str  # "untrusted" (a pickle names or calls what torch's caches never do), "unloadable" (malformed),
    # "refused" (a member `cache load` refuses whatever --trust says: a name it never writes, one the
    # manifest does not list, a listed file missing, a file where a folder must go, a size or content
    # other than its manifest entry's)
    detail: str


@dataclass(frozen=True, slots=True)
class ArchiveReport:
    path: str
    ok: bool
    provenance: provenance.Provenance
    members: int
    pickles_scanned: int
    mega_artifacts_scanned: int
    findings: tuple[ArchiveFinding, ...]


def verify_archive(path: str | os.PathLike[str]) -> ArchiveReport:
    """Provenance and scan of every pickle in the archive `path` (module docstring)."""
    from compilewatch.cache.archive import reader as arch

    findings: list[ArchiveFinding] = []
    counts = {"members": 0, "pickles": 0, "mega": 0}

    def add(member: str, scan: picklescan.ScanResult) -> None:
        if scan.problem:
            findings.append(ArchiveFinding(member, "unloadable", one_line(scan.problem, 300)))
        elif scan.refused:
            findings.append(ArchiveFinding(member, "untrusted", "; ".join(one_line(r, 200) for r in scan.refused[:3])))

    def on_member(name: str, data: bytes | reader.MemberStream) -> None:
        counts["members"] += 1
        large = isinstance(data, reader.MemberStream)  # over provenance.IN_MEMORY: scanned as it streams
        if name not in _OWN_MEMBERS:
            rel = reader.cache_rel(name)
            if rel is None:
                findings.append(ArchiveFinding(one_line(name, 200), "refused", "a member `cache load` never writes "
                                               f"(only files under {arch.PREFIX}, no absolute path, `.` or `..`): "
                                               "load refuses the archive"))
        head = data.peek(1) if large else data[:1]
        if name.startswith(arch.PREFIX) and picklescan.is_pickle_file(name[len(arch.PREFIX):], head):
            counts["pickles"] += 1
            add(name, picklescan.scan_file(data, data.size) if large else picklescan.scan(data))
        elif name == arch.MEGA and large:  # a declared size no real Mega-Cache has: never read into memory
            findings.append(ArchiveFinding(name, "unloadable", f"{data.size} bytes, more than {arch.MAX_MEGA}: not "
                                           "parsed (load_mega_cache refuses it too)"))
        elif name == arch.MEGA:
            artifacts = _mega_artifacts(data)
            if artifacts is None:
                findings.append(ArchiveFinding(name, "unloadable", "not a Mega-Cache torch can parse"))
            for kind, content, key in artifacts or ():
                counts["mega"] += 1
                where = paths.mega_key_refused(kind, key)
                if where is not None:
                    findings.append(ArchiveFinding(f"{arch.MEGA}: {kind}", "refused", f"{one_line(where, 300)}: "
                                                   "load_mega_cache refuses the archive"))
                add(f"{arch.MEGA}: {kind} {one_line(key, 80)}", picklescan.scan_artifact(kind, content))

    digests: dict[str, tuple[int, str]] = {}  # member -> (size, xxh3-128): hashed in the same pass
    verdict, manifest = reader.inspect_archive(Path(path), on_member=on_member, digests=digests)
    got = {rel: digest for name, digest in digests.items()  # the members load would write, by cache path
           if name not in _OWN_MEMBERS and (rel := reader.cache_rel(name)) is not None}
    if manifest is not None or verdict.verdict != "foreign":  # (a foreign archive is not ok already)
        findings.extend(_against_manifest(Path(path), manifest, got))
    return ArchiveReport(str(path), verdict.verdict != "foreign" and not findings, verdict, counts["members"],
                         counts["pickles"], counts["mega"], tuple(findings))


_OWN_MEMBERS = frozenset({reader.HEADER, reader.MEGA, reader.MANIFEST, provenance.SIGNATURE})


def _against_manifest(path: Path, manifest: bytes | None,
                      got: dict[str, tuple[int, str]]) -> list[ArchiveFinding]:
    """What `cache load` would refuse, comparing the cache members read (`got`: relative path -> (size,
    xxh3-128) of what was read) with the manifest: files missing or not listed, a file where a folder
    must go, a size or content other than the manifest lists (`load`'s `_extract` and `_check_extracted`;
    the signature vouches for the bytes, the manifest must too: a signed archive with a stale manifest
    is refused by load)."""
    if manifest is None:
        return [ArchiveFinding(reader.MANIFEST, "refused", "the archive has no manifest: load refuses it")]
    try:
        fp = reader._parse_manifest(path, manifest)
    except BadInput as e:
        return [ArchiveFinding(reader.MANIFEST, "refused", one_line(e.message, 300))]
    listed = {e.rel: (e.size, e.hash) for e in fp.entries or ()}  # a rel listed twice: the last, as for load
    want, have = set(listed), set(got)
    out = []
    for rel in sorted(want - have)[:_SHOWN]:
        out.append(ArchiveFinding(reader.PREFIX + one_line(rel, 200), "refused",
                                  "listed in the manifest, not in the archive"))
    for rel in sorted(have - want)[:_SHOWN]:
        out.append(ArchiveFinding(reader.PREFIX + one_line(rel, 200), "refused",
                                  "not in the manifest: load refuses the archive"))
    for rel in sorted(rel for rel in want & have if listed[rel] != got[rel])[:_SHOWN]:
        (size, digest), (n, actual) = listed[rel], got[rel]
        why = (f"{n} bytes in the archive, the manifest lists {size}" if n != size else
               f"content differs from the manifest's hash (xxh3-128 {one_line(str(actual), 40)}, the manifest "
               f"says {one_line(str(digest), 40)})")
        out.append(ArchiveFinding(reader.PREFIX + one_line(rel, 200), "refused", f"{why}: load refuses the archive"))
    folders = sorted({rel for rel in got for a in _ancestors(rel) if a in got} if len(got) > 1 else set())
    for rel in folders[:_SHOWN]:
        parent = next(a for a in _ancestors(rel) if a in got)
        out.append(ArchiveFinding(reader.PREFIX + one_line(rel, 200), "refused", f"needs a folder where the archive "
                                  f"holds the file {reader.PREFIX}{one_line(parent, 200)}: load cannot write both"))
    return out


_SHOWN = 200  # findings of one kind listed (the CLI shows 200 in all)


def _ancestors(rel: str):
    parts = rel.split("/")
    return ("/".join(parts[:i]) for i in range(1, len(parts)))


def _mega_artifacts(data: bytes) -> list[tuple[str, object, str]] | None:
    """(kind, content, key) of each artifact in a Mega-Cache blob, parsed the way torch parses it
    (`CacheArtifactManager.deserialize`: a length-prefixed container; nothing is unpickled); None when
    torch cannot parse it ([] without torch's Mega-Cache)."""
    try:
        from torch.compiler._cache import CacheArtifactManager
    except ImportError:
        return []
    artifacts = deserialize_quietly(CacheArtifactManager, data)
    if artifacts is None:
        return None
    return [(kind, getattr(a, "content", None), getattr(a, "key", None)) for kind, items in artifacts.items()
            for a in items]


def deserialize_quietly(manager, data: bytes):
    """`manager.deserialize(data)` without the traceback torch logs as a warning when the blob is not a
    Mega-Cache (the caller says so in one line); None then."""
    import logging

    log = logging.getLogger("torch.compiler._cache")
    was = log.disabled
    log.disabled = True
    try:
        return manager.deserialize(data)
    finally:
        log.disabled = was
