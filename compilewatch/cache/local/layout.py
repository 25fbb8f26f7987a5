"""Where the inductor cache lives, what its sub-caches are, and the one walk over its files.

The cache dir is torch's own answer (`torchinfo.inductor_cache_dir()`: TORCHINDUCTOR_CACHE_DIR, else
`/tmp/torchinductor_<user>`). `KINDS` names every sub-cache torch 2.11, 2.13 and 2.15 write there (read
from each version's source: `_inductor/codecache.py`, `runtime/cache_dir_utils.py`,
`runtime/autotune_cache.py`, `runtime/caching/`, `_dynamo/pgo.py`, `_dynamo/package.py`,
`_functorch/_aot_autograd/autograd_cache.py`, `cpp_builder.py`, `codegen/cutlass/`, ...): where it is,
what it holds, what it is tied to (the system key, the device, the host compiler), which versions write
it. docs/cache.md has the same table. `subcache_of` puts every file of a walk in one of them; "other" is
only for what no supported torch writes.

Two sub-caches are not always inside the cache dir: `triton/` moves to TRITON_CACHE_DIR when that is set,
and `precompiled_headers/` is always under torch's *default* dir (`codecache._HEADER_DIR` is
`default_cache_dir()/precompiled_headers`, by design: "these headers need to be global"), so with
TORCHINDUCTOR_CACHE_DIR set it is elsewhere and save / clear / prune of the cache dir never see it.
`locate` says where each one is and whether it is inside.

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

from compilewatch.cache.local.lock import lock_file_for
from compilewatch.errors import BadInput

SIDECAR = ".compilewatch"  # compilewatch's folder inside a cache dir (stat index); never archived


@dataclass(frozen=True, slots=True)
class SubCacheKind:
    """One sub-cache torch writes (a row of docs/cache.md's table)."""

    name: str
    where: str  # its path inside the cache dir
    holds: str
    tied_to: str  # what decides whether its entries are reusable on another machine / device
    torch: str  # the supported torch versions that write it
    when: str  # when torch writes it


_EVERY = "2.11, 2.13, 2.15"


KINDS: tuple[SubCacheKind, ...] = (
    SubCacheKind("fxgraph", "fxgraph/<2>/f<key>/<entry>",
                 "FX graph cache: pickled CompiledFxGraph entries (code + triton kernel bundle)",
                 "the system key (GPU name, CUDA, triton) and torch build, both in the key; the device "
                 "index through the inputs' metadata", _EVERY, "every inductor compile"),
    SubCacheKind("aotautograd", "aotautograd/a<key>/<entry>",
                 "AOTAutograd cache: pickled forward/backward results that point at fxgraph keys",
                 "the torch build; the system key through the fxgraph entries it names", _EVERY,
                 "every inductor compile through AOTAutograd"),
    SubCacheKind("codegen", "<2>/c<hash>.{py,cpp,so,...}, <2>/<sha256>.best_config",
                 "generated Python / C++ source, kernels built from it, and triton autotuning results",
                 "the code's own hash (rebuilt when missing); .so files to the host compiler and CPU; "
                 ".best_config to the GPU", _EVERY, "every inductor compile; .best_config on CUDA"),
    SubCacheKind("triton", "triton/<device index>/<KERNEL HASH>/",
                 "triton kernel cache (cubin/ptx/json per kernel) when TRITON_CACHE_DIR is unset",
                 "the device index (the folder) and the GPU arch + triton version (the hash)", _EVERY,
                 "compiles of triton kernels (GPU)"),
    SubCacheKind("cache", "cache/<system key>, cache/<name>",
                 "local caches: autotuning results per system key (JSON); named on-disk caches",
                 "the system key (the file name); named caches are under torch's default dir", _EVERY,
                 "autotuning (max-autotune, GPU)"),
    SubCacheKind("dynamo", "dynamo/code_state_<key>.pkl, dynamo/<package>",
                 "PGO code state (which dims went dynamic) and precompile packages",
                 "the torch version and the code's source; not the device", _EVERY,
                 "automatic dynamic shapes (PGO) and torch.compiler precompile"),
    SubCacheKind("locks", "locks/<key>.lock",
                 "torch's per-kernel file locks (empty files, safe to lose)", "nothing", _EVERY,
                 "every C++ / kernel build"),
    SubCacheKind("precompiled_headers", "precompiled_headers/c<hash>.h{,.gch}, precompiled_headers/locks/",
                 "precompiled C++ headers for CPU kernels (cpp_prefix.h; 150 MB and more each)",
                 "the host compiler, its version and flags (in the hash); not the system key or device; "
                 "always under torch's default dir, not TORCHINDUCTOR_CACHE_DIR", _EVERY,
                 "the first CPU C++ compile (config.cpp_cache_precompile_headers, on by default)"),
    SubCacheKind("memoizer", "memoizer_cache.json, memoizer_cache.lock",
                 "the dump of inductor's persistent memoizer (runtime/caching)",
                 "the memoized function's parameters (in each key)", _EVERY, "when a persistent memoizer dumps"),
    SubCacheKind("gcc", "gcc/", "a C++ compiler torch installed with conda (old systems without one)",
                 "the host", _EVERY, "only when no usable C++ compiler was found"),
    SubCacheKind("aoti_eager", "aoti_eager/<namespace>/<device>/",
                 "AOTInductor kernels for eager ops", "the device type (the folder)", _EVERY,
                 "only with AOTI eager mode"),
    SubCacheKind("autoheuristic", "autoheuristic/<GPU name>/",
                 "data collected to train inductor's autoheuristics", "the GPU name (the folder)", _EVERY,
                 "only when collecting (TORCHINDUCTOR_AUTOHEURISTIC_COLLECT)"),
    SubCacheKind("cutlass", "torch_cutlass/, configs_<key>.json",
                 "CUTLASS sources and the generated op configs", "the GPU arch and CUDA version (the key)",
                 _EVERY, "only with the CUTLASS backend (CUDA)"),
    SubCacheKind("halide", "halide-runtime-<target>-<hash>/", "the Halide backend's standalone runtime",
                 "the Halide target (host / host-cuda) and config", _EVERY, "only with the Halide backend"),
    SubCacheKind("debug", "bisect/, unhashed_kernel_inputs/",
                 "the compiler bisector's state; kernel inputs dumped for debugging",
                 "the run that wrote them", _EVERY, "only under the bisector or the kernel-input dump option"),
    SubCacheKind("cutedsl", "cutedsl_compile_cache/", "CuTe DSL compiled objects (<hash>.o)",
                 "the GPU arch (in the hash)", "2.13, 2.15", "only with CuTe DSL kernels (CUDA)"),
    SubCacheKind("quack", "quack/", "QuACK (flex GEMM) kernel cache", "the GPU arch", "2.13, 2.15",
                 "only with flex GEMM kernels (CUDA)"),
    SubCacheKind("flydsl", "flydsl_compile_cache/", "FlyDSL compiled kernels", "the GPU arch", "2.15",
                 "only with FlyDSL kernels (ROCm)"),
    SubCacheKind("temp", "tmp*/, tmp*.py, inductor_const_spill_<pid>_<id>",
                 "temporary files: fresh-cache dirs, autotuning code dumps, spilled constants",
                 "the process that wrote them (torch removes spills itself)", _EVERY,
                 "force_disable_caches, debug output logging; constant spilling (2.15)"),
    SubCacheKind("other", "anything else", "what no supported torch writes (another tool, or a newer torch)",
                 "unknown", "-", "-"),
)


SUBCACHES: dict[str, str] = {k.name: k.holds for k in KINDS}  # name -> what it holds


KIND_BY_NAME: dict[str, SubCacheKind] = {k.name: k for k in KINDS}


# the top-level names of each sub-cache (exact folder or file names, then name prefixes)
_NAMED = {"fxgraph", "aotautograd", "triton", "cache", "dynamo", "locks", "precompiled_headers", "gcc",
          "aoti_eager", "autoheuristic"}


_NAMED_AS = {"torch_cutlass": "cutlass", "bisect": "debug", "unhashed_kernel_inputs": "debug",
             "cutedsl_compile_cache": "cutedsl", "quack": "quack", "flydsl_compile_cache": "flydsl",
             "memoizer_cache.json": "memoizer", "memoizer_cache.lock": "memoizer"}


_PREFIXES = (("halide-runtime-", "halide"), ("inductor_const_spill_", "temp"), ("configs_", "cutlass"),
             ("tmp", "temp"))


_HASH_DIR = re.compile(r"^[a-z0-9]{2}$")


_TRITON_TMP = "tmp.pid_"


@dataclass(frozen=True, slots=True)
class SubCache:
    name: str
    path: Path
    exists: bool
    description: str
    inside: bool = True  # in the cache dir: saved, loaded, pruned and cleared with it
    tied_to: str = ""  # what decides whether its entries are reusable (SubCacheKind.tied_to)


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
    if head in _NAMED_AS:
        return _NAMED_AS[head]
    if nested and _HASH_DIR.match(head):
        return "codegen"
    for prefix, name in _PREFIXES:
        if head.startswith(prefix) and (name != "cutlass" or not nested and head.endswith(".json")):
            return name
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
    if sub == "precompiled_headers" and len(parts) == 2:  # c<hash>.h and its c<hash>.h.gch: one header
        return sub, parts[0] + "/" + parts[1].split(".", 1)[0]
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


_OTHER_TORCH_DIRS = {"aot_inductor", "kernel"}  # names torch's own tools use (kept: not a sign of a foreign dir)


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
            if _subcache_of_head(n, False) == "other":
                out.append(n)
        elif not (_subcache_of_head(n, True) not in ("other", "codegen") or n in _OTHER_TORCH_DIRS
                  or _TRITON_KERNEL_DIR.match(n)
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


def header_dir() -> Path:
    """Where torch keeps precompiled C++ headers: `<torch's default cache dir>/precompiled_headers`,
    whatever TORCHINDUCTOR_CACHE_DIR says (torch's `codecache._HEADER_DIR`, torch 2.11-2.15)."""
    from compilewatch import torchinfo

    return Path(torchinfo.default_cache_dir()) / "precompiled_headers"


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
    from compilewatch.cache.local import swap

    swap.recover(root)  # a load killed between its two renames: completed or rolled back first
    env_triton = os.environ.get("TRITON_CACHE_DIR")
    if env_triton:
        triton_dir, triton_source = Path(os.path.abspath(env_triton)), "TRITON_CACHE_DIR"
    else:
        triton_dir, triton_source = root / "triton", "inside the inductor dir"
    triton_inside = triton_dir == root / "triton" or root in triton_dir.parents
    subs = []
    names = _safe_listdir(root) if root.is_dir() else []
    for kind in KINDS:
        name, desc, inside = kind.name, kind.holds, True
        if name == "codegen":
            exists = any(_HASH_DIR.match(n) and _is_dir(str(root / n)) for n in names)
            sub_path = root
        elif name == "other":
            continue
        elif name == "triton":
            sub_path, exists, inside = triton_dir, triton_dir.is_dir(), triton_inside
        elif name == "precompiled_headers":
            sub_path = header_dir()
            exists, inside = sub_path.is_dir(), sub_path.parent == root
        elif name in _NAMED:
            sub_path = root / name
            exists = sub_path.is_dir()
        else:  # named by several folder / file names or prefixes: the first one present, else the cache dir
            present = sorted(n for n in names if _subcache_of_head(n, _is_dir(str(root / n))) == name)
            sub_path = root / present[0] if len(present) == 1 else root
            exists = bool(present)
        subs.append(SubCache(name, sub_path, exists, desc, inside, kind.tied_to))
    exists = root.is_dir()
    return CacheLocation(
        path=root, source=source, exists=exists, looks_like_cache=exists and looks_like_cache(root),
        triton_dir=triton_dir, triton_source=triton_source, triton_inside=triton_inside,
        subcaches=tuple(subs), lock_file=lock_file_for(root), siblings=siblings_of(root),
    )


@dataclass(frozen=True, slots=True)
class Elsewhere:
    """A sub-cache of this cache that lives outside its dir (not saved, pruned or cleared with it)."""

    name: str
    path: str
    files: int
    bytes: int


def elsewhere(loc: CacheLocation) -> tuple[Elsewhere, ...]:
    """The existing sub-caches of `loc` outside its dir, each with its size (one walk of each)."""
    out = []
    for s in loc.subcaches:
        if s.exists and not s.inside:
            w = walk(s.path)
            out.append(Elsewhere(s.name, str(s.path), len(w.files), sum(f.size for f in w.files)))
    return tuple(out)


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


def resolve_existing(path: str | os.PathLike[str] | None, *, force: bool = False,
                     can_force: bool = False) -> CacheLocation:
    """`locate(path)`, raising BadInput unless it is an existing dir that looks like an inductor cache
    (`force` skips that last check, for caches this module does not recognise; `can_force`: the
    command has a --force, so the hint may name it)."""
    loc = locate(path)
    if not loc.exists:
        if loc.path.exists():
            raise BadInput(f"{loc.path} is not a directory", hint="pass the inductor cache dir (see `compilewatch cache where`)")
        raise BadInput(
            f"cache dir {loc.path} does not exist ({loc.source})",
            hint="compile something first, or point --dir / TORCHINDUCTOR_CACHE_DIR at an existing cache",
        )
    if not loc.looks_like_cache and not force:
        raise not_a_cache(loc.path, can_force=can_force)
    return loc


def refuse_inside(root: Path, path: str | os.PathLike[str], what: str) -> None:
    """BadInput when `path` (a file a command is about to write: an archive, a fingerprint) is the cache dir
    `root` or inside it (links resolved): it would change the very content it describes."""
    real_root, real = Path(os.path.realpath(root)), Path(os.path.realpath(path))
    if real == real_root or real_root in real.parents:
        raise BadInput(f"the {what} {path} would be written inside the cache it describes ({root})",
                       hint="write it somewhere outside the cache dir; nothing was written")


def refuse_symlink(path: Path, verb: str) -> None:
    """BadInput when the cache dir `path` is a symlink: `clear` and `load` rename the dir, and renaming a
    link moves only the link (the cache stays where it points, and the "backup" is a link that `cache
    load` refuses as writable by everyone; `--no-backup` could not delete it)."""
    if not path.is_symlink():
        return
    import shlex

    real = os.path.realpath(path)
    raise BadInput(f"{path} is a symlink to {real}: {verb} renames the cache dir, and renaming the link would "
                   "move only the link; nothing was changed",
                   hint=f"give the dir itself: --dir {shlex.quote(real)}" + (
                       f", then `mkdir {shlex.quote(real)}` (torch cannot create a dir through a dangling link)"
                       if verb == "clear" else ""))


def not_a_cache(path: Path, *, can_force: bool = False) -> BadInput:
    """The BadInput for a dir without inductor's structure, naming what is there; the hint names
    --force only for a command that has it (`can_force`)."""
    unknown = unknown_entries(path)
    shown = ", ".join(unknown[:6]) + (f" and {len(unknown) - 6} more" if len(unknown) > 6 else "")
    what = (f"it holds {shown}, which torch does not write" if unknown and cache_evidence(path)
            else "no fxgraph/<2>/f<key>/, aotautograd/a<key>/, triton kernels or generated c<hash> files")
    return BadInput(f"{path} does not look like an inductor cache ({what})",
                    hint="pass the inductor cache dir (see `compilewatch cache where`)"
                         + (", or --force if it really is one" if can_force else "") + "; nothing was changed")


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
