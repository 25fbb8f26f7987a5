"""Fixtures that pin the environment for every test (STYLE.md §12-13).

- NO_COLOR / COLUMNS fixed, so rendered output does not depend on the terminal.
- TORCHINDUCTOR_CACHE_DIR, TRITON_CACHE_DIR, COMPILEWATCH_STATE_DIR, COMPILEWATCH_CONFIG_DIR and DFLASH_DATA_CACHE point
  into tmp_path: tests never touch a user's cache, signing key or trust store.
- Environment variables a test leaks fail that test.
- Repeatable: every test starts from the same `random` and torch seeds, and hypothesis draws the same
  examples on every run (derandomize), so CI sees what a developer saw.
- GPU tests: `@requires_cuda(...)` (tests/helpers.py) skips with the reason; `-m gpu` runs only them.
  A GPU test fails when a warning points at the project's own code (dynamo's "lru_cache-wrapped
  function at 'mask.py:180'" was one; tests/test_no_project_warnings.py holds the same rule on CPU).
"""

from __future__ import annotations

import os
import random
import warnings
from pathlib import Path

import pytest
from hypothesis import settings

settings.register_profile("repeatable", derandomize=True, database=None)
settings.load_profile("repeatable")

from tests.redis_helpers import redis_server, redis_url  # noqa: F401 - fixtures (a real redis-server)

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

