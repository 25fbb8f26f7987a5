"""Regression guard for the compilewatch CLI surface (STYLE.md §15): the command list is frozen,
every command answers --help, and every command that reports has --json."""

from __future__ import annotations

import typer

from cli.main import app
from tests.helpers import invoke

COMMANDS = {"probe", "lock", "diff-env", "warm", "gpus", "doctor", "run", "timeline", "cache"}
CACHE_COMMANDS = {"where", "fingerprint", "verify", "save", "load", "clear", "prune", "ls", "du", "diff", "remote"}
REMOTE_COMMANDS = {"status", "push", "pull", "verify", "clear"}


def _group():
    return typer.main.get_command(app)


def test_command_list_is_frozen():
    group = _group()
    assert set(group.commands) == COMMANDS
    assert set(group.commands["cache"].commands) == CACHE_COMMANDS
    assert set(group.commands["cache"].commands["remote"].commands) == REMOTE_COMMANDS


def test_every_command_has_help_and_json():
    group = _group()
    leaves = [([name], cmd) for name, cmd in group.commands.items() if name != "cache"]
    leaves += [(["cache", name], cmd) for name, cmd in group.commands["cache"].commands.items() if name != "remote"]
    leaves += [(["cache", "remote", name], cmd) for name, cmd in group.commands["cache"].commands["remote"].commands.items()]
    for path, cmd in leaves:
        r = invoke(app, [*path, "--help"])
        assert r.exit_code == 0, path
        opts = {o for p in cmd.params for o in getattr(p, "opts", [])}
        assert "--json" in opts, f"{' '.join(path)} has no --json"


def test_unknown_command_is_a_usage_error():
    r = invoke(app, ["no-such-command"])
    assert r.exit_code == 2
