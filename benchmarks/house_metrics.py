"""The house's shape, measured from the AST (issue 27): rerun after any move.

    python benchmarks/house_metrics.py [--json]

- longest function in cli/ (lines, decorators excluded)
- cli -> dflash file pairs (a cli file importing a dflash module counts once per module file)
- most sibling modules one dflash module imports (other dflash modules, rooms' __init__ excluded)
- mutual folder pairs in compilewatch (rooms importing each other)
- with --config-path: the path of the resolved config through the calls of one tiny CPU
  `dflash train` (1 step): every call into cli/, dflash/ or compilewatch/ that receives the Config
  or one of its sections as an argument, in order. Moves between consecutive such calls: "stays"
  (same file), "returns" (to a file already left); "climbs": such a call made from a lower floor
  (compilewatch < dflash < cli) than the callee's (a callback the CLI handed in counts). Runs the command in this process under sys.setprofile (main thread; ~1 min on CPU).
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


def config_path(argv: list[str]) -> dict:
    import contextlib
    import io
    import os
    import tempfile

    import dflash
    from dflash import config as config_mod

    kinds = tuple(v for v in vars(config_mod).values() if isinstance(v, type) and v.__module__ == config_mod.__name__
                  and v.__name__.endswith("Config"))
    floors = {"compilewatch": 1, "dflash": 2, "cli": 3}
    root = str(ROOT) + os.sep
    calls: list[tuple[str, str]] = []

    def profile(frame, event, arg):
        if event != "call":
            return
        code = frame.f_code
        if not code.co_filename.startswith(root):
            return
        rel = code.co_filename[len(root):]
        if rel.split(os.sep)[0] not in floors:
            return
        n = code.co_argcount + code.co_kwonlyargcount
        loc = frame.f_locals
        if any(isinstance(loc.get(name), kinds) for name in code.co_varnames[:n]):
            up = frame.f_back
            while up is not None and not (up.f_code.co_filename.startswith(root)
                                          and up.f_code.co_filename[len(root):].split(os.sep)[0] in floors):
                up = up.f_back
            caller = up.f_code.co_filename[len(root):] if up is not None else rel
            calls.append((rel, code.co_name, caller))

    from cli.dflash_main import app

    with tempfile.TemporaryDirectory() as tmp:
        args = ["train", "--out", str(Path(tmp) / "run"), "--device", "cpu", "--max-steps", "1",
                "--set", "eval.at_end=false", "--set", "metrics.tensorboard=false", *argv]
        sys.setprofile(profile)
        try:
            with contextlib.redirect_stdout(io.StringIO()):  # the command's own report: not this script's
                app(args, standalone_mode=False)
        finally:
            sys.setprofile(None)
    assert dflash.__version__
    stays = returns = climbs = 0
    left: set[str] = set()
    floor = lambda f: floors[f.split(os.sep)[0]]  # noqa: E731
    for (a, _, _), (b, _, _) in zip(calls, calls[1:]):
        if a == b:
            stays += 1
            continue
        left.add(a)
        returns += b in left
    up = [f"{caller} -> {f}:{fn}" for f, fn, caller in calls if floor(f) > floor(caller)]
    return {"calls": len(calls), "files": len({f for f, _, _ in calls}), "stays": stays, "returns": returns,
            "climbs": len(up), "climbs_where": up, "sequence": [f"{f}:{fn}" for f, fn, _ in calls]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", action="store_true")
    p.add_argument("--config-path", action="store_true", help="also trace the resolved config (runs a 1-step train)")
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
    if a.config_path:
        out["config_path"] = config_path([])
    if a.json:
        print(json.dumps(out, indent=1))
    else:
        print(f"longest function in cli/: {n} lines ({where})")
        print(f"cli -> dflash file pairs: {len(pairs)}: " + ", ".join(f"{c}->{d}" for c, d in sorted(pairs)))
        print(f"most sibling modules one dflash module imports: {sib} ({mod})")
        print(f"most other rooms one dflash module imports: {rooms} ({room_mod})")
        print(f"mutual folder pairs in compilewatch: {len(mutual)} {mutual}")
        if a.config_path:
            c = out["config_path"]
            print(f"resolved config from `dflash train`: {c['calls']} calls in {c['files']} files; {c['stays']} stay in "
                  f"their file, {c['returns']} return to a file already left, {c['climbs']} climb to a higher floor")
    return 0


if __name__ == "__main__":
    sys.exit(main())
