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


# --- no cycles between files; the cache room's sub-rooms in one order --------------------------------

HOUSE = ("cli", "dflash", "compilewatch")
CACHE_ROOMS = ("trust", "local", "content", "archive", "remote")  # each may import only those before it


def _modules(root: Path = ROOT) -> dict[str, Path]:
    return {module_name(f, root): f for pkg in HOUSE if (root / pkg).is_dir() for f in (root / pkg).rglob("*.py")}


def import_edges(root: Path = ROOT) -> dict[str, set[str]]:
    """module -> the house's modules it imports (static, lazy in-function and string imports). A name
    imported from a package resolves to the deepest module that exists; a module importing a package
    above itself (its own __init__) is not an edge: Python runs that __init__ first anyway."""
    mods = _modules(root)
    edges: dict[str, set[str]] = {}
    for m, f in mods.items():
        out = set()
        for name, _ in imports(f, root):
            parts = name.split(".")
            while parts and ".".join(parts) not in mods:
                parts.pop()
            dep = ".".join(parts)
            if dep and dep != m and not m.startswith(dep + "."):
                out.add(dep)
        edges[m] = out
    return edges


def import_cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    cycles: list[list[str]] = []
    for start in sorted(edges):
        if start in index:
            continue
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on.add(start)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in edges:
                    continue
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(edges[w]))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    x = stack.pop()
                    on.discard(x)
                    comp.append(x)
                    if x == v:
                        break
                if len(comp) > 1:
                    cycles.append(sorted(comp))
    return cycles


def test_no_import_cycle_between_files():
    assert import_cycles(import_edges()) == []


def test_the_cycle_finder_sees_a_lazy_cycle(tmp_path):
    (tmp_path / "pyproject.toml").write_text("[project]\nname = 'x'\n")
    (tmp_path / "compilewatch").mkdir()
    (tmp_path / "compilewatch" / "__init__.py").write_text("")
    (tmp_path / "compilewatch" / "a.py").write_text("from compilewatch import b\n")
    (tmp_path / "compilewatch" / "b.py").write_text("def f():\n    from compilewatch.c import x\n")
    (tmp_path / "compilewatch" / "c.py").write_text('import importlib\nM = importlib.import_module("compilewatch.a")\n')
    (tmp_path / "compilewatch" / "d.py").write_text("from compilewatch import a\n")
    assert import_cycles(import_edges(tmp_path)) == [["compilewatch.a", "compilewatch.b", "compilewatch.c"]]


def _cache_room(module: str) -> str | None:
    parts = module.split(".")
    return parts[2] if len(parts) >= 4 and parts[:2] == ["compilewatch", "cache"] else None


def test_cache_rooms_import_only_the_rooms_before_them():
    rooms = sorted(p.name for p in (ROOT / "compilewatch" / "cache").iterdir() if (p / "__init__.py").is_file())
    assert sorted(CACHE_ROOMS) == rooms, "a new cache room needs its place in CACHE_ROOMS"
    up = set()
    for m, deps in import_edges().items():
        src = _cache_room(m)
        if src is None:
            continue
        for d in deps:
            dst = _cache_room(d)
            if dst is not None and dst != src and CACHE_ROOMS.index(dst) > CACHE_ROOMS.index(src):
                up.add((m, d))
            assert not d.startswith(("cli", "dflash")), (m, d)
    assert up == set()


def test_each_cache_room_says_what_it_may_import():
    """The `May import:` line of each room's docstring names exactly the rooms before it."""
    import ast

    for i, room in enumerate(CACHE_ROOMS):
        doc = ast.get_docstring(ast.parse((ROOT / "compilewatch" / "cache" / room / "__init__.py").read_text()))
        line = next((ln for ln in (doc or "").splitlines() if ln.startswith("May import:")), None)
        assert line is not None, f"compilewatch/cache/{room}/__init__.py: no 'May import:' line"
        named = {r for r in CACHE_ROOMS if f"`{r}`" in line}
        before = set(CACHE_ROOMS[:i])
        assert named == before or ("every other cache room" in line and i == len(CACHE_ROOMS) - 1), (room, line)


MAX_FILE_LINES = 700
MAX_CLASS_LINES = 300


def test_no_file_over_700_lines_and_no_class_over_300():
    """A file or class past these holds two jobs: split it where the jobs part (not by cutting)."""
    import ast

    long_files, long_classes = {}, {}
    for pkg in ("compilewatch", "dflash"):
        for f in sorted((ROOT / pkg).rglob("*.py")):
            text = f.read_text(encoding="utf-8")
            rel = str(f.relative_to(ROOT))
            if text.count("\n") > MAX_FILE_LINES:
                long_files[rel] = text.count("\n")
            for node in ast.walk(ast.parse(text)):
                if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > MAX_CLASS_LINES:
                    long_classes[f"{rel}:{node.name}"] = node.end_lineno - node.lineno + 1
    assert (long_files, long_classes) == ({}, {})
