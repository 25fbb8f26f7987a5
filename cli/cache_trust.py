"""`compilewatch cache trust ...`: the keys whose archives load without --trust (rendering of
compilewatch.cache.trust.keys)."""

from __future__ import annotations

from typing import Annotated, Optional

import typer
from rich.table import Table

from cli import output
from cli.app import make_app
from cli.lazy import lazy
from cli.options import JsonOpt

keys = lazy("compilewatch.cache.trust.keys")

app = make_app(
    "trust",
    "Who you trust to give you code: the signing keys whose cache archives load without --trust.\n\n"
    "Every `cache save` signs its archive with this machine's key (made on the first save). Give your "
    "public key (`cache trust key`) to the people and machines that load your archives; add theirs with "
    "`cache trust add`. Archives signed by any other key are foreign (docs/security.md).",
)


@app.command("key")
def key_cmd(as_json: JsonOpt = False) -> None:
    """Print this machine's public signing key, to give to whoever loads your archives (made now if
    this machine has none yet; the private key stays in the config dir, mode 0600).

    Example: compilewatch cache trust key > ci-runner.pub
    """
    pk = keys.own_public_key(create=True)
    if as_json:
        output.print_json({**output.jsonable(pk), "line": keys.public_key_line(pk), "key_file": str(keys.key_path())})
        return
    output.out.print(output.clean(keys.public_key_line(pk)))
    output.err.print(f"[dim]key {pk.id}, private key {keys.key_path()} (keep it private)[/]")
    output.hint("on the other machine: compilewatch cache trust add '<the line above>' --name NAME")


@app.command("add")
def add_cmd(
    key: Annotated[str, typer.Argument(help="The line `cache trust key` printed elsewhere, or a file holding it.")],
    name: Annotated[Optional[str], typer.Option("--name", help="Who it belongs to (default: the name in the line).")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Trust a signing key: its archives then load without --trust. Only add keys of machines and people
    you would let run code as you. A key is trusted under one name; this machine's own key is trusted
    already (as made here) and is not added.

    Example: compilewatch cache trust add ci-runner.pub --name ci
    """
    added = keys.trust_add(key, name=name)
    output.emit(added, as_json, lambda k: output.out.print(f"trusted {k.name} ({k.id})"), escape_markup=True)


@app.command("list")
def list_cmd(as_json: JsonOpt = False) -> None:
    """The keys you trust, and this machine's own.

    Example: compilewatch cache trust list
    """
    output.emit(keys.trust_store(), as_json, _render_list, escape_markup=True)


def _render_list(s) -> None:
    o = output.out
    if s.own is not None and s.own_name == keys.MACHINE:
        o.print(f"this machine: {s.own.id} ({s.own.name}); its archives are recognised as made here")
    elif s.own is not None:
        o.print(f"your signing key: {s.own.id} from {s.own_name}; archives it signs are recognised as your own")
    else:
        o.print("this machine has no signing key yet (the first `cache save` makes one)")
    if not s.keys:
        o.print(f"no other trusted keys ({s.path})")
    else:
        table = Table("name", "key", "added", box=None)
        for k in s.keys:
            table.add_row(k.name, k.id, k.added_at)
        o.print(table)
    for note in s.notes:
        output.warn(note)


@app.command("remove")
def remove_cmd(
    which: Annotated[str, typer.Argument(help="The key's name or id (`cache trust list`).")],
    as_json: JsonOpt = False,
) -> None:
    """Stop trusting a key: its archives become foreign again.

    Example: compilewatch cache trust remove ci
    """
    removed = keys.trust_remove(which)
    output.emit(removed, as_json, lambda k: output.out.print(f"no longer trusted: {k.name} ({k.id})"), escape_markup=True)
