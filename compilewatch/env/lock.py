"""`lock`: a snapshot of everything that decides whether a compiled artifact is reusable.

The snapshot is a frozen `EnvLock` that serializes to JSON with a versioned schema
(`schema: "compilewatch.lock"`, `schema_version: 1`; every field is documented in docs/env.md).
Compatible additions keep the version; a removed or re-meant field bumps it, and `load_lock` refuses
a lock written by a newer schema instead of misreading it.

What it holds and where each fact comes from:
- python: `platform` / `sys` (version, implementation, platform tag, ABI tag).
- distributions: `importlib.metadata` over `sys.path` (or given paths), with PEP 610 direct-URL
  facts (VCS commit, local file, editable). The first distribution of a name wins, as for imports.
- torch: by default read from torch's files without importing torch (`torchinfo.torch_build_from_files`:
  version with its local label, CUDA version, git version; `source: "files"`); with `ask_torch=True`
  asked of torch (`torchinfo.torch_build()`, adds cuDNN and NCCL as torch loads them and the arch list).
- triton: the installed `triton` / `pytorch-triton` distribution (not imported: that is slow).
- inductor: cache dir, triton cache dir and system key, all through torchinfo; the key is computed from
  files when `compilewatch.env.systemkey` is sure it equals torch's, else asked of torch
  (`system_key_source`, with the reason in `notes`); `cache` summarizes the cache dir's contents.
- driver and GPUs: NVML (`pynvml` from nvidia-ml-py); any NVMLError means "no NVIDIA GPU/driver",
  a normal state recorded as a note. GPU UUIDs are hashed.
- cpu: model and the ISA flags the inductor C++ backend picks its vector code from.
- env: variables by prefix; names that look secret (TOKEN, SECRET, KEY, PASSWORD) are left out and
  only their names are listed.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import os
import platform
import re
import sys
import sysconfig
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any, Iterable, Sequence

from compilewatch.errors import BadInput
from compilewatch.inputs import loads_json, read_text
from compilewatch.jsonshape import build
from compilewatch.torchinfo import TorchBuild

SCHEMA = "compilewatch.lock"
SCHEMA_VERSION = 1

ENV_PREFIXES = ("TORCH", "TORCHINDUCTOR_", "TRITON_", "CUDA", "NCCL", "PYTORCH_", "HF_", "TRANSFORMERS_", "OMP_")
SECRET_WORDS = ("TOKEN", "SECRET", "KEY", "PASSWORD")
# Names that contain a secret word but are torch configuration, not credentials: they enter cache keys.
NOT_SECRET = frozenset({"TORCH_COMPILE_CACHE_KEY_TAG"})
# /proc/cpuinfo flags the inductor C++ backend chooses its vector ISA from (torch._inductor.cpu_vec_isa).
CPU_ISA_FLAGS = frozenset({
    "avx", "avx2", "fma", "f16c", "avx512f", "avx512dq", "avx512vl", "avx512bw", "avx512_bf16",
    "avx512_fp16", "avx512_vnni", "avx_vnni", "amx_tile", "amx_bf16", "amx_int8", "amx_fp16",
    "asimd", "sve", "sve2", "bf16", "i8mm",
})
TRITON_DISTRIBUTIONS = ("triton", "pytorch-triton", "pytorch-triton-rocm", "triton-xpu")


@dataclass(frozen=True, slots=True)
class PythonInfo:
    version: str  # platform.python_version(), e.g. "3.12.3"
    implementation: str  # "CPython"
    platform: str  # sysconfig.get_platform(), e.g. "linux-x86_64"
    abi: str  # sys.implementation.cache_tag, e.g. "cpython-312"


@dataclass(frozen=True, slots=True)
class Distribution:
    name: str  # as the distribution's metadata spells it
    version: str
    source: str | None = None  # PEP 610: "git+URL@commit", "file:///...whl", a directory; None = an index
    editable: bool = False


@dataclass(frozen=True, slots=True)
class TritonInfo:
    distribution: str  # which distribution provides triton
    version: str


@dataclass(frozen=True, slots=True)
class CacheSummary:
    dir: str
    exists: bool
    files: int
    bytes: int
    fingerprint: str | None = None  # content fingerprint, when the cache module provides one


@dataclass(frozen=True, slots=True)
class InductorInfo:
    cache_dir: str  # as torch resolves it (TORCHINDUCTOR_CACHE_DIR, else its default)
    triton_cache_dir: str | None
    system_key: str | None  # CacheBase.get_system()["hash"]: every cache entry is keyed on it
    cache: CacheSummary | None
    system_key_source: str | None = None  # "files" (compilewatch.env.systemkey) or "torch" (asked torch)


@dataclass(frozen=True, slots=True)
class DriverInfo:
    version: str  # NVIDIA driver, e.g. "580.95.05"
    cuda: str | None  # the newest CUDA the driver supports, e.g. "13.0"


@dataclass(frozen=True, slots=True)
class GpuInfo:
    index: int  # NVML index (PCI bus order)
    name: str
    capability: str  # compute capability "9.0"
    memory_bytes: int
    uuid_hash: str  # sha256 of the UUID, first 16 hex digits: tells GPUs apart without naming them


@dataclass(frozen=True, slots=True)
class CpuInfo:
    model: str
    count: int
    isa_flags: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class EnvLock:
    schema: str
    schema_version: int
    created: str  # UTC, ISO 8601
    compilewatch: str
    python: PythonInfo
    distributions: tuple[Distribution, ...]
    torch: TorchBuild | None
    triton: TritonInfo | None
    inductor: InductorInfo | None
    driver: DriverInfo | None
    gpus: tuple[GpuInfo, ...]
    cpu: CpuInfo
    env: dict[str, str]
    env_left_out: tuple[str, ...]  # names of secret-looking variables, values never read into the lock
    notes: tuple[str, ...] = field(default=())  # facts that could not be collected, and why


# ---------------------------------------------------------------------------------------------------
# collection


def snapshot(*, paths: Sequence[str] | None = None, with_torch: bool = True, with_gpus: bool = True,
             ask_torch: bool = False, progress: Any = None) -> EnvLock:
    """Collect an `EnvLock` of this process's environment.

    `paths` limits the distribution scan (default: sys.path). `with_torch=False` skips torch, triton's
    system key and the cache (for tools that only want packages); `with_gpus=False` skips NVML.
    `ask_torch=True` imports torch (and initialises CUDA) for the facts only torch knows (cuDNN, NCCL,
    arch list) and takes the system key from torch's own function: seconds instead of well under one.
    `progress(bytes done, bytes total)` follows the cache fingerprint (a large cache hashed for the
    first time takes seconds; later runs reuse its stat index).
    """
    import compilewatch

    notes: list[str] = []
    # read the environment first: torch's cache_dir() sets TORCHINDUCTOR_CACHE_DIR in os.environ
    env, left_out = env_vars(os.environ)
    dists = scan_distributions(paths, notes)
    torch = inductor = None
    if with_torch:
        torch, inductor = _torch_facts(notes, ask_torch, progress)
    driver, gpus = _gpu_facts(notes) if with_gpus else (None, ())
    return EnvLock(
        schema=SCHEMA,
        schema_version=SCHEMA_VERSION,
        created=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        compilewatch=compilewatch.__version__,
        python=python_info(),
        distributions=dists,
        torch=torch,
        triton=_triton(dists),
        inductor=inductor,
        driver=driver,
        gpus=gpus,
        cpu=cpu_info(),
        env=env,
        env_left_out=left_out,
        notes=tuple(notes),
    )


def python_info() -> PythonInfo:
    return PythonInfo(
        version=platform.python_version(),
        implementation=platform.python_implementation(),
        platform=sysconfig.get_platform(),
        abi=sys.implementation.cache_tag or "",
    )


def scan_distributions(paths: Sequence[str] | None = None, notes: list[str] | None = None) -> tuple[Distribution, ...]:
    """Every installed distribution on `paths` (default sys.path), first of a name wins, sorted by name."""
    seen: dict[str, Distribution] = {}
    for d in metadata.distributions(**({"path": list(paths)} if paths is not None else {})):
        meta = d.metadata
        name = meta["Name"] if meta is not None else None
        version = meta["Version"] if meta is not None else None
        if not name or not version or not is_metadata_version(version):
            if notes is not None:
                notes.append(f"distribution without a name or a version in its metadata at {getattr(d, '_path', '?')}"
                             + (f" (version {version[:60]!r})" if version else ""))
            continue
        key = _canonical(name)
        if key in seen:
            if notes is not None and seen[key].version != version:
                notes.append(f"{name} {version} is shadowed by {seen[key].version} earlier on the path")
            continue
        source, editable = _direct_url(d.read_text("direct_url.json"))
        seen[key] = Distribution(name=name, version=version, source=source, editable=editable)
    return tuple(sorted(seen.values(), key=lambda x: _canonical(x.name)))


def _direct_url(text: str | None) -> tuple[str | None, bool]:
    """PEP 610 direct_url.json -> (source, editable). Unreadable JSON counts as no direct URL."""
    if not text:
        return None, False
    try:
        data = json.loads(text)
    except ValueError:
        return None, False
    url = data.get("url")
    if not isinstance(url, str):
        return None, False
    vcs = data.get("vcs_info")
    if isinstance(vcs, dict):
        kind = vcs.get("vcs", "git")
        commit = vcs.get("commit_id")
        return (f"{kind}+{url}@{commit}" if commit else f"{kind}+{url}"), False
    editable = bool((data.get("dir_info") or {}).get("editable", False))
    return url, editable


def _canonical(name: str) -> str:
    from packaging.utils import canonicalize_name

    return canonicalize_name(name)


def _triton(dists: Iterable[Distribution]) -> TritonInfo | None:
    by_name = {_canonical(d.name): d for d in dists}
    for name in TRITON_DISTRIBUTIONS:
        if name in by_name:
            return TritonInfo(distribution=by_name[name].name, version=by_name[name].version)
    return None


def _torch_facts(notes: list[str], ask_torch: bool = False, progress: Any = None,
                 ) -> tuple[TorchBuild | None, InductorInfo | None]:
    from compilewatch import torchinfo
    from compilewatch.env import systemkey

    try:
        build = torchinfo.torch_build() if ask_torch else torchinfo.torch_build_from_files()
    except (ImportError, systemkey.Unsure) as e:
        notes.append(f"torch is not importable here ({e}): no torch, system key or cache facts")
        return None, None
    if build is None:
        notes.append("torch is not installed here: no torch, system key or cache facts")
        return None, None
    cache_dir = str(torchinfo.inductor_cache_dir())
    cache = _cache_summary(cache_dir, progress)  # before the system key: importing torch._dynamo creates the dir
    try:
        triton_dir: str | None = str(torchinfo.triton_cache_dir(0))
    except Exception as e:  # noqa: BLE001 - a fact we could not get is a note, not a crash
        triton_dir = None
        notes.append(f"triton cache dir unknown: {e}")
    key: str | None = None
    source: str | None = None
    try:
        if ask_torch:
            key, source = systemkey.torch_key(), "torch"
        else:
            info = torchinfo.system_key_info()
            key, source = info.key, info.method
            if info.reason:
                notes.append(f"system key asked of torch (slow path): {info.reason}")
    except Exception as e:  # noqa: BLE001
        notes.append(f"inductor system key unavailable: {type(e).__name__}: {e}")
    return build, InductorInfo(cache_dir=cache_dir, triton_cache_dir=triton_dir, system_key=key, cache=cache,
                               system_key_source=source)


def _cache_summary(cache_dir: str, progress: Any = None) -> CacheSummary:
    """What the inductor cache dir holds: files, bytes and the cache module's content fingerprint.

    A dir that is not an inductor cache (compilewatch.cache refuses it) is only counted.
    """
    from compilewatch.cache.content import fingerprint as cache_fingerprint
    from compilewatch.cache.local import layout as cache_layout
    from compilewatch.errors import BadInput

    root = Path(cache_dir)
    if not root.is_dir():
        return CacheSummary(dir=cache_dir, exists=False, files=0, bytes=0)
    try:
        fp = cache_fingerprint.fingerprint(root, progress=progress)
        return CacheSummary(dir=cache_dir, exists=True, files=fp.files, bytes=fp.bytes, fingerprint=fp.content_hash)
    except BadInput:  # not an inductor cache: count it
        pass
    except Exception:  # noqa: BLE001 - e.g. torch's system key failing: counts are still a fact
        pass
    w = cache_layout.walk(root)
    return CacheSummary(dir=cache_dir, exists=True, files=len(w.files), bytes=sum(f.size for f in w.files))


def _gpu_facts(notes: list[str]) -> tuple[DriverInfo | None, tuple[GpuInfo, ...]]:
    try:
        import pynvml
    except ImportError:
        notes.append("nvidia-ml-py is not installed: no driver or GPU facts")
        return None, ()
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as e:
        notes.append(f"no NVIDIA GPU/driver (NVML: {e})")
        return None, ()
    try:
        driver = DriverInfo(version=_str(pynvml.nvmlSystemGetDriverVersion()),
                            cuda=_cuda_version(pynvml.nvmlSystemGetCudaDriverVersion()))
        gpus = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            major, minor = pynvml.nvmlDeviceGetCudaComputeCapability(h)
            uuid = _str(pynvml.nvmlDeviceGetUUID(h))
            gpus.append(GpuInfo(
                index=i,
                name=_str(pynvml.nvmlDeviceGetName(h)),
                capability=f"{major}.{minor}",
                memory_bytes=int(pynvml.nvmlDeviceGetMemoryInfo(h).total),
                uuid_hash=hashlib.sha256(uuid.encode()).hexdigest()[:16],
            ))
        return driver, tuple(gpus)
    except pynvml.NVMLError as e:
        notes.append(f"NVML failed while reading GPUs: {e}")
        return None, ()
    finally:
        try:
            pynvml.nvmlShutdown()
        except pynvml.NVMLError:
            pass


def _str(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def _cuda_version(v: int | None) -> str | None:
    """NVML's CUDA driver version integer (12080) -> "12.8"."""
    if not v:
        return None
    return f"{v // 1000}.{(v % 1000) // 10}"


def cpu_info(cpuinfo: str | None = None) -> CpuInfo:
    """CPU model and ISA flags, from /proc/cpuinfo on Linux (or the given text), platform elsewhere."""
    model, flags = "", set()
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text(errors="replace")
        except OSError:
            cpuinfo = ""
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key in ("model name", "Model", "cpu model") and not model:
            model = value.strip()
        elif key in ("flags", "Features") and not flags:
            flags = set(value.split()) & CPU_ISA_FLAGS
    return CpuInfo(model=model or platform.processor() or platform.machine(), count=os.cpu_count() or 0,
                   isa_flags=tuple(sorted(flags)))


def is_secret_name(name: str) -> bool:
    upper = name.upper()
    return upper not in NOT_SECRET and any(w in upper for w in SECRET_WORDS)


def env_vars(environ: dict[str, str] | os._Environ) -> tuple[dict[str, str], tuple[str, ...]]:
    """Variables whose name starts with one of ENV_PREFIXES; secret-looking names left out (by name)."""
    kept, left_out = {}, []
    for name in sorted(environ):
        if not name.upper().startswith(ENV_PREFIXES):
            continue
        if is_secret_name(name):
            left_out.append(name)
        else:
            kept[name] = environ[name]
    return kept, tuple(left_out)


# ---------------------------------------------------------------------------------------------------
# reading a lock back


def lock_from_dict(data: Any, *, where: str = "lock") -> EnvLock:
    """Rebuild an `EnvLock` from its JSON form; BadInput names the field that is wrong."""
    if not isinstance(data, dict) or data.get("schema") != SCHEMA:
        raise BadInput(f"{where}: not a compilewatch lock (no \"schema\": \"{SCHEMA}\")",
                       hint="write one with `compilewatch lock -o FILE`")
    version = data.get("schema_version")
    if not isinstance(version, int) or version < 1:
        raise BadInput(f"{where}: schema_version must be a positive integer, got {version!r}")
    if version > SCHEMA_VERSION:
        raise BadInput(f"{where}: lock schema version {version} is newer than this compilewatch reads "
                       f"({SCHEMA_VERSION})", hint="upgrade compilewatch to read it")
    filled = {"created": "", "compilewatch": "", "distributions": [], "torch": None, "triton": None,
              "inductor": None, "driver": None, "gpus": [], "env": {}, "env_left_out": [], "notes": [],
              **data, "schema": SCHEMA, "schema_version": version}
    if isinstance(filled["torch"], dict):
        filled["torch"] = {"arch_list": [], **filled["torch"]}
    if isinstance(filled.get("cpu"), dict):
        filled["cpu"] = {"isa_flags": [], **filled["cpu"]}
    for key in ("created", "compilewatch"):  # free text: whatever a writer put there, as text
        filled[key] = str(filled[key])
    lock = build(EnvLock, filled, where)
    _check_counts(lock, where)
    _check_versions(lock, where)
    return lock


_PYTHON_VERSION = re.compile(r"\d{1,4}\.\d{1,4}(\.\d{1,4})?([a-z]{1,5}\d{0,4})?\+?")  # 3.12.3, 3.14.0rc1, 3.11.7+
_TEXT_VERSION = re.compile(r"[0-9A-Za-z][0-9A-Za-z.+!_-]{0,199}")  # torch's and triton's: PEP 440


def is_metadata_version(v: str) -> bool:
    """Any version a package's metadata may declare (PEP 440 or legacy), if it is one: the writer records
    only these and the reader takes only these."""
    return bool(v.strip()) and v.isprintable() and len(v) <= 200


def _check_versions(lock: EnvLock, where: str) -> None:
    """The versions the diff compares are versions: BadInput for `python.version: "abc"` or an empty torch
    version (read as an upgrade to "abc": a critical change made up by a damaged or edited lock)."""
    from compilewatch.inputs import one_line

    def bad(path: str, got: str, expected: str) -> BadInput:
        return BadInput(f"{where}: {path}: expected {expected}, got {one_line(repr(got), 60)}",
                        hint="the lock was edited or damaged: write it again with `compilewatch lock -o FILE`")

    if not _PYTHON_VERSION.fullmatch(lock.python.version):
        raise bad("python.version", lock.python.version, 'a Python version such as "3.12.3"')
    for path, info in (("torch", lock.torch), ("triton", lock.triton)):
        if info is not None and not _TEXT_VERSION.fullmatch(info.version):
            raise bad(f"{path}.version", info.version, 'a version such as "2.13.0+cpu" (letters, digits and .+!_-)')
    for i, d in enumerate(lock.distributions):
        if not is_metadata_version(d.version):
            raise bad(f"distributions[{i}].version", d.version, "a version: printable text of up to 200 characters")


MAX_COUNT = 2**63 - 1  # bytes, files, memory, indices: a lock from a real machine is far below this


def _check_counts(obj: Any, where: str, path: str = "") -> None:
    """Every integer in a lock is a count, a size, an index or a version number: BadInput for a negative
    one (`files: -1` read as "the cache is gone") or one past 2**63 (10**400 bytes made the diff's
    size label raise OverflowError)."""
    import dataclasses

    if dataclasses.is_dataclass(obj):
        for f in dataclasses.fields(obj):
            _check_counts(getattr(obj, f.name), where, f"{path}.{f.name}" if path else f.name)
    elif isinstance(obj, tuple):
        for i, x in enumerate(obj):
            _check_counts(x, where, f"{path}[{i}]")
    elif isinstance(obj, int) and not isinstance(obj, bool) and not 0 <= obj <= MAX_COUNT:
        from compilewatch.inputs import one_line

        raise BadInput(f"{where}: {path}: expected a count from 0 to 2**63-1, got {one_line(obj, 40)}",
                       hint="the lock was edited or damaged: write it again with `compilewatch lock -o FILE`")


def load_lock(path: str | os.PathLike[str]) -> EnvLock:
    """Read a lock file written by `compilewatch lock -o`; BadInput with file and line if unreadable."""
    path = Path(path)
    return parse_lock(read_text(path, what="compilewatch lock"), str(path))


def parse_lock(text: str, where: str) -> EnvLock:
    data = loads_json(text, where)
    _refuse_duplicate_keys(text, where)
    return lock_from_dict(data, where=where)


def _refuse_duplicate_keys(text: str, where: str) -> None:
    """BadInput when one JSON object names a key twice: json keeps the last one silently (a second
    `"torch"` replaced the first), other readers keep the first, so which environment the file
    describes is ambiguous. `compilewatch lock` never writes one. Runs on text json already parsed."""
    def pairs_hook(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                from compilewatch.inputs import one_line

                raise BadInput(f"{where}: the key {one_line(repr(key), 80)} appears twice in one object: which "
                               "value is meant is ambiguous (JSON readers differ)",
                               hint="keep one of them, or write the lock again with `compilewatch lock -o FILE`")
            seen.add(key)
        return dict(pairs)

    json.loads(text, object_pairs_hook=pairs_hook)
