"""What `cache` and `cache remote` render alike: shortened keys, entries counted per system key or
torch build, and a table of findings (a cache dir's or a Redis server's)."""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from rich.markup import escape
from rich.table import Table

from cli import output

SEVERITY_STYLE = {"error": "red", "foreign": "magenta", "warning": "yellow"}
MAX_FINDINGS = 200  # rows shown; --json has them all


def short(key: str | None, n: int = 12) -> str:
    return "-" if not key else key if len(key) <= n else key[:n] + "…"


def counts_by_key(counts: Mapping[str, int], mine: str | None, mark: str = " (this machine)") -> str:
    """`abcdef012345… × 3 (this machine), 0123456789ab… × 1`, most first ("" when there are none)."""
    return ", ".join(f"{short(k)} × {n}" + (mark if k == mine else "")
                     for k, n in sorted(counts.items(), key=lambda kv: -kv[1]))


def print_findings(findings: Sequence[Any], column: str) -> None:
    """Findings (severity, kind, `column`, detail) as a table, the first MAX_FINDINGS of them."""
    o = output.out
    table = Table("severity", "kind", column, "detail", box=None)
    for f in findings[:MAX_FINDINGS]:
        # the key (a file name, a Redis key) and the detail come from elsewhere: shown as text, never as markup
        table.add_row(f"[{SEVERITY_STYLE[f.severity]}]{f.severity}[/]", escape(f.kind), escape(str(getattr(f, column))),
                      escape(str(f.detail)))
    o.print(table)
    if len(findings) > MAX_FINDINGS:
        o.print(f"... and {len(findings) - MAX_FINDINGS} more (see --json)")
