"""`compilewatch cache ...`: the inductor cache as a managed artifact (rendering of compilewatch.cache)."""

from __future__ import annotations

import shlex
import time
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.markup import escape
from rich.table import Table

from cli import cache_trust, output
from cli.app import make_app
from cli.cache_render import counts_by_key, print_findings, short
from cli.lazy import lazy
from cli.options import JsonOpt
from cli.progress import byte_progress

archive_save = lazy("compilewatch.cache.archive.save")
archive_load = lazy("compilewatch.cache.archive.load")
cache_diff = lazy("compilewatch.cache.archive.diff")
archive_check = lazy("compilewatch.cache.archive.check")
fp_lib = lazy("compilewatch.cache.content.fingerprint")
layout = lazy("compilewatch.cache.local.layout")
manage = lazy("compilewatch.cache.local.manage")
verify_lib = lazy("compilewatch.cache.content.verify")
trust_keys = lazy("compilewatch.cache.trust.keys")
from compilewatch.errors import BadInput
from compilewatch.fsutil import atomic_write_json

app = make_app(
    "cache",
    "The inductor cache as an artifact: locate, fingerprint, verify, save, load, clear, prune, ls, du, diff.\n\n"
    "Every command acts on torch's cache dir (TORCHINDUCTOR_CACHE_DIR, else /tmp/torchinductor_<user>) "
    "unless --dir says otherwise. Nothing is ever deleted without a backup unless you say --no-backup/--delete and --yes.",
)

app.add_typer(cache_trust.app, name="trust")


@app.callback()
def _cache_group(ctx: typer.Context) -> None:
    ctx.call_on_close(_say_recovered)


def _say_recovered() -> None:
    """A load killed between its two renames is repaired by the next cache command (swap.recover): say so."""
    from compilewatch.cache.local import swap

    for line in swap.take_recovered():
        output.err.print(f"[yellow]repaired:[/] {output.clean(line)}")

from cli.cache_remote import app as remote_app  # noqa: E402 - `cache remote ...`

app.add_typer(remote_app, name="remote")

from cli.cache_explain import explain_cmd  # noqa: E402 - `cache explain` (issue 38)

app.command("explain")(explain_cmd)

DirOpt = Annotated[Optional[Path], typer.Option("--dir", help="The inductor cache dir (default: the one torch uses).")]
ForceDirOpt = Annotated[bool, typer.Option("--force", help="Act on --dir even though it does not look like an inductor cache (no fxgraph/, aotautograd/, triton kernels or generated code files).")]


def _ago(ns: int) -> str:
    s = max(0.0, time.time() - ns / 1e9)
    for unit, n in (("d", 86400), ("h", 3600), ("min", 60)):
        if s >= n:
            return f"{s / n:.0f} {unit} ago"
    return f"{s:.0f} s ago"


# --- where ----------------------------------------------------------------------------------------
@app.command("where")
def where_cmd(dir: DirOpt = None, as_json: JsonOpt = False) -> None:
    """Where the inductor and triton caches are, and which sub-caches exist.

    Example: compilewatch cache where
    """
    loc = layout.locate(dir)
    output.emit(loc, as_json, _render_where, escape_markup=True)


_ALWAYS_SHOWN = ("fxgraph", "aotautograd", "codegen", "triton", "precompiled_headers")


def _render_where(loc: layout.CacheLocation) -> None:
    o = output.out
    state = "exists" if loc.exists else ("[red]not a directory: torch cannot use it[/]" if loc.path.exists()
                                         else "[yellow]does not exist[/]")
    o.print(f"[bold]inductor cache[/] {loc.path}  ({loc.source}; {state})")
    o.print(f"[bold]triton cache[/]   {loc.triton_dir}  ({loc.triton_source})")
    if loc.exists and not loc.looks_like_cache:
        o.print("[yellow]this dir holds things torch does not write: cache commands will refuse it[/]")
    table = Table("sub-cache", "exists", "path", "what it holds", box=None)
    rare = []
    for s in loc.subcaches:
        if not s.exists and s.name not in _ALWAYS_SHOWN:
            rare.append(s.name)
            continue
        where = str(s.path) + ("" if s.inside else "  [yellow](outside the cache dir: not saved or cleared with it)[/]")
        table.add_row(s.name, "yes" if s.exists else "-", where, s.description)
    o.print(table)
    if rare:
        o.print(f"[dim]not here (written only by some backends or options; docs/cache.md): {', '.join(rare)}[/]")
    o.print(f"lock file: {loc.lock_file}")
    if loc.siblings:
        o.print("[bold]beside it[/] (backups and set-aside entries compilewatch kept; `cache load DIR` restores a backup):")
        for p in loc.siblings:
            o.print(f"  {p}")


# --- fingerprint ----------------------------------------------------------------------------------
@app.command("fingerprint")
def fingerprint_cmd(
    dir: DirOpt = None,
    files: Annotated[bool, typer.Option("--files", help="Include every file with its hash (what `cache diff` needs).")] = False,
    out_file: Annotated[Optional[Path], typer.Option("--output", "-o", help="Also write the fingerprint (with --files) to FILE, atomically.")] = None,
    no_index: Annotated[bool, typer.Option("--no-index", help="Hash every file again; ignore and keep the stat index.")] = False,
    as_json: JsonOpt = False,
) -> None:
    """A content manifest: files and bytes per sub-cache, a Merkle hash, the system key, torch version.

    Re-running on an unchanged cache only stats files (stat index in <cache>/.compilewatch/).

    Examples:

      compilewatch cache fingerprint

      compilewatch cache fingerprint -o before.json

      compilewatch cache diff before.json after.json
    """
    if out_file is not None:
        layout.refuse_inside(layout.locate(dir).path, out_file, "fingerprint file")
    with byte_progress("fingerprint") as on_bytes:
        fp = fp_lib.fingerprint(dir, files=files or out_file is not None, use_index=not no_index, progress=on_bytes)
    if out_file is not None:
        atomic_write_json(out_file, fp)
        output.err.print(f"wrote {out_file}")
    if not files and fp.entries is not None:
        import dataclasses

        fp = dataclasses.replace(fp, entries=None)
    output.emit(fp, as_json, _render_fingerprint, escape_markup=True)


def _render_fingerprint(fp: fp_lib.Fingerprint) -> None:
    o = output.out
    o.print(f"[bold]{fp.path}[/]: {fp.files} files, {output.fmt_bytes(fp.bytes)}")
    o.print(f"content hash  {fp.content_hash}")
    o.print(f"system key    {fp.system_key}  (this machine, torch {fp.torch_version})")
    keys = counts_by_key(fp.entry_system_keys, fp.system_key) or "no stamped entries"
    o.print(f"entries built for: {keys}")
    if fp.foreign_entries:
        output.warn(f"{fp.foreign_entries} entries were built for another system key and can never hit here "
                    "(`compilewatch cache verify` lists them)")
    table = Table("sub-cache", "files", "size", "content hash", "newest", box=None)
    for s in sorted(fp.subcaches, key=lambda s: -s.bytes):
        table.add_row(s.name, str(s.files), output.fmt_bytes(s.bytes), s.content_hash, _ago(s.newest_mtime_ns))
    o.print(table)
    outside = [s for s in layout.locate(fp.path).subcaches if s.exists and not s.inside]
    if outside:
        o.print("[dim]not in this fingerprint (outside the dir): "
                + ", ".join(f"{s.name} {s.path}" for s in outside) + "[/]")
    o.print(f"[dim]{fp.hashed} files hashed, {fp.reused} from the stat index, {fp.in_flight} in-flight temp files "
            f"skipped, {output.fmt_seconds(fp.duration_s)}[/]")
    for w in fp.warnings:
        output.warn(w)


# --- verify ---------------------------------------------------------------------------------------
@app.command("verify")
def verify_cmd(
    archive_path: Annotated[Optional[Path], typer.Argument(metavar="ARCHIVE", help="Verify this archive instead of a cache dir: who made it (made here, signed by a trusted key, or foreign), then every pickle in it scanned. Nothing is extracted.")] = None,
    dir: DirOpt = None,
    fix: Annotated[bool, typer.Option("--fix", help="Move bad and foreign entries to <cache>.quarantine-<time>/ (never deletes); rewrite relocated triton paths.")] = False,
    quick: Annotated[bool, typer.Option("--quick", help="Read bytes only; do not parse pickle opcodes (nothing is ever unpickled, in either mode).")] = False,
    as_json: JsonOpt = False,
) -> None:
    """Find unusable entries (empty, truncated, unloadable, missing kernel binaries) and entries built
    for another system key or torch build. Exit 1 when it finds any (with --fix: when any remain).

    With ARCHIVE: say first whether the archive was made here, signed by a key you trust, or is
    foreign, then scan every pickle in it (nothing is extracted or unpickled). Exit 1 when it is
    foreign or a pickle is refused.

    Examples:

      compilewatch cache verify

      compilewatch cache verify --fix --json

      compilewatch cache verify warm-cache.tar.gz
    """
    if archive_path is not None:
        if fix or dir is not None:
            raise typer.BadParameter("--fix and --dir act on a cache dir, not on ARCHIVE")
        if archive_path.is_dir():
            raise BadInput(f"{archive_path} is a directory: ARCHIVE is an archive file from `cache save`",
                           hint="to verify a cache dir, pass it with --dir: compilewatch cache verify --dir "
                                + shlex.quote(str(archive_path)))
        rep = archive_check.verify_archive(archive_path)
        output.emit(rep, as_json, _render_verify_archive, escape_markup=True)
        raise typer.Exit(0 if rep.ok else 1)
    report = verify_lib.verify(dir, deep=not quick, fix=fix)
    output.emit(report, as_json, _render_verify, escape_markup=True)
    remaining = not report.ok and not (fix and report.moved)
    raise typer.Exit(1 if remaining else 0)


def _render_verify(r: verify_lib.VerifyReport) -> None:
    o = output.out
    verdict = "[green]ok[/]" if r.ok else "[red]problems found[/]"
    o.print(f"[bold]verify {r.path}[/]: {r.files} files, {verdict}"
            + ("" if r.deep else " (quick: pickles not parsed)"))
    o.print(f"this machine: system key {short(r.system_key)}, torch {r.torch_version}")
    keys = counts_by_key(r.entry_system_keys, r.system_key) or "none stamped"
    o.print(f"entries built for: {keys}")
    if r.findings:
        print_findings(r.findings, "path")
    for note in r.not_checked:
        o.print(f"[dim]not checked: {note}[/]")
    if r.moved:
        o.print(f"[bold]moved {len(r.moved)} path(s) to {r.quarantine}[/] (nothing deleted)")
    if r.paths_rewritten:
        o.print(f"pointed {r.paths_rewritten} triton .json file(s) at this dir")
    elif not r.ok and not r.moved:
        output.hint("`compilewatch cache verify --fix` moves the bad entries aside; torch then recompiles them")


def _provenance_line(p) -> str:
    colour = {"own": "green", "trusted": "green", "foreign": "red"}[p.verdict]
    made = p.made_by
    who = f" — made by {made['user']}@{made['host']}" if {"user", "host"} <= set(made) and p.verdict != "foreign" else ""
    when = f" on {made['created_at']}" if made.get("created_at") and p.verdict != "foreign" else ""
    return f"[{colour}]{p.summary}[/]{who}{when}"


def _render_verify_archive(r) -> None:
    o = output.out
    o.print(_provenance_line(r.provenance))
    refused = any(f.kind == "refused" for f in r.findings)  # load refuses these even with --trust
    verdict = "[green]ok[/]" if r.ok else "[red]cache load refuses it, with --trust too[/]" if refused else \
        "[red]not loadable without --trust[/]"
    o.print(f"[bold]verify {r.path}[/]: {r.members} members, {r.pickles_scanned} pickles and "
            f"{r.mega_artifacts_scanned} Mega-Cache artifacts scanned, {verdict}")
    if r.findings:
        table = Table("kind", "member", "detail", box=None)
        for f in r.findings[:200]:
            table.add_row(f"[red]{f.kind}[/]", f.member, f.detail)
        o.print(table)
    if r.provenance.verdict == "foreign":
        output.hint("an archive is code: load it only if you trust who made it (`cache trust add` their key, "
                    "or `cache load --trust` once); docs/security.md")


# --- save / load ----------------------------------------------------------------------------------
@app.command("save")
def save_cmd(
    archive_path: Annotated[Path, typer.Argument(metavar="ARCHIVE", help="Archive to write: *.tar.zst, *.tar.gz, *.tgz or *.tar.")],
    dir: DirOpt = None,
    no_mega: Annotated[bool, typer.Option("--no-mega", help="Leave out the Mega-Cache copy of fxgraph/aotautograd entries.")] = False,
    level: Annotated[Optional[int], typer.Option("--level", help="Compression level (gzip 1-9, zstd 1-22; default 3).")] = None,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace ARCHIVE if it exists.")] = False,
    headers: Annotated[bool, typer.Option("--headers", help="Also archive precompiled_headers/ (in torch's default dir only: hundreds of MB that only the same host compiler can use; left out by default).")] = False,
    as_json: JsonOpt = False,
) -> None:
    """Save the cache to a portable archive (manifest, environment summary, Mega-Cache), atomically.
    Precompiled C++ headers are left out unless --headers (torch rebuilds them on the first CPU compile).

    Examples:

      compilewatch cache save warm-cache.tar.gz

      compilewatch cache save /shared/caches/h200-torch2.11.tar.zst \\
        --dir /tmp/torchinductor_root
    """
    with byte_progress("save") as on_bytes:
        result = archive_save.save(archive_path, dir, mega=not no_mega, level=level, overwrite=overwrite,
                              headers=headers, progress=on_bytes)
    output.emit(result, as_json, _render_save, escape_markup=True)


def _render_save(r: archive_save.SaveResult) -> None:
    o = output.out
    o.print(f"saved {r.source} → [bold]{r.archive}[/]")
    o.print(f"{r.files} files, {output.fmt_bytes(r.bytes)} → {output.fmt_bytes(r.archive_bytes)} ({r.compression}) "
            f"in {output.fmt_seconds(r.duration_s)}")
    o.print(f"content hash {r.content_hash}")
    if r.signed_by:
        who = trust_keys.describe_own(r.signed_by)  # this machine's, or COMPILEWATCH_SIGNING_KEY's, by path
        o.print(f"signed by {who} (other machines trust it with `cache trust add`; `cache trust key` prints it)")
    if r.mega_cache:
        o.print("Mega-Cache: " + ", ".join(f"{n} {k}" for k, n in sorted(r.mega_cache.items())))
    for sub, c in (r.left_out or {}).items():
        o.print(f"left out {sub}/: {c['files']} files, {output.fmt_bytes(c['bytes'])} (only the same host compiler "
                "can use them; torch rebuilds them; --headers keeps them)")
    for w in r.warnings:
        output.warn(w)


@app.command("load")
def load_cmd(
    source: Annotated[Path, typer.Argument(metavar="ARCHIVE", help="An archive from `cache save`, or a backup dir compilewatch made (`cache clear`, a previous `cache load`).")],
    dir: DirOpt = None,
    force: Annotated[bool, typer.Option("--force", help="Load even if it was made for another system key or torch version, or if --dir does not look like an inductor cache.")] = False,
    trust: Annotated[bool, typer.Option("--trust", help="Load a foreign archive (not made here, not signed by a key in `cache trust list`) or a dir that is not a backup compilewatch made here, and pickles the scanner refuses: you accept it as code from a stranger. Prefer `cache trust add` for people you trust.")] = False,
    as_json: JsonOpt = False,
) -> None:
    """Load an archive (or restore a backup dir) as the cache, atomically; the current cache is moved to
    a timestamped backup. Refuses archives from another system key or torch version unless --force.

    An archive is code: torch runs what its entries carry. So it says first who made the archive: made
    here, signed by a key you trust (`cache trust`), or foreign; a foreign archive is refused unless
    --trust. A dir is not signed: a backup compilewatch made here (recorded when it made it) is
    restored, any other dir only with --trust. Every pickle, of an archive or a dir, is scanned as a
    second line (never unpickled); one the scanner refuses is refused unless --trust (docs/security.md).

    Examples:

      compilewatch cache load warm-cache.tar.gz

      compilewatch cache load /tmp/torchinductor_root.backup-20260101-120000
    """
    with byte_progress("load") as on_bytes:
        result = archive_load.load(source, dir, force=force, trust=trust, progress=on_bytes)
    output.emit(result, as_json, _render_load, escape_markup=True)


def _render_load(r: archive_load.LoadResult) -> None:
    o = output.out
    if r.provenance is not None:
        o.print(_provenance_line(r.provenance))
        if r.provenance.trusted_by_flag:
            what = "dir" if r.provenance.kind == "dir" else "archive"
            o.print(f"[bold red]loaded with --trust: this {what} is code[/] from someone this machine does not "
                    "trust; torch runs what it carries on the next compile")
    for p in r.trusted_pickles:
        output.warn(f"loaded with --trust although the scanner refused {p}")
    o.print(f"loaded {r.source} → [bold]{r.path}[/]: {r.files} files, {output.fmt_bytes(r.bytes)} "
            f"in {output.fmt_seconds(r.duration_s)}")
    if r.content_hash:  # empty for pruned entries moved back: the cache holds more than they are
        o.print(f"content hash {r.content_hash}")
    if r.backup:
        o.print(f"previous cache moved to {r.backup}")
    if r.paths_rewritten:
        o.print(f"{r.paths_rewritten} triton .json file(s) pointed at the new path (triton finds kernels by absolute path)")
    for m in r.mismatches:
        output.warn(f"loaded with --force: {m}")
    for w in r.warnings:
        if not (r.provenance is not None and r.provenance.trusted_by_flag and w.startswith("this archive is code")):
            output.warn(w)  # (the code warning was said above, in bold)


# --- clear / prune --------------------------------------------------------------------------------
@app.command("clear")
def clear_cmd(
    dir: DirOpt = None,
    no_backup: Annotated[bool, typer.Option("--no-backup", help="Delete instead of moving to a backup (needs --yes).")] = False,
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Confirm --no-backup.")] = False,
    force: ForceDirOpt = False,
    as_json: JsonOpt = False,
) -> None:
    """Move the cache to <cache>.backup-<time> and print how to restore it.

    Examples:

      compilewatch cache clear

      compilewatch cache clear --no-backup --yes
    """
    result = manage.clear(dir, backup=not no_backup, yes=yes, force=force)
    output.emit(result, as_json, _render_clear, escape_markup=True)


def _render_clear(r: manage.ClearResult) -> None:
    o = output.out
    if r.deleted:
        o.print(f"deleted {r.path} ({r.files} files, {output.fmt_bytes(r.bytes)})")
        return
    o.print(f"moved {r.path} ({r.files} files, {output.fmt_bytes(r.bytes)}) → [bold]{r.backup}[/]")
    o.print(f"restore with: {r.restore_command}")


@app.command("prune")
def prune_cmd(
    max_size: Annotated[str, typer.Option("--max-size", help="Keep at most this much, e.g. 500MB, 2G (powers of 1024).")],
    dir: DirOpt = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Only say what would go.")] = False,
    delete: Annotated[bool, typer.Option("--delete", help="Delete pruned entries instead of moving them to <cache>.pruned-<time>/ (needs --yes).")] = False,
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Confirm --delete.")] = False,
    force: ForceDirOpt = False,
    as_json: JsonOpt = False,
) -> None:
    """Shrink the cache to --max-size, least recently used entries first.

    Examples:

      compilewatch cache prune --max-size 2G --dry-run

      compilewatch cache prune --max-size 500MB --delete --yes
    """
    result = manage.prune(manage.parse_size(max_size), dir, dry_run=dry_run, delete=delete, yes=yes, force=force)
    output.emit(result, as_json, _render_prune, escape_markup=True)


def _render_prune(r: manage.PruneResult) -> None:
    o = output.out
    verb = "would remove" if r.dry_run else "deleted" if r.deleted else "moved"
    o.print(f"{r.path}: {output.fmt_bytes(r.bytes_before)} → {output.fmt_bytes(r.bytes_after)} "
            f"(max {output.fmt_bytes(r.max_bytes)}); {verb} {len(r.removed)} entries")
    for e in r.removed[:20]:
        o.print(f"  {e.subcache:12} {e.name}  {output.fmt_bytes(e.bytes)}  last used {_ago(e.last_used_ns)}")
    if len(r.removed) > 20:
        o.print(f"  ... and {len(r.removed) - 20} more")
    if r.moved_to:
        o.print(f"moved to {r.moved_to}; to put them back: {r.restore} (delete the dir when you are sure)")


# --- ls / du --------------------------------------------------------------------------------------
@app.command("ls")
def ls_cmd(
    dir: DirOpt = None,
    subcache: Annotated[Optional[str], typer.Option("--subcache", "-s", help="Only this sub-cache (fxgraph, aotautograd, codegen, triton, ...).")] = None,
    sort: Annotated[str, typer.Option("--sort", help="size, recent or name.")] = "size",
    limit: Annotated[Optional[int], typer.Option("--limit", "-n", help="Show at most N entries (0: all).")] = 50,
    as_json: JsonOpt = False,
) -> None:
    """List cache entries (an FX-graph key, a kernel folder, a generated module), largest first.

    Examples:

      compilewatch cache ls -s fxgraph --sort recent
    """
    result = manage.ls(dir, subcache=subcache, sort=sort, limit=limit)  # type: ignore[arg-type]
    output.emit(result, as_json, _render_ls, escape_markup=True)


def _render_ls(r: manage.Listing) -> None:
    o = output.out
    table = Table("sub-cache", "entry", "files", "size", "last used", box=None)
    for e in r.entries:
        table.add_row(e.subcache, e.name, str(e.files), output.fmt_bytes(e.bytes), _ago(e.last_used_ns))
    o.print(table)
    shown = f"{len(r.entries)} of {r.total_entries}" if len(r.entries) < r.total_entries else str(r.total_entries)
    o.print(f"{shown} entries; {r.total_files} files, {output.fmt_bytes(r.total_bytes)} in {r.path}")


@app.command("du")
def du_cmd(
    dir: DirOpt = None,
    top: Annotated[int, typer.Option("--top", "-n", help="How many of the largest entries to show.")] = 10,
    as_json: JsonOpt = False,
) -> None:
    """Disk use per sub-cache and the largest entries.

    Example: compilewatch cache du --top 5
    """
    output.emit(manage.du(dir, top=top), as_json, _render_du, escape_markup=True)


def _render_du(r: manage.Usage) -> None:
    o = output.out
    o.print(f"[bold]{r.path}[/]: {r.files} files, {output.fmt_bytes(r.bytes)}"
            + (f" ({r.in_flight} in-flight temp files not counted)" if r.in_flight else ""))
    table = Table("sub-cache", "entries", "files", "size", "what it holds", box=None)
    for s in r.subcaches:
        table.add_row(s.name, str(s.entries), str(s.files), output.fmt_bytes(s.bytes), s.description)
    o.print(table)
    if r.largest:
        o.print("[bold]largest entries[/]")
        for e in r.largest:
            o.print(f"  {output.fmt_bytes(e.bytes):>9}  {e.subcache:12} {e.name}")


# --- diff -----------------------------------------------------------------------------------------
@app.command("diff")
def diff_cmd(
    a: Annotated[str, typer.Argument(help="A cache dir, an archive, or a fingerprint JSON (`cache fingerprint -o`).")],
    b: Annotated[str, typer.Argument(help="The same kinds as A.")],
    limit: Annotated[int, typer.Option("--limit", "-n", help="Paths shown per sub-cache and kind.")] = 10,
    as_json: JsonOpt = False,
) -> None:
    """Added / removed / changed files per sub-cache from A to B. Exit 1 when they differ (like diff).

    Examples:

      compilewatch cache diff before.json /tmp/torchinductor_root

      compilewatch cache diff old.tar.gz new.tar.gz --json
    """
    if limit < 0:
        raise BadInput(f"--limit must be >= 0, got {limit}", hint="leave --limit out for 10 paths per sub-cache and kind")
    result = cache_diff.diff(a, b)
    output.emit(result, as_json, lambda r: _render_diff(r, limit), escape_markup=True)
    raise typer.Exit(0 if result.same else 1)


def _render_diff(r: cache_diff.CacheDiff, limit: int) -> None:
    o = output.out
    o.print(f"[bold]A[/] {r.a}  {r.content_hash_a}  (system key {short(r.system_key_a)}, torch {r.torch_version_a})")
    o.print(f"[bold]B[/] {r.b}  {r.content_hash_b}  (system key {short(r.system_key_b)}, torch {r.torch_version_b})")
    if r.same:
        o.print("[green]same content[/]")
    for side, src, why in (("A", r.source_a, r.source_reason_a), ("B", r.source_b, r.source_reason_b)):
        if src == "foreign":
            o.print(f"[yellow]{side} is a foreign archive[/] ({why}): its manifest is only what its maker claims; "
                    "no signature vouches for it")
    if not r.per_file:
        o.print("[dim]a side has no per-file entries (fingerprint without --files): counts and hashes only[/]")
    table = Table("sub-cache", "files A", "files B", "size A", "size B", "added", "removed", "changed", box=None)
    for s in r.subcaches:
        mark = "=" if s.same else ""
        table.add_row(s.name + (" (same)" if mark else ""), str(s.files_a), str(s.files_b), output.fmt_bytes(s.bytes_a),
                      output.fmt_bytes(s.bytes_b), str(len(s.added)), str(len(s.removed)), str(len(s.changed)))
    o.print(table)
    for s in r.subcaches:
        for label, paths in (("+", s.added), ("-", s.removed), ("~", s.changed)):
            for p in paths[:limit]:
                o.print(f"  {label} {p}")
            if len(paths) > limit:
                o.print(f"  {label} ... {len(paths) - limit} more in {s.name}")
