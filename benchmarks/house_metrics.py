"""The house's shape, measured from the AST (issue 27): rerun after any move.

    python benchmarks/house_metrics.py [--json]

- longest function in cli/ (lines, decorators excluded)
- cli -> dflash file pairs (a cli file importing a dflash module counts once per module file)
- most sibling modules one dflash module imports (other dflash modules, rooms' __init__ excluded)
- mutual folder pairs in compilewatch (rooms importing each other)
Imports are read by tests/import_graph.py: statements (inside functions too) and string imports.
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.import_graph import imports, module_exists, module_name  # noqa: E402
from tests.test_layering import mutual_rooms  # noqa: E402


def longest_function(folder: str) -> tuple[int, str]:
    best = (0, "")
    for f in sorted((ROOT / folder).rglob("*.py")):
        for node in ast.walk(ast.parse(f.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                best = max(best, (n, f"{f.relative_to(ROOT)}:{node.name}"))
    return best


def _module_file(mod: str) -> str | None:
    """The dflash module file a dotted name lands on (a name inside a module: that module)."""
    parts = mod.split(".")
    while parts:
        name = ".".join(parts)
        if module_exists(name):
            return name
        parts.pop()
    return None


def cli_dflash_pairs() -> set[tuple[str, str]]:
    pairs = set()
    for f in sorted((ROOT / "cli").rglob("*.py")):
        for mod, _ in imports(f):
            if mod.split(".")[0] == "dflash" and (target := _module_file(mod)):
                pairs.add((str(f.relative_to(ROOT)), target))
    return pairs


def most_siblings(level: str = "module") -> tuple[int, str]:
    """level "module": other dflash modules; "room": other dflash rooms (top-level modules count as rooms)."""
    best = (0, "")
    for f in sorted((ROOT / "dflash").rglob("*.py")):
        me = module_name(f)
        seen = set()
        for mod, _ in imports(f):
            if mod.split(".")[0] != "dflash":
                continue
            target = _module_file(mod)
            if target and target != me and not (ROOT.joinpath(*target.split(".")) / "__init__.py").is_file():
                seen.add(target if level == "module" else target.split(".")[1])
        if level == "room":
            seen.discard(me.split(".")[1] if me.count(".") else "")
        best = max(best, (len(seen), me))
    return best


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    n, where = longest_function("cli")
    pairs = cli_dflash_pairs()
    sib, mod = most_siblings()
    rooms, room_mod = most_siblings("room")
    mutual = sorted(mutual_rooms())
    out = {"longest_cli_function": {"lines": n, "where": where},
           "cli_dflash_file_pairs": {"count": len(pairs), "pairs": sorted(map(list, pairs))},
           "most_dflash_siblings_imported": {"count": sib, "module": mod},
           "most_dflash_rooms_imported": {"count": rooms, "module": room_mod},
           "compilewatch_mutual_folder_pairs": {"count": len(mutual), "pairs": [list(m) for m in mutual]}}
    if a.json:
        print(json.dumps(out, indent=1))
    else:
        print(f"longest function in cli/: {n} lines ({where})")
        print(f"cli -> dflash file pairs: {len(pairs)}: " + ", ".join(f"{c}->{d}" for c, d in sorted(pairs)))
        print(f"most sibling modules one dflash module imports: {sib} ({mod})")
        print(f"most other rooms one dflash module imports: {rooms} ({room_mod})")
        print(f"mutual folder pairs in compilewatch: {len(mutual)} {mutual}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
