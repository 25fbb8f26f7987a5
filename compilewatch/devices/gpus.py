"""What the NVIDIA GPUs are doing, from NVML (`nvidia-ml-py`, imported as `pynvml`), with processes
enriched by psutil, and an imbalance verdict for GPUs that run the same job.

No driver is a normal state (STYLE.md §3): `sample()` returns `()` and `status()` an empty report
whose `reason` says "no NVIDIA GPU/driver found". NVML indices follow PCI bus order; CUDA's follow it
only with CUDA_DEVICE_ORDER=PCI_BUS_ID (CUDA orders devices fastest first by default: the CUDA
programming guide's `CUDA_DEVICE_ORDER`), so `nvidia-smi` and NVML agree, torch may not.

`sample()` is the cheap call for per-step metrics (memory and utilization only, no process scan);
`status()` is the full view the `gpus` command shows.
"""

from __future__ import annotations

import dataclasses
import statistics
import threading
from dataclasses import dataclass
from typing import Hashable, Mapping, TypeVar

IMBALANCE_RATIO = 0.6  # a GPU below 60% of the median of its job's other GPUs is flagged
BUSY_FRACTION = 0.1  # a GPU with no visible process counts as busy above 10% memory used

K = TypeVar("K", bound=Hashable)

_lock = threading.Lock()
_initialized = False


@dataclass(frozen=True, slots=True)
class GpuSample:
    index: int  # NVML index (PCI bus order)
    memory_used: int  # bytes
    memory_total: int
    utilization: int | None  # % of the last sample period a kernel ran; None if not supported


@dataclass(frozen=True, slots=True)
class GpuProcess:
    pid: int
    gpu_memory: int | None  # bytes NVML attributes to it on this GPU (None inside some containers)
    name: str | None  # from psutil; None when the PID is not visible here
    cmdline: str | None
    user: str | None
    visible: bool  # psutil found the PID (False: another PID namespace / container, or it exited)

    @property
    def label(self) -> str:
        return self.cmdline or self.name or f"pid {self.pid}"


@dataclass(frozen=True, slots=True)
class Imbalance:
    """One GPU that uses much less memory than the other GPUs of the same job."""

    gpu: int
    job: str  # what the GPUs share: their process command lines
    group: tuple[int, ...]  # every GPU of that job
    memory_used: int
    others_median: float  # median memory used by the job's other GPUs
    ratio: float  # memory_used / others_median

    @property
    def message(self) -> str:
        gb = 1024 ** 3
        return (f"GPU {self.gpu} uses {self.memory_used / gb:.1f} GB while the other GPUs of the same job "
                f"({', '.join(map(str, (g for g in self.group if g != self.gpu)))}) use a median of "
                f"{self.others_median / gb:.1f} GB ({self.ratio:.0%}): a worker on it may have failed to start, "
                f"crashed, or be stuck (job: {self.job})")


@dataclass(frozen=True, slots=True)
class Gpu:
    index: int
    name: str
    uuid: str | None
    memory_used: int
    memory_total: int
    utilization: int | None
    processes: tuple[GpuProcess, ...]
    imbalance: Imbalance | None = None  # set when this GPU is the low one of its job


@dataclass(frozen=True, slots=True)
class GpuStatus:
    available: bool
    reason: str | None  # why no GPU is listed ("no NVIDIA GPU/driver found (...)")
    driver_version: str | None
    gpus: tuple[Gpu, ...]
    imbalances: tuple[Imbalance, ...]
    verdicts: tuple[str, ...]
    warnings: tuple[str, ...]  # GPUs or processes that could not be read


def _nvml():
    """pynvml, initialized once per process; raises pynvml.NVMLError when there is no driver."""
    global _initialized
    import pynvml

    with _lock:
        if not _initialized:
            pynvml.nvmlInit()
            _initialized = True
    return pynvml


def _text(v) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def _memory_and_util(nv, h) -> tuple[int, int, int | None]:
    mem = nv.nvmlDeviceGetMemoryInfo(h)
    try:
        util: int | None = int(nv.nvmlDeviceGetUtilizationRates(h).gpu)
    except nv.NVMLError:
        util = None
    return int(mem.used), int(mem.total), util


def sample() -> tuple[GpuSample, ...]:
    """Memory and utilization of every GPU, cheaply (no process scan). `()` without a driver."""
    try:
        nv = _nvml()
        n = nv.nvmlDeviceGetCount()
    except Exception:  # noqa: BLE001 - pynvml.NVMLError or a broken install: no GPUs to report
        return ()
    out = []
    for i in range(n):
        try:
            used, total, util = _memory_and_util(nv, nv.nvmlDeviceGetHandleByIndex(i))
        except nv.NVMLError:
            continue
        out.append(GpuSample(i, used, total, util))
    return tuple(out)


def _process(pid: int, gpu_memory: int | None) -> GpuProcess:
    try:
        import psutil

        p = psutil.Process(pid)
        with p.oneshot():
            name = p.name()
            try:
                cmd = " ".join(p.cmdline()) or None
            except (psutil.AccessDenied, psutil.ZombieProcess):
                cmd = None
            try:
                user = p.username()
            except (psutil.AccessDenied, KeyError):
                user = None
        if cmd and len(cmd) > 300:
            cmd = cmd[:300] + " ..."
        return GpuProcess(pid, gpu_memory, name, cmd, user, True)
    except Exception:  # noqa: BLE001 - NoSuchProcess / AccessDenied: not visible from here
        return GpuProcess(pid, gpu_memory, None, None, None, False)


def _processes(nv, h) -> tuple[GpuProcess, ...]:
    procs = nv.nvmlDeviceGetComputeRunningProcesses(h)
    out = {}
    for p in procs:
        used = getattr(p, "usedGpuMemory", None)
        out[int(p.pid)] = _process(int(p.pid), None if used is None else int(used))
    return tuple(out.values())


def _job_key(g: Gpu) -> str | None:
    if g.processes:
        return " | ".join(sorted({p.label for p in g.processes}))
    if g.memory_total and g.memory_used > BUSY_FRACTION * g.memory_total:
        return "(processes not visible)"
    return None  # idle


def low_outliers(values: Mapping[K, float], ratio: float = IMBALANCE_RATIO) -> dict[K, float]:
    """The imbalance rule (docs/gpus.md), decided here only: every key whose value is below `ratio`
    x the median of the *other* values, mapped to that median. Comparing with the others makes two
    values work (40 vs 77 is flagged; a median that includes the low value would hide it) and keeps
    one busy outlier from flagging everyone else (unlike a max). Fewer than two values, or others
    whose median is 0, flag nothing; a value exactly at the threshold is not flagged.
    Used for GPUs of one job (`find_imbalances`) and for dflash's drafter devices (engine verdicts)."""
    out: dict[K, float] = {}
    if len(values) < 2:
        return out
    for key, value in values.items():
        med = float(statistics.median(v for k, v in values.items() if k != key))
        if med > 0 and value < ratio * med:
            out[key] = med
    return out


def find_imbalances(gpus: list[Gpu] | tuple[Gpu, ...], ratio: float = IMBALANCE_RATIO) -> tuple[Imbalance, ...]:
    """GPUs of one job (same set of processes) whose memory is below `ratio` x the median of the
    job's other GPUs: the symptom of the 8-GPU trainer in docs/gpus.md (one drafter GPU at 40 GB next to
    two at 72-77 GB)."""
    groups: dict[str, list[Gpu]] = {}
    for g in gpus:
        key = _job_key(g)
        if key is not None:
            groups.setdefault(key, []).append(g)
    out = []
    for key, members in groups.items():
        low = low_outliers({g.index: g.memory_used for g in members}, ratio)
        for g in members:
            if g.index in low:
                med = low[g.index]
                out.append(Imbalance(g.index, key, tuple(m.index for m in members), g.memory_used, med,
                                     g.memory_used / med))
    return tuple(out)


def status() -> GpuStatus:
    """Every GPU with memory, utilization and processes, plus imbalance verdicts."""
    try:
        nv = _nvml()
        n = nv.nvmlDeviceGetCount()
    except Exception as e:  # noqa: BLE001 - NVMLError_LibraryNotFound, DriverNotLoaded, ...
        reason = f"no NVIDIA GPU/driver found ({type(e).__name__}: {e})"
        return GpuStatus(False, reason, None, (), (), ("no NVIDIA GPU/driver found",), ())
    try:
        driver: str | None = _text(nv.nvmlSystemGetDriverVersion())
    except nv.NVMLError:
        driver = None
    gpus: list[Gpu] = []
    warnings: list[str] = []
    for i in range(n):
        try:
            h = nv.nvmlDeviceGetHandleByIndex(i)
            used, total, util = _memory_and_util(nv, h)
            name = _text(nv.nvmlDeviceGetName(h))
            try:
                uuid: str | None = _text(nv.nvmlDeviceGetUUID(h))
            except nv.NVMLError:
                uuid = None
            try:
                procs = _processes(nv, h)
            except nv.NVMLError as e:
                procs = ()
                warnings.append(f"GPU {i}: cannot list processes ({e})")
        except nv.NVMLError as e:
            warnings.append(f"GPU {i}: unreadable ({type(e).__name__}: {e})")
            continue
        gpus.append(Gpu(i, name, uuid, used, total, util, procs))
    imbalances = find_imbalances(gpus)
    by_gpu = {im.gpu: im for im in imbalances}
    gpus = [dataclasses.replace(g, imbalance=by_gpu.get(g.index)) for g in gpus]
    hidden = sum(1 for g in gpus for p in g.processes if not p.visible)
    if hidden:
        warnings.append(f"{hidden} GPU process(es) not visible to psutil (another container or PID namespace)")
    return GpuStatus(True, None, driver, tuple(gpus), imbalances, tuple(_verdicts(gpus, imbalances)), tuple(warnings))


def _verdicts(gpus: list[Gpu], imbalances: tuple[Imbalance, ...]) -> list[str]:
    if not gpus:
        return ["NVML found no GPUs"]
    out = [im.message for im in imbalances]
    if not imbalances:
        busy = [g for g in gpus if _job_key(g) is not None]
        out.append(f"{len(gpus)} GPU(s), {len(busy)} in use; no memory imbalance between GPUs of the same job.")
    return out
