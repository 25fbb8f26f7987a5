"""Where the inductor cache lives, what its sub-caches are, and the one walk over its files.

The cache dir is torch's own answer (`torchinfo.inductor_cache_dir()`: TORCHINDUCTOR_CACHE_DIR, else
`/tmp/torchinductor_<user>`). Inside it, torch 2.11-2.13 writes (FACTS.md §3 and torch's codecache):

| sub-cache | path | what it holds |
|---|---|---|
| fxgraph | `fxgraph/<2>/<key>/<entry>` | pickled CompiledFxGraph (generated code + triton kernel bundle) |
| aotautograd | `aotautograd/<key>/<entry>` | pickled AOTAutograd results pointing at fxgraph keys |
| codegen | `<2 chars>/c<hash>.{py,cpp,so,...}` | generated Python / C++ and built kernels |
| triton | `triton/<device>/<key>/` | triton kernels (when TRITON_CACHE_DIR is unset) |
| cache | `cache/<system key>`, `cache/<name>` | system-keyed local caches (autotuning results) |
| dynamo | `dynamo/` | PGO code state and precompile packages |
| locks | `locks/*.lock` | torch's per-kernel file locks (empty files) |
| other | anything else | e.g. `gcc/`, `precompiled_headers/`, `unhashed_kernel_inputs/` |

Files whose name (or a parent folder's name) starts with "." are in flight: torch's `write_atomic`
writes `.<pid>.<tid>.tmp` then renames it, and triton writes into `tmp.pid_<pid>_<uuid>/` folders.
The walk skips both (and counts them), and skips compilewatch's own sidecar folder `.compilewatch/`.
"""

from __future__ import annotations

import functools
import os
import re
import stat as stat_mod
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, NamedTuple

from compilewatch.errors import BadInput

SIDECAR = ".compilewatch"  # compilewatch's folder inside a cache dir (stat index); never archived

SUBCACHES: dict[str, str] = {
    "fxgraph": "FX graph cache: pickled CompiledFxGraph entries (code + triton kernel bundle)",
    "aotautograd": "AOTAutograd cache: pickled forward/backward results that point at fxgraph keys",
    "codegen": "generated Python / C++ source and built kernels in two-character hash folders",
    "triton": "triton kernel cache (cubin/ptx/json per kernel) when TRITON_CACHE_DIR is unset",
    "cache": "system-keyed local caches (autotuning results), one JSON file per system key",
    "dynamo": "dynamo PGO code state and precompile packages",
    "locks": "torch's per-kernel file locks (empty files, safe to lose)",
    "other": "anything else torch or its extensions wrote here",
}
_NAMED = {"fxgraph", "aotautograd", "triton", "cache", "dynamo", "locks"}
_HASH_DIR = re.compile(r"^[a-z0-9]{2}$")
_TRITON_TMP = "tmp.pid_"


@dataclass(frozen=True, slots=True)
class SubCache:
    name: str
    path: Path
    exists: bool
    description: str


@dataclass(frozen=True, slots=True)
class CacheLocation:
    """Where the caches are. `path` is the inductor cache dir every `cache` command acts on."""

    path: Path
    source: str  # "TORCHINDUCTOR_CACHE_DIR", "default" or "argument"
    exists: bool
    looks_like_cache: bool  # False when the dir holds things torch does not write
    triton_dir: Path
    triton_source: str  # "TRITON_CACHE_DIR" or "inside the inductor dir"
    triton_inside: bool  # True when the triton cache is part of `path` (saved, cleared with it)
    subcaches: tuple[SubCache, ...]
    lock_file: Path
    siblings: tuple[str, ...]  # backups, quarantines, pruned entries and load temp dirs beside the cache


class FileStat(NamedTuple):
    """One file of a cache, relative to its root (POSIX separators). A NamedTuple, not a dataclass:
    a walk makes one per file and tuple construction is several times cheaper."""

    rel: str
    size: int
    mtime_ns: int
    ino: int
    atime_ns: int


@dataclass(frozen=True, slots=True)
class Walk:
    files: tuple[FileStat, ...]
    in_flight: tuple[str, ...]  # temp files / folders of writers in progress (skipped)
    warnings: tuple[str, ...]  # unreadable folders, special files


def subcache_of(rel: str) -> str:
    """The sub-cache a relative path belongs to (see the table in the module docstring)."""
    head, sep, _ = rel.partition("/")
    return _subcache_of_head(head, bool(sep))


@functools.lru_cache(maxsize=4096)
def _subcache_of_head(head: str, nested: bool) -> str:
    if head in _NAMED:
        return head
    if nested and _HASH_DIR.match(head):
        return "codegen"
    return "other"


def entry_of(rel: str) -> tuple[str, str]:
    """(sub-cache, entry) for a relative file path: the unit that ls / prune / verify --fix handle.

    An entry is what torch treats as one thing: an fxgraph or aotautograd key folder, a triton kernel
    folder, the files of one generated module (`ab/cab12.py`, `.cpp`, `.so` share stem `ab/cab12`).
    """
    sub = subcache_of(rel)
    parts = rel.split("/")
    if sub == "fxgraph" and len(parts) >= 4:
        return sub, "/".join(parts[:3])
    if sub == "aotautograd" and len(parts) >= 3:
        return sub, "/".join(parts[:2])
    if sub == "triton" and len(parts) >= 4:
        return sub, "/".join(parts[:3])
    if sub == "codegen":
        return sub, parts[0] + "/" + parts[-1].split(".", 1)[0] if len(parts) == 2 else "/".join(parts[:2])
    if sub == "locks":
        return sub, "locks"
    if sub in ("cache", "dynamo"):
        return sub, "/".join(parts[:2])
    return sub, "/".join(parts[:2])


def walk(root: str | os.PathLike[str]) -> Walk:
    """Every regular file under `root`, with its stat, skipping in-flight temp files and the sidecar.

    Symlinks are reported as warnings and not followed (torch never writes them). Folders are told
    apart by scandir's d_type, so only files cost a stat call.
    """
    files: list[FileStat] = []
    in_flight: list[str] = []
    warnings: list[str] = []
    add = files.append
    is_reg = stat_mod.S_ISREG
    stack = [(os.fspath(root), "")]
    while stack:
        path, prefix = stack.pop()
        try:
            it = os.scandir(path)
        except OSError as e:
            warnings.append(f"cannot read {prefix or '.'}: {e.strerror}")
            continue
        with it:
            for e in it:
                name = e.name
                if name[0] == "." or name.startswith(_TRITON_TMP):
                    if prefix or name != SIDECAR:
                        in_flight.append(prefix + name)
                    continue
                try:
                    if e.is_dir(follow_symlinks=False):
                        stack.append((e.path, prefix + name + "/"))
                        continue
                    st = e.stat(follow_symlinks=False)
                except OSError as err:
                    warnings.append(f"cannot stat {prefix + name}: {err.strerror}")
                    continue
                if is_reg(st.st_mode):
                    add(FileStat(prefix + name, st.st_size, st.st_mtime_ns, st.st_ino, st.st_atime_ns))
                else:
                    warnings.append(f"skipped {prefix + name}: not a regular file")
    files.sort(key=lambda f: f.rel)
    return Walk(tuple(files), tuple(sorted(in_flight)), tuple(warnings))


_CODE_FILE = re.compile(r"^c([a-z0-9]{2})[a-z0-9]{40,}(\.[A-Za-z0-9_.]+)?$")  # c<base32 key>[.main].py/.cpp/.so
# triton autotuning's local cache, beside the kernel's c<hash>.py: sha256(cache key + torch key).best_config
# (torch/_inductor/runtime/autotune_cache.py; CUDA caches only, so no CPU cache shows it)
_AUTOTUNE_FILE = re.compile(r"^[0-9a-f]{64}\.best_config$")
_FX_KEY_DIR = re.compile(r"^f[a-z0-9]{40,}$")
_AOT_KEY_DIR = re.compile(r"^a[a-z0-9]{40,}$")
_TRITON_KERNEL_DIR = re.compile(r"^[A-Z2-7]{52}$")  # triton's base32 kernel hash
_SYSTEM_KEY_FILE = re.compile(r"^[0-9a-f]{64}$")  # cache/<system key>: sha256 hex of CacheBase.get_system()
_OTHER_TORCH_DIRS = {"gcc", "precompiled_headers", "unhashed_kernel_inputs", "aot_inductor", "kernel", "cache"}


def _listdir(path: str | os.PathLike[str], limit: int = 64) -> list[str]:
    try:
        with os.scandir(path) as it:
            out = []
            for e in it:
                out.append(e.name)
                if len(out) >= limit:
                    break
            return out
    except OSError:
        return []


def _is_dir(path: str) -> bool:
    return os.path.isdir(path) and not os.path.islink(path)


def cache_evidence(path: str | os.PathLike[str]) -> tuple[str, ...]:
    """What in `path` is shaped like inductor's own output (empty: nothing is).

    Folder names alone prove nothing (`db/`, `go/`, `cache/` are common names). Evidence is structure:
    `fxgraph/<2>/f<key>/`, `aotautograd/a<key>/`, `triton/<device>/<KERNEL HASH>/` (or kernel folders
    at the top of a TRITON_CACHE_DIR), `cache/<64 hex digits>` (the local cache of one system key),
    or a two-character folder holding a generated file named
    `c<those two characters><hash>.<ext>` (torch names code files after their hash).
    """
    root = os.fspath(path)
    found: list[str] = []
    names = [n for n in _listdir(root, limit=4096) if n != SIDECAR]
    for n in names:
        full = os.path.join(root, n)
        if not _is_dir(full):
            continue
        if n == "fxgraph":
            if any(_FX_KEY_DIR.match(k) for d in _listdir(full) if _HASH_DIR.match(d)
                   for k in _listdir(os.path.join(full, d))):
                found.append("fxgraph/<2>/f<key>/")
        elif n == "aotautograd":
            if any(_AOT_KEY_DIR.match(k) for k in _listdir(full)):
                found.append("aotautograd/a<key>/")
        elif n == "cache":
            if any(_SYSTEM_KEY_FILE.match(k) for k in _listdir(full)):
                found.append("cache/<system key>")
        elif n == "triton":
            if any(_TRITON_KERNEL_DIR.match(k) for d in _listdir(full) for k in _listdir(os.path.join(full, d))):
                found.append("triton/<device>/<kernel>/")
        elif n == "precompiled_headers":  # inductor's C++ headers (CPU), named after their hash like code files
            if any(_CODE_FILE.match(f) for f in _listdir(full)):
                found.append("precompiled_headers/c<hash>.h")
        elif _TRITON_KERNEL_DIR.match(n):
            found.append("triton kernel folders")
        elif _HASH_DIR.match(n):
            if any((m := _CODE_FILE.match(f)) and m.group(1) == n for f in _listdir(full)):
                found.append("generated code in <2>/c<hash>.*")
    return tuple(dict.fromkeys(found))


def unknown_entries(path: str | os.PathLike[str]) -> tuple[str, ...]:
    """Top-level names torch does not write (files, folders that are none of the sub-caches)."""
    root = os.fspath(path)
    out = []
    for n in _listdir(root, limit=4096):
        if n == SIDECAR or n.startswith(".") or n.startswith(_TRITON_TMP):
            continue
        full = os.path.join(root, n)
        if not _is_dir(full):
            out.append(n)
        elif not (n in _NAMED or n in _OTHER_TORCH_DIRS or _TRITON_KERNEL_DIR.match(n)
                  or (_HASH_DIR.match(n) and all(_CODE_FILE.match(f) or _AUTOTUNE_FILE.match(f)
                                                 for f in _listdir(full)))):
            out.append(n + "/")
    return tuple(sorted(out))


def looks_like_cache(path: str | os.PathLike[str]) -> bool:
    """True for an empty dir (nothing to lose) or one with inductor's structure (`cache_evidence`)
    and fewer top-level things torch does not write than things it does.

    Used to refuse acting on a dir that is something else (a repo, a home folder, a database).
    """
    names = [n for n in _listdir(path, limit=4096) if n != SIDECAR]
    if not names:
        return os.path.isdir(path)
    if not cache_evidence(path):
        return False
    return len(unknown_entries(path)) * 2 < len(names)


def lock_file_for(path: Path) -> Path:
    """The lock file beside the cache dir (beside, so it survives the dir being swapped or moved)."""
    return path.parent / f".{path.name}.compilewatch.lock"


def default_root(env: Mapping[str, str] | None = None) -> tuple[Path, str]:
    """The inductor cache dir torch uses, and its source: "TORCHINDUCTOR_CACHE_DIR" when that
    variable is set in `env`, else "default". `env` defaults to os.environ; `compilewatch doctor`
    passes the variables as they were before torch ran (torch sets TORCHINDUCTOR_CACHE_DIR itself
    when it first resolves the dir, which would make a default look chosen)."""
    from compilewatch import torchinfo

    env = os.environ if env is None else env
    return torchinfo.inductor_cache_dir(), "TORCHINDUCTOR_CACHE_DIR" if env.get("TORCHINDUCTOR_CACHE_DIR") else "default"


def locate(path: str | os.PathLike[str] | None = None) -> CacheLocation:
    """Where the inductor and triton caches are and which sub-caches exist.

    `path=None` asks torch (TORCHINDUCTOR_CACHE_DIR or its default: `default_root`); a given path is
    used as is.
    """
    if path is None:
        root, source = default_root()
    else:
        root = Path(path)
        source = "argument"
    root = Path(os.path.abspath(os.path.expanduser(root)))
    env_triton = os.environ.get("TRITON_CACHE_DIR")
    if env_triton:
        triton_dir, triton_source = Path(os.path.abspath(env_triton)), "TRITON_CACHE_DIR"
    else:
        triton_dir, triton_source = root / "triton", "inside the inductor dir"
    triton_inside = triton_dir == root / "triton" or root in triton_dir.parents
    subs = []
    for name, desc in SUBCACHES.items():
        if name == "codegen":
            exists = root.is_dir() and any(_HASH_DIR.match(n) for n in _safe_listdir(root))
            sub_path = root
        elif name == "other":
            continue
        elif name == "triton":
            sub_path, exists = triton_dir, triton_dir.is_dir()
        else:
            sub_path = root / name
            exists = sub_path.is_dir()
        subs.append(SubCache(name, sub_path, exists, desc))
    exists = root.is_dir()
    return CacheLocation(
        path=root, source=source, exists=exists, looks_like_cache=exists and looks_like_cache(root),
        triton_dir=triton_dir, triton_source=triton_source, triton_inside=triton_inside,
        subcaches=tuple(subs), lock_file=lock_file_for(root), siblings=siblings_of(root),
    )


SIBLING_LABELS = ("backup", "quarantine", "pruned", "deleting")


def siblings_of(root: Path) -> tuple[str, ...]:
    """What compilewatch left beside the cache dir: `<name>.backup-*` (clear, load), `.quarantine-*`
    (verify --fix), `.pruned-*` (prune), and `.<name>.load-*` temp dirs of a load that was killed."""
    prefixes = tuple(f"{root.name}.{label}-" for label in SIBLING_LABELS) + (f".{root.name}.load-",)
    return tuple(sorted(str(root.parent / n) for n in _safe_listdir(root.parent) if n.startswith(prefixes)))


def _safe_listdir(path: Path) -> list[str]:
    try:
        return os.listdir(path)
    except OSError:
        return []


def resolve_existing(path: str | os.PathLike[str] | None, *, force: bool = False) -> CacheLocation:
    """`locate(path)`, raising BadInput unless it is an existing dir that looks like an inductor cache
    (`force` skips that last check, for caches this module does not recognise)."""
    loc = locate(path)
    if not loc.exists:
        if loc.path.exists():
            raise BadInput(f"{loc.path} is not a directory", hint="pass the inductor cache dir (see `compilewatch cache where`)")
        raise BadInput(
            f"cache dir {loc.path} does not exist ({loc.source})",
            hint="compile something first, or point --dir / TORCHINDUCTOR_CACHE_DIR at an existing cache",
        )
    if not loc.looks_like_cache and not force:
        raise not_a_cache(loc.path)
    return loc


def not_a_cache(path: Path) -> BadInput:
    """The BadInput for a dir without inductor's structure, naming what is there."""
    unknown = unknown_entries(path)
    shown = ", ".join(unknown[:6]) + (f" and {len(unknown) - 6} more" if len(unknown) > 6 else "")
    what = (f"it holds {shown}, which torch does not write" if unknown and cache_evidence(path)
            else "no fxgraph/<2>/f<key>/, aotautograd/a<key>/, triton kernels or generated c<hash> files")
    return BadInput(f"{path} does not look like an inductor cache ({what})",
                    hint="pass the inductor cache dir (see `compilewatch cache where`), or --force if it really "
                         "is one; nothing was changed")


def timestamped_sibling(path: Path, label: str) -> Path:
    """A new, unused path beside `path`: `<name>.<label>-<YYYYmmdd-HHMMSS>[-N]` (same filesystem, so
    moving there is a rename)."""
    import time

    stamp = time.strftime("%Y%m%d-%H%M%S")
    candidate = path.parent / f"{path.name}.{label}-{stamp}"
    n = 1
    while candidate.exists() or candidate.is_symlink():
        candidate = path.parent / f"{path.name}.{label}-{stamp}-{n}"
        n += 1
    return candidate


def move_aside(root: Path, rels: "list[str] | tuple[str, ...]", dest_root: Path) -> list[tuple[str, str]]:
    """Move files or folders `rels` (relative to `root`) to the same relative paths under `dest_root`.

    Renames only (never copies, never deletes); returns (rel, destination) for each one moved. Paths
    that vanished meanwhile are skipped. Emptied parent folders inside `root` are left in place.
    """
    moved = []
    for rel in rels:
        src = root / rel
        if not (src.exists() or src.is_symlink()):
            continue
        dst = dest_root / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        os.rename(src, dst)
        moved.append((rel, str(dst)))
    return moved
