"""`doctor`: one report on what decides whether torch.compile works in this environment, with verdicts.

Environment facts (torch build, triton, python), the inductor cache (where, how big, whether it was
built for this machine's system key), the GPUs, the thread race on this torch (what it fixed upstream
and what it did not, probed by compilewatch.tracing.torchcompat), the dynamo limits that silently turn compiled code eager, whether dynamo
config is per thread, and known issues of the installed torch. Each check ends in a Verdict; a
verdict of level "problem" makes the command exit 1.

The cache facts come from one function (`cache_status`): it uses the `compilewatch.cache` package
(issue 4) when it is installed (entry stamps), else a plain walk and the names of the system-keyed
files in `<cache>/cache/`.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from compilewatch import torchinfo
from compilewatch.devices import gpus as _gpus
from compilewatch.tracing import torchcompat

if TYPE_CHECKING:
    from compilewatch.remote_usage import RemoteUsage

Level = Literal["ok", "info", "warn", "problem"]

ENV_VARS = ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "TORCHINDUCTOR_FX_GRAPH_CACHE",
            "TORCHINDUCTOR_FX_GRAPH_REMOTE_CACHE", "TORCHINDUCTOR_AUTOGRAD_REMOTE_CACHE",
            "TORCHINDUCTOR_AUTOTUNE_REMOTE_CACHE", "TORCHINDUCTOR_BUNDLED_AUTOTUNE_REMOTE_CACHE",
            "TORCHINDUCTOR_AUTOGRAD_CACHE", "TORCHINDUCTOR_FORCE_DISABLE_CACHES", "TORCH_COMPILE_DISABLE",
            "TORCHDYNAMO_DISABLE", "TORCH_COMPILE_CACHE_KEY_TAG", "CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER",
            "TORCH_LOGS", "PYTORCH_CUDA_ALLOC_CONF")


@dataclass(frozen=True, slots=True)
class Verdict:
    level: Level
    topic: str  # "cache", "fx-flag", "dynamo", "threads", "gpus", "torch", "env"
    message: str
    advice: str | None = None


@dataclass(frozen=True, slots=True)
class EnvFacts:
    python: str
    platform: str
    torch: str
    torch_cuda: str | None
    cudnn: int | None
    nccl: str | None
    triton: str | None
    cuda_available: bool
    device_count: int
    env: dict[str, str]  # the compile-relevant environment variables that are set


@dataclass(frozen=True, slots=True)
class CacheStatus:
    path: str
    source: str  # "TORCHINDUCTOR_CACHE_DIR" or "default"
    exists: bool
    size_bytes: int
    files: int
    subdirs: dict[str, int]  # bytes per top-level folder (fxgraph, aotautograd, triton, ...)
    system_key: str  # this machine's (CacheBase.get_system()["hash"])
    entry_system_keys: tuple[str, ...]  # keys named by `<cache>/cache/<key>` files
    system_key_match: bool | None  # True: entries for this key exist; False: only other keys; None: unknown
    method: str  # how this was found out
    foreign_entries: int | None = None  # entries built for another system/torch (compilewatch.cache only)
    broken_entries: int | None = None  # empty/truncated/unloadable entries (compilewatch.cache only)
    elsewhere: dict[str, int] | None = None  # bytes of its sub-caches outside `path` (precompiled headers, ...)
    writable: bool | None = None  # whether this process may write there (None: it does not exist yet)


@dataclass(frozen=True, slots=True)
class FxFacts:
    global_flag: bool  # torch keeps the FX tracing flag as a plain module global (up to 2.13)
    flag_now: bool | None  # its value now, in this thread (True outside any trace = stuck; None: unknown layout)
    error_on_nested_fx_trace: bool | None
    force_compile_during_fx_trace: bool | None
    layout: str = "unknown"  # "global", "thread_local" (torch 2.14+) or "unknown"
    stuck: bool = False  # the flag, nn.Module.__call__/__getattr__ or CURRENT_PATCHER left set now
    race: torchcompat.RaceFacts | None = None  # what this torch fixed upstream and what it did not


@dataclass(frozen=True, slots=True)
class DynamoLimits:
    recompile_limit: int | None  # per code object (older torch: cache_size_limit)
    accumulated_recompile_limit: int | None
    fail_on_recompile_limit_hit: bool | None
    automatic_dynamic_shapes: bool | None
    config_per_thread: bool | None  # measured: a value set here is not seen by a new thread


@dataclass(frozen=True, slots=True)
class GpuSummary:
    available: bool
    reason: str | None
    driver_version: str | None
    gpus: tuple[str, ...]  # "0: NVIDIA H200, 12.0 GB / 140.4 GB, 3%"
    imbalances: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class DoctorReport:
    env: EnvFacts
    cache: CacheStatus
    gpus: GpuSummary
    fx: FxFacts
    dynamo: DynamoLimits
    verdicts: tuple[Verdict, ...]
    ok: bool  # no verdict of level "problem"
    remote: "RemoteUsage | None" = None  # torch's remote caches, when the environment turns one on


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _set_env() -> dict[str, str]:
    return {k: os.environ[k] for k in ENV_VARS if k in os.environ}


def env_facts(env: dict[str, str] | None = None) -> EnvFacts:
    """`env`: the variables as they were before torch was used (torch sets TORCHINDUCTOR_CACHE_DIR
    itself when it first resolves the cache dir)."""
    env = _set_env() if env is None else env
    b = torchinfo.torch_build()
    triton = _version("triton") or _version("pytorch-triton")
    return EnvFacts(
        python=platform.python_version(), platform=f"{platform.system()} {platform.machine()}", torch=b.version,
        torch_cuda=b.cuda, cudnn=b.cudnn, nccl=b.nccl, triton=triton, cuda_available=b.cuda_available,
        device_count=b.device_count, env=env,
    )


def cache_status(env: dict[str, str] | None = None) -> CacheStatus:
    """The inductor cache: location, size, and whether it was built for this machine's system key
    (compilewatch.cache's walk, and its quick verify: the system keys stamped inside entries, bytes
    only, nothing unpickled)."""
    from compilewatch.cache.content import verify as cache_verify
    from compilewatch.cache.local import layout as cache_layout

    env = _set_env() if env is None else env
    root, source = cache_layout.default_root(env)
    exists = root.is_dir()  # before the system key: importing torch._inductor creates the default dir
    key = torchinfo.system_key()
    if not exists:
        return CacheStatus(str(root), source, False, 0, 0, {}, key, (), None, "not found")
    writable = os.access(root, os.W_OK | os.X_OK)
    try:
        w = cache_layout.walk(root)
        per: dict[str, int] = {}
        for f in w.files:
            sub = cache_layout.subcache_of(f.rel)
            per[sub] = per.get(sub, 0) + f.size
        rep = cache_verify.verify(root, deep=False)
    except Exception as e:  # noqa: BLE001 - doctor reports; an unreadable cache is a fact, not a crash
        return CacheStatus(str(root), source, True, 0, 0, {}, key, (), None,
                           f"compilewatch.cache failed: {type(e).__name__}: {e}", writable=writable)
    stamped = {k: n for k, n in rep.entry_system_keys.items() if k != "unknown"}
    match = None if not stamped else key in stamped
    foreign = sum(n for k, n in rep.counts.items() if k.startswith("foreign"))
    errors = sum(n for k, n in rep.counts.items() if k in getattr(cache_verify, "ERROR_KINDS", ()))
    return CacheStatus(str(root), source, True, sum(f.size for f in w.files), len(w.files), dict(sorted(per.items())),
                       key, tuple(sorted(stamped)), match, "compilewatch.cache walk + verify (quick)",
                       foreign_entries=foreign, broken_entries=errors, writable=writable,
                       elsewhere={f"{e.name} ({e.path})": e.bytes for e in cache_layout.elsewhere(cache_layout.locate(root))})


def fx_facts() -> FxFacts:
    import torch._dynamo.config as dc

    from compilewatch.tracing import fxpatch

    race = torchcompat.race_facts()
    try:
        stuck = fxpatch.stuck_state().stuck
    except Exception:  # noqa: BLE001 - a torch whose patcher is not recognised: reported through `race`
        stuck = False
    return FxFacts(race.fx_flag == "global", torchcompat.fx_flag(),
                   getattr(dc, "error_on_nested_fx_trace", None), getattr(dc, "force_compile_during_fx_trace", None),
                   layout=race.fx_flag, stuck=stuck, race=race)


def dynamo_limits() -> DynamoLimits:
    import torch._dynamo.config as dc

    def first(*names):
        for n in names:
            if hasattr(dc, n):
                return getattr(dc, n)
        return None

    return DynamoLimits(
        recompile_limit=first("recompile_limit", "cache_size_limit"),
        accumulated_recompile_limit=first("accumulated_recompile_limit", "accumulated_cache_size_limit"),
        fail_on_recompile_limit_hit=first("fail_on_recompile_limit_hit"),
        automatic_dynamic_shapes=first("automatic_dynamic_shapes"),
        config_per_thread=torchcompat.dynamo_config_per_thread(),
    )


def gpu_summary() -> GpuSummary:
    st = _gpus.status()
    lines = tuple(f"{g.index}: {g.name}, {g.memory_used / 2**30:.1f} GB / {g.memory_total / 2**30:.1f} GB"
                  + ("" if g.utilization is None else f", {g.utilization}%") for g in st.gpus)
    return GpuSummary(st.available, st.reason, st.driver_version, lines, tuple(im.message for im in st.imbalances))


def _public(version: str) -> tuple[int, int]:
    from packaging.version import Version

    v = Version(version)
    return v.major, v.minor


def _verdicts(env: EnvFacts, cache: CacheStatus, g: GpuSummary, fx: FxFacts, dyn: DynamoLimits) -> list[Verdict]:
    out: list[Verdict] = []
    v = _public(env.torch)
    # --- the race (what this torch fixed upstream and what it did not: torchcompat.race_facts) ---
    if fx.flag_now or fx.stuck:
        out.append(Verdict("problem", "fx-flag", "tracing state (the FX flag, nn.Module.__call__ or CURRENT_PATCHER) "
                           "is set while nothing traces: it is stuck, later compiled or module calls in this process "
                           "will fail", "a crashed or overlapping trace left it set; restart the process"))
    race = fx.race
    warm_advice = ("compile every device one after another before starting threads: `compilewatch warm --devices ... "
                   "-- python train.py` (or compilewatch.prewarm in the trainer)")
    patch_advice = ("use compilewatch.CompileGuard() (its thread-local mode makes the patch and CURRENT_PATCHER per "
                    "thread), and do not trace while other threads run modules: `compilewatch warm` before threads start")
    held = torchcompat.compiling_flag_held_for_session()
    if race is not None:
        for fixed in race.fixed:
            out.append(Verdict("ok", "fx-flag", f"fixed in torch {env.torch}: {fixed}"))
        for still in race.not_fixed:
            if still == torchcompat.COMPILING_NOT_FIXED:
                if not held:  # else the "torch" verdict below says it, with what it means
                    out.append(Verdict("info", "threads", f"not fixed in torch {env.torch}: {still}"))
                continue
            out.append(Verdict("warn", "fx-flag", f"not fixed in torch {env.torch}: {still}",
                               warm_advice if still == torchcompat.FLAG_NOT_FIXED else patch_advice))
        for unknown in race.unknown:
            out.append(Verdict("warn", "fx-flag", f"not recognised in torch {env.torch}: {unknown}; compilewatch's "
                               "watcher and guard cannot watch or fix it on this torch",
                               "check for a newer compilewatch; warm sequentially before threads start"))
    if fx.error_on_nested_fx_trace is False and not fx.force_compile_during_fx_trace:
        who = "another thread" if fx.global_flag else "the same thread"  # a per-thread flag only leaks within
        out.append(Verdict("warn", "fx-flag", "torch._dynamo.config.error_on_nested_fx_trace is False: a compiled "
                           f"call made while {who} traces runs EAGERLY, silently (for flex_attention: the "
                           "dense, unfused path)", "leave it True so the race shows up as an error"))
    # --- dynamo limits and per-thread config ---
    if dyn.recompile_limit is not None:
        n = max(env.device_count, 1)
        msg = (f"recompile_limit = {dyn.recompile_limit} per function (accumulated {dyn.accumulated_recompile_limit}): "
               "every (device, shape, dtype) combination is one more compile of the same function; past the limit "
               "torch runs it eagerly (a log warning, no error)")
        level: Level = "warn" if n >= dyn.recompile_limit else "info"
        out.append(Verdict(level, "dynamo", msg + (f"; this machine has {n} GPUs" if level == "warn" else ""),
                           "raise torch._dynamo.config.recompile_limit (in every worker thread on torch >= 2.12), "
                           "keep shapes fixed, or set fail_on_recompile_limit_hit=True to fail loudly"))
    if dyn.config_per_thread:
        out.append(Verdict("warn", "threads", "dynamo/inductor config is per thread here (torch >= 2.12, "
                           "pytorch#186537): values set in the main thread do not reach worker threads",
                           "set recompile_limit, error_on_nested_fx_trace and inductor options inside each worker "
                           "thread, or through environment variables"))
    # --- known torch versions (torch/compiler/__init__.py, docs/race.md, docs/benchmarks.md) ---
    if v == (2, 11):
        out.append(Verdict("warn", "torch", "torch 2.11: is_compiling() is False inside AOTAutograd's traces, and a "
                           "3-thread cold start of compiled flex_attention fwd+bwd hung 3/3 on an H200",
                           "always warm sequentially before threads start"))
    if held:
        msg = (f"torch {env.torch} holds torch.compiler's compiling flag, a process global, for a whole dynamo compile "
               "session: while one thread compiles, is_compiling() reads True in every thread")
        if fx.global_flag:
            msg += (", which hides the FX-flag race for dynamo compiles, but plain make_fx/symbolic_trace in one "
                    "thread still breaks compiled calls in others")
        out.append(Verdict("info", "torch", msg))
    if v < (2, 6):
        out.append(Verdict("warn", "torch", f"torch {env.torch} has no torch.compiler.set_stance: `warm` cannot "
                           "verify strictly", "use torch >= 2.6"))
    # --- cache ---
    size = f"{cache.size_bytes / 2**30:.2f} GB" if cache.size_bytes >= 2**30 else f"{cache.size_bytes / 2**20:.1f} MB"
    if not cache.exists:
        out.append(Verdict("info", "cache", f"no inductor cache at {cache.path} yet: the first compiles will be cold"))
    else:
        out.append(Verdict("ok", "cache", f"inductor cache at {cache.path} ({cache.source}): {size} in "
                           f"{cache.files} files"))
    if cache.exists and cache.writable is False:
        out.append(Verdict("problem", "cache", f"the inductor cache {cache.path} is not writable by this process "
                           "(permissions or a read-only filesystem): torch writes the code it generates there, so "
                           "torch.compile fails",
                           "point TORCHINDUCTOR_CACHE_DIR at a directory you may write, or fix its permissions"))
    others = [k for k in cache.entry_system_keys if k != cache.system_key]
    if cache.system_key_match is False:
        out.append(Verdict("problem", "cache", f"the cache was built for {len(others)} other system key(s) "
                           f"({', '.join(k[:12] + '…' for k in others)}), not this machine's ({cache.system_key[:12]}…): "
                           "every entry will miss silently (GPU, CUDA or triton differ)",
                           "rebuild it here (`compilewatch warm`); `compilewatch cache verify --fix` moves the "
                           "foreign entries aside"))
    elif cache.system_key_match and others:
        out.append(Verdict("info", "cache", f"besides this machine's entries the cache holds entries for {len(others)} "
                           "other system key(s): they never hit here (dead weight, or a cache copied from elsewhere)"))
    if cache.broken_entries:
        out.append(Verdict("warn", "cache", f"{cache.broken_entries} cache entries are empty, truncated or unreadable",
                           "`compilewatch cache verify` lists them; `--fix` moves them aside"))
    elif cache.system_key_match is None and cache.exists:
        out.append(Verdict("info", "cache", "the cache holds no system-keyed file, so whether its entries match this "
                           f"machine's system key ({cache.system_key[:12]}…) is not known from a file walk"))
    if cache.path.startswith("/tmp/"):
        out.append(Verdict("info", "cache", f"the cache lives in {cache.path}: clean-ups and reboots delete it, and "
                           "every process after that compiles from scratch",
                           "set TORCHINDUCTOR_CACHE_DIR to a persistent path"))
    for var in ("TORCHINDUCTOR_FX_GRAPH_CACHE", "TORCHINDUCTOR_AUTOGRAD_CACHE"):
        if env.env.get(var) == "0":
            out.append(Verdict("warn", "cache", f"{var}=0: that cache is off, every process compiles from scratch"))
    if env.env.get("TORCHINDUCTOR_FORCE_DISABLE_CACHES") == "1":
        out.append(Verdict("warn", "cache", "TORCHINDUCTOR_FORCE_DISABLE_CACHES=1: every inductor cache is off"))
    # --- GPUs ---
    if not g.available:
        out.append(Verdict("info", "gpus", "no NVIDIA GPU/driver found"))
    else:
        for m in g.imbalances:
            out.append(Verdict("problem", "gpus", m))
        if len(g.gpus) > 1 and env.env.get("CUDA_DEVICE_ORDER") != "PCI_BUS_ID":
            out.append(Verdict("info", "gpus", "CUDA_DEVICE_ORDER is not PCI_BUS_ID: torch's cuda:N may not be "
                               "nvidia-smi's GPU N", "export CUDA_DEVICE_ORDER=PCI_BUS_ID"))
    return out


def remote_verdicts(u: "RemoteUsage | None") -> list[Verdict]:
    """torch's remote caches: on and answering, or on and unreachable (a problem: torch stays silent)."""
    from compilewatch import remote_usage

    if u is None:
        return []
    if u.down:
        return [Verdict("problem", "cache", remote_usage.down_message(u),
                        "start redis-server there or fix TORCHINDUCTOR_REDIS_URL (`compilewatch cache remote status`)")]
    if u.enabled:
        return [Verdict("ok", "cache", f"torch's remote caches ({', '.join(u.enabled)}) are on: {u.url} {u.why}")]
    return []


def explain_verdicts(cache_path: str) -> list[Verdict]:
    """Issue 38: the hit rate of the last watched run on this cache and its top miss cause (compilewatch.explain)."""
    from compilewatch.explain.explain import last_run_line

    line = last_run_line(cache_path)
    return [] if line is None else [Verdict(line[0], "cache", line[1])]


def doctor() -> DoctorReport:
    """Collect every fact and verdict. Never raises for what it finds."""
    from compilewatch import remote_usage

    before = _set_env()  # before anything below lets torch set TORCHINDUCTOR_CACHE_DIR
    env = env_facts(before)
    cache = cache_status(before)
    g = gpu_summary()
    fx = fx_facts()
    dyn = dynamo_limits()
    remote = remote_usage.usage(counts={})  # os.environ: torch sets none of these; the URL is shown redacted
    verdicts = tuple(_verdicts(env, cache, g, fx, dyn) + remote_verdicts(remote) + explain_verdicts(cache.path))
    return DoctorReport(env, cache, g, fx, dyn, verdicts, not any(v.level == "problem" for v in verdicts), remote)

