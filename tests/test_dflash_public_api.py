"""dflash's public face (dflash/__init__.py) is frozen here, as compilewatch's is in
tests/test_public_api.py: the CLI and users' programs rely on these names. Changing it is a deliberate
act: edit this list in the same commit. And the CLI uses nothing else from dflash."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import dflash
from tests.import_graph import imports

ROOT = Path(__file__).resolve().parents[1]

SURFACE = {
    "__version__", "train", "RunOutcome", "dry_run", "prepare", "regen", "evaluate",
    "Config", "TargetConfig", "DrafterConfig", "DataConfig", "OptimConfig", "TrainConfig", "TopologyConfig",
    "CheckpointConfig", "MetricsConfig", "EvalConfig", "EMBEDDED_TARGET", "EMBEDDED_DATA",
    "build_config", "resume_config", "apply_overrides", "parse_set", "config_field", "to_dict", "to_toml",
    "TrainResult", "StepMetrics", "EngineReport", "DistributedResult", "RankReport", "PeerFailed",
    "DryRunReport", "PrepareReport", "RegenResult", "EvalResult", "run_complete", "RunComplete", "check_export",
    "changes_since_checkpoint", "data_since_checkpoint",
}


def test_surface_is_frozen():
    assert set(dflash.__all__) == SURFACE


@pytest.mark.parametrize("name", sorted(SURFACE - {"__version__"}))
def test_every_public_name_resolves(name):
    assert getattr(dflash, name) is not None


def test_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        dflash.nope  # noqa: B018


def test_import_is_light():
    code = "import sys, dflash; dflash.build_config; print('torch' in sys.modules)"
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and p.stdout.strip() == "False", p.stderr


def test_the_cli_uses_only_the_public_face():
    found = sorted(f"{f.relative_to(ROOT)}: {mod}" for f in sorted((ROOT / "cli").rglob("*.py"))
                   for mod, _ in imports(f) if mod.split(".")[0] == "dflash" and mod != "dflash"
                   and not (mod.startswith("dflash.") and mod.split(".")[1] in SURFACE))
    assert found == [], "cli/ reaches into dflash's rooms:\n" + "\n".join(found)
