"""The inductor system key, read from torch's and triton's files without importing either.

Every inductor cache entry is keyed on `CacheBase.get_system()["hash"]` (torch/_inductor/codecache.py).
Asking torch costs `import torch`, CUDA initialisation and triton's import: 3-10 s, which made
`compilewatch lock` slow. The key is a sha256 over a small JSON document:

    torch 2.11-2.13:  no CUDA device -> sha256("{}")
                      a device       -> sha256(json.dumps({"device": {"name": GPU name},
                                                          "version": {"cuda": torch.version.cuda,
                                                                      "triton": triton key}}, sort_keys=True))
    torch 2.15:       no CUDA device -> sha256(json.dumps({"version": {"triton": triton key}}))
                      a device       -> as above (plus "device_interfaces", which no built-in fills)

The inputs come from files: `torch/version.py` (CUDA version, hip), NVML (GPU names, MIG mode, the
driver's CUDA version), and triton's own `triton_key()` recomputed from triton's files (the same
walk and hashes, without importing triton; its 0.5 GB library hash is memoised per stat).

The fast path answers only when it is sure; otherwise `key()` falls back to torch's function and
says why (`SystemKey.method` / `.reason`). It is sure when:
- the code that computes the key is code we have read: the text of `CacheBase.get_system` (and of
  what it calls) and of triton's `triton_key` hash to a variant in KNOWN_* below; a torch or triton
  release that changes them falls back until its variant is added (and tested equal);
- the GPU torch would pick as `current_device()` is unambiguous: every visible GPU has one name,
  no MIG, CUDA_VISIBLE_DEVICES unset or starting with a valid index or GPU UUID, a driver whose
  CUDA version is at least torch's;
- nothing registers extra device backends (the `torch.backends` entry point group).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import os
import re
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path

# sha256 of the normalized source of CacheBase.get_system (+ codecache's triton_key wrapper, + the
# whole cache_key.py when get_system uses it) -> how that torch builds the key. Add a variant only
# with a test run under that torch (tests/test_systemkey.py compares with torch's own key).
KNOWN_GET_SYSTEM: dict[str, str] = {
    "e120299b9f1c05d4b9cfeb75ac663c65dfe156022004c9905326b920a44716b0": "device-or-empty",  # torch 2.11.0
    "92e414024ac6e5337f821d1589233ad4225bf8ae42876d96bec3b5ba26c854c0": "device-or-empty",  # torch 2.13.0
    "2deb90a56ebdf3c89cf166795c87961712abdbd5325f788cc83cf998275ba624": "triton-always",  # torch 2.15.0
}
KNOWN_TRITON_KEY: frozenset[str] = frozenset({
    "a82355abe9f4419448ff9fa2eadc81d208950afe3ccf11196c447bc4443cf1b8",  # triton 3.6.0, 3.9.0
})
# variants: "device-or-empty" = torch 2.11-2.13 (no device: hash of {}), "triton-always" = torch 2.15
# (no device: hash of the triton key), both hash the same document when a device is present.
RACY_NS = 2_000_000_000  # a memoised triton key is trusted only for files older than this at memo time


class Unsure(Exception):
    """The fast path cannot be sure of the key; the message says why."""


@dataclass(frozen=True, slots=True)
class SystemKey:
    key: str | None
    method: str  # "files": computed from torch/triton files + NVML; "torch": CacheBase.get_system()
    reason: str | None = None  # why the fast path was not used (method "torch")
    device: str | None = None  # the GPU name in the key, None for the CPU-only key
    triton_memo: bool = False  # the triton key came from the memo (files unchanged since it was hashed)


@dataclass(frozen=True, slots=True)
class DeviceView:
    """What NVML says about the devices torch would see, for the key."""

    driver_cuda: str | None  # newest CUDA the driver supports, "13.0"
    names: tuple[str, ...]  # NVML index order
    uuids: tuple[str, ...]
    mig: tuple[bool, ...]
    error: str | None = None  # NVML could not be read although a driver seems present


# ---------------------------------------------------------------------------------------------------
# source fingerprints


def _normalized(block: str) -> str:
    """Lines without trailing space, blank lines and whole-line comments: formatting-only edits keep the hash."""
    lines = (ln.rstrip() for ln in block.splitlines())
    return "\n".join(ln for ln in lines if ln and not ln.lstrip().startswith("#"))


def source_block(text: str, header: str) -> str | None:
    """The block that starts at the line containing `header` and ends before the next line at the
    same or a smaller indentation (decorators of the next definition included in "next")."""
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if line.lstrip().startswith(header):
            indent = len(line) - len(line.lstrip())
            out = [line]
            for nxt in lines[i + 1:]:
                if nxt.strip() and len(nxt) - len(nxt.lstrip()) <= indent:
                    break
                out.append(nxt)
            return "\n".join(out)
    return None


def _digest(*parts: str) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(_normalized(p).encode())
        h.update(b"\0")
    return h.hexdigest()


def package_dir(name: str) -> Path | None:
    """Where a top-level package lives, found without importing it."""
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def _read(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise Unsure(f"cannot read {path}: {e}") from None


def get_system_variant(torch_dir: Path) -> tuple[str, str]:
    """(variant, digest) of the installed torch's key code; Unsure when the code is not a known variant."""
    codecache = _read(torch_dir / "_inductor" / "codecache.py")
    get_system = source_block(codecache, "def get_system(")
    if get_system is None:
        raise Unsure("torch/_inductor/codecache.py has no CacheBase.get_system")
    parts = [get_system]
    wrapper = source_block(codecache, "def triton_key(")
    if wrapper is not None:
        parts.append(wrapper)
    if "SYSTEM_CACHE_KEY_STRATEGY" in get_system:
        parts.append(_read(torch_dir / "_inductor" / "cache_key.py"))
    compat = _read(torch_dir / "_inductor" / "runtime" / "triton_compat.py")
    if "from triton.runtime.cache import triton_key" not in compat or "import triton\n" not in compat:
        raise Unsure("torch's triton_compat finds triton's key differently from the versions compilewatch has read")
    digest = _digest(*parts)
    variant = KNOWN_GET_SYSTEM.get(digest)
    if variant is None:
        raise Unsure(f"this torch's CacheBase.get_system is not a variant compilewatch has read (digest {digest[:12]})")
    if variant == "triton-always":
        iface = _read(torch_dir / "_dynamo" / "device_interface.py")
        if iface.count("def get_cache_system_info(") != 1:
            raise Unsure("a torch device interface adds its own cache system info")
    return variant, digest


# ---------------------------------------------------------------------------------------------------
# torch's files


def torch_version_facts(torch_dir: Path) -> dict[str, str | None]:
    """`torch/version.py`'s literal assignments (__version__, cuda, hip, git_version, ...), not imported."""
    out: dict[str, str | None] = {}
    for m in re.finditer(r"^(\w+)\s*(?::[^=]*)?=\s*(None|'[^'\n]*'|\"[^\"\n]*\")\s*$",
                         _read(torch_dir / "version.py"), re.M):
        v = m.group(2)
        out[m.group(1)] = None if v == "None" else v[1:-1]
    if "__version__" not in out:
        raise Unsure("torch/version.py has no literal __version__")
    return out


# ---------------------------------------------------------------------------------------------------
# triton's key, as triton computes it (triton/runtime/cache.py `triton_key`), without importing triton


def _module_suffixes() -> tuple[list[str], list[str]]:
    from importlib.machinery import BYTECODE_SUFFIXES, EXTENSION_SUFFIXES, SOURCE_SUFFIXES, all_suffixes

    return [*EXTENSION_SUFFIXES, *SOURCE_SUFFIXES, *BYTECODE_SUFFIXES], all_suffixes()


def _modulename(fn: str, suffixes: list[str]) -> str | None:
    """inspect.getmodulename without importing inspect (the longest matching suffix wins)."""
    for suffix in sorted(suffixes, key=len, reverse=True):
        if fn.endswith(suffix):
            return fn[:-len(suffix)]
    return None


def _origin(directory: str, name: str, order: list[str]) -> str | None:
    """What FileFinder.find_spec(name).origin is for `name` in `directory`: a package's __init__, else
    the first of extension, source, bytecode files."""
    pkg = os.path.join(directory, name)
    if os.path.isdir(pkg):
        for suffix in order:
            init = os.path.join(pkg, "__init__" + suffix)
            if os.path.isfile(init):
                return init
    for suffix in order:
        f = pkg + suffix
        if os.path.isfile(f):
            return f
    return None


def walk_module_files(path: str, seen: set[str]) -> list[str]:
    """The files `pkgutil.walk_packages([path])` yields, in its order, as `find_spec(...).origin`:
    sorted directory listing, packages walked depth first. (walk_packages imports each package to read
    its __path__; a plain package's __path__ is its directory, which is what is walked here.)"""
    order, all_sfx = _module_suffixes()
    files: list[str] = []
    try:
        names = sorted(os.listdir(path))
    except OSError:
        return files
    yielded: set[str] = set()
    for fn in names:
        mod = _modulename(fn, all_sfx)
        if mod == "__init__" or (mod is not None and mod in yielded):
            continue
        full = os.path.join(path, fn)
        ispkg = False
        if not mod and os.path.isdir(full) and "." not in fn:
            try:
                inner = os.listdir(full)
            except OSError:
                inner = []
            if not any(_modulename(x, all_sfx) == "__init__" for x in inner):
                continue
            mod, ispkg = fn, True
        if not mod or "." in mod:
            continue
        yielded.add(mod)
        origin = _origin(path, mod, order)
        if origin is None:
            raise Unsure(f"cannot resolve module {mod} in {path}")
        files.append(origin)
        if ispkg and full not in seen:
            seen.add(full)
            files.extend(walk_module_files(full, seen))
    return files


def triton_key_inputs(triton_dir: Path) -> tuple[str, str, list[str], str, list[str]]:
    """(version, frontend file, compiler+backend files, libtriton, language files) of triton's key."""
    frontend = triton_dir / "runtime" / "cache.py"
    text = _read(frontend) if frontend.is_file() else ""
    block = source_block(text, "def triton_key(")
    if block is None:  # older triton: torch's triton_compat imports it from triton.compiler.compiler
        frontend = triton_dir / "compiler" / "compiler.py"
        block = source_block(_read(frontend), "def triton_key(")
        if block is None:
            raise Unsure("triton has no triton_key where torch looks for it")
    digest = _digest(block)
    if digest not in KNOWN_TRITON_KEY:
        raise Unsure(f"this triton's triton_key is not a variant compilewatch has read (digest {digest[:12]})")
    m = re.search(r"^__version__\s*=\s*['\"]([^'\"]+)['\"]", _read(triton_dir / "__init__.py"), re.M)
    if m is None:
        raise Unsure("triton/__init__.py has no literal __version__")
    seen: set[str] = set()
    compiler = [f for sub in ("compiler", "backends") for f in walk_module_files(str(triton_dir / sub), seen)]
    ext = (sysconfig.get_config_var("EXT_SUFFIX") or ".so").split(".")[-1]
    lib = str(triton_dir / "_C" / f"libtriton.{ext}")
    language = walk_module_files(str(triton_dir / "language"), seen)
    return m.group(1), str(os.path.abspath(frontend)), compiler, lib, language


def _sha256_file(path: str) -> str:
    try:
        with open(path, "rb") as f:
            return hashlib.file_digest(f, "sha256").hexdigest() if hasattr(hashlib, "file_digest") \
                else _sha256_chunks(f)
    except OSError as e:
        raise Unsure(f"cannot read {path}: {e.strerror}") from None


def _sha256_chunks(f) -> str:  # Python < 3.11
    h = hashlib.sha256()
    while chunk := f.read(1 << 20):
        h.update(chunk)
    return h.hexdigest()


def memo_path() -> Path:
    """Where the triton key memo lives: $COMPILEWATCH_STATE_DIR, else $XDG_CACHE_HOME/compilewatch."""
    base = os.environ.get("COMPILEWATCH_STATE_DIR")
    if base:
        return Path(base) / "triton-key.json"
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(xdg) / "compilewatch" / "triton-key.json"


def triton_key(triton_dir: Path, *, use_memo: bool = True) -> tuple[str, bool]:
    """(triton's `triton_key()`, whether it came from the memo). The memo maps the stat of every input
    file (size, mtime_ns, inode) to the key; files modified within RACY_NS of the memo are re-hashed."""
    version, frontend, compiler, lib, language = triton_key_inputs(triton_dir)
    files = [frontend, *compiler, lib, *language]
    stats = []
    for f in files:
        try:
            st = os.stat(f)
        except OSError as e:
            raise Unsure(f"cannot stat {f}: {e.strerror}") from None
        stats.append((f, st.st_size, st.st_mtime_ns, st.st_ino))
    stat_id = hashlib.sha256(json.dumps([version, stats]).encode()).hexdigest()
    memo_file = memo_path()
    memo: dict = {}
    if use_memo:
        try:
            memo = json.loads(memo_file.read_text(encoding="utf-8"))
            entry = memo.get(str(triton_dir)) if isinstance(memo, dict) else None
            if isinstance(entry, dict) and entry.get("stat") == stat_id and isinstance(entry.get("key"), str):
                return entry["key"], True
        except (OSError, ValueError):
            memo = {}
    started = time.time_ns()
    key = version + "-".join(_sha256_file(f) for f in files)
    if use_memo and all(s[2] < started - RACY_NS for s in stats):
        _save_memo(memo_file, memo if isinstance(memo, dict) else {}, str(triton_dir), stat_id, key)
    return key, False


def _save_memo(path: Path, memo: dict, where: str, stat_id: str, key: str) -> None:
    from compilewatch.fsutil import atomic_write_text

    memo = {k: v for k, v in memo.items() if isinstance(v, dict)}
    memo[where] = {"stat": stat_id, "key": key}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, json.dumps(memo))
    except OSError:  # a memo we cannot write only costs time next run
        pass


# ---------------------------------------------------------------------------------------------------
# devices


@functools.lru_cache(maxsize=1)
def read_devices() -> DeviceView | None:
    """NVML's view of the NVIDIA devices, or None when there is no NVIDIA driver at all (once per process)."""
    driver_present = os.path.exists("/proc/driver/nvidia/version") or os.path.exists("/dev/nvidiactl")
    try:
        import pynvml
    except ImportError:
        return DeviceView(None, (), (), (), error="nvidia-ml-py is not installed") if driver_present else None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as e:
        return DeviceView(None, (), (), (), error=f"NVML: {e}") if driver_present else None
    try:
        names, uuids, mig = [], [], []
        cuda = pynvml.nvmlSystemGetCudaDriverVersion()
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            names.append(_text(pynvml.nvmlDeviceGetName(h)))
            uuids.append(_text(pynvml.nvmlDeviceGetUUID(h)))
            try:
                mig.append(bool(pynvml.nvmlDeviceGetMigMode(h)[0]))
            except pynvml.NVMLError:  # not supported: no MIG
                mig.append(False)
        return DeviceView(f"{cuda // 1000}.{(cuda % 1000) // 10}" if cuda else None, tuple(names), tuple(uuids),
                          tuple(mig))
    except pynvml.NVMLError as e:
        return DeviceView(None, (), (), (), error=f"NVML: {e}")
    finally:
        try:
            pynvml.nvmlShutdown()
        except pynvml.NVMLError:
            pass


def visible_count(view: DeviceView | None, environ=os.environ) -> int:
    """How many of NVML's GPUs CUDA_VISIBLE_DEVICES leaves visible (CUDA stops at the first entry
    it cannot match)."""
    if view is None or view.error or not view.names:
        return 0
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return len(view.names)
    n = 0
    for entry in visible.split(","):
        e = entry.strip()
        if (e.isdigit() and int(e) < len(view.names)) or (
                e.startswith("GPU-") and sum(u.startswith(e) for u in view.uuids) == 1):
            n += 1
        else:
            break
    return n


def _text(v) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def _version_tuple(v: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", v)[:2])


def current_device_name(view: DeviceView | None, torch_cuda: str | None, environ=os.environ) -> str | None:
    """The name torch's `get_device_properties(current_device()).name` gives, None when torch sees no
    CUDA device; Unsure when that cannot be told from NVML alone."""
    if torch_cuda is None or view is None:
        return None  # a CPU build, or no NVIDIA driver: torch.cuda raises and the key has no device
    if view.error:
        raise Unsure(f"an NVIDIA driver is present but NVML cannot be read ({view.error})")
    if not view.names:
        return None
    if any(view.mig):
        raise Unsure("a GPU is in MIG mode")
    if len(set(view.names)) != 1:
        raise Unsure(f"GPUs of different models ({', '.join(sorted(set(view.names)))}): which one is "
                     f"torch's current device depends on CUDA's ordering")
    if view.driver_cuda is None or _version_tuple(view.driver_cuda) < _version_tuple(torch_cuda):
        raise Unsure(f"the driver supports CUDA {view.driver_cuda}, torch is built for {torch_cuda}")
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        first = visible.split(",")[0].strip()
        if first.isdigit() and int(first) < len(view.names):
            pass
        elif first.startswith("GPU-") and sum(u.startswith(first) for u in view.uuids) == 1:
            pass
        else:
            raise Unsure(f"CUDA_VISIBLE_DEVICES={visible!r}: which GPU torch would see is not certain")
    return view.names[0]


# ---------------------------------------------------------------------------------------------------
# the key


def fast_key(*, devices: DeviceView | None | str = "read", use_memo: bool = True) -> SystemKey:
    """The system key from files and NVML; raises Unsure when it cannot be sure."""
    from importlib import metadata

    torch_dir = package_dir("torch")
    if torch_dir is None:
        raise Unsure("torch is not installed")
    variant, _ = get_system_variant(torch_dir)
    facts = torch_version_facts(torch_dir)
    if facts.get("hip"):
        raise Unsure("a ROCm build of torch")
    if any(True for _ in metadata.entry_points(group="torch.backends")):
        raise Unsure("a package registers a torch device backend (entry point group torch.backends)")
    view = read_devices() if devices == "read" else devices
    name = current_device_name(view, facts.get("cuda"))  # type: ignore[arg-type]
    if name is None and variant == "device-or-empty":
        return SystemKey(_sha256_json({}), "files")
    triton_dir = package_dir("triton")
    tkey, memo = triton_key(triton_dir, use_memo=use_memo) if triton_dir is not None else (None, False)
    doc: dict = {"version": {"triton": tkey}}
    if name is not None:
        doc = {"device": {"name": name}, "version": {"triton": tkey, "cuda": facts.get("cuda")}}
    return SystemKey(_sha256_json(doc), "files", device=name, triton_memo=memo)


def _sha256_json(doc: dict) -> str:
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode("utf-8")).hexdigest()


def torch_key() -> str:
    """torch's own `CacheBase.get_system()["hash"]` (imports torch, initialises CUDA)."""
    from torch._inductor.codecache import CacheBase

    return str(CacheBase.get_system()["hash"])


def key(*, devices: DeviceView | None | str = "read") -> SystemKey:
    """The system key: from files when sure, else torch's function (with the reason)."""
    try:
        return fast_key(devices=devices)
    except Unsure as e:
        return SystemKey(torch_key(), "torch", reason=str(e))
