"""`diff-env`: what changed between two environments, ranked by what it means for compilation.

Every change gets a severity by its impact on compiled-artifact reuse and behaviour, and one plain
sentence of consequence:
- critical: torch version or CUDA flavour, triton, GPU architecture, Python minor, the inductor
  system key, the cache dir moved or the cache gone. Expect every cache entry to miss.
- warning: driver, cuDNN, NCCL, transformers, attention/kernel libraries, CUDA libraries,
  compile-related environment variables, CPU ISA flags.
- info: everything else.

Both sides are `EnvSpec`s (compilewatch.env.formats): packages always compare; system facts (driver,
GPUs, cache, env vars) compare only when both sides are compilewatch locks. When a side hides torch's
CUDA flavour (PyPI wheels say `torch==2.11.0`), it is inferred from the CUDA packages next to torch
and the change says so.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Iterable

from packaging.version import Version

from compilewatch.env.formats import EnvSpec, Package, load_env
from compilewatch.env.lock import EnvLock

SEVERITIES = ("critical", "warning", "info")
_RANK = {s: i for i, s in enumerate(SEVERITIES)}
TORCH = "torch"
TRITON_NAMES = frozenset({"triton", "pytorch-triton", "pytorch-triton-rocm", "triton-xpu"})
# pip freeze leaves these out by default: their absence on a freeze side is not a change.
FREEZE_OMITS = frozenset({"pip", "setuptools", "wheel", "distribute"})

KERNEL_LIBRARIES = frozenset({
    "flash-attn", "flash-attn-3", "flash-attn-4", "flashinfer-python", "flashinfer-cubin", "flashinfer-jit-cache",
    "xformers", "sgl-kernel", "sglang", "vllm", "liger-kernel", "kernels", "mamba-ssm", "causal-conv1d",
    "torchao", "deepspeed", "apex", "bitsandbytes", "triton-kernels", "quack-kernels", "nvidia-cutlass-dsl",
    "flex-attention", "natten", "deep-gemm", "deep-ep", "fbgemm-gpu",
})
CONSEQUENCE = {
    "torch_version": "torch's version is part of every inductor cache key: every cached graph misses and "
                     "recompiles, and compile behaviour (including the FX-tracing race) can differ.",
    "torch_build": "same torch version, different build: the cache key hashes torch's source, so expect "
                   "misses, and kernels may differ.",
    "torch_presence": "without torch on one side nothing compiled on the other can be reused.",
    "triton": "the triton key is part of the inductor system key: every cached kernel misses and recompiles.",
    "transformers": "model code changes (attention dispatch, masks, module wrappers): graphs can break, "
                    "trace or recompile differently; compare the model's forward before blaming torch.",
    "kernels": "an attention/kernel library: the kernels and custom ops it gives torch change, so speed "
               "and numerics can differ and its ops can add graph breaks.",
    "cudnn": "the cuDNN torch loads changes: kernel choice, speed and numerics can differ; not part of the "
             "cache key.",
    "nccl": "NCCL changes: multi-GPU communication (speed, hangs) can differ; not part of the cache key.",
    "cuda_lib": "a CUDA library torch loads: kernel speed and behaviour can differ; the CUDA flavour decides "
                "cache reuse.",
    "cuda_libs": "the CUDA libraries torch loads changed together (they follow torch's CUDA flavour): "
                 "kernel speed and behaviour can differ; the flavour decides cache reuse.",
    "info": "not on the compile path: compiled-artifact reuse is not affected.",
    "python_minor": "torch, triton and every C++ extension are built per Python minor version: nothing "
                    "compiled under the other Python is reused.",
    "python_micro": "a Python bug-fix release: compiled artifacts stay reusable.",
    "python_impl": "a different Python implementation: nothing compiled is reused.",
    "system_key": "the inductor system key differs: every cache entry written under the old key misses.",
    "cache_moved": "torch now looks for compiled artifacts in {new}; what was compiled into {old} is not "
                   "used unless you move it or point TORCHINDUCTOR_CACHE_DIR back.",
    "cache_gone": "the warm inductor cache is gone: the first run recompiles every graph and is slow until "
                  "the cache is warm again.",
    "cache_changed": "the cache holds different content: some entries may miss.",
    "cache_new": "a cache now exists where there was none: earlier compiles can be reused.",
    "triton_dir": "triton looks for compiled kernels elsewhere: expect kernel recompiles and autotuning.",
    "driver": "the driver is not part of the cache key; a driver older than torch's CUDA runtime fails at "
              "the first CUDA call, a newer one is normally harmless.",
    "driver_too_old": "the driver supports CUDA {driver} but torch is built for CUDA {torch}: CUDA will "
                      "fail to initialize.",
    "gpu_arch": "the GPU name is part of the inductor system key and kernels are compiled per "
                "architecture: every cache entry misses.",
    "gpu_count": "device indices that scripts or per-device caches (triton/<index>) assume differ.",
    "gpu_same": "same GPU model, different physical devices: compiled artifacts stay reusable.",
    "arch_list": "the GPU architectures compiled into torch differ: a GPU outside the list fails or "
                 "JIT-compiles at start.",
    "cpu_isa": "the C++ backend picks its vector ISA (AVX2/AVX-512/AMX) from these flags and keys CPU "
               "kernels on it: CPU-compiled code misses.",
    "cpu_model": "a different CPU model: CPU-compiled code is reused if the ISA flags match.",
    "env_compile": "compile configuration from the environment: inductor/dynamo config is part of the "
                   "FX-graph cache key, so entries can miss and compiled code can differ.",
    "env_info": "not compile configuration: compiled-artifact reuse is not affected.",
    "env_runtime": "a torch runtime setting (the CUDA allocator, memory caching, ...), not part of any cache key: "
                   "cache reuse is not affected; memory use, speed or numerics can differ.",
    "env_cache_off": "{name}={value} turns off {what}: every process compiles from scratch (nothing is read "
                     "from or written to the cache).",
    "env_compile_off": "TORCH_COMPILE_DISABLE=1 turns torch.compile off: every compiled function runs eagerly "
                       "(slow), nothing compiled is used.",
    "env_gpus": "which GPUs torch sees and how cuda:N numbers them changed: the system key holds the name of the "
                "first visible GPU (another model: every entry misses) and triton's per-device cache follows the "
                "index; the same models in the same order: no miss.",
    "env_no_gpu": "CUDA_VISIBLE_DEVICES={value} leaves torch no GPU: torch.cuda.is_available() is False, work "
                  "meant for the GPU runs on the CPU or fails, and the system key loses the GPU name: no GPU cache "
                  "entry is reused.",
    "secret_env": "a secret-looking variable (value never recorded) appeared or went away.",
}


@dataclass(frozen=True, slots=True)
class Change:
    severity: str  # "critical" | "warning" | "info"
    action: str  # "Updated" | "Downgraded" | "Added" | "Removed" | "Changed"
    subject: str  # "torch", "python", "GPU architecture", "inductor cache", "env TORCHINDUCTOR_..."
    old: str | None
    new: str | None
    consequence: str  # one plain sentence
    note: str | None = None  # how a value was inferred, when it was
    details: tuple[str, ...] = ()  # the single changes a grouped change stands for
    headline: str = field(init=False)  # `Updated torch v2.11.0+cu128 -> v2.11.0+cu130`

    def __post_init__(self) -> None:
        if self.action == "Added":
            line = f"Added {self.subject} {self.new}"
        elif self.action == "Removed":
            line = f"Removed {self.subject} {self.old}"
        elif self.old is None:
            line = f"{self.action} {self.subject}: {self.new}"
        else:
            line = f"{self.action} {self.subject} {self.old} -> {self.new}"
        object.__setattr__(self, "headline", line)


@dataclass(frozen=True, slots=True)
class EnvSide:
    path: str
    format: str
    packages: int
    python: str | None
    torch: str | None  # torch's version as this side shows it
    torch_flavour: str | None  # "cu128", "cu13", "cpu", or None if unknown
    flavour_inferred_from: str | None  # evidence when the flavour is not in the version label


@dataclass(frozen=True, slots=True)
class EnvDiff:
    old: EnvSide
    new: EnvSide
    changes: tuple[Change, ...]  # sorted: critical first
    notes: tuple[str, ...] = field(default=())
    counts: dict[str, int] = field(default_factory=dict)

    def at_or_above(self, threshold: str) -> tuple[Change, ...]:
        limit = _RANK[check_severity(threshold)]
        return tuple(c for c in self.changes if _RANK[c.severity] <= limit)

    def fails(self, threshold: str = "critical") -> bool:
        return bool(self.at_or_above(threshold))


def check_severity(name: str) -> str:
    from compilewatch.errors import BadInput

    if name not in _RANK:
        raise BadInput(f"unknown severity {name!r}", hint=f"one of: {', '.join(SEVERITIES)}")
    return name


# ---------------------------------------------------------------------------------------------------
# entry points


def diff_files(old: str | os.PathLike[str], new: str | os.PathLike[str], *, old_format: str | None = None,
               new_format: str | None = None) -> EnvDiff:
    return diff_envs(load_env(old, old_format), load_env(new, new_format))


def diff_envs(old: EnvSpec, new: EnvSpec) -> EnvDiff:
    changes: list[Change] = []
    notes: list[str] = [*old.notes, *new.notes]
    old_side, new_side = side(old), side(new)
    changes += _torch_changes(old, new, old_side, new_side)
    changes += _package_changes(old, new, notes)
    changes += _python_changes(old.python, new.python)
    if old.lock is not None and new.lock is not None:
        system = _lock_changes(old.lock, new.lock, torch_reported=any(c.subject == TORCH for c in changes))
        # cuDNN/NCCL as torch loads them supersede the nvidia-cudnn/-nccl package lines
        runtime = {c.consequence for c in system if c.subject in ("cuDNN (torch)", "NCCL (torch)")}
        changes = [c for c in changes if not (c.consequence in runtime and c.subject.startswith("nvidia-"))]
        changes += system
    else:
        for s in (old, new):
            if s.lock is None:
                notes.append(f"{s.path} is a {s.format} file: driver, GPU, cache and environment-variable "
                             "facts compare only between two compilewatch locks")
                break
    torch_note = any(c.subject == TORCH and c.note for c in changes)
    for s in (old_side, new_side):
        if s.flavour_inferred_from and not torch_note:  # said once: on the torch change when there is one
            notes.append(f"{s.path}: torch's CUDA flavour {s.torch_flavour} is inferred from "
                         f"{s.flavour_inferred_from} (the version has no +cuXXX label)")
    if old_side.torch and new_side.torch and (old_side.torch_flavour is None) != (new_side.torch_flavour is None):
        unknown = old_side if old_side.torch_flavour is None else new_side
        notes.append(f"{unknown.path}: torch's CUDA flavour is unknown (no +cuXXX label, no CUDA packages): "
                     "a flavour change cannot be ruled out")
    changes.sort(key=_order)
    counts = {s: sum(1 for c in changes if c.severity == s) for s in SEVERITIES}
    return EnvDiff(old=old_side, new=new_side, changes=tuple(changes), notes=tuple(dict.fromkeys(notes)),
                   counts=counts)


def _order(c: Change) -> tuple:
    """Severity first; inside one, torch, then transformers, then the rest by name, grouped CUDA libs last."""
    first = {TORCH: 0, "transformers": 1, "CUDA libraries": 9}.get(c.subject, 5)
    return _RANK[c.severity], first, c.subject.lower()


def side(env: EnvSpec) -> EnvSide:
    version = torch_version(env)
    flavour, evidence = torch_flavour(env)
    return EnvSide(path=env.path, format=env.format, packages=len(env.packages), python=env.python,
                   torch=version, torch_flavour=flavour, flavour_inferred_from=evidence)


# ---------------------------------------------------------------------------------------------------
# torch and its CUDA flavour


def torch_version(env: EnvSpec) -> str | None:
    """torch's version as the side knows it: the runtime `torch.__version__` in a lock, else the package."""
    if env.lock is not None and env.lock.torch is not None:
        return env.lock.torch.version
    pkgs = env.by_name().get(TORCH, ())
    if len(pkgs) == 1:
        return pkgs[0].version or pkgs[0].spec
    return None


def _local(version: str | None) -> str | None:
    try:
        return Version(version).local if version else None
    except ValueError:  # InvalidVersion, or digits past Python's int limit
        return None


def torch_flavour(env: EnvSpec) -> tuple[str | None, str | None]:
    """(flavour, evidence): "cu128" from the label (evidence None), or inferred with the evidence named."""
    local = _local(torch_version(env))
    if local:
        return local, None
    if env.lock is not None and env.lock.torch is not None:
        cuda = env.lock.torch.cuda
        if cuda:
            return "cu" + cuda.replace(".", ""), f"torch.version.cuda {cuda}"
        return "cpu", "torch.version.cuda None"
    by_name = env.by_name()
    for p in by_name.get(TORCH, ()):
        m = re.search(r"cuda(\d+)\.?(\d)?", p.build or "")
        if m:
            return f"cu{m.group(1)}{m.group(2) or ''}", f"conda build {p.build}"
        if re.search(r"(^|_)cpu(_|$)", p.build or ""):
            return "cpu", f"conda build {p.build}"
    if "cpuonly" in by_name:
        return "cpu", "conda package cpuonly"
    for name in ("pytorch-cuda", "cuda-version", "nvidia-cuda-runtime-cu12", "nvidia-cuda-runtime-cu13",
                 "nvidia-cuda-runtime", "cuda-toolkit"):
        for p in by_name.get(name, ()):
            m = re.match(r"(\d+)\.(\d)", p.version or "")
            if m:
                return f"cu{m.group(1)}{m.group(2)}", f"{name} {p.version}"
    for suffix in ("cu13", "cu12", "cu11"):
        hits = sorted(n for n in by_name if n.startswith("nvidia-") and n.endswith("-" + suffix))
        if hits:
            return suffix, f"{hits[0]} ({len(hits)} nvidia-*-{suffix} packages)"
    return None, None


def _cuda_of(flavour: str | None) -> str | None:
    """'cu128' -> '12.8', 'cu130' -> '13.0', 'cu13' -> '13.x'; None for cpu/unknown."""
    m = re.fullmatch(r"cu(\d\d)(\d?)", flavour or "")
    if not m:
        return None
    return f"{m.group(1)}.{m.group(2) or 'x'}"


def _torch_label(version: str | None, flavour: str | None, evidence: str | None) -> str:
    if version is None:
        return "(unknown)"
    if evidence and flavour:
        return f"v{version} ({flavour}, inferred)"
    return f"v{version}"


def _flavour_sentence(old: str | None, new: str | None) -> str:
    oc, nc = _cuda_of(old), _cuda_of(new)
    if oc and nc:
        return (f"the inductor cache is keyed on CUDA {oc} (torch.version.cuda): under CUDA {nc} expect every "
                "entry to miss and a full recompile.")
    if "cpu" in (old, new):
        return ("one side is a CPU-only torch: no CUDA kernels there, and nothing compiled for the GPU on the "
                "other side is reused.")
    return "torch's build flavour differs: the cache key includes it, expect every entry to miss."


def _torch_changes(old: EnvSpec, new: EnvSpec, o: EnvSide, n: EnvSide) -> list[Change]:
    old_pkgs, new_pkgs = old.by_name().get(TORCH, ()), new.by_name().get(TORCH, ())
    if len(old_pkgs) > 1 or len(new_pkgs) > 1:
        return []  # several torch entries (uv.lock): compared as a set with the other packages
    if o.torch is None and n.torch is None:
        return []
    ol, nl = _torch_label(o.torch, o.torch_flavour, o.flavour_inferred_from), \
        _torch_label(n.torch, n.torch_flavour, n.flavour_inferred_from)
    if o.torch is None or n.torch is None:
        action = "Added" if o.torch is None else "Removed"
        return [Change("critical", action, TORCH, ol if o.torch else None, nl if n.torch else None,
                       CONSEQUENCE["torch_presence"])]
    note = "; ".join(f"{s.path}: CUDA flavour inferred from {s.flavour_inferred_from}"
                     for s in (o, n) if s.flavour_inferred_from) or None
    flavour_differs = (o.torch_flavour != n.torch_flavour and o.torch_flavour is not None
                       and n.torch_flavour is not None
                       and not _same_family(o.torch_flavour, n.torch_flavour))
    public_differs = _public(o.torch) != _public(n.torch)
    if public_differs:
        action = _direction(o.torch, n.torch)
        sentence = CONSEQUENCE["torch_version"]
        if flavour_differs:
            flavour = _flavour_sentence(o.torch_flavour, n.torch_flavour)
            sentence += " " + flavour[0].upper() + flavour[1:]
        return [Change("critical", action, TORCH, ol, nl, sentence, note)]
    if flavour_differs:
        return [Change("critical", "Updated", TORCH, ol, nl, _flavour_sentence(o.torch_flavour, n.torch_flavour),
                       note)]
    if old.lock and new.lock and old.lock.torch and new.lock.torch \
            and old.lock.torch.git_version != new.lock.torch.git_version:
        return [Change("critical", "Changed", "torch build", old.lock.torch.git_version,
                       new.lock.torch.git_version, CONSEQUENCE["torch_build"])]
    return []


def _same_family(a: str, b: str) -> bool:
    """'cu13' (inferred from package names only) and 'cu130' are not a difference we can claim."""
    return a.startswith("cu") and b.startswith("cu") and (a.startswith(b) or b.startswith(a)) \
        and min(len(a), len(b)) == 4


def _public(version: str) -> str:
    try:
        return Version(version).public
    except ValueError:  # InvalidVersion, or digits past Python's int limit
        return version


def _direction(old: str | None, new: str | None) -> str:
    try:
        return "Downgraded" if Version(new) < Version(old) else "Updated"  # type: ignore[arg-type]
    except (ValueError, TypeError):
        return "Updated"


# ---------------------------------------------------------------------------------------------------
# packages


def package_severity(name: str) -> tuple[str, str]:
    """(severity, consequence key) of a change to package `name`."""
    if name == TORCH:
        return "critical", "torch_version"
    if name in TRITON_NAMES:
        return "critical", "triton"
    if name == "transformers":
        return "warning", "transformers"
    if name in KERNEL_LIBRARIES or name.startswith(("transformer-engine", "flash-attn")):
        return "warning", "kernels"
    if name.startswith("nvidia-cudnn"):
        return "warning", "cudnn"
    if name.startswith("nvidia-nccl"):
        return "warning", "nccl"
    if name.startswith("nvidia-") and name != "nvidia-ml-py" or name in ("cuda-toolkit", "cuda-bindings", "cuda-python"):
        return "warning", "cuda_lib"
    return "info", "info"


def _family(name: str) -> str:
    """nvidia-cudnn-cu12 and nvidia-cudnn-cu13 are one library in two CUDA flavours: 'nvidia-cudnn'."""
    return re.sub(r"-cu\d+$", "", name) if name.startswith("nvidia-") else name


def _package_changes(old: EnvSpec, new: EnvSpec, notes: list[str]) -> list[Change]:
    a, b = _families(old), _families(new)
    single_torch = len(a.get(TORCH, ())) <= 1 and len(b.get(TORCH, ())) <= 1
    one_side_freeze = (old.format == "requirements") != (new.format == "requirements")
    changes: list[Change] = []
    skipped_freeze = []
    for name in sorted(set(a) | set(b)):
        if name == TORCH and single_torch:
            continue
        ops, nps = a.get(name, ()), b.get(name, ())
        if one_side_freeze and name in FREEZE_OMITS and (not ops or not nps):
            skipped_freeze.append(name)
            continue
        change = _package_change(name, ops, nps)
        if change is not None:
            changes.append(change)
    if skipped_freeze:
        notes.append(f"{', '.join(skipped_freeze)}: present on one side only, and pip freeze omits them: "
                     "not counted as changes")
    return _fold_cuda_libraries(changes)


def _families(env: EnvSpec) -> dict[str, tuple[Package, ...]]:
    out: dict[str, list[Package]] = {}
    for p in env.packages:
        out.setdefault(_family(p.name), []).append(p)
    return {k: tuple(v) for k, v in out.items()}


def _fold_cuda_libraries(changes: list[Change]) -> list[Change]:
    """Many CUDA library changes follow one flavour change: show them as one line with the details."""
    libs = [c for c in changes if c.consequence == CONSEQUENCE["cuda_lib"]]
    if len(libs) <= 3:
        return changes
    rest = [c for c in changes if c.consequence != CONSEQUENCE["cuda_lib"]]
    counts = {a: sum(1 for c in libs if c.action == a) for a in ("Updated", "Downgraded", "Changed", "Added", "Removed")}
    summary = ", ".join(f"{n} {a.lower()}" for a, n in counts.items() if n)
    return rest + [Change("warning", "Changed", "CUDA libraries", None, summary, CONSEQUENCE["cuda_libs"],
                          details=tuple(c.headline for c in libs))]


def _package_change(name: str, ops: tuple[Package, ...], nps: tuple[Package, ...]) -> Change | None:
    severity, key = package_severity(name)
    sentence = CONSEQUENCE[key]
    if not ops:
        return Change(severity, "Added", name, None, _labels(nps, name), sentence)
    if not nps:
        return Change(severity, "Removed", name, _labels(ops, name), None, sentence)
    if len(ops) == 1 and len(nps) == 1:
        o, n = ops[0], nps[0]
        unknown = (o.version is None and o.spec is None) or (n.version is None and n.spec is None)
        if not unknown and (o.version != n.version or o.spec != n.spec or o.name != n.name):
            action = _direction(o.version, n.version) if o.version and n.version else "Changed"
            return Change(severity, action, name, _labels(ops, name), _labels(nps, name), sentence)
        if (o.source, o.editable) != (n.source, n.editable):
            return Change(severity, "Changed", name, f"{o.label()} ({_where(o)})", f"{n.label()} ({_where(n)})",
                          sentence)
        return None
    if _labels(ops, name, with_source=True) != _labels(nps, name, with_source=True):
        return Change(severity, "Updated" if _labels(ops, name) != _labels(nps, name) else "Changed", name,
                      _labels(ops, name, with_source=True), _labels(nps, name, with_source=True), sentence)
    return None


def _labels(pkgs: Iterable[Package], family: str, with_source: bool = False) -> str:
    def one(p: Package) -> str:
        text = p.label() + (f" [{p.name}]" if p.name != family else "")
        return f"{text} ({_where(p)})" if with_source and p.source else text
    return ", ".join(sorted(dict.fromkeys(one(p) for p in pkgs)))


def _where(p: Package) -> str:
    return ("editable " if p.editable else "") + (p.source or "index")


# ---------------------------------------------------------------------------------------------------
# python


def _python_changes(old: str | None, new: str | None) -> list[Change]:
    if not old or not new or old == new:
        return []
    om, nm = old.split(".")[:2], new.split(".")[:2]
    if om != nm:
        return [Change("critical", _direction(old, new), "python", old, new, CONSEQUENCE["python_minor"])]
    return [Change("info", _direction(old, new), "python", old, new, CONSEQUENCE["python_micro"])]


# ---------------------------------------------------------------------------------------------------
# system facts (lock vs lock)


def _lock_changes(o: EnvLock, n: EnvLock, *, torch_reported: bool) -> list[Change]:
    out: list[Change] = []
    add = out.append
    if o.python.implementation != n.python.implementation:
        add(Change("critical", "Changed", "python implementation", o.python.implementation,
                   n.python.implementation, CONSEQUENCE["python_impl"]))
    if o.python.platform != n.python.platform:
        add(Change("critical", "Changed", "platform", o.python.platform, n.python.platform,
                   CONSEQUENCE["python_impl"].replace("Python implementation", "platform")))
    ot, nt = o.torch, n.torch
    if ot and nt:
        if ot.cuda != nt.cuda and not torch_reported:
            add(Change("critical", "Changed", "torch CUDA", ot.cuda or "none (CPU build)", nt.cuda or "none (CPU build)",
                       _flavour_sentence(_flav(ot.cuda), _flav(nt.cuda))))
        asked = getattr(ot, "source", "torch") == "torch" and getattr(nt, "source", "torch") == "torch"
        if ot.cudnn != nt.cudnn and asked:  # a lock read from files does not know them (None)
            add(Change("warning", _direction(str(ot.cudnn), str(nt.cudnn)), "cuDNN (torch)", _cudnn(ot.cudnn),
                       _cudnn(nt.cudnn), CONSEQUENCE["cudnn"]))
        if ot.nccl != nt.nccl and asked:
            add(Change("warning", _direction(ot.nccl, nt.nccl), "NCCL (torch)", str(ot.nccl), str(nt.nccl),
                       CONSEQUENCE["nccl"]))
        if set(ot.arch_list) != set(nt.arch_list) and ot.arch_list and nt.arch_list:
            add(Change("warning", "Changed", "torch arch list", " ".join(ot.arch_list), " ".join(nt.arch_list),
                       CONSEQUENCE["arch_list"]))
    out += _inductor_changes(o, n)
    out += _gpu_changes(o, n)
    if o.cpu.isa_flags != n.cpu.isa_flags and o.cpu.isa_flags and n.cpu.isa_flags:
        add(Change("warning", "Changed", "CPU ISA flags", " ".join(o.cpu.isa_flags), " ".join(n.cpu.isa_flags),
                   CONSEQUENCE["cpu_isa"]))
    if o.cpu.model != n.cpu.model:
        add(Change("info", "Changed", "CPU model", o.cpu.model, n.cpu.model, CONSEQUENCE["cpu_model"]))
    out += _env_changes(o, n)
    return out


def _flav(cuda: str | None) -> str | None:
    return "cu" + cuda.replace(".", "") if cuda else "cpu"


def _cudnn(v: int | None) -> str:
    """torch's cuDNN integer (91900) -> '9.19.0'."""
    if v is None:
        return "none"
    return f"{v // 10000}.{(v % 10000) // 100}.{v % 100}" if v >= 10000 else str(v)


def _inductor_changes(o: EnvLock, n: EnvLock) -> list[Change]:
    oi, ni = o.inductor, n.inductor
    if oi is None or ni is None:
        return []
    out = []
    if oi.system_key and ni.system_key and oi.system_key != ni.system_key:
        out.append(Change("critical", "Changed", "inductor system key", oi.system_key[:12], ni.system_key[:12],
                          CONSEQUENCE["system_key"]))
    if oi.cache_dir != ni.cache_dir:
        out.append(Change("critical", "Changed", "inductor cache dir", oi.cache_dir, ni.cache_dir,
                          CONSEQUENCE["cache_moved"].format(old=oi.cache_dir, new=ni.cache_dir)))
    oc, nc = oi.cache, ni.cache
    if oc and nc:
        had, has = oc.exists and oc.files > 0, nc.exists and nc.files > 0
        if had and not has:
            out.append(Change("critical", "Removed", "inductor cache", _cache_label(oc), None,
                              CONSEQUENCE["cache_gone"]))
        elif has and not had:
            out.append(Change("info", "Added", "inductor cache", None, _cache_label(nc), CONSEQUENCE["cache_new"]))
        elif had and has and (oc.fingerprint != nc.fingerprint or
                              (oc.fingerprint is None and (oc.files, oc.bytes) != (nc.files, nc.bytes))):
            out.append(Change("info", "Changed", "inductor cache", _cache_label(oc), _cache_label(nc),
                              CONSEQUENCE["cache_changed"]))
    if oi.triton_cache_dir != ni.triton_cache_dir and oi.cache_dir == ni.cache_dir:
        out.append(Change("warning", "Changed", "triton cache dir", str(oi.triton_cache_dir),
                          str(ni.triton_cache_dir), CONSEQUENCE["triton_dir"]))
    return out


def _cache_label(c) -> str:
    if not c.exists:
        return f"{c.dir} (missing)"
    return f"{c.dir} ({_mb(c.bytes)}, {c.files} files)"


def _mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB" if n >= 1e5 else f"{n} B"


def _gpu_changes(o: EnvLock, n: EnvLock) -> list[Change]:
    out = []
    od, nd = o.driver, n.driver
    if od and nd and (od.version, od.cuda) != (nd.version, nd.cuda):
        out.append(Change("warning", _direction(od.version, nd.version), "driver",
                          f"{od.version} (CUDA {od.cuda})", f"{nd.version} (CUDA {nd.cuda})", CONSEQUENCE["driver"]))
    if nd and nd.cuda and n.torch and n.torch.cuda and _vtuple(nd.cuda) < _vtuple(n.torch.cuda):
        out.append(Change("critical", "Changed", "driver vs torch CUDA", f"driver CUDA {nd.cuda}",
                          f"torch CUDA {n.torch.cuda}",
                          CONSEQUENCE["driver_too_old"].format(driver=nd.cuda, torch=n.torch.cuda)))
    if not o.gpus or not n.gpus:
        return out
    oa, na = _gpu_models(o), _gpu_models(n)
    if set(oa) != set(na):
        out.append(Change("critical", "Changed", "GPU architecture", _gpu_label(oa), _gpu_label(na),
                          CONSEQUENCE["gpu_arch"]))
    elif len(o.gpus) != len(n.gpus):
        out.append(Change("warning", "Changed", "GPU count", str(len(o.gpus)), str(len(n.gpus)),
                          CONSEQUENCE["gpu_count"]))
    elif sorted(g.uuid_hash for g in o.gpus) != sorted(g.uuid_hash for g in n.gpus):
        out.append(Change("info", "Changed", "GPUs", _gpu_label(oa), _gpu_label(na) + " (other devices)",
                          CONSEQUENCE["gpu_same"]))
    return out


def _gpu_models(lock: EnvLock) -> dict[str, int]:
    models: dict[str, int] = {}
    for g in lock.gpus:
        key = f"{g.name} (sm {g.capability})"
        models[key] = models.get(key, 0) + 1
    return models


def _gpu_label(models: dict[str, int]) -> str:
    return ", ".join(f"{count}x {name}" for name, count in sorted(models.items()))


def _vtuple(v: str) -> tuple[int, ...]:
    return tuple(int(x[:18]) for x in re.findall(r"\d+", v))  # a crafted 10^5-digit number stays an int


# torch reads these too (torch/_dynamo/config.py): TORCH_DYNAMO_AUTOMATIC_DYNAMIC_SHAPES, TORCH_CACHING_PRECOMPILE, ...
_COMPILE_ENV = ("TORCHINDUCTOR_", "TORCHDYNAMO_", "TORCH_DYNAMO_", "TORCH_COMPILE", "TORCH_CACHING_PRECOMPILE",
                "TORCH_STRICT_PRECOMPILE", "TORCH_FAKE_TENSOR_DISPATCH_CACHE", "TRITON_", "TORCH_LOGS")
_RUNTIME_ENV = ("PYTORCH_",)  # PYTORCH_CUDA_ALLOC_CONF, PYTORCH_NO_CUDA_MEMORY_CACHING, ...: read at run time
_COVERED_ENV = frozenset({"TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"})  # reported as cache dir changes
# a variable and the value with which torch turns a cache off (torch._inductor/_functorch/compiler config)
_CACHE_OFF = {"TORCHINDUCTOR_FORCE_DISABLE_CACHES": ("1", "every inductor cache"),
              "TORCH_COMPILE_FORCE_DISABLE_CACHES": ("1", "every inductor cache"),
              "TORCHINDUCTOR_FX_GRAPH_CACHE": ("0", "torch's FX-graph cache"),
              "TORCHINDUCTOR_AUTOGRAD_CACHE": ("0", "torch's AOTAutograd cache")}
_GPU_ENV = frozenset({"CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER"})


def _no_gpu(visible: str | None) -> bool:
    """CUDA_VISIBLE_DEVICES that leaves CUDA no device: empty, or a first entry CUDA cannot match
    ("-1", "none", garbage); CUDA stops at the first entry it cannot match."""
    if visible is None:
        return False
    first = visible.split(",")[0].strip()
    return not (first.isdigit() or first.startswith(("GPU-", "MIG-")))


def _env_change(name: str, ov: str | None, nv: str | None, o: EnvLock, n: EnvLock) -> tuple[str, str]:
    """(severity, consequence) of one variable's change: the changes that turn caches or compile off, or
    hide every GPU that the other side had, are critical; other compile/GPU settings are a risk (warning)."""
    if name in _CACHE_OFF:
        value, what = _CACHE_OFF[name]
        if nv == value and ov != value:
            return "critical", CONSEQUENCE["env_cache_off"].format(name=name, value=value, what=what)
    if name == "TORCH_COMPILE_DISABLE" and nv == "1" and ov != "1":
        return "critical", CONSEQUENCE["env_compile_off"]
    if name == "CUDA_VISIBLE_DEVICES" and _no_gpu(ov) != _no_gpu(nv):
        hidden, seen = (nv, o) if _no_gpu(nv) else (ov, n)
        if seen.gpus and seen.torch is not None and seen.torch.cuda:  # GPUs a CUDA torch would have used
            return "critical", CONSEQUENCE["env_no_gpu"].format(value=repr(hidden))
    if name in _GPU_ENV:
        return "warning", CONSEQUENCE["env_gpus"]
    if name.startswith(_COMPILE_ENV):
        return "warning", CONSEQUENCE["env_compile"]
    if name.startswith(_RUNTIME_ENV):
        return "warning", CONSEQUENCE["env_runtime"]
    return "info", CONSEQUENCE["env_info"]


def _env_changes(o: EnvLock, n: EnvLock) -> list[Change]:
    out = []
    for name in sorted(set(o.env) | set(n.env)):
        ov, nv = o.env.get(name), n.env.get(name)
        if ov == nv or name in _COVERED_ENV:
            continue
        severity, sentence = _env_change(name, ov, nv, o, n)
        action = "Added" if ov is None else "Removed" if nv is None else "Changed"
        out.append(Change(severity, action, f"env {name}", ov, nv, sentence))
    for name in sorted(set(o.env_left_out) ^ set(n.env_left_out)):
        action = "Added" if name in n.env_left_out else "Removed"
        out.append(Change("info", action, f"env {name}", "(secret, not recorded)" if action == "Removed" else None,
                          "(secret, not recorded)" if action == "Added" else None, CONSEQUENCE["secret_env"]))
    return out


__all__ = ["Change", "EnvDiff", "EnvSide", "SEVERITIES", "check_severity", "diff_envs", "diff_files",
           "package_severity", "side", "torch_flavour", "torch_version"]
