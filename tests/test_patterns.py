"""compilewatch.tracing.patterns: known torch failures are recognised by their real message, and docs/race.md
shows every pattern with its fix."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from compilewatch.tracing import patterns

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("message, name, race", [
    ("BackendCompilerFailed: backend='aot_eager' raised:\nRuntimeError: false INTERNAL ASSERT FAILED at "
     "\"c10/core/Scalar.h\":273, please report a bug to PyTorch. NYI SymInt equality", "recompile_dynamic_symint_assert",
     False),
    ("RuntimeError: Detected that you are using FX to symbolically trace a dynamo-optimized function. This is not "
     "supported at the moment.", "nested_fx_trace", True),
    ("NameError: module is not installed as a submodule", "module_not_submodule", True),
    ("AssertionError: CURRENT_PATCHER is None in finally block", "patcher_assert", True),
])
def test_messages_name_their_real_cause(message, name, race):
    p = patterns.match(message)
    assert p is not None and p.name == name and p.race is race and p.fix


def test_unknown_messages_and_findings():
    assert patterns.match("ValueError: shapes differ") is None and patterns.match(None) is None
    assert patterns.for_kind("stuck_state").name == "stuck_flag" and patterns.for_kind("stall").name == "compile_hang"
    assert "dynamic=False" in patterns.by_name("recompile_dynamic_symint_assert").fix
    assert "TORCH_DYNAMO_AUTOMATIC_DYNAMIC_SHAPES=0" in patterns.by_name("recompile_dynamic_symint_assert").fix


def test_race_md_shows_the_table():
    text = (ROOT / "docs" / "race.md").read_text()
    for p in patterns.PATTERNS:
        row = next((ln for ln in text.splitlines() if ln.startswith(f"| `{p.name}` |")), None)
        assert row is not None, p.name
        assert p.fix in row and p.cause in row and p.torch_versions in row
        if p.regex:
            re.compile(p.regex)
            assert f"`{p.regex}`" in row
