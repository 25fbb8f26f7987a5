"""`cache diff A B`: what differs between two caches, each side a dir, a fingerprint JSON or an
archive (whose provenance is part of the answer: a foreign archive's manifest is only a claim).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from compilewatch.cache.archive import reader as archive_mod
from compilewatch.cache.content import fingerprint as fp_mod
from compilewatch.cache.content.fingerprint import Fingerprint
from compilewatch.cache.local import layout
from compilewatch.errors import BadInput
from compilewatch.inputs import loads_json, open_untrusted, read_text


# --- diff -----------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class SubCacheDiff:
    name: str
    files_a: int
    files_b: int
    bytes_a: int
    bytes_b: int
    same: bool
    added: tuple[str, ...]  # files only in B
    removed: tuple[str, ...]  # files only in A
    changed: tuple[str, ...]  # in both, different content


@dataclass(frozen=True, slots=True)
class CacheDiff:
    a: str
    b: str
    same: bool
    content_hash_a: str
    content_hash_b: str
    system_key_a: str
    system_key_b: str
    torch_version_a: str
    torch_version_b: str
    per_file: bool  # False when a side is a fingerprint without file entries (counts and hashes only)
    subcaches: tuple[SubCacheDiff, ...]
    # what each side is, and so how far its contents are known: "dir" (read here), "fingerprint" (a
    # JSON file: what it says), or an archive's provenance verdict, "own" / "trusted" (every member
    # matched what was signed) / "foreign" (its manifest is only what its maker claims)
    source_a: str = "dir"
    source_b: str = "dir"
    source_reason_a: str = ""  # an archive's provenance reason
    source_reason_b: str = ""


def load_side(x: str | os.PathLike[str]) -> tuple[Fingerprint, str, str]:
    """A fingerprint (with files when available) from a cache dir, an archive or a fingerprint JSON,
    with what the side is (CacheDiff.source_*) and, for an archive, its provenance reason."""
    p = Path(os.path.expanduser(x))
    if p.is_dir():
        return fp_mod.fingerprint(p, files=True), "dir", ""
    if not p.exists():
        raise BadInput(f"{p} does not exist", hint="give a cache dir, an archive or a fingerprint JSON file")
    # a FIFO or device is refused by name, never waited on
    fd, _ = open_untrusted(p, "cache diff side (a cache dir, an archive or a fingerprint JSON)")
    with os.fdopen(fd, "rb") as fh:
        head = fh.read(1)
    if head in (b"{", b"["):
        data = loads_json(read_text(p, what="fingerprint JSON file"), str(p))
        if not isinstance(data, dict):
            raise BadInput(f"{p} is not a compilewatch fingerprint (a JSON object was expected)")
        return fp_mod.from_json(data, source=str(p)), "fingerprint", ""
    fp, prov = archive_mod.read_manifest_checked(p)
    return fp, prov.verdict, prov.reason


def diff(a: str | os.PathLike[str], b: str | os.PathLike[str]) -> CacheDiff:
    """What changed from A to B, per sub-cache. A and B: cache dirs, archives or fingerprint JSON files.
    An archive is read whole: its provenance says whether its manifest matches what was signed."""
    (fa, src_a, why_a), (fb, src_b, why_b) = load_side(a), load_side(b)
    per_file = fa.entries is not None and fb.entries is not None
    names = sorted({s.name for s in fa.subcaches} | {s.name for s in fb.subcaches})
    subs = []
    for name in names:
        sa, sb = fa.subcache(name), fb.subcache(name)
        same = sa is not None and sb is not None and sa.content_hash == sb.content_hash
        added: tuple[str, ...] = ()
        removed: tuple[str, ...] = ()
        changed: tuple[str, ...] = ()
        if per_file and not same:
            ea = {e.rel: e.hash for e in fa.entries or () if layout.subcache_of(e.rel) == name}
            eb = {e.rel: e.hash for e in fb.entries or () if layout.subcache_of(e.rel) == name}
            added = tuple(sorted(set(eb) - set(ea)))
            removed = tuple(sorted(set(ea) - set(eb)))
            changed = tuple(sorted(r for r in set(ea) & set(eb) if ea[r] != eb[r]))
        subs.append(SubCacheDiff(name, sa.files if sa else 0, sb.files if sb else 0, sa.bytes if sa else 0,
                                 sb.bytes if sb else 0, same, added, removed, changed))
    return CacheDiff(
        a=str(a), b=str(b), same=fa.content_hash == fb.content_hash, content_hash_a=fa.content_hash,
        content_hash_b=fb.content_hash, system_key_a=fa.system_key, system_key_b=fb.system_key,
        torch_version_a=fa.torch_version, torch_version_b=fb.torch_version, per_file=per_file,
        subcaches=tuple(subs), source_a=src_a, source_b=src_b, source_reason_a=why_a, source_reason_b=why_b,
    )
