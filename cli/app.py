"""The one error map: library errors become a clean message and an exit code, in one place.

`CompilewatchGroup` wraps every command invocation (also under typer's CliRunner, so tests see the
same exit codes as users): `CompilewatchError` -> "error: ..." (+ "hint: ...") on stderr and its exit
code (2 bad input, 1 a finding); Ctrl-C -> 130. Set COMPILEWATCH_DEBUG=1 to see the traceback.

A closed stdout (`compilewatch cache ls | head -1`) ends the command quietly with exit code 141
(128 + SIGPIPE), what a shell reports for `yes | head -1`'s `yes`: no message, no traceback, and a
`set -o pipefail` script sees the same status as for coreutils. `run_app` is what the console scripts
call: it also catches the broken pipe of the last flush at exit (click alone exits 1 on EPIPE).
"""

from __future__ import annotations

import os
import re
import sys
from typing import Annotated, Optional

import typer
from typer.core import TyperGroup

from compilewatch.errors import CompilewatchError
from cli import helpstyle, output
from cli.helptext import reflow_command

helpstyle.install()  # one look for every --help (cli/helpstyle.py)


EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE: what a shell reports for a writer whose reader went away
MAX_MESSAGE = 2000  # a message quoting a crafted file stays readable (the library cuts quotes too)


class CompilewatchGroup(TyperGroup):
    def __init__(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        super().__init__(*args, **kwargs)
        reflow_group(self)

    def invoke(self, ctx):  # type: ignore[override]
        try:
            return super().invoke(ctx)
        except CompilewatchError as e:
            if os.environ.get("COMPILEWATCH_DEBUG"):
                raise
            # messages quote paths, tracebacks and torch errors ("[/__w/pytorch/...]"): never markup
            message = e.message if len(e.message) <= MAX_MESSAGE else e.message[:MAX_MESSAGE] + "… (cut)"
            output.err.print(f"[red]error:[/] {output.clean(message)}", markup=True)
            _log_unknown_options(ctx, f"{e.message}\n{e.hint or ''}")
            if e.hint:
                output.err.print(f"[dim]hint:[/] {output.clean(e.hint)}")
            raise typer.Exit(e.exit_code) from None
        except KeyboardInterrupt:
            output.err.print("interrupted")
            raise typer.Exit(130) from None
        except BrokenPipeError:
            _silence_stdout()
            raise typer.Exit(EXIT_BROKEN_PIPE) from None


_PROGRAMS = ("compilewatch", "dflash")
_OPTION = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")
_WORD = re.compile(r"[a-z][a-z0-9-]*$")


def _command_options(cmd) -> set[str]:  # type: ignore[no-untyped-def]
    return {o for p in cmd.params for o in (*p.opts, *p.secondary_opts)} | {"--help"}


def unknown_options(ctx, text: str) -> list[str]:  # type: ignore[no-untyped-def]
    """The `--options` a message or hint names that the command it names does not have. An option in a
    backticked `compilewatch ...` / `dflash ...` command belongs to that command (its path resolved from
    the root); one in a backticked command of another program (`pip ...`, `torchrun ...`) is that
    program's; any other belongs to the command that is running (or a group above it)."""
    root = ctx.find_root()
    prog = root.info_name or ""
    leaf = getattr(ctx.command, "commands", {}).get(ctx.invoked_subcommand or "")
    here = _command_options(leaf) if leaf is not None else set()
    c = ctx
    while c is not None:
        here |= _command_options(c.command)
        c = c.parent
    bad = []
    for i, part in enumerate(text.split("`")):
        words = part.split()
        if i % 2 == 1 and words and words[0] in _PROGRAMS:
            cmd = root.command if words[0] == prog or not prog else None
            if cmd is None:
                continue  # the other CLI: not resolvable from here
            known = _command_options(cmd)
            for w in words[1:]:
                sub = getattr(cmd, "commands", {}).get(w) if _WORD.match(w) else None
                if sub is None:
                    break
                cmd = sub
                known |= _command_options(cmd)
            bad += [o for o in _OPTION.findall(part) if o not in known]
        elif i % 2 == 1 and words:
            continue  # another program's command line
        else:
            bad += [o for o in _OPTION.findall(part) if o not in here]
    return bad


def _log_unknown_options(ctx, text: str) -> None:  # type: ignore[no-untyped-def]
    """Under the test suite (COMPILEWATCH_HINT_LOG set by tests/conftest.py), record every option a
    message or hint names that does not exist, so no hint a test ever triggers tells users to type
    something the CLI refuses (tests/conftest.py fails the run on a non-empty log)."""
    path = os.environ.get("COMPILEWATCH_HINT_LOG")
    if not path:
        return
    try:
        bad = unknown_options(ctx, text)
    except Exception as e:  # noqa: BLE001 - the check must never change what users see
        bad = [f"(check failed: {e!r})"]
    if bad:
        line = f"{ctx.command_path} {ctx.invoked_subcommand or ''}: {', '.join(sorted(set(bad)))} in: {' '.join(text.split())[:300]}\n"
        with open(path, "a", encoding="utf-8") as fh:
            fh.write(line)


def _silence_stdout() -> None:
    """Point stdout at /dev/null, so the interpreter's final flush of what is still buffered does
    not fail again on the closed pipe."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):  # no real stdout (a test runner's capture)
        pass


def _stdout_pipe_closed() -> bool:
    """True when stdout is a pipe whose reader has gone (poll reports POLLERR on its write end)."""
    import select

    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(ev & select.POLLERR for _, ev in poller.poll(0))
    except (OSError, ValueError, AttributeError):
        return False


def _stdout_identity() -> tuple[int, int] | None:
    try:
        st = os.fstat(sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):
        return None
    return st.st_dev, st.st_ino


def _reopen_closed_streams() -> None:
    """A process started with stdout or stderr closed (`cmd >&-`) has sys.stdout / sys.stderr None: what
    would be printed there goes to /dev/null instead (it had nowhere to go), so a command still ends with its
    own exit code (`compilewatch run` passes its program's through) rather than an AttributeError traceback."""
    for name in ("stdout", "stderr"):
        if getattr(sys, name) is None:
            setattr(sys, name, open(os.devnull, "w", encoding="utf-8"))  # noqa: SIM115 - for the process's life


def run_app(app: typer.Typer) -> None:
    """Run `app` as a console script (see the module docstring for the closed-pipe rule)."""
    _reopen_closed_streams()
    before = _stdout_identity()
    try:
        try:
            app()
        except SystemExit as e:
            # Help and usage text are written by typer's own rich console before any command runs:
            # on EPIPE it points stdout at /dev/null and exits 1 (click does the same without the
            # redirect). Either way the pipe was closed: the same 141 as for a command's output.
            if e.code == 1 and (_stdout_pipe_closed() or _stdout_identity() != before):
                raise BrokenPipeError from None
            raise
        finally:
            sys.stdout.flush()
    except BrokenPipeError:
        _silence_stdout()
        sys.exit(EXIT_BROKEN_PIPE)


def reflow_group(group: TyperGroup) -> None:
    """Help text as rich wraps it (cli/helptext.py): this group's and each of its commands' (sub-groups
    are CompilewatchGroups too and reflow their own)."""
    reflow_command(group)
    for cmd in group.commands.values():
        if not isinstance(cmd, TyperGroup):
            reflow_command(cmd)


def make_root_app(name: str, help: str, version: str, doc: str) -> typer.Typer:
    """A command's root app: `make_app` plus `--version` (prints `NAME VERSION`) and the root help `doc`."""
    app = make_app(name, help)

    def _version(value: bool) -> None:
        if value:
            typer.echo(f"{name} {version}")
            raise typer.Exit(0)

    def root(version: bool = False) -> None:
        pass

    # real objects, not strings (this module's annotations are lazy): the option closes over this app's name
    root.__annotations__ = {"version": Annotated[Optional[bool], typer.Option(
        "--version", callback=_version, is_eager=True, help="Print the version and exit.")], "return": None}
    root.__defaults__ = (None,)
    root.__doc__ = doc
    app.callback()(root)
    return app


def make_app(name: str, help: str) -> typer.Typer:
    """A root or sub app with our conventions: no rich tracebacks for users, -h works, errors mapped."""
    return typer.Typer(
        name=name,
        help=help,
        cls=CompilewatchGroup,
        no_args_is_help=True,
        pretty_exceptions_enable=False,
        add_completion=False,
        rich_markup_mode="rich",
        context_settings={"help_option_names": ["-h", "--help"]},
    )
