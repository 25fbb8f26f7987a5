"""`compilewatch cache explain [REPORT] [--against OTHER]`: why compiles missed the cache (rendering of
compilewatch.explain). Also the explanations `run` and `probe` print after their findings."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Optional

import typer
from rich.markup import escape

from cli import output
from cli.lazy import lazy
from cli.options import JsonOpt

explain_lib = lazy("compilewatch.explain.explain")
against_lib = lazy("compilewatch.explain.against")

EXIT_RULE = ("0 when every lookup hit or every miss was a graph never compiled before; 1 when a miss has a cause "
             "(something in its key changed, the entry is gone, the cache dir moved) or --against finds entries that "
             "would miss; 2 for bad input.")


def explain_cmd(
    report: Annotated[Optional[Path], typer.Argument(help="A watch report (`compilewatch run --report FILE`); default: the last watched run on the cache dir.")] = None,
    against: Annotated[Optional[str], typer.Option("--against", help="Explain why the entries of this other cache dir, archive (`cache save`) or Redis server (redis://HOST:PORT) would not be hit here.")] = None,
    dir: Annotated[Optional[Path], typer.Option("--dir", help="The inductor cache dir (default: the one torch uses).")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Explain every cache miss of a watched run by the part of its key that changed.

    compilewatch records, for each FX-graph / AOTAutograd cache lookup of a watched process, its key and
    the digests of the key's parts (beside the cache dir, never inside torch's entries); each miss is
    compared with the closest recorded entry. For each watched process it also says where the compile
    time went, from the steps torch times itself (dynamo tracing, AOTAutograd lookup, FX-graph load,
    kernel load, autotune, ...): why a warm start is not instant.

    Exit code: EXIT_RULE

    Examples:

      compilewatch cache explain

      compilewatch cache explain watch.jsonl --json

      compilewatch cache explain --against /mnt/shared/inductor-cache

      compilewatch cache explain --against h200-torch2.11.tar.zst

      compilewatch cache explain --against redis://cache-host:6379
    """
    from compilewatch import torchinfo

    here = dir if dir is not None else torchinfo.inductor_cache_dir()
    if against is not None:
        if report is not None:
            from compilewatch.errors import BadInput

            raise BadInput("give REPORT or --against, not both",
                           hint="REPORT explains a recorded run; --against compares another cache's entries with "
                                "this one: run them one at a time")
        rep = against_lib.explain_against(against, here)
        output.emit(rep, as_json, _render_against)
        raise typer.Exit(1 if rep.entries - rep.would_hit else 0)
    runs = explain_lib.explain_report(report) if report is not None else [explain_lib.explain_run(here, must_exist=True)]
    if as_json:
        output.print_json(runs if report is not None else runs[0])
    else:
        for r in runs:
            render_run(r, output.out, header=True)
    raise typer.Exit(1 if any(has_cause(r) for r in runs) else 0)


explain_cmd.__doc__ = explain_cmd.__doc__.replace("EXIT_RULE", EXIT_RULE)


def has_cause(r: Any) -> bool:
    return any(e.verdict != "new_graph" for e in r.explanations)


def render_run(r: Any, console, *, header: bool = False, limit: int = 8) -> None:
    if header:
        console.print(f"[bold]cache explain[/] {escape(r.cache_dir)} run {escape(str(r.run))} (pids {list(r.pids)})")
    if not r.lookups:
        console.print("no cache lookups recorded for this run")
        return
    style = "green" if not r.misses else "yellow"
    console.print(f"[{style}]cache lookups: {r.hits} hit / {r.misses} miss[/] ({100 * (r.hit_rate or 0):.0f}% hit)")
    for c in r.causes[:limit]:
        console.print(f"  [bold]{c.misses}×[/] {escape(c.cause)}: {escape(c.example)}")
    if len(r.causes) > limit:
        console.print(f"  ... {len(r.causes) - limit} more cause(s) (--json has all)")
    render_compile_times(r, console)
    for w in r.warnings:
        console.print(f"[yellow]warning:[/] {escape(w)}")


def render_compile_times(r: Any, console, *, limit: int = 4) -> None:
    """Where each watched process's compile time went (issue 38, part 4), worst phase first."""
    times = getattr(r, "compile_times", ())
    for ct in times[:limit]:
        who = f"pid {ct.pid} " if len(times) > 1 else ""
        console.print(f"  {escape(who + ct.text)}")
        steps = [f"{name} {s:.2f} s" for name, _, s, _ in ct.top[:3] if s >= 0.005]
        if steps:
            console.print(f"    torch's slowest steps: {escape(', '.join(steps))}")
    if len(times) > limit:
        console.print(f"  ... {len(times) - limit} more process(es) (--json has all)")


def _render_against(r: Any) -> None:
    o = output.out
    o.print(f"[bold]cache explain --against[/] {escape(r.other)} (here: {escape(r.here)}, from its {r.source}): "
            f"{r.would_hit} of {r.entries} entries would hit here")
    for cause, n in r.causes.items():
        o.print(f"  [bold]{n}×[/] {escape(cause)}")
    for e in [e for e in r.results if not e.would_hit][:10]:
        o.print(f"    {escape(e.text)}")
    for w in r.warnings:
        o.print(f"[yellow]warning:[/] {escape(w)}")


# --- after `run` and `probe` ---------------------------------------------------------------------
class LookupEvents:
    """Collects the `cache_lookups` events of a `compilewatch run` while passing every event on."""

    def __init__(self, inner=None) -> None:
        self.inner = inner
        self.events: list = []

    def __call__(self, ev) -> None:
        if ev.kind == "cache_lookups":
            self.events.append(ev)
        if self.inner is not None:
            self.inner(ev)

    def explain(self) -> list:
        seen: dict[tuple[str, str], set[int]] = {}
        for ev in self.events:
            d = ev.detail
            for st in d.get("stores") or []:
                seen.setdefault((st, d.get("run")), set()).add(ev.pid)
        out = []
        for (st, run), pids in sorted(seen.items()):
            try:
                from compilewatch.explain import store as S

                out.append(explain_lib.explain_run(S.cache_dir_of(Path(st)), run=run, pids=tuple(pids)))
            except Exception as e:  # noqa: BLE001 - the run's own verdict comes first; say why, go on
                output.err.print(f"[yellow]cache explain:[/] {escape(getattr(e, 'message', str(e)))}")
        return out


def print_after(runs: list, console) -> None:
    for r in runs:
        if r.lookups:
            console.print(f"[bold]cache[/] ({escape(r.cache_dir)}):", end=" ")
            render_run(r, console)


class recording:
    """`with recording() as explained:` records the cache lookups of the block (probe runs in this
    process) and fills `explained` with the run's explanations when it ends. `temp_caches`: the name
    prefix of the block's own temp cache dirs (`probe --threads` without --keep-cache, removed when it
    ends): their key stores are explained, then removed too, once their cache dir is gone."""

    def __init__(self, temp_caches: str | None = None) -> None:
        self.temp_caches = temp_caches

    def __enter__(self) -> list:
        from compilewatch.explain import record

        self.explained: list = []
        self.rec = record.start(run=f"probe-{__import__('os').getpid()}-{__import__('time').time():.0f}")
        return self.explained

    def __exit__(self, *exc: object) -> None:
        from compilewatch.explain import record

        summary = record.stop()
        if summary is None or exc[0] is not None:
            return
        for st in summary.get("stores", []):
            from compilewatch.explain import store as S

            try:
                self.explained.append(explain_lib.explain_run(S.cache_dir_of(Path(st)), run=summary["run"]))
            except Exception as e:  # noqa: BLE001 - the probe's own report comes first
                output.err.print(f"[yellow]cache explain:[/] {escape(getattr(e, 'message', str(e)))}")
            self._forget_temp(Path(st))

    def _forget_temp(self, store: Path) -> None:
        import shutil
        import tempfile

        from compilewatch.explain import store as S

        cache = S.cache_dir_of(store)
        if self.temp_caches and cache.parent == Path(tempfile.gettempdir()) and \
                cache.name.startswith(self.temp_caches) and not cache.exists():
            shutil.rmtree(store, ignore_errors=True)  # the store of our own temp cache dir, already removed
