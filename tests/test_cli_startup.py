"""Fast paths stay fast: `compilewatch lock`, `compilewatch --help` and `dflash --help` never import
torch or transformers (their timings are in benchmarks/cli_startup.py and docs/benchmarks.md)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

RUN = """
import sys
from {module} import app
try:
    app({args!r})
except SystemExit as e:
    assert e.code in (0, None), e.code
heavy = sorted(m for m in ("torch", "transformers", "triton") if m in sys.modules)
assert not heavy, "imported " + ", ".join(heavy)
"""


@pytest.mark.parametrize("module, args", [
    ("cli.main", ["lock", "--json", "--no-gpus"]),
    ("cli.main", ["--help"]),
    ("cli.main", ["diff-env", "--help"]),
    ("cli.dflash_main", ["--help"]),
    ("cli.dflash_main", ["train", "--help"]),
])
def test_no_torch_import(module, args, tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO), "COMPILEWATCH_STATE_DIR": str(tmp_path)}
    r = subprocess.run([sys.executable, "-c", RUN.format(module=module, args=args)], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]


def test_lock_records_how_it_found_its_facts(tmp_path):
    from compilewatch.env import lock as envlock

    lock = envlock.snapshot(with_gpus=False)
    assert lock.torch.source == "files" and lock.inductor.system_key_source == "files"
    import torch

    assert lock.torch.version == torch.__version__ and lock.torch.cuda == torch.version.cuda
    from torch._inductor.codecache import CacheBase

    assert lock.inductor.system_key == CacheBase.get_system()["hash"]
