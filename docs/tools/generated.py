"""Blocks of the docs that come from the code, so they cannot drift from it.

A generated block in a docs/*.md or README.md file sits between two HTML comments (invisible when
rendered):

    <!-- generated: NAME -->
    ...text made by BLOCKS[NAME]()...
    <!-- end generated: NAME -->

    python docs/tools/generated.py          # rewrite every block from the code
    python docs/tools/generated.py --check  # exit 1 naming each block that differs (tests run this)

Only what the code decides is generated (tables of what the code knows, version floors, command
lists); output that depends on the torch version or the machine is not an exact number in the docs.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[2]
_BLOCK = re.compile(r"(<!-- generated: (?P<name>[\w-]+) -->\n)(?P<body>.*?)(<!-- end generated: (?P=name) -->)", re.S)


def subcache_table() -> str:
    from compilewatch.cache.local import layout

    rows = ["| sub-cache | where | what it holds | tied to | torch | written when |", "|---|---|---|---|---|---|"]
    for k in layout.KINDS:
        rows.append(f"| `{k.name}` | `{k.where}` | {k.holds} | {k.tied_to} | {k.torch} | {k.when} |")
    return "\n".join(rows) + "\n"


def torch_floor() -> str:
    import tomllib

    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    spec = next(d for d in deps if re.match(r"torch\b", d))
    floor = re.search(r">=\s*([\d.]+)", spec)
    assert floor, spec
    ci = (ROOT / ".ci" / "run").read_text()
    matrix = re.findall(r'^matrix="([\d. ]+)"', ci, re.M)  # the torch matrix's versions (.ci/run)
    assert matrix, ".ci/run names no matrix=\"...\" of torch versions"
    tested = sorted(set(re.findall(r"torch==([\d.]+)", ci)) | set(matrix[0].split()),
                    key=lambda v: tuple(int(x) for x in v.split(".")))
    return f"torch ≥ {floor.group(1)}; CI tests {', '.join(tested)}.\n"


BLOCKS: dict[str, Callable[[], str]] = {
    "subcache-table": subcache_table,
    "torch-floor": torch_floor,
}


def doc_files() -> list[Path]:
    return sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]


def render(text: str, where: str = "") -> tuple[str, list[str]]:
    """`text` with every generated block made anew, and the names of the blocks that changed."""
    changed: list[str] = []

    def one(m: re.Match) -> str:
        name = m.group("name")
        if name not in BLOCKS:
            raise SystemExit(f"{where}: unknown generated block {name!r} (known: {', '.join(BLOCKS)})")
        body = BLOCKS[name]()
        if body != m.group("body"):
            changed.append(f"{where}: {name}")
        return m.group(1) + body + m.group(4)

    return _BLOCK.sub(one, text), changed


def main(argv: list[str]) -> int:
    check = "--check" in argv
    stale: list[str] = []
    for path in doc_files():
        text = path.read_text()
        new, changed = render(text, str(path.relative_to(ROOT)))
        stale += changed
        if changed and not check:
            path.write_text(new)
    for s in stale:
        print(("stale: " if check else "rewrote: ") + s)
    return 1 if check and stale else 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    raise SystemExit(main(sys.argv[1:]))
