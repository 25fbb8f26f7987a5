"""What a first hour with the dflash docs walked into: the config reference against the real config,
the dry run's sample against the command, a resumed finished engine run as documented.

- docs/dflash.md's config tables (`Every field` and `[topology]`) name every field `dflash train
  --print-config` prints, once, and no other; their values are the recipes' (tiny and qwen3_8b), as
  TOML writes them; every flag the topology table names is an option of `dflash train`.
- The `--dry-run` block of docs/dflash.md is what `dflash train --recipe qwen3_8b --dry-run` prints.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from cli.dflash_main import app
from dflash.config import qwen3_8b, tiny, to_toml
from tests.helpers import invoke

ROOT = Path(__file__).resolve().parents[1]
DFLASH_MD = ROOT / "docs" / "dflash.md"


def _cells(line: str) -> list[str]:
    """A markdown table row's cells (`\\|` inside a cell is a literal bar)."""
    parts = re.split(r"(?<!\\)\|", line.strip())[1:-1]
    return [p.strip().replace("\\|", "|") for p in parts]


def _rows(after: str) -> list[list[str]]:
    """The rows of the first table after the line starting with `after`, header and rule left out."""
    lines = DFLASH_MD.read_text(encoding="utf-8").splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(after))
    i = next(j for j in range(start, len(lines)) if lines[j].startswith("|"))
    rows = []
    while i < len(lines) and lines[i].startswith("|"):
        rows.append(_cells(lines[i]))
        i += 1
    return rows[2:]


def _code(cell: str) -> str:
    m = re.fullmatch(r"`([^`]*)`", cell)
    assert m, f"expected one code span, got {cell!r}"
    return m.group(1)


def _toml_value(text: str):
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text  # a bare word in the topology table (`auto`)


def _flat(cfg) -> dict[str, object]:
    data = tomllib.loads(to_toml(cfg))
    return {f"{s}.{k}": v for s, sec in data.items() if isinstance(sec, dict) for k, v in sec.items()}


def test_every_config_field_is_in_the_reference_with_the_recipes_values():
    t, q = _flat(tiny()), _flat(qwen3_8b())
    every = _rows("**Every field**")
    topo = _rows("**`[topology]`: where the run trains.**")
    documented = [_code(r[0]) for r in every] + [_code(r[0]) for r in topo]
    assert sorted(documented) == sorted(t), (set(documented) ^ set(t))
    assert len(documented) == len(set(documented)), "a field documented twice"
    for key, tiny_cell, q_cell, what in every:
        key = _code(key)
        assert _toml_value(_code(tiny_cell)) == t[key], (key, tiny_cell, t[key])
        want_q = t[key] if q_cell == "same" else _toml_value(_code(q_cell))
        assert want_q == q[key], (key, q_cell, q[key])
        assert what, key
    for key, _flag, default, _what in topo:
        key = _code(key)
        assert _toml_value(_code(default)) == t[key] == q[key], (key, default, t[key])


def test_the_topology_tables_flags_are_options_of_dflash_train():
    import typer.main

    train = typer.main.get_command(app).commands["train"]
    options = {o for p in train.params for o in p.opts}
    flags = {_code(r[1]) for r in _rows("**`[topology]`: where the run trains.**") if r[1] != "(`--set`)"}
    assert flags and flags <= options, flags - options


def test_the_dry_run_block_is_what_the_command_prints():
    text = DFLASH_MD.read_text(encoding="utf-8")
    m = re.search(r"```\n\$ dflash train --recipe qwen3_8b --dry-run\n(.*?)\n```", text, re.S)
    assert m, "no dry-run block in docs/dflash.md"
    r = invoke(app, ["train", "--recipe", "qwen3_8b", "--dry-run"])
    assert r.exit_code == 0, r.stderr
    assert r.stdout.strip().splitlines() == m.group(1).splitlines()


def test_eval_every_names_the_event_metrics_jsonl_writes():
    """config.py's help for eval.every (what the config's docs repeat) names the event `periodic_eval`."""
    src = (ROOT / "dflash" / "config.py").read_text(encoding="utf-8")
    doc = src[src.index("    every: int = 0"):src.index("    every_prompts:")]
    assert '"periodic_eval"' in doc and '"eval"' not in doc
    assert "a `periodic_eval` event" in DFLASH_MD.read_text(encoding="utf-8")
