"""The house's arrows point down: cli/ -> dflash/ -> compilewatch/. No module below imports one above
(read from the source with ast, so imports inside functions count too)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def imported_packages(path: Path) -> set[str]:
    """Top-level names of every absolute import in a file (relative imports stay in their package)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize("package, forbidden", [("dflash", {"cli"}), ("compilewatch", {"cli", "dflash"})])
def test_no_module_imports_a_package_above_it(package, forbidden):
    files = sorted((ROOT / package).rglob("*.py"))
    assert files
    offenders = {str(f.relative_to(ROOT)): sorted(imported_packages(f) & forbidden) for f in files}
    assert {f: up for f, up in offenders.items() if up} == {}


def test_python_m_dflash_runs_the_installed_command():
    p = subprocess.run([sys.executable, "-m", "dflash", "--version"], cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0 and p.stdout.startswith("dflash "), p.stderr


def test_python_m_dflash_without_the_installed_command_says_so(monkeypatch, capsys):
    import dflash.__main__ as entry

    monkeypatch.setattr(entry, "entry_points", lambda **kw: ())
    assert entry.main() == 2
    err = capsys.readouterr().err
    assert "`dflash` command is not installed" in err and "pip install" in err
