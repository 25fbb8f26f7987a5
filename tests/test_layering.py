"""The house's arrows point down: cli/ -> dflash/ -> compilewatch/. No module below imports one above
(read from the source with ast, so imports inside functions count too, and so do string imports:
import_module, lazy maps, entry points resolved through pyproject.toml: tests/import_graph.py).
Inside compilewatch, no two rooms (folders) import each other."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.import_graph import imports, module_name

ROOT = Path(__file__).resolve().parents[1]

# the one sanctioned upward reach: `python -m dflash` (and `torchrun -m dflash`) is a launcher, not
# library code; it runs the installed `dflash` console script (cli.dflash_main) through its entry point
ALLOWED_UP = {"dflash/__main__.py": {"cli"}}


def imported_packages(path: Path) -> set[str]:
    """Top-level names of every absolute import in a file, string imports included (relative
    imports stay in their package)."""
    names = {mod.split(".")[0] for mod, _ in imports(path)}
    return names - ALLOWED_UP.get(str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else "", set())


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


def _room(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) >= 2 and parts[0] == "compilewatch" else None


def mutual_rooms(root: Path = ROOT) -> set[tuple[str, str]]:
    """Pairs of compilewatch folders that import each other (static or string imports)."""
    edges = set()
    for f in (root / "compilewatch").rglob("*.py"):
        src = _room(module_name(f, root))
        for mod, _ in imports(f, root):
            dst = _room(mod)
            if src and dst and src != dst and all((root / "compilewatch" / r).is_dir() for r in (src, dst)):
                edges.add((src, dst))
    return {tuple(sorted(e)) for e in edges if (e[1], e[0]) in edges}


def test_no_two_compilewatch_rooms_import_each_other():
    assert mutual_rooms() == set()


def test_the_checker_sees_string_imports(tmp_path):
    (tmp_path / "pyproject.toml").write_text('[project.scripts]\ntool = "cli.main:main"\n')
    for pkg in ("cli", "dflash", "compilewatch", "compilewatch/a", "compilewatch/b"):
        (tmp_path / pkg).mkdir(parents=True)
        (tmp_path / pkg / "__init__.py").write_text("")
    (tmp_path / "cli" / "main.py").write_text("")
    (tmp_path / "compilewatch" / "a" / "x.py").write_text(
        'import importlib\nM = importlib.import_module("compilewatch.b")\n'
        '_LAZY = {"run": ("cli.main", "main")}\n'
        'from importlib.metadata import entry_points\nentry_points(group="console_scripts", name="tool")\n')
    (tmp_path / "compilewatch" / "b" / "y.py").write_text('"""compilewatch.a is named in a docstring only"""\n'
                                                          "from compilewatch.a import x\n")
    found = imports(tmp_path / "compilewatch" / "a" / "x.py", tmp_path)
    assert ("compilewatch.b", "string") in found and found.count(("cli.main", "string")) == 2
    assert mutual_rooms(tmp_path) == {("a", "b")}
