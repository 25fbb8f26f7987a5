"""The learning-rate schedule: warmup, then cosine, warmup-stable-decay (wsd) or constant."""

from __future__ import annotations

import math


def lr_at(step: int, total: int, cfg) -> float:
    """Learning rate for the optimizer step with 0-based index `step` (warmup, then cosine / wsd)."""
    peak, low = cfg.lr, cfg.lr * cfg.min_lr_ratio
    warm = int(round(cfg.warmup_ratio * total))
    if step < warm:
        return peak * (step + 1) / warm
    if cfg.schedule == "constant":
        return peak
    if cfg.schedule == "wsd":
        decay = max(1, int(round(cfg.decay_ratio * total)))
        start = total - decay
        if step < start:
            return peak
        return low + (peak - low) * max(0.0, (total - step - 1) / decay)
    progress = (step - warm) / max(1, total - warm - 1)
    return low + (peak - low) * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
