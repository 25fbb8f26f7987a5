"""Every --help of both CLIs reads as finished text (cli/helpstyle.py), and every hint names options that
exist (cli/app.py `unknown_options`; tests/conftest.py also fails the run when any hint a test triggers
names one that does not)."""

from __future__ import annotations

import re

import pytest
import typer
from typer.testing import CliRunner

from cli.app import unknown_options
from cli.dflash_main import app as dflash_app
from cli.helpstyle import TidyWriter
from cli.main import app as compilewatch_app
from tests.test_cli_help_wrap import ALL, _help

_TYPE_TOKEN = re.compile(r"<(?:bool|str|int|float|list\[|int range|float range|Path)[^>]*>")


@pytest.mark.parametrize("prog, app, path", ALL, ids=[" ".join([p[0], *p[2]]) for p in ALL])
def test_help_looks_finished(prog, app, path):
    text = _help(app, path, 80)
    lines = text.split("\n")
    where = f"{prog} {' '.join(path)} --help"
    assert lines[0].strip(), f"{where}: starts with a blank line"
    assert not [ln for ln in lines if ln != ln.rstrip()], f"{where}: trailing spaces"
    assert "\n\n\n" not in text, f"{where}: two blank lines in a row"
    assert max(len(ln) for ln in lines) <= 80, f"{where}: a line over 80 columns"
    assert not _TYPE_TOKEN.findall(text), f"{where}: {_TYPE_TOKEN.findall(text)}"
    usage = next(ln for ln in lines if ln.strip().startswith("Usage:"))
    assert "{" not in usage and "[[" not in usage, usage
    words = usage.split()
    args = [w for w in words[words.index("[OPTIONS]") + 1:] if w not in ("COMMAND", "[ARGS]...")]
    assert all(w.strip("[].") == w.strip("[].").upper() for w in args), usage


def _commands(app) -> list[tuple[str, object]]:
    out = []

    def walk(cmd, name):
        out.append((name, cmd))
        for sub_name, sub in getattr(cmd, "commands", {}).items():
            walk(sub, f"{name} {sub_name}")

    walk(typer.main.get_command(app), "")
    return out


@pytest.mark.parametrize("app", [compilewatch_app, dflash_app], ids=["compilewatch", "dflash"])
def test_no_option_says_its_default_twice(app):
    """typer prints `[default: X]` for an option with a default: its help must not say it again."""
    twice = []
    for name, cmd in _commands(app):
        for p in cmd.params:
            shown = p.default not in (None, False, ()) and getattr(p, "show_default", True) is not False
            if shown and p.help and re.search(r"\(default\)|default\)\.", p.help):
                twice.append(f"{name} {p.opts}: {p.help}")
    assert twice == []


def test_a_flag_shows_no_type_and_a_value_shows_what_it_is():
    text = _help(compilewatch_app, ["probe"], 120)
    row = next(ln for ln in text.splitlines() if "│ --threads" in ln)
    assert "INTEGER" in row
    row = next(ln for ln in text.splitlines() if "│ --list" in ln)
    assert "BOOLEAN" not in row and "<" not in row


def test_tidy_writer_keeps_content_and_drops_padding():
    class Sink:
        def __init__(self):
            self.parts = []

        def write(self, t):
            self.parts.append(t)

        def flush(self):
            pass

    s = Sink()
    w = TidyWriter(s)
    w.write("\n\n  Usage: x   \n\n")
    w.write("\n\x1b[1mtext\x1b[0m   \x1b[0m\n\n\nend")
    w.flush()
    assert "".join(s.parts) == "  Usage: x\n\n\x1b[1mtext\x1b[0m\x1b[0m\n\nend"
    s.parts.clear()
    w = TidyWriter(lambda: s, blank_lines=False)  # the output consoles' form: a stream looked up per write
    w.write("a  \n\n\nb ")
    w.flush()
    assert "".join(s.parts) == "a\n\n\nb "


def test_output_off_a_terminal_has_no_padded_lines(tmp_path):
    """doctor's facts table is padded to its widest row by rich; piped, each line ends at its content."""
    import subprocess
    import sys
    from pathlib import Path

    exe = Path(sys.executable).with_name("compilewatch")
    p = subprocess.run([str(exe), "doctor"], capture_output=True, text=True, timeout=300,
                       env={**__import__("os").environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "c")})
    assert p.returncode in (0, 1), p.stderr
    lines = p.stdout.splitlines()
    assert lines and not [ln for ln in lines if ln != ln.rstrip()]


def _ctx(app, *path):
    """The context of the innermost group and the command name that group invokes (what
    CompilewatchGroup.invoke holds when an error reaches it)."""
    root = typer.main.get_command(app)
    ctx = root.make_context(root.name, [*path, "--help"], resilient_parsing=True)
    group = root
    for name in path[:-1]:
        group = group.commands[name]
        ctx = group.make_context(name, [path[-1]], parent=ctx, resilient_parsing=True)
    ctx.invoked_subcommand = path[-1]
    return ctx


def test_unknown_options_names_what_the_command_lacks():
    ctx = _ctx(compilewatch_app, "cache", "ls")
    assert unknown_options(ctx, "pass --dir X, or --force if it is one") == ["--force"]
    assert unknown_options(ctx, "see `compilewatch cache load B --dir D --force`") == []
    assert unknown_options(ctx, "see `compilewatch cache where --bogus`") == ["--bogus"]
    assert unknown_options(ctx, "run `pip install --no-deps x`") == []
    ctx = _ctx(dflash_app, "train")
    assert unknown_options(ctx, "or use --devices cpu") == ["--devices"]
    assert unknown_options(ctx, "or --device cpu, --target-devices 0") == []


@pytest.mark.parametrize("argv", [["cache", "ls", "--dir", "{d}"], ["cache", "du", "--dir", "{d}"],
                                  ["cache", "fingerprint", "--dir", "{d}"], ["cache", "verify", "--dir", "{d}"],
                                  ["cache", "save", "{d}/a.tar", "--dir", "{d}"]])
def test_a_dir_that_is_no_cache_gets_a_hint_without_force_where_there_is_none(tmp_path, argv):
    (tmp_path / "notes.txt").write_text("not a cache")
    r = CliRunner().invoke(compilewatch_app, [a.format(d=tmp_path) for a in argv])
    assert r.exit_code == 2, r.output
    assert "does not look like an inductor cache" in r.output and "--force" not in r.output


def test_a_dir_that_is_no_cache_names_force_where_it_works(tmp_path):
    (tmp_path / "notes.txt").write_text("not a cache")
    r = CliRunner().invoke(compilewatch_app, ["cache", "clear", "--dir", str(tmp_path), "--yes"])
    assert r.exit_code == 2 and "--force" in r.output, r.output


# each short flag means one thing across both CLIs (its long names say the same thing)
SHORT_FLAGS = {
    "-n": {"--limit", "--top", "--prompts"},  # how many (entries shown, largest shown, prompts decoded)
    "-o": {"--output", "--out"},  # where the command writes its result (a file; train: the run dir)
    "-c": {"--config"}, "-d": {"--device", "--devices"}, "-j": {"--workers"}, "-s": {"--subcache"},
    "-w": {"--watch"}, "-y": {"--yes"}, "-r": {"--report"}, "-a": {"--all"}, "-h": {"--help"},
}


def test_each_short_flag_has_one_meaning():
    seen: dict[str, set[str]] = {}
    for app in (compilewatch_app, dflash_app):
        for _, cmd in _commands(app):
            for p in cmd.params:
                opts = [*getattr(p, "opts", ()), *getattr(p, "secondary_opts", ())]
                for short in (o for o in opts if re.fullmatch(r"-[A-Za-z]", o)):
                    seen.setdefault(short, set()).update(o for o in opts if o.startswith("--"))
    seen.setdefault("-h", set()).add("--help")
    unknown = {s: longs for s, longs in seen.items() if not longs <= SHORT_FLAGS.get(s, set())}
    assert unknown == {}, "a short flag with a new meaning: give it its own letter, or none"
