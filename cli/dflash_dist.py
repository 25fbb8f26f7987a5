"""The distributed part of `dflash train` (one rank of a torchrun job): the --distributed option, per-rank log lines,
rank 0's cross-rank report, and torchrun's error file for a failing rank."""

from __future__ import annotations

import os
from typing import Annotated, Any

import typer

from cli import output

DistributedOpt = Annotated[bool, typer.Option(
    "--distributed", help="Run as one rank of a torchrun job (automatic when torchrun started this process): "
                          "gradients summed across ranks, data sharded by rank, checkpoints from rank 0.")]


def _cache_line(c: Any) -> str:
    if c.status == "warm":
        what = f"warm, {c.files} files, {output.fmt_bytes(c.bytes)}, fingerprint {c.content_hash.split(':')[-1][:16]}"
    else:
        what = c.status + (f" ({c.error})" if c.error else "")
    key = f", system key {c.system_key[:12]}" if c.system_key else ""
    return f"inductor cache {c.path}: {what}{key}"


class RankLog:
    """on_event for a rank: rank 0 forwards everything to the progress display; every rank prints its
    own cache line (prefixed `[rank N/W host]`) on stderr; rank 0 prints the cross-rank verdicts."""

    def __init__(self, progress: Any) -> None:
        self.progress = progress
        self.prefix = ""
        self.primary = True

    def __call__(self, kind: str, data: dict[str, Any]) -> None:
        if kind == "rank":
            info = data["info"]
            self.primary = info.primary
            self.prefix = f"[rank {info.rank}/{info.world_size} {info.host}]"
            output.err.print(f"{self.prefix} backend {data['backend']}, target devices {','.join(data['target_devices'])}, "
                             f"drafter devices {','.join(data['drafter_devices'])}; {_cache_line(data['cache'])}",
                             markup=False, highlight=False)
            return
        if kind == "ranks":
            if self.primary:
                for v in data["verdicts"]:
                    output.err.print(f"{self.prefix} ranks: {v}", markup=False, highlight=False)
            return
        if self.primary:
            self.progress(kind, data)


def render_ranks(ranks: Any, verdicts: Any) -> None:
    o = output.out
    o.print(f"ranks: {len(ranks)}", markup=False)
    for r in ranks:
        pre = r.prewarm
        warm = (f"prewarm {pre.seconds:.1f} s, fxgraph cache {pre.fxgraph_hits} hit / {pre.fxgraph_misses} miss, "
                f"autograd cache {pre.autograd_hits} hit / {pre.autograd_misses} miss") if pre else "no prewarm"
        o.print(f"  rank {r.rank} ({r.host}, node {r.node_rank}): {r.outcome}, {r.steps_done} steps, {warm}; "
                f"{_cache_line(r.cache)}", markup=False, highlight=False)
    for v in verdicts:
        o.print(f"  → {v}", markup=False, highlight=False)


def record_error(e: BaseException) -> None:
    """Write this rank's error where torchrun looks for it (TORCHELASTIC_ERROR_FILE, the format of
    torch's ErrorHandler.record_exception), so torchrun's failure summary shows the message instead
    of an exit code. torchrun names the failure with the smallest timestamp (whole seconds) the root
    cause; a rank that failed only because a peer died (PeerFailed) records one second later, so the
    rank that failed first keeps that title."""
    import json
    import time
    import traceback

    from dflash import PeerFailed

    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    stamp = int(time.time()) + (1 if isinstance(e, PeerFailed) else 0)
    data = {"message": {"message": f"{type(e).__name__}: {e}",
                        "extraInfo": {"py_callstack": traceback.format_exc(), "timestamp": str(stamp)}}}
    try:
        with open(path, "w") as fh:
            json.dump(data, fh)
    except OSError:  # best effort: the message is on stderr anyway
        pass


def render_rank(done: Any, cfg: Any, as_json: bool, render: Any) -> None:
    """A torchrun rank's outcome: rank 0 prints the result (stdout: data, once per job); every rank
    prints its own line on stderr and exits non-zero with its own error."""
    import dflash
    from cli.dflash_engine import finish, render_engine
    from compilewatch.serialize import to_jsonable

    try:
        out, me = done.distributed, done.distributed.rank
        if me.rank == 0:
            data = {**to_jsonable(out.result), "config": dflash.to_dict(cfg), "engine": to_jsonable(out.engine),
                    "ranks": to_jsonable(done.ranks), "rank_verdicts": list(done.verdicts)}
            output.emit(data, as_json, render)
            if not as_json:
                render_engine(out.engine)
                render_ranks(done.ranks, done.verdicts)
        else:
            output.err.print(f"[rank {me.rank}/{me.world_size} {me.host}] {out.engine.outcome}: "
                             f"{out.engine.steps_done} steps; report {done.rank_report}", markup=False, highlight=False)
        if out.engine.outcome == "interrupted":  # Ctrl-C: the engine saved replica 0 (rank 0 wrote it); 130, no error
            finish(out.engine)
            return
        error = done.failure
        if error is not None and any(t.alive for t in out.engine.threads):
            record_error(error)  # threads blocked inside torch (a collective, a stall): leave at once
            output.err.print(f"error: {error.message}", markup=False, highlight=False)
            finish(out.engine)
        if error is not None:
            raise error
    except Exception as e:
        record_error(e)  # inside the handler: torchrun shows this traceback as the rank's failure
        raise
