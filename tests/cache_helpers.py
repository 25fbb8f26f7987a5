"""Synthetic inductor caches for the cache tests: the layout torch writes, with controllable stamps.

Entries are built the way torch lays them out (compilewatch/cache/layout.py): fxgraph/aotautograd
pickles that carry the `system_info[hash]` / `torch_version` key lines torch stores, generated
modules in two-character folders (.py that compiles, .so with a valid ELF header), triton kernel
folders with a group file, and empty lock files.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import random
import tarfile
from pathlib import Path

from compilewatch import torchinfo
from compilewatch.cache.content import stamps

OTHER_KEY = "f" * 64


def elf_bytes(extra: int = 64) -> bytes:
    """A minimal 64-bit little-endian ELF: header (64 B) + one section header right after it."""
    head = bytearray(64)
    head[0:4] = b"\x7fELF"
    head[4], head[5], head[6] = 2, 1, 1
    head[0x28:0x30] = (64).to_bytes(8, "little")  # e_shoff
    head[0x3A:0x3C] = (64).to_bytes(2, "little")  # e_shentsize
    head[0x3C:0x3E] = (1).to_bytes(2, "little")  # e_shnum
    return bytes(head) + bytes(extra)


def entry_pickle(system_key: str | None, torch_hash: str | None = None, pad: int = 0) -> bytes:
    lines = [f"[abc] system_info[hash]: {system_key}"] if system_key else []
    if torch_hash:
        lines.append(f"[{torch_hash}] torch_version: \x00\x01")
    return pickle.dumps({"_fx_graph_cache_debug_lines": lines, "pad": b"x" * pad}, protocol=4)


def write(root: Path, rel: str, data: bytes | str, mtime: float | None = None) -> Path:
    p = root / rel
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_bytes(data.encode() if isinstance(data, str) else data)
    if mtime is not None:
        os.utime(p, (mtime, mtime))
    return p


def make_cache(root: Path, *, n_fx: int = 3, n_codegen: int = 4, system_key: str | None = None,
               torch_hash: str | None = None, triton: bool = True, mtime: float | None = 1_700_000_000.0) -> Path:
    """A small synthetic cache at `root`; entries are stamped with `system_key` (default: this machine's)."""
    key = system_key or torchinfo.system_key()
    th = torch_hash or stamps.current_torch_hash()
    root.mkdir(parents=True, exist_ok=True)
    for i in range(n_fx):
        fx_key = f"f{i:02d}" + "a" * 49
        write(root, f"fxgraph/{fx_key[1:3]}/{fx_key}/entry{i}", entry_pickle(key, th, pad=100 * i), mtime)
        write(root, f"aotautograd/a{i:02d}{'b' * 49}/entry{i}", entry_pickle(key, th), mtime)
    for i in range(n_codegen):
        stem = f"c{i:02d}{'x' * 49}"
        write(root, f"{stem[1:3]}/{stem}.py", f"def call(args):\n    return {i}\n", mtime)
        write(root, f"{stem[1:3]}/{stem}.cpp", f"// kernel {i}\n", mtime)
        write(root, f"{stem[1:3]}/{stem}.so", elf_bytes(64 + i), mtime)
        write(root, f"locks/{stem}.lock", b"", mtime)
    if triton:
        kdir = "triton/0/KERNELAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA"
        write(root, f"{kdir}/triton_poi_0.cubin", elf_bytes(), mtime)
        write(root, f"{kdir}/triton_poi_0.json", json.dumps({"name": "triton_poi_0", "target": {"backend": "cuda", "arch": 90}}), mtime)
        group = {"child_paths": {n: str(root / kdir / n) for n in ("triton_poi_0.cubin", "triton_poi_0.json")}}
        write(root, f"{kdir}/__grp__triton_poi_0.json", json.dumps(group), mtime)
    return root


def noise(n: int, seed: int = 0) -> bytes:
    """`n` bytes that look random but are the same on every run (tests never depend on os.urandom)."""
    return random.Random(seed).randbytes(n)


def big_cache(root: Path, n_files: int, size: int = 512) -> Path:
    """Many small files spread over codegen folders and fxgraph keys (a 'large' cache for tests)."""
    key = torchinfo.system_key()
    for i in range(n_files):
        if i % 4 == 0:
            k = f"f{i:06d}" + "q" * 45
            write(root, f"fxgraph/{k[1:3]}/{k}/e", entry_pickle(key, pad=size))
        else:
            d = f"{i % 89:02d}"  # torch names code files c<key>, in the folder of the key's 2nd-3rd chars
            # C++ source starts "//": never a pickle's PROTO byte (0x80), which random bytes were 1 time in 256
            write(root, f"{d}/c{d}{i:07d}{'x' * 43}.cpp", (b"//" + noise(6, seed=i)) * (size // 8))
    return root


def tree(root: Path) -> dict[str, bytes]:
    """Every file under root (relative path -> bytes), for before/after comparisons; compilewatch's
    own stat-index sidecar is left out."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and ".compilewatch" not in p.relative_to(root).parts}


def moved(t: dict[str, bytes], old: Path, new: Path) -> dict[str, bytes]:
    """`tree()` of a cache as it should look after moving from `old` to `new`: triton's .json files
    name their kernel folder by absolute path (compilewatch.cache.local.relocate rewrites it)."""
    return {rel: data.replace(str(old).encode(), str(new).encode()) if rel.startswith("triton/") and rel.endswith(".json")
            else data for rel, data in t.items()}


def tar_members(path: Path) -> list[tuple[str, bytes]]:
    """Every member of the tar at `path` (name, bytes), in order."""
    with tarfile.open(path) as t:
        return [(m.name, t.extractfile(m).read()) for m in t.getmembers()]


def write_tar(path: Path, members) -> Path:
    """A tar of `members` (name, bytes), in order, PAX format like compilewatch's; gzip for *.gz."""
    with tarfile.open(path, "w:gz" if str(path).endswith(".gz") else "w", format=tarfile.PAX_FORMAT) as t:
        for name, data in members:
            ti = tarfile.TarInfo(name)
            ti.size = len(data)
            t.addfile(ti, io.BytesIO(data))
    return path


def signed_tar(path: Path, members) -> Path:
    """`write_tar` of `members` (an old signature.json left out), signed by this machine's key as
    `cache save` would sign them: how a test crafts an archive this machine calls its own."""
    from compilewatch.cache.trust import provenance

    members = [(n, d) for n, d in members if n != provenance.SIGNATURE]
    rec = provenance.Recorder()
    for name, data in members:
        rec.add_bytes(name, data)
    return write_tar(path, [*members, (provenance.SIGNATURE, rec.signature_member())])
