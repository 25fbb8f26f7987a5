"""What a training step measured, and where it is written (metrics JSONL; TensorBoard when installed).

Per step: loss, per-slot accuracy (slot k predicts the token at anchor + k), the acceptance length τ
estimated from it (1 + mean leading run of correct slots over complete blocks), tokens/s (sequence
tokens through target and drafter), the time split (data, target forward, drafter forward+backward,
optimizer), learning rate, gradient norm, and memory (peak CUDA allocation, else process RSS).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from compilewatch.serialize import to_jsonable


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

    def row(self) -> dict[str, Any]:
        return to_jsonable(asdict(self))


def memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    try:
        import psutil

        return int(psutil.Process().memory_info().rss)
    except Exception:  # noqa: BLE001 - memory is informative only
        return 0


class MetricsWriter:
    """Appends rows to RUN/metrics.jsonl (flushed per row) and mirrors scalars to TensorBoard."""

    def __init__(self, run_dir: Path, tensorboard: bool = True) -> None:
        self.path = Path(run_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fh = open(self.path, "a", encoding="utf-8")
        self._tb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(log_dir=str(Path(run_dir) / "tensorboard"))
            except Exception:  # noqa: BLE001 - tensorboard is optional (ImportError or its deps)
                self._tb = None

    @property
    def tensorboard(self) -> bool:
        return self._tb is not None

    def write(self, m: StepMetrics) -> None:
        self._fh.write(json.dumps(m.row()) + "\n")
        self._fh.flush()
        if self._tb is not None:
            for k in ("loss", "lr", "grad_norm", "tau_estimate", "tokens_per_s"):
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


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """Step rows of a metrics.jsonl (events skipped)."""
    rows = []
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            if line.strip():
                row = json.loads(line)
                if "event" not in row:
                    rows.append(row)
    return rows
