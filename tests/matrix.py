"""Which test modules are torch-version sensitive: the ones CI runs under every torch version it tests
(.ci/run: the whole suite under 2.13.0, then `-m torch_matrix` under 2.15.0 and 2.11.0).

A test module is sensitive when what it touches reaches torch, read statically (tests/import_graph.py's
`imports()`: import statements, in functions too, and string imports) and followed transitively through
the house's modules (cli/, dflash/, compilewatch/, with the packages above each one, whose __init__
Python runs first) and the tests' own helpers (tests/*.py, benchmarks/*.py). A test also touches:
- what a program it starts reaches: `-m MODULE` in an argument list (`python -m dflash`, `torchrun -m`),
  a console script's name (`compilewatch`, `dflash` -> cli.main / cli.dflash_main, from pyproject),
  a `python -c` or script source held in a string (its imports), a `.py` file of tests/ or benchmarks/
  named in a string (a script it runs or loads by path), a package a prefix f-string imports from
  (`import_module(f"tests.race_programs.{name}")`: every module of that package);
- what the CLI reaches when it drives the CLI in process (typer's CliRunner on an app it imports: the
  import of `cli.*` already names it).

"Reaches torch" means importing one of TORCH_PACKAGES: torch itself, or a third-party package that
imports torch on import (TORCH_PACKAGES says why each is there). tests/conftest.py is left out of
every closure: its autouse fixtures (torch seeds, the FX-flag reset) run around every test, so under
a torch that breaks them every test fails, matrix or not; they say nothing about which test is sensitive.

OVERRIDES holds the few modules where this rule is provably wrong, each with its reason;
tests/test_matrix.py checks the rule on synthetic modules and that every override names a real
file and says why. `python -m tests.matrix` prints every module's verdict and the chain that made it.
"""

from __future__ import annotations

import ast
import re
import sys
from functools import lru_cache
from pathlib import Path

from tests.import_graph import ROOT, PACKAGES, entry_point_targets, imports, module_exists

MARKER = "torch_matrix"

# top-level (or dotted) names whose import imports torch
TORCH_PACKAGES = {
    "torch": "torch itself",
    "functorch": "ships inside the torch wheel",
    "torchgen": "ships inside the torch wheel",
    "triton": "pinned by torch's wheel (a CUDA torch's dependency); version-locked to torch",
    "transformers": "dflash's target models are transformers' torch models (PreTrainedModel imports torch)",
    "safetensors.torch": "safetensors' torch bridge imports torch",
}

UNREADABLE = "(a file that does not parse: counted as reaching torch)"

# test file (relative to the repo root) -> (sensitive or not, why the static rule is wrong for it)
OVERRIDES: dict[str, tuple[bool, str]] = {
    "tests/test_matrix.py": (False, "its torch imports are the source of synthetic test modules it writes "
                                    "to tmp_path and classifies with this file; it never runs them, and "
                                    "the classification reads files only (ast), the same under any torch"),
}

# roots of the helpers a test may import or run besides the house's packages
_HELPER_ROOTS = ("tests", "benchmarks")
_CODE_HINT = re.compile(r"^\s*(?:import|from)\s+[\w.]+", re.M)


def _torch_package(module: str) -> str | None:
    parts = module.split(".")
    for i in range(1, len(parts) + 1):
        if ".".join(parts[:i]) in TORCH_PACKAGES:
            return ".".join(parts[:i])
    return None


def module_file(module: str, root: Path = ROOT) -> Path | None:
    """The source file of a house or helper module (a package: its __init__.py), else None."""
    if module.split(".")[0] not in (*PACKAGES, *_HELPER_ROOTS):
        return None
    base = root.joinpath(*module.split("."))
    for p in (base.with_suffix(".py"), base / "__init__.py"):
        if p.is_file():
            return p
    return None


def _with_parents(module: str) -> list[str]:
    parts = module.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts) + 1)]


def _embedded_code(text: str) -> ast.Module | None:
    """Python source held in a string (`python -c CODE`, a script a test writes and runs), parsed."""
    if "import" not in text or not _CODE_HINT.search(text.replace(";", "\n")):
        return None
    for src in (text, text.replace(";", "\n")):
        try:
            return ast.parse(src)
        except SyntaxError:
            continue
    return None


def _run_module(name: str, root: Path) -> list[tuple[str, str]]:
    """`python -m NAME`: a package runs its __init__ (PARENT) and its __main__; a module runs whole."""
    if module_exists(f"{name}.__main__", root):
        return [(name, PARENT), (f"{name}.__main__", FULL)]
    return [(name, FULL)]


@lru_cache(maxsize=None)
def _helper_files(root: Path) -> dict[str, tuple[Path, ...]]:
    """basename -> the .py files of that name under tests/ and benchmarks/."""
    out: dict[str, list[Path]] = {}
    for r in _HELPER_ROOTS:
        for p in sorted((root / r).rglob("*.py")):
            out.setdefault(p.name, []).append(p)
    return {k: tuple(v) for k, v in out.items()}


def _package_modules(package: str, root: Path) -> list[str]:
    base = root.joinpath(*package.split("."))
    if not (base / "__init__.py").is_file():
        return []
    return [".".join(p.relative_to(root).with_suffix("").parts) for p in sorted(base.rglob("*.py"))
            if p.name != "__init__.py"]


def lazy_map(path: Path, root: Path = ROOT) -> dict[str, str]:
    """A package's lazy names: `_LAZY = {"name": "mod"}` or `{"name": ("mod", attr)}` at module level
    (loaded by its `__getattr__` on first access) -> name: module."""
    out: dict[str, str] = {}
    tree = _parse(path)
    for node in tree.body:
        value = node.value if isinstance(node, (ast.Assign, ast.AnnAssign)) else None
        if not isinstance(value, ast.Dict):
            continue
        for k, v in zip(value.keys, value.values):
            first = v.elts[0] if isinstance(v, ast.Tuple) and v.elts else v
            if isinstance(k, ast.Constant) and isinstance(first, ast.Constant) and isinstance(first.value, str) \
                    and module_exists(first.value, root):
                out[k.value] = first.value
    return out


@lru_cache(maxsize=None)
def _parse(path: Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"), filename=str(path))


FULL, PARENT = "full", "parent"


def _statement_edges(tree: ast.AST, root: Path) -> list[tuple[str, str]]:
    """(module, mode) for every absolute import statement, in functions too. `import a.b` imports a.b
    (FULL; its packages come in as PARENT in _reach); `from P import x` imports P.x when that is a
    module, else runs P (PARENT) and, when x is one of P's lazy names, the module it loads."""
    out: list[tuple[str, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, FULL) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            pkg_file = module_file(node.module, root)
            pkg_lazy = lazy_map(pkg_file, root) if pkg_file and pkg_file.name == "__init__.py" else {}
            for a in node.names:
                if module_exists(f"{node.module}.{a.name}", root):
                    out.append((f"{node.module}.{a.name}", FULL))
                elif a.name == "*":
                    out.append((node.module, FULL))  # __all__: the lazy names too
                else:  # a name P's own code binds (P runs whole, its lazy map aside), or P's lazy entry
                    out += [(node.module, PARENT)] + ([(pkg_lazy[a.name], FULL)] if a.name in pkg_lazy else [])
    return out


def touches(path: Path, mode: str = FULL, root: Path = ROOT) -> tuple[list[tuple[str, str]], list[Path]]:
    """What one file reaches directly: ([(module, mode)], files it runs or loads by path).

    mode FULL: the file is imported (or run) by name: every import, string import and program it names.
    mode PARENT: it is a package's __init__ that Python ran because a submodule was imported: the same,
    less its lazy map, whose names load only on attribute access (`from pkg import name` follows the
    entry of that name; `import pkg` follows them all)."""
    tree = _parse(path)
    lazy_values = set(lazy_map(path, root).values()) if path.name == "__init__.py" else set()
    mods = _statement_edges(tree, root)
    for m, how in imports(path, root):
        if how == "string" and not (mode == PARENT and m in lazy_values):  # a lazy-map entry: not run on import
            mods.append((m, FULL))
    files: list[Path] = []
    scripts = {n: m for (g, n), m in entry_point_targets(root).items() if g == "console_scripts"}
    helpers = _helper_files(root)
    for node in ast.walk(tree):
        if isinstance(node, (ast.List, ast.Tuple)):
            elts = node.elts
            for a, b in zip(elts, elts[1:]):
                if isinstance(a, ast.Constant) and a.value == "-m" and isinstance(b, ast.Constant) \
                        and isinstance(b.value, str):
                    mods += _run_module(b.value, root)  # python -m X / torchrun -m X
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            s = node.value
            if s in scripts:
                mods.append((scripts[s], FULL))  # the console script `compilewatch` / `dflash`
            if s.endswith(".py") and "/" not in s and s in helpers:
                files += helpers[s]  # ROOT / "benchmarks" / "x.py", Path(__file__).with_name("x.py")
            code = _embedded_code(s)
            if code is not None:
                mods += _statement_edges(code, root)
        if isinstance(node, ast.JoinedStr) and node.values and isinstance(node.values[0], ast.Constant):
            prefix = str(node.values[0].value)
            if prefix.endswith(".") and prefix.split(".")[0] in (*PACKAGES, *_HELPER_ROOTS):
                mods += [(m, FULL) for m in _package_modules(prefix.rstrip("."), root)]  # import_module(f"pkg.{x}")
    return mods, files


def _label(path: Path, root: Path) -> str:
    return str(path.relative_to(root)) if path.is_relative_to(root) else str(path)


@lru_cache(maxsize=None)
def _reach(path: Path, root: Path) -> tuple[str, ...] | None:
    """The chain from `path` to a torch package (files..., "torch"), or None when it reaches none."""
    conftest = root / "tests" / "conftest.py"
    state: dict[Path, str] = {path: FULL}
    todo: list[tuple[Path, str, tuple[str, ...]]] = [(path, FULL, (_label(path, root),))]
    while todo:
        here, mode, chain = todo.pop(0)  # breadth first: the shortest chain
        try:
            mods, files = touches(here, mode, root)
        except (SyntaxError, ValueError, OSError):  # mid-edit, or gone: in the matrix until it reads
            return (*chain, UNREADABLE)
        for m, _ in mods:
            hit = _torch_package(m)
            if hit:
                return (*chain, hit)
        nxt: list[tuple[Path, str]] = [(f, FULL) for f in files]
        for m, m_mode in mods:
            parts = _with_parents(m)
            for p in parts:
                f = module_file(p, root)
                if f is not None:
                    nxt.append((f, m_mode if p == m else PARENT))
        for f, m_mode in nxt:
            if f == conftest or state.get(f) == FULL or state.get(f) == m_mode:
                continue
            state[f] = m_mode
            todo.append((f, m_mode, (*chain, _label(f, root) + (" (package)" if m_mode == PARENT and f.name == "__init__.py" else ""))))
    return None


def classify(path: Path, root: Path = ROOT) -> tuple[bool, str]:
    """(sensitive, why) for one test module."""
    path = Path(path).resolve()
    rel = _label(path, root)
    if rel in OVERRIDES:
        sensitive, reason = OVERRIDES[rel]
        return sensitive, f"override: {reason}"
    chain = _reach(path, root)
    if chain is None:
        return False, "reaches no torch import"
    return True, " -> ".join(chain)


def module_files(root: Path = ROOT) -> list[Path]:
    return sorted((root / "tests").glob("test_*.py"))


def main() -> int:
    rows = [(p.name, *classify(p)) for p in module_files()]
    for name, sensitive, why in rows:
        print(f"{'MATRIX' if sensitive else '      '}  {name}: {why}")
    n = sum(s for _, s, _ in rows)
    print(f"{n} of {len(rows)} test modules are torch-version sensitive")
    return 0


if __name__ == "__main__":
    sys.exit(main())
