"""The one error map: library errors become a clean message and an exit code, in one place.

`CompilewatchGroup` wraps every command invocation (also under typer's CliRunner, so tests see the
same exit codes as users): `CompilewatchError` -> "error: ..." (+ "hint: ...") on stderr and its exit
code (2 bad input, 1 a finding); Ctrl-C -> 130. Set COMPILEWATCH_DEBUG=1 to see the traceback.
"""

from __future__ import annotations

import os
from typing import Annotated, Optional

import typer
from typer.core import TyperGroup

from compilewatch.errors import CompilewatchError
from cli import output


MAX_MESSAGE = 2000  # a message quoting a crafted file stays readable (the library cuts quotes too)


class CompilewatchGroup(TyperGroup):
    def invoke(self, ctx):  # type: ignore[override]
        try:
            return super().invoke(ctx)
        except CompilewatchError as e:
            if os.environ.get("COMPILEWATCH_DEBUG"):
                raise
            # messages quote paths, tracebacks and torch errors ("[/__w/pytorch/...]"): never markup
            message = e.message if len(e.message) <= MAX_MESSAGE else e.message[:MAX_MESSAGE] + "… (cut)"
            output.err.print(f"[red]error:[/] {output.clean(message)}", markup=True)
            if e.hint:
                output.err.print(f"[dim]hint:[/] {output.clean(e.hint)}")
            raise typer.Exit(e.exit_code) from None
        except KeyboardInterrupt:
            output.err.print("interrupted")
            raise typer.Exit(130) from None


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
