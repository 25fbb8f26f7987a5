"""Run one fault or fuzz case in a child process under a wall-clock and an address-space limit.

A hang or a blow-up in the code under test then fails that one case (a timeout, a MemoryError
traceback, exit 137) instead of the suite. Limits are generous, ~10x what a case normally needs on
a 2-core CI machine: a limit that fails a hang or a blow-up, not a benchmark.
"""

from __future__ import annotations

import os
import resource
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
MiB = 1 << 20


@dataclass(frozen=True)
class Outcome:
    rc: int  # -9 (SIGKILL) or "timeout" never: a timeout raises in the test
    stdout: str
    stderr: str

    @property
    def traceback(self) -> bool:
        return "Traceback (most recent call last)" in self.stderr


def _limits(mem: int | None, fsize: int | None):
    def preexec() -> None:
        if mem is not None:
            resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
        if fsize is not None:
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG
            resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))

    return preexec


def run_limited(argv: list[str], *, timeout: float = 30.0, mem: int | None = 1024 * MiB, fsize: int | None = None,
                env: dict[str, str] | None = None, cwd: str | os.PathLike[str] | None = None,
                stdout=subprocess.PIPE) -> Outcome:
    """Run `argv` with RLIMIT_AS `mem`, RLIMIT_FSIZE `fsize` (SIGXFSZ ignored) and `timeout` seconds
    (subprocess.TimeoutExpired fails the test: the case hung)."""
    full_env = dict(os.environ if env is None else env)
    full_env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + [p for p in full_env.get("PYTHONPATH", "").split(os.pathsep) if p])
    p = subprocess.run(argv, stdout=stdout, stderr=subprocess.PIPE, timeout=timeout, env=full_env, cwd=cwd or REPO,
                       preexec_fn=_limits(mem, fsize), text=True, errors="replace")
    return Outcome(p.returncode, p.stdout or "", p.stderr)


def cli(*args: str, **kw) -> Outcome:
    """`compilewatch ARGS` (the console script's own entry, `cli.main:main`) under limits."""
    return run_limited([sys.executable, "-c", "from cli.main import main; main()", *args], **kw)


def python(code: str, *args: str, **kw) -> Outcome:
    """`python -c CODE ARGS` under limits."""
    return run_limited([sys.executable, "-c", code, *args], **kw)


def one_clear_line(o: Outcome, rc: int = 2, *, words: str | None = None, width: int = 2500) -> None:
    """The outcome of bad input or a fault: exit `rc`, an `error:` message of bounded length that says
    `words`, no traceback."""
    assert o.rc == rc, (o.rc, o.stderr[-2000:])
    assert not o.traceback, o.stderr[-3000:]
    assert "error:" in o.stderr, o.stderr[-2000:]
    assert len(o.stderr) < width, len(o.stderr)
    if words is not None:
        assert words in o.stderr, o.stderr[-2000:]


import contextlib  # noqa: E402


@contextlib.contextmanager
def file_size_limit(n: int):
    """In this process, for the `with` block: writes past `n` bytes per file fail with EFBIG (a full
    disk, as the kernel reports it; RLIMIT_FSIZE's soft limit, SIGXFSZ ignored), then back as it was."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    old = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (n, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, old)
