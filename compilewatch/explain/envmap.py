"""Which environment variables set which inductor config flag, read from torch's own config source.

torch's config entries keep the value a variable gave them, not the variable's name
(`torch/utils/_config_module.py`, `_ConfigEntry`: `env_value_default`/`env_value_force`), and most of
`torch/_inductor/config.py` reads `os.environ` in the assignment itself
(`max_autotune = os.environ.get("TORCHINDUCTOR_MAX_AUTOTUNE") == "1"`) or in a module function the
assignment calls (`autotune_remote_cache_default()`), or names the variable in `Config(env_name_force=...)`.
So the map comes from the source: every assignment of the module and of its classes (`triton.cudagraphs`),
with the variable names written in it or in the module functions it calls (transitively). Nothing is
imported or run; the file is the installed torch's, found without importing torch.

`explain` uses it to tell a variable that set a differing flag from one that set nothing that differs.
A flag the map does not know (another torch's, or a part outside inductor's config) stays "may be set by
any variable": the map only ever narrows the verdict where torch's source says so.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import re
from pathlib import Path

MAX_SOURCE = 4 << 20  # torch 2.13's inductor config.py is ~110 KB
_VAR = re.compile(r"(TORCHINDUCTOR|TORCHDYNAMO|TORCH_COMPILE|PYTORCH|TRITON|INDUCTOR)_[A-Z0-9_]+")


def inductor_env_map() -> dict[str, frozenset[str]]:
    """{flag ("max_autotune", "triton.cudagraphs") -> the variables its value reads}; {} when torch's
    config source cannot be found or read."""
    path = _inductor_config_path()
    return _parsed(str(path)) if path is not None else {}


def _inductor_config_path() -> Path | None:
    try:
        spec = importlib.util.find_spec("torch")
    except (ImportError, ValueError):
        return None
    for root in (spec.submodule_search_locations or []) if spec is not None else []:
        p = Path(root) / "_inductor" / "config.py"
        if p.is_file():
            return p
    return None


@functools.lru_cache(maxsize=4)
def _parsed(path: str) -> dict[str, frozenset[str]]:
    try:
        with open(path, "rb") as fh:
            source = fh.read(MAX_SOURCE + 1)
        if len(source) > MAX_SOURCE:
            return {}
        return env_map_of(source.decode("utf-8"))
    except (OSError, UnicodeDecodeError, SyntaxError, ValueError, RecursionError):
        return {}


def env_map_of(source: str) -> dict[str, frozenset[str]]:
    """The map for one config module's source text (see the module docstring)."""
    tree = ast.parse(source)
    defs: dict[str, ast.AST] = {}  # module-level functions and assigned names: what a value may reach
    for n in tree.body:
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)):
            defs[n.name] = n
        for name, value in _assigned(n):
            defs.setdefault(name, value)
    memo: dict[str, frozenset[str]] = {}

    def reach(name: str, seen: frozenset[str]) -> frozenset[str]:
        if name in memo:
            return memo[name]
        if name in seen or name not in defs:
            return frozenset()
        got = _vars_in(defs[name], lambda m: reach(m, seen | {name}))
        memo[name] = got
        return got

    out: dict[str, frozenset[str]] = {}

    def walk(body: list[ast.stmt], prefix: str) -> None:
        for node in body:
            if isinstance(node, ast.ClassDef):
                walk(node.body, f"{prefix}{node.name}.")
            for name, value in _assigned(node):
                out[prefix + name] = _vars_in(value, lambda m: reach(m, frozenset({name}) if not prefix else frozenset()))
    walk(tree.body, "")
    return out


def _assigned(node: ast.stmt) -> list[tuple[str, ast.AST]]:
    if isinstance(node, ast.Assign):
        return [(t.id, node.value) for t in node.targets if isinstance(t, ast.Name)]
    if isinstance(node, ast.AnnAssign) and node.value is not None and isinstance(node.target, ast.Name):
        return [(node.target.id, node.value)]
    return []


def _vars_in(node: ast.AST, reach) -> frozenset[str]:
    """Variable names in string constants under `node`, and those of the module functions and names it
    uses (`reach`)."""
    got: set[str] = set()
    for sub in ast.walk(node):
        if isinstance(sub, ast.Constant) and isinstance(sub.value, str) and _VAR.fullmatch(sub.value):
            got.add(sub.value)
        elif isinstance(sub, ast.Name) and isinstance(sub.ctx, ast.Load):
            got |= reach(sub.id)
    return frozenset(got)
