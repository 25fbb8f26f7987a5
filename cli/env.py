"""`compilewatch lock` and `compilewatch diff-env`: rendering of compilewatch.env.lock / envdiff."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Optional

import typer
from rich.markup import escape

from cli import output
from cli.options import JsonOpt
from cli.progress import byte_progress
from compilewatch.env import lock as envlock

if TYPE_CHECKING:
    from compilewatch.env import diff as envdiff

# compilewatch.env.formats.FORMATS, spelled out so that `lock` and --help do not import every format
# reader (tests/test_cli_env.py checks the two agree)
FORMAT_NAMES = ("lock", "requirements", "uv.lock", "pylock", "conda-yaml", "conda-explicit")
from compilewatch.errors import BadInput
from compilewatch.fsutil import atomic_write_json

_STYLE = {"critical": "bold red", "warning": "yellow", "info": "dim"}


def lock_cmd(
    out_file: Annotated[Optional[Path], typer.Option("--output", "-o", help="Write the lock to FILE (atomically).")] = None,
    no_gpus: Annotated[bool, typer.Option("--no-gpus", help="Skip NVML (driver and GPU facts).")] = False,
    ask_torch: Annotated[bool, typer.Option(
        "--torch", help="Import torch (and initialise CUDA) for cuDNN, NCCL and the arch list, and take the system "
                        "key from torch itself: seconds instead of under one.")] = False,
    as_json: JsonOpt = False,
) -> None:
    """Snapshot what decides whether compiled artifacts are reusable: python, packages, torch build,
    triton, inductor system key and cache, driver, GPUs, CPU, env vars (secrets left out).

    torch is not imported: its facts come from its files and NVML, and the system key is computed the
    way torch computes it (or asked of torch when that cannot be certain; the lock says which).

    Examples:

      compilewatch lock -o env.lock.json

      compilewatch lock --json | jq .torch

      compilewatch diff-env before.lock.json env.lock.json
    """
    if out_file is not None:
        out_file = _lock_target(out_file)
    with byte_progress("fingerprint of the inductor cache") as on_bytes:
        lock = envlock.snapshot(with_gpus=not no_gpus, ask_torch=ask_torch, progress=on_bytes)
    if out_file is not None:
        atomic_write_json(out_file, lock)
    if as_json:
        output.print_json(lock)
        return
    _render_lock(lock)
    if out_file is not None:
        output.out.print(f"wrote {out_file}")
    else:
        output.hint("save it with -o FILE; compare two with `compilewatch diff-env OLD NEW`")


def _lock_target(out_file: Path) -> Path:
    """Where `lock -o FILE` writes, checked before any work: the atomic write renames a temp file over
    the target, so a device (`-o /dev/null` as root replaced /dev/null with a regular file), a FIFO or
    a socket would be replaced, not written: refused. A symlink is written through (the link stays),
    a link loop refused. A lock inside the inductor cache would become part of what it fingerprints
    and be treated as a stray file by `cache verify --fix`: refused. The folder must be writable."""
    import os
    import stat

    from compilewatch.fsutil import check_writable
    from compilewatch.inputs import file_kind

    target = out_file
    if os.path.islink(out_file):
        target = Path(os.path.realpath(out_file))
        if os.path.islink(target):  # realpath stops inside a loop
            raise BadInput(f"-o {out_file} is a symlink loop", hint="remove the link or give another file name")
    try:
        mode = os.stat(target).st_mode
    except FileNotFoundError:
        mode = None
    except OSError as e:
        raise BadInput(f"-o {out_file}: cannot be checked: {e.strerror or e}", hint="give another file name") from None
    if mode is not None and stat.S_ISDIR(mode):
        raise BadInput(f"{out_file} is a directory", hint="give a file name, e.g. -o env.lock.json")
    if mode is not None and not stat.S_ISREG(mode):
        raise BadInput(f"-o {out_file} is {file_kind(mode)}: the lock is written to a temp file renamed over "
                       "the target, which would replace it, not write to it",
                       hint=f"give a regular file name, or print it: compilewatch lock --json > {out_file}")
    try:
        from compilewatch import torchinfo

        cache = torchinfo.inductor_cache_dir()
    except Exception:  # noqa: BLE001 - torch not installed: there is no inductor cache to protect
        cache = None
    if cache is not None:  # it would become part of what it fingerprints; clean-ups treat it as a stray file
        from compilewatch.cache.local.layout import refuse_inside

        refuse_inside(Path(cache), target, "lock")
    check_writable(target)
    return target


def diff_env_cmd(
    old: Annotated[Path, typer.Argument(help="The environment before: a lock, pip freeze, uv.lock, pylock.toml, conda file.")],
    new: Annotated[Path, typer.Argument(help="The environment after (any of the same formats).")],
    fail_on: Annotated[str, typer.Option("--fail-on", help="Exit 1 when a change at or above this severity exists: "
                                                           "critical, warning or info.")] = "critical",
    formats: Annotated[Optional[list[str]], typer.Option(
        "--format", help=f"Override detection: once for both files, twice for OLD then NEW. One of: {', '.join(FORMAT_NAMES)}."
    )] = None,
    show_all: Annotated[bool, typer.Option("--all", "-a", help="List every change; by default info changes "
                                                               "below --fail-on are counted, a few named.")] = False,
    as_json: JsonOpt = False,
) -> None:
    """Diff two environments, each change ranked by its impact on compiled-artifact reuse
    (critical / warning / info) with its consequence in one sentence.

    Exit codes: 0 nothing at or above --fail-on changed, 1 something did, 2 unreadable input.

    Examples:

      compilewatch diff-env old.lock.json new.lock.json

      compilewatch diff-env requirements-old.txt requirements-new.txt \\
        --fail-on warning

      compilewatch diff-env uv.lock new-freeze.txt \\
        --format uv.lock --format requirements --json
    """
    from compilewatch.env import diff as envdiff
    from compilewatch.env.formats import normalize_format

    threshold = envdiff.check_severity(fail_on)
    fmts = [normalize_format(f) for f in formats or []]
    if len(fmts) > 2:
        raise BadInput(f"--format given {len(fmts)} times", hint="once for both files, or twice: OLD then NEW")
    old_fmt = fmts[0] if fmts else None
    new_fmt = fmts[-1] if fmts else None
    result = envdiff.diff_files(old, new, old_format=old_fmt, new_format=new_fmt)
    failed = result.fails(threshold)
    output.emit(result, as_json, lambda r: _render_diff(r, threshold, failed, show_all))
    raise typer.Exit(1 if failed else 0)


def _render_lock(lock: envlock.EnvLock) -> None:
    o = output.out
    p = lock.python
    o.print(f"[bold]python[/] {p.version} ({p.implementation}, {p.platform}), {len(lock.distributions)} distributions")
    t = lock.torch
    if t is not None:
        if t.source == "torch":
            o.print(f"[bold]torch[/] {t.version}  CUDA {t.cuda or '-'}  cuDNN {t.cudnn or '-'}  NCCL {t.nccl or '-'}  "
                    f"arch {' '.join(t.arch_list) or '-'}")
        else:
            o.print(f"[bold]torch[/] {t.version}  CUDA {t.cuda or '-'}  [dim](from its files; cuDNN, NCCL, arch "
                    f"list: --torch)[/]")
    o.print(f"[bold]triton[/] {lock.triton.version if lock.triton else '-'}")
    ind = lock.inductor
    if ind is not None:
        cache = ind.cache
        state = "-" if cache is None else (f"{output.fmt_bytes(cache.bytes)} in {cache.files} files"
                                           if cache.exists else "missing")
        how = {"files": "computed from torch's and triton's files", "torch": "asked of torch"}.get(
            ind.system_key_source or "", "")
        o.print(f"[bold]inductor[/] cache {ind.cache_dir} ({state}), system key {(ind.system_key or '-')[:16]}"
                + (f" [dim]({how})[/]" if how else ""))
    if lock.driver is not None:
        o.print(f"[bold]driver[/] {lock.driver.version} (CUDA {lock.driver.cuda or '-'})")
    for g in lock.gpus:
        o.print(f"[bold]gpu {g.index}[/] {g.name}  sm {g.capability}  {output.fmt_bytes(g.memory_bytes)}  id {g.uuid_hash}")
    c = lock.cpu
    o.print(f"[bold]cpu[/] {c.model} x{c.count}  {' '.join(c.isa_flags) or '-'}")
    o.print(f"[bold]env[/] {output.count(len(lock.env), 'variable')}" + (f", left out (secret-looking): {', '.join(lock.env_left_out)}"
                                                        if lock.env_left_out else ""))
    for note in lock.notes:
        output.note(note)


_ACTIONS = ("updated", "downgraded", "added", "removed", "changed")  # Change.action, lower case
SHOWN_PER_GROUP = 3  # info changes sharing a consequence: more than this are counted, not listed


def _cut(text: object) -> str:
    from compilewatch.inputs import one_line

    return one_line(text, 500)


def _render_diff(r: envdiff.EnvDiff, threshold: str, failed: bool, show_all: bool = False) -> None:
    from compilewatch.env import diff as envdiff

    o = output.out
    cut = _cut  # every string here comes from the files: one line, bounded, never markup
    o.print(f"[bold]diff-env[/] {escape(cut(r.old.path))} ({r.old.format}, {r.old.packages} packages) -> "
            f"{escape(cut(r.new.path))} ({r.new.format}, {r.new.packages} packages)")
    if not r.changes:
        o.print("no changes")
    for sev in envdiff.SEVERITIES:
        group = [c for c in r.changes if c.severity == sev]
        if not group:
            continue
        o.print(f"\n[{_STYLE[sev]}]{sev} ({len(group)})[/]")
        if sev == "info" and not show_all and threshold != "info":
            hidden = _render_info_counts(group)
            if hidden:
                output.hint(f"{hidden} info changes counted, not listed: --all lists every one (--json has them all)")
            continue
        for c in group:
            o.print(f"  {cut(c.headline)}", markup=False)
            o.print(f"      {cut(c.consequence)}", style="dim", markup=False)
            if c.note:
                o.print(f"      ({cut(c.note)})", style="dim", markup=False)
            if c.details:
                o.print(f"      {cut('; '.join(c.details))}", style="dim", markup=False)
    for note in r.notes:
        output.err.print(f"[dim]note:[/] {escape(cut(note))}")
    summary = ", ".join(f"{r.counts.get(s, 0)} {s}" for s in envdiff.SEVERITIES)
    verdict = f"exit 1: changes at or above {threshold}" if failed else f"exit 0: nothing at or above {threshold}"
    o.print(f"\n[bold]→[/] {summary}; {verdict}")


def _render_info_counts(group: "list[envdiff.Change]") -> int:
    """Info changes grouped by their consequence: a small group listed, a large one as counts by
    action and its first names. Returns how many changes were not listed."""
    from collections import Counter

    by_consequence: dict[str, list] = {}
    for c in group:
        by_consequence.setdefault(c.consequence, []).append(c)
    o, hidden = output.out, 0
    for consequence, changes in by_consequence.items():
        if len(changes) <= SHOWN_PER_GROUP:
            for c in changes:
                o.print(f"  {_cut(c.headline)}", markup=False)
                o.print(f"      {_cut(c.consequence)}", style="dim", markup=False)
            continue
        actions = Counter(c.action.lower() for c in changes)
        names = ", ".join(_cut(c.subject) for c in changes[:SHOWN_PER_GROUP])
        o.print(f"  {len(changes)} changes: " + ", ".join(f"{actions[a]} {a}" for a in _ACTIONS if actions[a])
                + f" (e.g. {names}, ...)", markup=False)
        o.print(f"      {_cut(consequence)}", style="dim", markup=False)
        hidden += len(changes)
    return hidden
