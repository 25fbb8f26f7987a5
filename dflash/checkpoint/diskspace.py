"""How much disk a run's checkpoints take, and whether the next one fits.

A checkpoint holds the fp32 master weights and AdamW's two moments (training_state.pt: 3 x 4 bytes
per parameter, plus step counters), the export in the compute dtype (model.safetensors) and a few
small files. Before the first save that is an estimate from the parameter count; after it, the
size of the newest checkpoint on disk. A save writes the new checkpoint before retention removes the
oldest, so the run's peak is `keep_last + 1` full checkpoints plus the exports kept by
`export_every`; `check_fits` asks for one checkpoint plus a margin to be free.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

SMALL_FILES = 1 << 20  # config.json, train_config.toml, manifest.json: a few KB; one MiB covers them
MARGIN = 1.05  # free space asked for beyond one checkpoint's size (filesystem overhead, estimates)


@dataclass(frozen=True)
class DiskPlan:
    checkpoint_bytes: int  # one full checkpoint (estimated, or measured from the newest one)
    export_bytes: int  # its model.safetensors
    saves: int  # checkpoints this run (from its current step) will write
    peak_bytes: int  # the most this run's checkpoints hold at once (keep_last + 1 full, plus kept exports)
    free_bytes: int  # free on the run directory's filesystem now
    measured: bool  # checkpoint_bytes comes from a checkpoint on disk


def estimate(num_params: int, export_itemsize: int) -> tuple[int, int]:
    """(checkpoint bytes, export bytes) for a drafter of `num_params` fp32 parameters."""
    export = num_params * export_itemsize
    return 3 * 4 * num_params + export + SMALL_FILES, export


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


def free_bytes(path: Path) -> int:
    """Free bytes for an unprivileged writer on `path`'s filesystem (its nearest existing parent)."""
    p = Path(path).absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    return shutil.disk_usage(p).free


def plan(run_dir: Path, num_params: int, export_itemsize: int, *, step: int, total_steps: int, every: int,
         keep_last: int, export_every: int, newest: Path | None = None) -> DiskPlan:
    ckpt, export = estimate(num_params, export_itemsize)
    measured = False
    if newest is not None and newest.is_dir():
        ckpt, measured = dir_bytes(newest), True
        ex = newest / "model.safetensors"
        export = ex.stat().st_size if ex.is_file() else export
    steps = range(step + 1, total_steps + 1)
    saved = [s for s in steps if s % every == 0 or s == total_steps]
    kept_exports = sum(1 for s in saved[:-keep_last] if export_every > 0 and s % export_every == 0)
    peak = min(len(saved), keep_last + 1) * ckpt + kept_exports * (export + SMALL_FILES)
    return DiskPlan(ckpt, export, len(saved), peak, free_bytes(run_dir), measured)


def gb(n: int) -> str:
    """Bytes for a message: GB, MB or KB (decimal, as `df -H`)."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6)):
        if n >= scale / 10:
            return f"{n / scale:.1f} {unit}"
    return f"{n / 1e3:.1f} KB"


def shortfall(p: DiskPlan) -> str | None:
    """Why one more checkpoint does not fit (the numbers), or None when it does."""
    need = int(p.checkpoint_bytes * MARGIN)
    if p.free_bytes >= need:
        return None
    return (f"{gb(p.free_bytes)} free, one checkpoint needs {gb(p.checkpoint_bytes)} "
            f"({'measured' if p.measured else 'estimated'}: training state + {gb(p.export_bytes)} export)")
