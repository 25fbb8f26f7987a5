"""`compilewatch cache remote ...`: torch's Redis remote caches (rendering of compilewatch.cache.remote)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.table import Table

from cli import output
from cli.app import make_app
from cli.cache_render import counts_by_key, print_findings, short
from cli.lazy import lazy
from cli.options import JsonOpt
from compilewatch.errors import BadInput

remote = lazy("compilewatch.cache.remote.server")
sync = lazy("compilewatch.cache.remote.sync")
manage = lazy("compilewatch.cache.local.manage")

app = make_app(
    "remote",
    "torch's own Redis remote caches (TORCHINDUCTOR_FX_GRAPH_REMOTE_CACHE=1 and friends): see, seed, fetch, "
    "verify, clear.\n\nURL defaults to what torch would use: TORCHINDUCTOR_REDIS_URL, else "
    "redis://TORCHINDUCTOR_REDIS_HOST:TORCHINDUCTOR_REDIS_PORT (localhost:6379). A writable Redis is code "
    "execution on every node that reads it: docs/security.md.",
)

UrlArg = Annotated[Optional[str], typer.Argument(metavar="URL", help="redis://:PASSWORD@HOST:PORT/DB, password and /DB optional (default: torch's).")]
UrlOpt = Annotated[Optional[str], typer.Option("--url", help="redis://:PASSWORD@HOST:PORT/DB, password and /DB optional (default: torch's).")]
DirOpt = Annotated[Optional[Path], typer.Option("--dir", help="The local inductor cache dir (default: the one torch uses).")]
TimeoutOpt = Annotated[float, typer.Option("--timeout", min=0.1, help="Network deadline of the whole command, seconds: connect and every read and write together, however slowly the bytes arrive.")]
MaxValueOpt = Annotated[str, typer.Option("--max-value", help="Largest value read from the server, e.g. 256MB (bigger ones are reported, never read).")]


def _url(arg: str | None, opt: str | None) -> str | None:
    """Every remote command takes the server as its URL argument or as --url (the same meaning either
    way); both at once must agree."""
    if arg is not None and opt is not None and arg != opt:
        raise BadInput(f"two servers given: {remote.redact(arg)} and --url {remote.redact(opt)}",
                       hint="give the server once, as the URL argument or as --url")
    url = arg if arg is not None else opt
    if url:
        remote.check_db(url)
    return url


MAX_CAP = 1 << 40  # 1 TB: far above a Redis string's 512 MB limit; past 2**63 Redis refuses the GETRANGE


def _cap(text: str) -> int:
    cap = manage.parse_size(text)
    if cap > MAX_CAP:
        raise BadInput(f"--max-value {text}: at most 1T (a Redis value is at most 512 MB unless the server's "
                       "proto-max-bulk-len says more)", hint="leave --max-value out for 256MB")
    return cap


# --- status -----------------------------------------------------------------------------------------
@app.command("status")
def status_cmd(
    url: UrlArg = None,
    url_opt: UrlOpt = None,
    quick: Annotated[bool, typer.Option("--quick", help="Keys and sizes only: do not read values (no system keys, no hit estimate).")] = False,
    max_value: MaxValueOpt = "256MB",
    timeout: TimeoutOpt = 60.0,
    as_json: JsonOpt = False,
) -> None:
    """Is the remote cache reachable (and why not), what it holds per kind and per system key / torch
    build, and how many entries this machine's torch would hit. Exit 1 when it is unreachable.

    Examples:

      compilewatch cache remote status

      compilewatch cache remote status redis://cache-host:6379/0 --json
    """
    r = remote.status(_url(url, url_opt), quick=quick, max_value=_cap(max_value), timeout=timeout)
    output.emit(r, as_json, _render_status)
    raise typer.Exit(0 if r.reach.reachable else 1)


def _render_status(r) -> None:
    o = output.out
    on = [k for k, v in r.config.enabled.items() if v]
    o.print(f"[bold]{r.reach.url}[/] ({r.reach.source}): "
            + (f"[green]reachable[/], {r.reach.why}, Redis {r.reach.server_version}" if r.reach.reachable
               else f"[red]unreachable[/]: {r.reach.why}"))
    o.print("torch's remote caches in this environment: " + (", ".join(on) if on else
            "none turned on (TORCHINDUCTOR_FX_GRAPH_REMOTE_CACHE=1, TORCHINDUCTOR_AUTOGRAD_REMOTE_CACHE=1, ...)"))
    if not r.reach.reachable:
        output.hint("start redis-server there, or point TORCHINDUCTOR_REDIS_URL at the right host; torch itself "
                    "says nothing when it cannot reach it (it silently stops using it)")
        return
    o.print(f"{r.keys} keys, {r.torch_keys} torch's ({output.fmt_bytes(r.bytes)})"
            + (f", {r.foreign_keys} not torch's" if r.foreign_keys else ""))
    table = Table("kind", "entries", "size", "what it holds", box=None)
    for k in r.kinds:
        table.add_row(k.kind, str(k.entries), output.fmt_bytes(k.bytes), k.description)
    o.print(table)
    if r.quick:
        o.print("[dim]--quick: values not read, so no system keys and no hit estimate[/]")
        return
    keys = counts_by_key(r.by_system_key, r.system_key) or "none"
    o.print(f"FX-graph / AOTAutograd entries built for system keys: {keys}")
    torches = counts_by_key(r.by_torch_hash, r.torch_hash, " (this torch)") or "none"
    o.print(f"... and torch builds: {torches}")
    o.print(f"this machine (torch {r.torch_version}, system key {short(r.system_key)}) would hit "
            f"[bold]{r.would_hit}[/], never {r.cannot_hit}, cannot tell {r.unknown} (autotune, PGO, unstamped)")
    if r.by_signature:
        sig = ", ".join(f"{n} {k}" for k, n in sorted(r.by_signature.items()))
        o.print(f"signatures: {sig} (processes compilewatch watches load only own / trusted ones)")
    for kind, n in r.problems.items():
        output.warn(f"{n} entries {kind} (`compilewatch cache remote verify` lists them)")
    for key, kind, detail in r.problem_keys[:5]:
        output.warn(f"{kind}: {key}: {detail}")


# --- verify -----------------------------------------------------------------------------------------
@app.command("verify")
def verify_cmd(url: UrlArg = None, url_opt: UrlOpt = None, max_value: MaxValueOpt = "256MB",
               timeout: TimeoutOpt = 60.0, as_json: JsonOpt = False) -> None:
    """Scan every entry (pickles parsed, never unpickled) and the server's security posture: a
    password/ACL set? bound to every interface? Exit 1 on any error finding.

    Examples:

      compilewatch cache remote verify

      compilewatch cache remote verify redis://:secret@10.0.0.5:6379 --json
    """
    r = remote.verify(_url(url, url_opt), max_value=_cap(max_value), timeout=timeout)
    output.emit(r, as_json, _render_verify)
    raise typer.Exit(0 if r.ok else 1)


def _render_verify(r) -> None:
    o = output.out
    verdict = "[green]ok[/]" if r.ok else "[red]problems found[/]"
    o.print(f"[bold]verify {r.url}[/]: {r.entries} entries, {verdict}")
    s = r.security
    o.print(f"server: auth {s.auth}, bind {s.bind or '?'}, protected-mode {s.protected_mode or '?'}, "
            f"TLS {'yes' if s.tls else 'no'}")
    for note in s.notes:
        o.print(f"[dim]not checked: {note}[/]")
    if r.findings:
        print_findings(r.findings, "key")
    if any(f.kind in ("no-auth", "open-bind") for f in r.findings):
        output.hint("set a password or ACL user (requirepass / ACL SETUSER) and bind to a private interface "
                    "(docs/security.md)")
    if any(f.kind in ("untrusted", "unloadable", "malformed", "bad-signature") for f in r.findings):
        output.hint("`compilewatch cache remote clear` backs everything up, then empties the cache")
    if any(f.kind in ("unsigned", "foreign-signed") for f in r.findings):
        output.hint("processes compilewatch watches load only entries signed by this machine or a trusted key "
                    "(`cache remote push` signs; `cache trust add` trusts another machine's key)")


# --- push / pull ------------------------------------------------------------------------------------
@app.command("push")
def push_cmd(
    source: Annotated[Path, typer.Argument(metavar="SOURCE", help="A cache dir, an archive from `cache save`, or a backup file from `cache remote clear`.")],
    url: UrlArg = None,
    url_opt: UrlOpt = None,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace keys the server already has.")] = False,
    max_value: MaxValueOpt = "256MB",
    timeout: TimeoutOpt = 600.0,
    as_json: JsonOpt = False,
) -> None:
    """Seed the remote cache with FX-graph and AOTAutograd entries, exactly as torch writes them, and
    only what verifies (a dir through `cache verify`, an archive through `cache load`'s checks).

    Examples:

      compilewatch cache remote push /tmp/torchinductor_root

      compilewatch cache remote push warm.tar.gz --url redis://cache:6379
    """
    r = sync.push(source, _url(url, url_opt), overwrite=overwrite, max_value=_cap(max_value), timeout=timeout)
    output.emit(r, as_json, _render_push)


def _render_push(r) -> None:
    o = output.out
    what = ", ".join(f"{n} {k}" for k, n in sorted(r.pushed.items())) or "nothing new"
    if not (r.pushed or r.already or r.skipped):  # an empty (or mistyped, freshly made) cache dir
        what = f"nothing: {r.source} holds no FX-graph or AOTAutograd entries"
    o.print(f"pushed {r.source} ({r.source_kind}) → [bold]{r.url}[/]: {what}, {output.fmt_bytes(r.bytes)} "
            f"in {output.fmt_seconds(r.duration_s)}")
    if r.already:
        o.print(f"{r.already} keys were already there (left alone; --overwrite replaces them)")
    if r.signed:
        o.print(f"{r.signed} signatures written" + (f" (key {r.signer})" if r.signer else " (restored from the backup)"))
    for n in r.notes:
        o.print(f"[dim]note: {n}[/]")
    for s in r.skipped[:20]:
        output.warn(f"not pushed {s.what}: {s.reason}")
    if len(r.skipped) > 20:
        output.warn(f"... and {len(r.skipped) - 20} more not pushed (see --json)")


@app.command("pull")
def pull_cmd(
    url: UrlArg = None,
    url_opt: UrlOpt = None,
    dir: DirOpt = None,
    all_systems: Annotated[bool, typer.Option("--all", help="Also fetch entries built for another system key or torch build (they never hit here).")] = False,
    force: Annotated[bool, typer.Option("--force", help="Act on --dir even though it does not look like an inductor cache.")] = False,
    allow_unsigned: Annotated[bool, typer.Option("--allow-unsigned", help="Also fetch entries no trusted key signed (written by torch outside compilewatch, or by another machine's key). Each is still scanned.")] = False,
    max_value: MaxValueOpt = "256MB",
    timeout: TimeoutOpt = 600.0,
    as_json: JsonOpt = False,
) -> None:
    """Fetch the entries this machine's torch would hit into the local cache: staged beside it, every
    pickle checked, swapped in atomically; the previous cache becomes <cache>.backup-<time>.

    Examples:

      compilewatch cache remote pull

      compilewatch cache remote pull --url redis://cache:6379 --dir /data/ic
    """
    r = sync.pull(_url(url, url_opt), dir, all_systems=all_systems, force=force, max_value=_cap(max_value),
                  allow_unsigned=allow_unsigned, timeout=timeout)
    output.emit(r, as_json, _render_pull)


def _render_pull(r) -> None:
    o = output.out
    what = ", ".join(f"{n} {k}" for k, n in sorted(r.pulled.items())) or "nothing new"
    o.print(f"pulled {r.url} → [bold]{r.path}[/]: {what}, {output.fmt_bytes(r.bytes)} in {output.fmt_seconds(r.duration_s)}")
    if r.already_local:
        o.print(f"{r.already_local} entries were already in the local cache")
    if r.backup:
        o.print(f"previous cache moved to {r.backup}")
    if r.skipped:
        o.print(f"{len(r.skipped)} entries left on the server (see --json), e.g. {r.skipped[0].reason}")


# --- clear ------------------------------------------------------------------------------------------
@app.command("clear")
def clear_cmd(
    url: UrlArg = None,
    url_opt: UrlOpt = None,
    backup: Annotated[Optional[Path], typer.Option("--backup", help="Backup file to write first (default: ./redis-HOST-PORT-DB.backup-TIME.jsonl).")] = None,
    max_value: MaxValueOpt = "256MB",
    timeout: TimeoutOpt = 600.0,
    as_json: JsonOpt = False,
) -> None:
    """Write every torch entry to a local backup file, then delete them from the server (keys that
    are not torch's are left alone). `cache remote push BACKUP` restores it.

    Examples:

      compilewatch cache remote clear

      compilewatch cache remote clear redis://cache:6379 --backup old.jsonl
    """
    r = sync.clear(_url(url, url_opt), backup=backup, max_value=_cap(max_value), timeout=timeout)
    output.emit(r, as_json, _render_clear)


def _render_clear(r) -> None:
    o = output.out
    if not r.backup:
        o.print(f"{r.url}: no torch entries, nothing to clear")
        return
    o.print(f"backed up {r.deleted + r.changed_meanwhile} entries ({output.fmt_bytes(r.bytes)}) to [bold]{r.backup}[/], "
            f"deleted {r.deleted} from {r.url}")
    if r.changed_meanwhile:
        output.warn(f"{r.changed_meanwhile} keys were rewritten meanwhile and kept")
    if r.left_alone:
        o.print(f"{r.left_alone} keys that are not torch's were left alone")
    o.print(f"restore with: {r.restore_command}")
