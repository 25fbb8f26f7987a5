"""Fixtures that pin the environment for every test (STYLE.md §12-13).

- NO_COLOR / COLUMNS fixed, so rendered output does not depend on the terminal.
- TORCHINDUCTOR_CACHE_DIR, TRITON_CACHE_DIR, COMPILEWATCH_STATE_DIR, COMPILEWATCH_CONFIG_DIR, DFLASH_DATA_CACHE and
  DFLASH_EVAL_CACHE point into (or beside) tmp_path: tests never touch a user's cache, signing key or trust store.
- Environment variables a test leaks fail that test.
- Repeatable: every test starts from the same `random` and torch seeds, and hypothesis draws the same
  examples on every run (derandomize), so CI sees what a developer saw.
- GPU tests: `@requires_cuda(...)` (tests/helpers.py) skips with the reason; `-m gpu` runs only them.
  A GPU test fails when a warning points at the project's own code (dynamo's "lru_cache-wrapped
  function at 'mask.py:180'" was one; tests/test_no_project_warnings.py holds the same rule on CPU).
- Parallel by default: with pytest-xdist installed, `pytest` runs one worker per CPU this process may use
  (`-n auto`, counted here), all of a test module's tests on one worker (`--dist loadfile`: a module's
  fixtures are built once, and its tests run in file order as before). `-n 0` or `-p no:xdist` runs in
  one process; `-n N` / `--dist` given on the command line win. A crashed worker is not replaced
  (`--max-worker-restart 0` unless given): its test fails and the run ends. Each worker has its own tmp dirs, its
  own redis-server (tests/redis_helpers.py) and its own environment. On a GPU machine (an NVIDIA
  driver) and under `-m gpu` the default stays one process: GPU tests share the devices.
- Torch matrix: a test module whose code reaches torch (tests/matrix.py, read statically) is marked
  `torch_matrix`; .ci/run runs the whole suite under one torch and `-m torch_matrix` under the others.
"""

from __future__ import annotations

import contextlib
import os
import random
import sys
import warnings
from pathlib import Path

import pytest
from hypothesis import settings

settings.register_profile("repeatable", derandomize=True, database=None)
settings.load_profile("repeatable")

# torch's CPU vector-ISA probe, trusted to /proc/cpuinfo (torch._inductor.cpu_vec_isa: config.cpp.vec_isa_ok, env
# TORCHINDUCTOR_VEC_ISA_OK; in 2.11, 2.13 and 2.15). Unset, the first CPU compile of every process builds a test
# program per ISA with g++ and dlopens each in a fresh Python: ~10 s a process on the 2-core CI box (13.1 s -> 4.6 s
# for one small cold compile), paid again by every compiling child a test starts. The ISA picked is the same
# (avx512 here, either way); the setting is in the environment of both runs a cache test compares, so hits and
# misses do not change. Set at import, before any fixture starts a child; a value of your own wins.
os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "1")

from tests.redis_helpers import redis_server, redis_url  # noqa: F401 - fixtures (a real redis-server)

# --- parallel by default (pytest-xdist), and the torch matrix marker ---------------------------------

def _usable_cpus() -> int:
    """CPUs this process may run on: its affinity mask (taskset, cpusets), capped by a cgroup v2 CPU
    quota (a container's --cpus). psutil's count, xdist's default, sees the host's cores instead."""
    try:
        n = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        n = os.cpu_count() or 1
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
        if quota != "max":
            n = min(n, max(1, int(quota) // int(period)))
    except (OSError, ValueError):
        pass
    return max(1, n)


@pytest.hookimpl(optionalhook=True, tryfirst=True)
def pytest_xdist_auto_num_workers(config):
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS"):
        return None  # xdist's own override
    return _usable_cpus()


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config):
    """No -n on the command line: `-n auto --dist loadfile` (here, not in addopts, so that
    `-p no:xdist` still works). Workers run what the controller sends them."""
    if not config.pluginmanager.hasplugin("xdist") or hasattr(config, "workerinput"):
        return
    if config.option.numprocesses is None:
        # GPU tests share the devices and some of them time work on them: on a machine with an NVIDIA
        # driver, or with `-m gpu`, one process unless -n says otherwise
        gpus = "gpu" in (config.option.markexpr or "") or os.path.exists("/dev/nvidiactl")
        config.option.numprocesses = 0 if gpus else "auto"
    if config.option.dist == "no" and config.option.numprocesses != 0:
        config.option.dist = "loadfile"  # a module's module- and session-scoped fixtures: built once
    if getattr(config.option, "maxworkerrestart", "") is None:
        # a worker that crashes (a segfault in torch) fails its test and ends the run, instead of xdist
        # sending the module to replacement workers again and again (and once hanging CI on one)
        config.option.maxworkerrestart = 0


# --- every hint a test triggers names options its command has (cli/app.py unknown_options) --------------
_HINT_LOG = "COMPILEWATCH_HINT_LOG"


def pytest_configure(config):
    """The controller (or a lone process) picks the log; xdist workers inherit it from its environment,
    and so do the CLI subprocesses tests start."""
    if hasattr(config, "workerinput") or os.environ.get(_HINT_LOG):
        return
    import tempfile

    fd, path = tempfile.mkstemp(prefix="compilewatch-hints-", suffix=".log")
    os.close(fd)
    os.environ[_HINT_LOG] = path
    config._compilewatch_hint_log = path


def pytest_sessionfinish(session, exitstatus):
    path = getattr(session.config, "_compilewatch_hint_log", None)
    if path is None:
        return
    try:
        lines = sorted(set(Path(path).read_text(encoding="utf-8").splitlines()))
    except OSError:
        lines = []
    finally:
        with contextlib.suppress(OSError):
            os.unlink(path)
    if lines:
        sys.stderr.write("\nerror: hints or messages name options their command does not have "
                         "(cli/app.py unknown_options):\n" + "".join(f"  {ln}\n" for ln in lines[:30]))
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Before `-m` selects: mark `torch_matrix` every test of a module that reaches torch (tests/matrix.py),
    and `gpu` every test that `requires_cuda` (tests/helpers.py) guards, so `-m gpu` selects them all."""
    from tests import matrix
    from tests.helpers import CUDA_MARK_REASON

    verdicts: dict[Path, bool] = {}
    for item in items:
        if any(CUDA_MARK_REASON in str(m.kwargs.get("reason", "")) for m in item.iter_markers("skipif")):
            item.add_marker(pytest.mark.gpu)
        path = Path(str(item.path))
        if path not in verdicts:
            verdicts[path] = matrix.classify(path)[0]
        if verdicts[path]:
            item.add_marker(matrix.MARKER)


_PROJECT_DIRS = tuple(str(Path(__file__).resolve().parents[1] / d) for d in ("compilewatch", "dflash", "cli"))


def project_warnings(records) -> list[str]:
    """The warnings raised from, or naming, a file of compilewatch/, dflash/ or cli/."""
    return [f"{r.filename}:{r.lineno}: {str(r.message)[:300]}" for r in records
            if str(r.filename).startswith(_PROJECT_DIRS) or any(d in str(r.message) for d in _PROJECT_DIRS)]


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    if item.get_closest_marker("gpu") is None:
        return (yield)
    with warnings.catch_warnings(record=True) as records:
        warnings.simplefilter("always")
        result = yield
    for r in records:  # shown in pytest's summary as before
        warnings.warn_explicit(r.message, r.category, r.filename, r.lineno)
    ours = project_warnings(records)
    assert not ours, f"warnings from the project's own code during a GPU test: {ours}"
    return result

_ENV_ALLOW = {"TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "PYTEST_CURRENT_TEST", "COLUMNS", "NO_COLOR",
              "TORCHINDUCTOR_COMPILE_THREADS", "_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR",
              "KMP_DUPLICATE_LIB_OK", "KMP_INIT_AT_FORK", "TORCH_LOGS",
              # torch sets these itself when CUDA / triton initialize (seen on the H200, torch 2.11)
              "CUDA_MODULE_LOADING", "TRITON_PTXAS_PATH"}


@pytest.fixture(autouse=True)
def _seeded():
    """The same random state at the start of every test: a test that draws unseeded numbers
    (torch.randn, random.random) draws the same ones on every run and machine."""
    import torch

    random.seed(0)
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _pinned_env(tmp_path, monkeypatch):
    before = dict(os.environ)
    monkeypatch.setenv("NO_COLOR", "1")
    monkeypatch.setenv("COLUMNS", "160")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor-cache"))
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton-cache"))
    monkeypatch.setenv("COMPILEWATCH_STATE_DIR", str(tmp_path / "compilewatch-state"))  # the triton key memo
    monkeypatch.setenv("DFLASH_DATA_CACHE", str(tmp_path / "dflash-data-cache"))  # tokenized data (dflash.data.cache)
    # signing key, trust store: beside tmp_path, so tests that compare what tmp_path holds do not see it
    monkeypatch.setenv("COMPILEWATCH_CONFIG_DIR", str(tmp_path.parent / f"{tmp_path.name}-compilewatch-config"))
    # plain baselines runs share (dflash.eval.baseline_store): beside tmp_path too (a run dir may be tmp_path)
    monkeypatch.setenv("DFLASH_EVAL_CACHE", str(tmp_path.parent / f"{tmp_path.name}-dflash-eval-cache"))
    monkeypatch.delenv("COMPILEWATCH_SIGNING_KEY", raising=False)
    yield
    monkeypatch.undo()
    after = dict(os.environ)
    leaked = {k for k in set(after) ^ set(before) if k not in _ENV_ALLOW}
    leaked |= {k for k in set(after) & set(before) if after[k] != before[k] and k not in _ENV_ALLOW}
    for k in leaked:  # restore, then fail
        if k in before:
            os.environ[k] = before[k]
        else:
            os.environ.pop(k, None)
    assert not leaked, f"test leaked environment variables: {sorted(leaked)}"


@pytest.fixture(autouse=True)
def _clean_fx_flag():
    """A test that leaves the FX flag stuck must not poison the ones after it. Reset through
    compilewatch.tracing.torchcompat (this thread's flag where torch keeps it per thread); a test that
    plants the module-global flag on a torch that no longer has one fails."""
    yield
    import torch.fx._symbolic_trace as st

    from compilewatch.tracing import torchcompat

    planted = torchcompat.fx_flag_layout().per_thread and "_is_fx_tracing_flag" in vars(st)
    if planted:
        del st._is_fx_tracing_flag  # remove it before failing, so later tests see torch as it is
    torchcompat.reset_fx_flag()
    assert not planted, "the test planted _is_fx_tracing_flag, which this torch removed"

