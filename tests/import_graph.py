"""Every import a source file makes, read from its AST: `import` statements (inside functions too)
and string imports — `importlib.import_module("x.y")`, lazy maps and entry-point strings
(`"x.y"` / `"x.y:attr"` naming one of the house's modules), and `entry_points(group=..., name=...)`
calls resolved through pyproject.toml. Used by tests/test_layering.py and benchmarks/house_metrics.py."""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("cli", "dflash", "compilewatch")
_MODULE_STRING = re.compile(r"(?:%s)(?:\.\w+)+(?::\w+)?" % "|".join(PACKAGES))  # dotted: a bare "cli" is a path part


def module_exists(name: str, root: Path = ROOT) -> bool:
    base = root.joinpath(*name.split("."))
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def entry_point_targets(root: Path = ROOT) -> dict[tuple[str, str], str]:
    """(group, name) -> module, from pyproject's [project.scripts] and [project.entry-points.*]."""
    project = tomllib.loads((root / "pyproject.toml").read_text(encoding="utf-8")).get("project", {})
    out = {("console_scripts", n): v.split(":")[0] for n, v in project.get("scripts", {}).items()}
    for group, entries in project.get("entry-points", {}).items():
        out.update({(group, n): v.split(":")[0] for n, v in entries.items()})
    return out


def _docstrings(tree: ast.AST) -> set[int]:
    ids = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                ids.add(id(first.value))
    return ids


def imports(path: Path, root: Path = ROOT) -> list[tuple[str, str]]:
    """(module, how) for every absolute import in `path`; how is "import" or "string"."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    docs = _docstrings(tree)
    eps = None
    out: list[tuple[str, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, "import") for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append((node.module, "import"))
            out += [(f"{node.module}.{a.name}", "import") for a in node.names
                    if module_exists(f"{node.module}.{a.name}", root)]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
            if _MODULE_STRING.fullmatch(node.value) and module_exists(node.value.split(":")[0], root):
                out.append((node.value.split(":")[0], "string"))
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None)) == "entry_points":
            kw = {k.arg: k.value.value for k in node.keywords if isinstance(k.value, ast.Constant)}
            if "group" in kw:
                eps = entry_point_targets(root) if eps is None else eps
                out += [(mod, "string") for (g, n), mod in eps.items()
                        if g == kw["group"] and kw.get("name", n) == n]
    return out


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
