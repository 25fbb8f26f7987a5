"""One rank of a torchrun job: join, agree, (train on the engine), compare, report.

dflash.run.train drives it (`dflash.train(cfg, distributed=True)`): `join` before the Trainer is
built, `agree` after, the engine trains (dflash.engine.program.train_multi with the group), then
`finish_rank`. Devices, backend, timeout and engine settings come from `cfg.topology`.

Order (every step is the same on every rank; the collectives are in the same order everywhere):
1. Read torchrun's environment (dflash.distributed.group.rank_info); pick this rank's devices (the
   topology's device lists, else one drafter on `topology.device`, auto = cuda:LOCAL_RANK).
2. Fingerprint this rank's inductor cache before anything compiles (dflash.distributed.rank_report).
3. Join the process group (its timeout bounds every later wait).
4. Agree on the run directory (rank 0's default when --out is not given).
5. Build the Trainer (target, data, drafter; on --resume, the latest checkpoint of the run dir,
   which must be on a filesystem every node sees), then check that every rank built the same run:
   same step, checkpoint, config, data and weights. A rank that differs stops every rank with a
   message naming it. Rank 0's parameters are broadcast (what DDP does at start).
6. Train with the node-local engine (dflash.engine.program.train_multi with the group): prewarm in this
   process's main thread, a barrier so every rank's threads start together, gradients summed
   across ranks in every step barrier, checkpoints from rank 0.
7. If the run failed here, return at once (no collective: the CLI exits non-zero and torchrun stops
   the others). Else gather every rank's report: cache, prewarm hits and misses, weight digest. The
   gather is also the barrier after rank 0's final checkpoint: no rank returns before it is on disk.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from compilewatch import BadInput, CheckFailed
from dflash.distributed import rank_report as rr
from dflash.config import Config, TopologyConfig, apply_overrides, to_toml
from dflash.distributed.group import ProcessGroup, RankInfo, backend_for, is_peer_failure, rank_device
from dflash.training.result import TrainResult
from dflash.checkpoint.rundir import default_run_dir
from dflash.training.trainer import Trainer

Event = Callable[[str, dict[str, Any]], None]


@dataclass(frozen=True)
class DistributedResult:
    result: TrainResult  # this rank's view (rank 0's is the run's: metrics.jsonl, checkpoints)
    engine: Any  # this rank's EngineReport
    rank: rr.RankReport
    ranks: tuple[rr.RankReport, ...]  # every rank's, when the run ended ok everywhere (else this rank's only)
    verdicts: tuple[str, ...]  # across ranks: caches, identical weights
    ok: bool
    behind: tuple[str, ...] = ()  # a collective failed: the ranks that never reached it (ProcessGroup.behind)


def _devices(info: RankInfo, topo: TopologyConfig) -> tuple[tuple[str, ...], tuple[str, ...]]:
    targets, drafters = topo.target_devices, topo.drafter_devices
    if drafters:
        if info.local_world_size > 1 and any(d.startswith("cuda") for d in (*targets, *drafters)):
            raise BadInput(f"--target-devices/--drafter-devices with {info.local_world_size} processes on {info.host}: "
                           "every process would use the same GPUs",
                           hint="run one process per node (--nproc-per-node 1): the engine spreads over the node's "
                                "GPUs itself; or drop the device lists to run one drafter per GPU (cuda:LOCAL_RANK)")
        return targets, drafters
    dev = rank_device(info, topo.device)
    return (dev,), (dev,)


def _facts(trainer: Trainer, digest: str) -> dict[str, Any]:
    """What must be equal on every rank for the ranks to train one run."""
    start = trainer.resumed_from
    return {"step": trainer.step, "checkpoint": start.name if start is not None and trainer.step else None,
            "total_steps": trainer.total_steps,
            "config": to_toml(apply_overrides(trainer.cfg, {"topology.device": "auto"})),  # devices differ per rank
            "samples": len(trainer.dataset), "tokens": trainer.dataset.stats.tokens, "weights": digest,
            "data": (getattr(trainer.dataset, "identity", None) or {}).get("digest")}  # the file's bytes (xxh3)


def check_agreement(facts: Sequence[dict[str, Any]], hosts: Sequence[str]) -> list[str]:
    """Raise BadInput when the ranks did not build the same run; return notes for harmless differences."""
    ref = facts[0]
    problems, notes = [], []
    for r, f in enumerate(facts[1:], start=1):
        where = f"rank {r} ({hosts[r]})"
        if f["step"] != ref["step"] or f["checkpoint"] != ref["checkpoint"]:
            problems.append(f"{where} starts at step {f['step']} ({f['checkpoint'] or 'no checkpoint'}), rank 0 at "
                            f"step {ref['step']} ({ref['checkpoint'] or 'no checkpoint'})")
        if f["config"] != ref["config"]:
            problems.append(f"{where} resolved a different config than rank 0")
        if (f["samples"], f["tokens"]) != (ref["samples"], ref["tokens"]):
            problems.append(f"{where} read different data ({f['samples']} sequences, {f['tokens']} tokens) than rank 0 "
                            f"({ref['samples']}, {ref['tokens']})")
        elif f.get("data") != ref.get("data"):  # the same counts from other records (another copy of the file)
            problems.append(f"{where} read other data than rank 0: the same {f['samples']} sequences and "
                            f"{f['tokens']} tokens, from a file of other contents ({f.get('data')} there, "
                            f"{ref.get('data')} on rank 0)")
        elif f["total_steps"] != ref["total_steps"]:
            problems.append(f"{where} plans {f['total_steps']} steps, rank 0 {ref['total_steps']}")
        if f["weights"] != ref["weights"] and not problems:
            if ref["step"]:
                problems.append(f"{where} loaded different weights from the same checkpoint name than rank 0")
            else:
                notes.append(f"{where} initialized different weights than rank 0 (another torch build?): rank 0's "
                             "were broadcast.")
    if problems:
        raise BadInput("the ranks did not build the same run: " + "; ".join(problems),
                       hint="every node needs the same config, data, target and run directory; the run directory "
                            "(--out) must be on a filesystem every node sees (checkpoints and --resume read it)")
    return notes


@dataclass
class Joined:
    """This rank in its job, before the Trainer exists: who it is, its devices (the topology with this
    rank's device lists), the open process group, and the run's config (rank 0's run directory)."""
    info: RankInfo
    cfg: Config
    topology: TopologyConfig
    backend: str
    cache: Any  # this rank's inductor cache before anything compiled (rank_report.CacheState)
    group: ProcessGroup
    restarted: bool = False  # torchrun restarted the job and its run dir holds a checkpoint: every rank resumes


def join(cfg: Config, info: RankInfo, on_event: Event) -> Joined:
    """Steps 1-4 (module docstring): this rank's devices, its cache before anything compiles, the
    process group, rank 0's run directory, and whether torchrun restarted the job over a checkpoint
    (`restarted_with_checkpoint`: then every rank resumes). The caller builds the Trainer next (dflash.run)."""
    topo = cfg.topology
    targets, drafters = _devices(info, topo)
    cache = rr.cache_state()  # before anything compiles
    backend = backend_for(drafters, topo.dist_backend)
    on_event("rank", {"info": info, "backend": backend, "cache": cache, "target_devices": targets,
                      "drafter_devices": drafters})
    if drafters[0].startswith("cuda"):
        torch.cuda.set_device(drafters[0])
    group = ProcessGroup(info, backend, topo.dist_timeout).open()
    if not cfg.checkpoint.out_dir:  # every rank must write to rank 0's choice of run dir
        out_dir = group.broadcast(str(default_run_dir(cfg)) if info.primary else None)
        cfg = apply_overrides(cfg, {"checkpoint.out_dir": out_dir})
    # replica 0 runs on this rank's first drafter device (rank_device's pick without device lists);
    # the run's config.toml keeps the user's spec ("auto": each rank resolves its own again on --resume)
    mine = dataclasses.replace(topo, device="auto", target_devices=targets, drafter_devices=drafters)
    return Joined(info, cfg, mine, backend, cache, group, restarted_with_checkpoint(cfg.checkpoint.out_dir))


def agree(joined: Joined, trainer: Trainer, on_event: Event) -> None:
    """Step 5's check: every rank built the same run (BadInput naming the rank that differs); rank
    0's parameters are broadcast; the ranks' caches compared."""
    group = joined.group
    facts = _facts(trainer, rr.params_digest(trainer.drafter))
    seen = group.all_gather((facts, joined.info.host, joined.cache))
    notes = check_agreement([s[0] for s in seen], [s[1] for s in seen])
    trainer.notes.extend(notes)
    group.broadcast_parameters(trainer.drafter)
    caches = [rr.RankCache(r, host, c) for r, (_, host, c) in enumerate(seen)]
    on_event("ranks", {"caches": caches, "verdicts": rr.cache_verdicts(caches)})


def finish_rank(joined: Joined, trainer: Trainer, result: TrainResult, report: Any, *,
                watch: bool = True) -> DistributedResult:
    """Step 7: this rank's report; when the run ended ok here, every rank's (gathered: also the
    barrier after rank 0's final checkpoint) and the cross-rank verdicts."""
    from compilewatch import atomic_write_json
    from dflash.engine.program import rank_dir

    info, group, topo = joined.info, joined.group, joined.topology
    own_dir = rank_dir(trainer.run_dir, info.rank)
    mine = rr.RankReport(
        rank=info.rank, world_size=info.world_size, local_rank=info.local_rank, node_rank=info.node_rank,
        host=info.host, backend=joined.backend, target_devices=topo.target_devices,
        drafter_devices=topo.drafter_devices, cache=joined.cache,
        prewarm=rr.prewarm_cache(report.prewarm), outcome=report.outcome, steps_done=report.steps_done,
        params_digest=rr.params_digest(trainer.drafter) if report.ok else None,
        watch_report=str(own_dir / "watch.jsonl") if watch else None, engine_verdicts=report.verdicts,
        remote=rr.remote_rank())
    if not report.ok:  # no collective: the others may be gone or blocked; exiting non-zero stops the job
        f = report.failure
        behind = tuple(group.behind()) if f is not None and is_peer_failure(f.error) else ()
        atomic_write_json(own_dir / "report.json", {"rank": mine, "ranks": [], "verdicts": list(behind)})
        return DistributedResult(result, report, mine, (mine,), behind, False, behind)
    ranks = tuple(group.all_gather(mine))  # also the barrier after rank 0's final checkpoint
    group.close()
    verdicts = rr.cache_verdicts(ranks)
    digests = {r.params_digest for r in ranks}
    ok = len(digests) == 1
    if ok:
        verdicts.append(f"drafter weights identical on all {len(ranks)} ranks after step {report.steps_done} "
                        f"(digest {mine.params_digest[:16]}).")
    else:
        groups: dict[str, list[int]] = {}
        for r in ranks:
            groups.setdefault(str(r.params_digest), []).append(r.rank)
        verdicts.append("drafter weights DIFFER between ranks: " + "; ".join(
            f"{rr._ranks(v)}: {d[:16]}" for d, v in groups.items()))
    atomic_write_json(own_dir / "report.json", {"rank": mine, "ranks": ranks, "verdicts": verdicts})
    return DistributedResult(result, report, mine, ranks, tuple(verdicts), ok)


def restarted_with_checkpoint(out_dir: str | None, env=None) -> bool:
    """Whether torchrun restarted this job (`--max-restarts`: TORCHELASTIC_RESTART_COUNT > 0) and its
    run directory `out_dir` (checkpoint.out_dir, agreed by join) holds a checkpoint: then every rank resumes from the newest complete one (a
    checkpoint directory appears only whole, and only rank 0 writes them), with the same command line
    the first attempt had. The ranks check that they all resume the same checkpoint (check_agreement)."""
    import os

    from dflash.checkpoint import store as ckpt

    env = os.environ if env is None else env
    try:
        restarts = int(env.get("TORCHELASTIC_RESTART_COUNT", "0"))
    except ValueError:
        return False
    return restarts > 0 and bool(out_dir) and ckpt.latest_checkpoint(out_dir) is not None


class PeerFailed(CheckFailed):
    """This rank failed only because another rank did (exit code 1)."""


def failure(out: DistributedResult) -> CheckFailed | None:
    """This rank's error as CheckFailed (exit 1; PeerFailed when only a peer's failure caused it),
    or None when the run succeeded here and every rank holds the same weights."""
    if out.ok:
        return None
    who = f"rank {out.rank.rank} ({out.rank.host})"
    f = out.engine.failure
    if f is not None and is_peer_failure(f.error):
        which = f" ({'; '.join(out.behind)})" if out.behind else ""
        return PeerFailed(f"{who}: a collective failed because another rank stopped or hung{which}: {f.error}",
                         hint="the first failure is in another rank's output (torchrun lists every failed rank); "
                              f"this rank's report: {rank_report_path(out)}")
    if f is not None:
        return CheckFailed(f"{who}: {f.thread} ({f.device}) failed: {f.error}",
                           hint=f"this rank's report: {rank_report_path(out)}")
    if out.engine.outcome != "ok":
        return CheckFailed(f"{who}: the engine ended {out.engine.outcome}",
                           hint=f"this rank's report: {rank_report_path(out)}")
    return CheckFailed(f"{who}: {out.verdicts[-1]}", hint="a bug: every rank must hold the same weights; "
                                                         "see every rank's report.json")


def rank_report_path(out: DistributedResult) -> str:
    from dflash.engine.program import rank_dir

    return str(rank_dir(out.result.run_dir, out.rank.rank) / "report.json")


