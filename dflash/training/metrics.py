"""What a training step measured, and where it is written (metrics JSONL; TensorBoard when asked for).

Per step: loss, per-slot accuracy (slot k predicts the token at anchor + k), the acceptance length τ
estimated from it (1 + mean leading run of correct slots over complete blocks), tokens/s (sequence
tokens through target and drafter), the time split (data, target forward, drafter forward+backward,
optimizer), learning rate, gradient norm, and memory (peak CUDA allocation, else process RSS); and
how much of the work was real: valid blocks/s, the share of computed blocks that were valid, and the
share of the target's tokens that were not padding.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from compilewatch import BadInput, atomic_write_text, to_jsonable


@dataclass(frozen=True, slots=True)
class StepMetrics:
    step: int  # optimizer steps completed, counting this one
    epoch: int
    loss: float  # Σ w·CE / Σ w over the step's global batch
    lr: float
    grad_norm: float  # before clipping
    accuracy: tuple[float, ...]  # per slot 1..B-1
    tau_estimate: float
    tokens: int  # sequence tokens in the global batch
    blocks: int  # trained (valid) blocks in the global batch
    seconds: float  # wall time of the step
    tokens_per_s: float
    time_split: dict[str, float]  # data / target / drafter / optim seconds
    memory_bytes: int
    block_slots: int = 0  # blocks the drafter computed (valid + padding slots)
    valid_block_share: float = 0.0  # blocks / block_slots: the drafter's work that was real
    valid_blocks_per_s: float = 0.0
    token_slots: int = 0  # tokens the target computed (rows × row length, padding included)
    target_fill: float = 0.0  # tokens / token_slots: the target's work that was real

    def row(self) -> dict[str, Any]:
        return to_jsonable(asdict(self))


class StepClock:
    """Where a step's time goes (target, drafter, optimizer) without waiting for the GPU in the middle of the
    step: on CUDA a mark is an event recorded in the device's current stream, read once the step has synced
    (`seconds`), so the spans are the GPU's time between marks; elsewhere a mark is the wall clock. A sync
    per span (the way this was measured before) left the GPU idle while the host queued the next work."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.spans: list[tuple[str, Any, Any]] = []

    def mark(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record(torch.cuda.current_stream(self.device))
            return event
        return time.perf_counter()

    def add(self, kind: str, start, end) -> None:
        self.spans.append((kind, start, end))

    def seconds(self) -> dict[str, float]:
        """Seconds per kind, summed over its spans (CUDA: call after the device synced; waits for the last event)."""
        out: dict[str, float] = {}
        for kind, a, b in self.spans:
            if self.cuda:
                b.synchronize()
            out[kind] = out.get(kind, 0.0) + (a.elapsed_time(b) / 1e3 if self.cuda else b - a)
        return out


def memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    try:
        import psutil

        return int(psutil.Process().memory_info().rss)
    except Exception:  # noqa: BLE001 - memory is informative only
        return 0


def tensorboard_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("tensorboard") is not None


def check_tensorboard(cfg) -> None:
    """BadInput when `metrics.tensorboard` is on and the tensorboard package is missing."""
    if cfg.tensorboard and not tensorboard_available():
        raise BadInput("metrics.tensorboard = true, but the tensorboard package is not installed",
                       hint="pip install tensorboard, or drop metrics.tensorboard (metrics.jsonl has every logged step)")


MAX_ROW_BYTES = 1 << 20  # a metrics.jsonl row or event is a few KB; a longer line is damage


def truncate_rows(path: Path, after_step: int) -> int:
    """Drop the step rows past `after_step` from a metrics.jsonl (atomically); events stay. A resumed run
    repeats the steps after its checkpoint, so the killed segment's rows for them would be duplicates.
    Returns the number of rows dropped."""
    from dflash.data.dataset import capped_lines

    if not path.is_file():
        return 0
    keep, dropped = [], 0
    with open(path, "rb") as fh:  # bytes, each line bounded: a torn or damaged line is dropped, never decoded whole
        for _, raw in capped_lines(fh, MAX_ROW_BYTES):
            try:
                if raw is None:
                    raise ValueError("a line longer than any row")
                line = raw.decode("utf-8")
                row = json.loads(line) if line.strip() else None
            except ValueError:  # UnicodeDecodeError too
                row = None  # a line torn by the kill: not a complete row
                dropped += 1
                continue
            if isinstance(row, dict) and "event" not in row and isinstance(row.get("step"), int) and row["step"] > after_step:
                dropped += 1
                continue
            if row is not None:
                keep.append(line if line.endswith("\n") else line + "\n")
    if dropped:
        atomic_write_text(path, "".join(keep))
    return dropped


class MetricsWriter:
    """Appends rows to RUN/metrics.jsonl (flushed per row) and mirrors scalars to TensorBoard (when
    `tensorboard`; check_tensorboard() first). `after_step`: the step this segment starts from; rows of
    later steps from a killed earlier segment are dropped first, so the file has one row per step."""

    def __init__(self, run_dir: Path, tensorboard: bool = False, after_step: int = 0) -> None:
        self.path = Path(run_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self.path.exists() and not self.path.is_file() or self.path.is_symlink() and not self.path.exists():
            what = "a directory" if self.path.is_dir() else "a dangling link" if not self.path.exists() else \
                "not a regular file"
            raise BadInput(f"{str(self.path)!r} is {what}: the run's metrics log is written there",
                           hint="move it out of the run directory, then run the command again")
        self.truncated = truncate_rows(self.path, after_step)
        self._fh = open(self.path, "a", encoding="utf-8")
        self._tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(Path(run_dir) / "tensorboard"))

    @property
    def tensorboard(self) -> bool:
        return self._tb is not None

    def write(self, m: StepMetrics) -> None:
        self._fh.write(json.dumps(m.row()) + "\n")
        self._fh.flush()
        if self._tb is not None:
            for k in ("loss", "lr", "grad_norm", "tau_estimate", "tokens_per_s", "valid_blocks_per_s",
                      "valid_block_share", "target_fill"):
                self._tb.add_scalar(f"train/{k}", getattr(m, k), m.step)
            for i, a in enumerate(m.accuracy, 1):
                self._tb.add_scalar(f"accuracy/slot_{i:02d}", a, m.step)

    def write_event(self, kind: str, data: dict[str, Any]) -> None:
        self._fh.write(json.dumps({"event": kind, **to_jsonable(data)}) + "\n")
        self._fh.flush()

    def close(self) -> None:
        if not self._fh.closed:
            self._fh.close()
        if self._tb is not None:
            self._tb.close()
            self._tb = None
