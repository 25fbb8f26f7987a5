"""Helpers shared by tests: run a CLI app with CliRunner and parse its JSON; a per-case time limit."""

from __future__ import annotations

import contextlib
import json
from typing import Any

import pytest

from typer.testing import CliRunner


def invoke(app, args: list[str]):
    """Run `app` with `args`; return the result (exit_code, stdout, stderr)."""
    runner = CliRunner()
    return runner.invoke(app, args, catch_exceptions=False)


def invoke_json(app, args: list[str], expect_code: int = 0) -> Any:
    result = invoke(app, [*args, "--json"])
    assert result.exit_code == expect_code, (result.exit_code, result.stdout, result.stderr)
    return json.loads(result.stdout)


CUDA_MARK_REASON = "[requires_cuda]"  # in every requires_cuda reason: conftest marks those tests `gpu`


def requires_cuda(min_gpus: int = 1, bf16: bool = False):
    """skipif listing every unmet GPU requirement (Lightning's RunIf pattern); the test is also marked `gpu`."""
    import torch

    reasons = []
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if n < min_gpus:
        reasons.append(f"needs {min_gpus} CUDA GPU(s), found {n}")
    if bf16 and n and not torch.cuda.is_bf16_supported():
        reasons.append("needs bf16 support")
    return pytest.mark.skipif(bool(reasons), reason=f"{CUDA_MARK_REASON} " + ("; ".join(reasons) or "ok"))


@contextlib.contextmanager
def time_limit(seconds: float):
    """Fail (TimeoutError) when the block runs longer than `seconds`: in a fault or fuzz suite a hang
    is a failure, not a stuck CI job (SIGALRM: the main thread only; a blocking syscall is interrupted)."""
    import signal

    def fire(signum, frame):
        raise TimeoutError(f"over the {seconds} s limit")

    old = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
