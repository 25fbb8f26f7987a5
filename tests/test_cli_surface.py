"""Regression guard for the compilewatch CLI surface (STYLE.md §15): the command list is frozen,
every command answers --help, and every command that reports has --json."""

from __future__ import annotations

import pytest
import typer

from cli.main import app
from tests.helpers import invoke

COMMANDS = {"probe", "lock", "diff-env", "warm", "gpus", "doctor", "run", "timeline", "cache"}
CACHE_COMMANDS = {"where", "fingerprint", "verify", "save", "load", "clear", "prune", "ls", "du", "diff", "explain", "trust",
                  "remote"}
TRUST_COMMANDS = {"key", "add", "list", "remove"}
REMOTE_COMMANDS = {"status", "push", "pull", "verify", "clear"}


def _group():
    return typer.main.get_command(app)


def test_command_list_is_frozen():
    group = _group()
    assert set(group.commands) == COMMANDS
    assert set(group.commands["cache"].commands) == CACHE_COMMANDS
    assert set(group.commands["cache"].commands["trust"].commands) == TRUST_COMMANDS
    assert set(group.commands["cache"].commands["remote"].commands) == REMOTE_COMMANDS


def test_every_command_has_help_and_json():
    group = _group()
    leaves = [([name], cmd) for name, cmd in group.commands.items() if name != "cache"]
    groups = ("trust", "remote")
    leaves += [(["cache", name], cmd) for name, cmd in group.commands["cache"].commands.items() if name not in groups]
    for sub in groups:
        leaves += [(["cache", sub, name], cmd) for name, cmd in group.commands["cache"].commands[sub].commands.items()]
    for path, cmd in leaves:
        r = invoke(app, [*path, "--help"])
        assert r.exit_code == 0, path
        opts = {o for p in cmd.params for o in getattr(p, "opts", [])}
        assert "--json" in opts, f"{' '.join(path)} has no --json"


def test_options_of_the_trust_surface_are_frozen():
    """Issue 29's options: `cache load --trust`, `cache verify [ARCHIVE]`, `cache trust add --name`."""
    cache = _group().commands["cache"].commands
    opts = {name: {o for p in cmd.params for o in getattr(p, "opts", [])} for name, cmd in cache.items() if name != "trust"}
    assert "--trust" in opts["load"]
    assert {p.name for p in cache["verify"].params} >= {"archive_path", "dir", "fix", "quick", "as_json"}
    add = cache["trust"].commands["add"]
    assert {o for p in add.params for o in getattr(p, "opts", [])} >= {"--name", "--json"}


def test_unknown_command_is_a_usage_error():
    r = invoke(app, ["no-such-command"])
    assert r.exit_code == 2


@pytest.mark.parametrize("args, message", [
    (["probe", "create_block_mask", "--threads", "2", "--timeout", "0"], "--timeout must be a number of seconds > 0"),
    (["probe", "create_block_mask", "--threads", "2", "--timeout", "-1"], "--timeout must be a number of seconds > 0"),
    (["probe", "create_block_mask", "--threads", "2", "--timeout", "nan"], "--timeout must be a number of seconds > 0"),
    (["warm", "--devices", "cpu", "--steps", "0"], "--steps must be >= 1"),
])
def test_numbers_out_of_range_are_bad_input_not_findings(args, message):
    """A --timeout of 0 or less once made every probe thread a "hang" finding (exit 1) before it could
    start; --steps 0 was quietly 1."""
    r = invoke(app, args)
    assert r.exit_code == 2 and message in r.stderr and "Traceback" not in r.stderr, (r.stdout, r.stderr)
