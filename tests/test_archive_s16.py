"""Session 16: `cache verify ARCHIVE` says ok only for the archives `cache load` takes, byte for byte.

`verify` compared the archive's members with its manifest by name only, and left sizes and content to
the signature; `load` also refuses a member whose size or xxh3-128 differs from its manifest entry, so
a signed archive with a stale or edited manifest was `ok` and then refused. Every archive here is made
by `cache save` and then altered (the manifest, the members, the tar itself; signed again by this
machine's key, the one the tests trust, unless a case keeps the old signature): for each,
`verify_archive(...).ok` must be whether `load` into an empty folder succeeds, and every refusal must
name the member. Both ways a member reaches verify are run: in memory, and streamed (every member
over `reader.IN_MEMORY`).
"""

from __future__ import annotations

import json
import pickle
import random
import tarfile
from dataclasses import dataclass, field

import pytest
import xxhash

from cli.main import app
from compilewatch.cache.archive import check as archive_check
from compilewatch.cache.archive import load as archive_load
from compilewatch.cache.archive import reader
from compilewatch.cache.archive import save as archive_save
from compilewatch.cache.trust import picklescan, provenance
from compilewatch.errors import BadInput
from tests.cache_helpers import make_cache, tar_members, tree, write_tar
from tests.helpers import invoke

FX, AOT, PY, CPP, SO, LOCK = "fx", "aot", "py", "cpp", "so", "lock"


@dataclass
class Parts:
    """A saved archive taken apart: altered, then written again (`build`)."""

    header: bytes
    cache: list[list]  # [name, bytes] of every cache member, in order
    manifest: dict
    signature: bytes | None  # None: written without one
    sign: bool = True  # signed again by this machine's key; False: `signature` kept
    cut_in: str | None = None  # the tar cut halfway through this member's bytes
    named: set[str] = field(default_factory=set)  # the members a refusal must name

    def name(self, kind: str) -> str:
        """The cache member of `kind` (FX, AOT, PY, ...)."""
        prefix = {FX: "cache/fxgraph/", AOT: "cache/aotautograd/", LOCK: "cache/locks/"}.get(kind)
        return next(n for n, _ in self.cache if (n.startswith(prefix) if prefix else n.endswith("." + kind)))

    def data(self, name: str) -> bytes:
        return next(d for n, d in self.cache if n == name)

    def set_data(self, name: str, data: bytes) -> None:
        next(m for m in self.cache if m[0] == name)[1] = data

    def entry(self, name: str) -> dict:
        rel = name[len(reader.PREFIX):]
        return next(e for e in self.manifest["entries"] if e["rel"] == rel)

    def remanifest(self) -> None:
        """The manifest made to match the members (as `cache save` would write it)."""
        old = {e["rel"]: e for e in self.manifest["entries"]}
        entries = []
        for name, data in self.cache:
            rel = name[len(reader.PREFIX):]
            entries.append({**old.get(rel, {"rel": rel, "mtime_ns": 0}), "size": len(data),
                            "hash": xxhash.xxh3_128_hexdigest(data)})
        self.manifest["entries"] = entries
        self.manifest["files"], self.manifest["bytes"] = len(entries), sum(e["size"] for e in entries)


def parts_of(saved) -> Parts:
    members = tar_members(saved)
    by = dict(members)
    cache = [[n, d] for n, d in members if n.startswith(reader.PREFIX)]
    assert [n for n, _ in members if not n.startswith(reader.PREFIX)] == \
        [reader.HEADER, reader.MANIFEST, provenance.SIGNATURE]  # what this test takes apart
    return Parts(by[reader.HEADER], cache, json.loads(by[reader.MANIFEST]), by[provenance.SIGNATURE])


def build(parts: Parts, path):
    members = [(reader.HEADER, parts.header), *((n, d) for n, d in parts.cache),
               (reader.MANIFEST, json.dumps(parts.manifest).encode())]
    if parts.sign:
        rec = provenance.Recorder()
        for name, data in members:
            rec.add_bytes(name, data)
        members.append((provenance.SIGNATURE, rec.signature_member()))
    elif parts.signature is not None:
        members.append((provenance.SIGNATURE, parts.signature))
    write_tar(path, members)
    if parts.cut_in is not None:
        with tarfile.open(path) as t:
            m = t.getmember(parts.cut_in)
        path.write_bytes(path.read_bytes()[:m.offset_data + m.size // 2])
    return path


@pytest.fixture
def saved(tmp_path):
    src = make_cache(tmp_path / "src", n_fx=1, n_codegen=1, triton=False)
    return archive_save.save(tmp_path / "a.tar", src, mega=False).archive


@pytest.fixture(params=["in memory", "streamed"])
def memory(request, monkeypatch):
    """verify gets members as bytes, or every one as a MemberStream (hashed and scanned as it streams)."""
    if request.param == "streamed":
        monkeypatch.setattr(reader, "IN_MEMORY", 0)
        monkeypatch.setattr(picklescan, "READ_WHOLE", 0)
    return request.param


@dataclass
class Outcome:
    verify_ok: bool
    verify_says: str  # the findings (member: detail) and the verdict's reason, or verify's BadInput
    refused_members: list[str]  # the members verify's findings name
    load_ok: bool
    load_says: str


def outcome(archive, dst) -> Outcome:
    """What verify says about `archive`, and whether `load` into the empty folder `dst` succeeds."""
    try:
        rep = archive_check.verify_archive(archive)
        v_ok, members = rep.ok, [f.member for f in rep.findings]
        says = rep.provenance.reason + "\n" + "\n".join(f"{f.member}: {f.kind}: {f.detail}" for f in rep.findings)
    except BadInput as e:
        v_ok, members, says = False, [], e.message
    dst.mkdir()
    try:
        archive_load.load(archive, dst)
        l_ok, l_says = True, ""
    except BadInput as e:
        l_ok, l_says = False, e.message
    return Outcome(v_ok, says, members, l_ok, l_says)


def check(parts: Parts, tmp_path, tag: str = "x") -> Outcome:
    """The property: verify's ok is load's success; every refused finding names a member of the archive
    or its manifest; a load that succeeded wrote the archive's cache members, byte for byte."""
    archive = build(parts, tmp_path / f"{tag}.tar")
    out = outcome(archive, tmp_path / f"{tag}-dst")
    assert out.verify_ok == out.load_ok, (out.verify_says, out.load_says)
    listed = {reader.PREFIX + e["rel"] for e in parts.manifest["entries"]}
    assert all(m in {n for n, _ in parts.cache} | listed | {reader.MANIFEST} for m in out.refused_members), out
    if out.load_ok:
        assert tree(tmp_path / f"{tag}-dst") == {n[len(reader.PREFIX):]: d for n, d in parts.cache}
    return out


# --- each way of altering an archive, alone ---------------------------------------------------------
def _dup(kind: str, other: bytes | None = None):
    def mutate(p: Parts) -> None:
        name = p.name(kind)
        p.cache.append([name, p.data(name) if other is None else other])
        p.named.add(name)
    return mutate


def _named(p: Parts, kind: str) -> str:
    name = p.name(kind)
    p.named.add(name)
    return name


def _add(p: Parts, name: str, data: bytes, listed: bool) -> None:
    p.cache.append([name, data])
    if listed:
        p.remanifest()
    else:
        p.named.add(name)


def _missing(p: Parts, kind: str, listed: bool) -> None:
    name = p.name(kind)
    p.cache = [m for m in p.cache if m[0] != name]
    if listed:
        p.named.add(name)
    else:
        p.remanifest()


CASES = {  # what is done to the saved archive -> whether load takes it
    "intact": (lambda p: None, True),
    "manifest size one more": (lambda p: p.entry(_named(p, FX)).update(size=p.entry(p.name(FX))["size"] + 1), False),
    "manifest size 0": (lambda p: p.entry(_named(p, PY)).update(size=0), False),
    "manifest size of an empty file": (lambda p: p.entry(_named(p, LOCK)).update(size=7), False),
    "manifest hash changed": (lambda p: p.entry(_named(p, SO)).update(hash="0" * 32), False),
    "manifest hash another member's": (lambda p: p.entry(_named(p, AOT)).update(
        hash=xxhash.xxh3_128_hexdigest(p.data(p.name(PY)))), False),
    "manifest mtime, bytes and content hash edited": (lambda p: (
        p.entry(p.name(FX)).update(mtime_ns=1), p.manifest.update(bytes=1, content_hash="xxh3-128:" + "0" * 32)), True),
    "manifest lists a member twice, the last stale": (lambda p: p.manifest["entries"].append(
        {**p.entry(_named(p, CPP)), "size": 1}), False),
    "manifest lists a member twice, the first stale": (lambda p: p.manifest["entries"].insert(
        0, {**p.entry(p.name(CPP)), "size": 1}), True),
    "content changed, same size, manifest stale": (lambda p: p.set_data(
        _named(p, PY), p.data(p.name(PY)).replace(b"0", b"7")), False),
    "content changed, manifest and signature made again": (lambda p: (
        p.set_data(p.name(PY), b"def call(args):\n    return 42\n"), p.remanifest()), True),
    "content changed, signature kept": (lambda p: (
        p.set_data(_named(p, CPP), b"// another kernel\n"), p.remanifest(), setattr(p, "sign", False)), False),
    "an empty file given bytes, manifest stale": (lambda p: p.set_data(_named(p, LOCK), b"x"), False),
    "a pickle that runs code, manifest made again": (lambda p: (
        p.set_data(_named(p, FX), pickle.dumps(_RunsCode(), protocol=4)), p.remanifest()), False),
    "a member truncated, manifest stale": (lambda p: p.set_data(_named(p, SO), p.data(p.name(SO))[:10]), False),
    "a text member truncated, manifest made again": (lambda p: (
        p.set_data(p.name(PY), p.data(p.name(PY))[:12]), p.remanifest()), True),
    "a pickle truncated, manifest made again": (lambda p: (
        p.set_data(_named(p, AOT), p.data(p.name(AOT))[:-3]), p.remanifest()), False),
    "the tar cut inside a member": (lambda p: setattr(p, "cut_in", _named(p, SO)), False),
    "a member twice, the same bytes": (_dup(CPP), False),
    "a member twice, other bytes": (_dup(PY, b"x = 1\n"), False),
    "an extra member the manifest does not list": (lambda p: _add(p, "cache/zz/czzextra.py", b"x = 1\n", False), False),
    "an extra member, listed": (lambda p: _add(p, "cache/zz/czzextra.py", b"x = 1\n", True), True),
    "an extra member where a folder must go": (lambda p: _add(p, "cache/locks", b"x", True), False),
    "a member missing, still listed": (lambda p: _missing(p, SO, listed=True), False),
    "a member missing, manifest made again": (lambda p: _missing(p, SO, listed=False), True),
    "the manifest lists a file the archive lacks": (lambda p: (p.manifest["entries"].append(
        {"rel": "zz/czzlisted.py", "size": 3, "hash": "0" * 32, "mtime_ns": 0}), p.named.add("cache/zz/czzlisted.py")),
        False),
    "the old signature kept, nothing changed": (lambda p: setattr(p, "sign", False), True),
    "no signature": (lambda p: (setattr(p, "sign", False), setattr(p, "signature", None)), False),
}


class _RunsCode:
    def __reduce__(self):
        import os

        return (os.system, ("true",))


_NOT_A_MEMBER = {"no signature", "an extra member where a folder must go"}  # named otherwise: below


@pytest.mark.parametrize("case", CASES)
def test_verify_is_ok_exactly_when_load_takes_the_archive(tmp_path, saved, memory, case):
    mutate, loads = CASES[case]
    parts = parts_of(saved)
    mutate(parts)
    out = check(parts, tmp_path)
    assert out.load_ok is loads, (out.load_says, out.verify_says)
    assert loads or parts.named or case in _NOT_A_MEMBER, case  # every refusal here is about a member
    for name in parts.named:  # named by verify (a finding, the verdict, or its BadInput) and by load
        assert name in out.verify_says or name in out.refused_members, (name, out.verify_says)
        assert name[len(reader.PREFIX):] in out.load_says, (name, out.load_says)


def test_a_stale_manifest_is_one_refused_finding_naming_member_and_sizes(tmp_path, saved, memory):
    parts = parts_of(saved)
    fx, so = parts.name(FX), parts.name(SO)
    size = parts.entry(fx)["size"]
    parts.entry(fx)["size"] = size + 5
    parts.entry(so)["hash"] = "0" * 32
    rep = archive_check.verify_archive(build(parts, tmp_path / "stale.tar"))
    assert not rep.ok and rep.provenance.verdict == "own"  # signed: the signature vouches for the bytes only
    assert [(f.member, f.kind) for f in rep.findings] == [(so, "refused"), (fx, "refused")]  # by name
    assert "content differs from the manifest's hash" in rep.findings[0].detail
    assert f"{size} bytes in the archive, the manifest lists {size + 5}" in rep.findings[1].detail
    r = invoke(app, ["cache", "verify", str(tmp_path / "stale.tar")])
    assert r.exit_code == 1 and "Traceback" not in r.output
    assert "the manifest lists" in r.stdout and "content differs from the manifest's hash" in r.stdout, r.stdout
    with pytest.raises(BadInput, match=f"is {size} bytes, the manifest says {size + 5}"):
        archive_load.load(tmp_path / "stale.tar", tmp_path / "dst")


def test_many_differing_members_are_capped_like_every_finding(tmp_path, saved, monkeypatch):
    monkeypatch.setattr(archive_check, "_SHOWN", 2)
    parts = parts_of(saved)
    for e in parts.manifest["entries"]:
        e["hash"] = "0" * 32
    rep = archive_check.verify_archive(build(parts, tmp_path / "stale.tar"))
    assert len(parts.manifest["entries"]) > 2 and len(rep.findings) == 2
    assert all(f.kind == "refused" and "content differs" in f.detail for f in rep.findings)


def test_a_duplicate_member_is_refused_by_both_naming_it(tmp_path, saved):
    """A tar may hold one name twice; `load` reads the archive once before writing anything and refuses
    it there (which copy counts is ambiguous), so it writes each member once: verify says the same."""
    parts = parts_of(saved)
    _dup(FX)(parts)
    archive = build(parts, tmp_path / "dup.tar")
    for run in (archive_check.verify_archive, lambda a: archive_load.load(a, tmp_path / "dst")):
        with pytest.raises(BadInput, match=f"member {parts.name(FX)} appears twice"):
            run(archive)
    r = invoke(app, ["cache", "verify", str(archive)])
    assert r.exit_code == 2 and "appears twice" in r.stderr and "Traceback" not in r.output


def test_verify_streams_large_members_and_extracts_nothing(tmp_path, saved, monkeypatch):
    """Streamed, a member reaches verify as a MemberStream read in bounded pieces (never `read()` whole),
    and its size and xxh3 are still those load compares; nothing is written anywhere."""
    monkeypatch.setattr(reader, "IN_MEMORY", 0)
    monkeypatch.setattr(picklescan, "READ_WHOLE", 0)
    calls = []
    real = reader.MemberStream.read

    def read(self, n=-1):
        calls.append(n)
        return real(self, n)

    monkeypatch.setattr(reader.MemberStream, "read", read)
    parts = parts_of(saved)
    parts.set_data(parts.name(PY), b"# " + b"y" * 300_000 + b"\n")
    parts.remanifest()
    archive = build(parts, tmp_path / "big.tar")
    before = sorted(p for p in tmp_path.rglob("*"))
    assert archive_check.verify_archive(archive).ok
    assert sorted(p for p in tmp_path.rglob("*")) == before
    assert calls and all(n is not None and 0 <= n <= 4 << 20 for n in calls), calls
    parts.entry(parts.name(PY))["hash"] = xxhash.xxh3_128_hexdigest(b"other")
    rep = archive_check.verify_archive(build(parts, tmp_path / "stale.tar"))
    assert [(f.member, f.kind) for f in rep.findings] == [(parts.name(PY), "refused")]


# --- the property, over random combinations ---------------------------------------------------------
_COMBINABLE = [c for c in CASES if c not in ("intact", "the tar cut inside a member")]


@pytest.mark.parametrize("seed", range(24))
def test_verify_agrees_with_load_on_random_combinations(tmp_path, saved, seed):
    rng = random.Random(seed)
    parts = parts_of(saved)
    picked = rng.sample(_COMBINABLE, rng.randint(2, 3))
    for case in picked:
        try:
            CASES[case][0](parts)
        except StopIteration:  # the member an earlier change removed
            pass
    if rng.random() < 0.25:
        parts.remanifest()
    if rng.random() < 0.15:
        parts.sign = False
    out = check(parts, tmp_path, f"s{seed}")
    if not out.load_ok:
        assert out.verify_says.strip() or out.refused_members, picked
