"""torch.distributed for dflash: one process per node (or per GPU group), launched by torchrun.

    torchrun --nnodes 2 --nproc-per-node 1 --rdzv-backend c10d --rdzv-endpoint node0:29500 \\
        -m dflash train --target-devices 0,1,2,3,4 --drafter-devices 5,6,7 --out /shared/runs/q8

Each process runs the node-local engine (dflash.engine.engine) on its own devices; this module is the thin
layer over torch.distributed that joins them:

- **Who am I**: `rank_info()` reads what torchrun exports (RANK, WORLD_SIZE, LOCAL_RANK,
  LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR/PORT); None when torchrun did not start this process.
- **Process group**: `ProcessGroup` (env:// rendezvous, the address torchrun exported). Backend
  `gloo` when the drafters are on CPU, `cpu:gloo,cuda:nccl` when they are on GPUs: gradients (CUDA
  tensors) go through NCCL, small objects and barriers through gloo.
- **Gradients**: not DDP. The engine already sums its in-process replicas' gradients into one flat
  buffer per dtype inside its step barrier; `ProcessGroup.sum_` all-reduces that buffer across
  processes (plus the step's loss sum and label weight, `sum_scalars`) before the one division by
  the global weight. Every replica of every process then holds the same gradient bits: all-reduce
  gives every rank the same result, so the optimizers keep every replica identical. DDP wraps one
  module per process and reduces during backward in the calling thread; it does not compose with
  several replicas stepping in threads (multi-device-per-process DDP was removed from torch).
- **Timeout**: the group is created with `timeout` (default 30 min): a collective that waits longer
  (a peer that died without its process exiting, a peer stuck in a compile) raises in the waiting
  rank instead of hanging forever. When a rank's process exits non-zero, torchrun stops the others
  at once; the timeout covers launchers that do not, and hangs. It must exceed the longest wait a
  healthy run has at a collective: the difference between ranks' prewarm times (a cold inductor
  cache compiles for minutes) and rank 0's checkpoint save.

The library never prints: rank-level facts go into frozen dataclasses (dflash.distributed.rank_report).
"""

from __future__ import annotations

import datetime
import os
import socket
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from compilewatch import BadInput
from dflash.config import DEFAULT_DIST_TIMEOUT_S as DEFAULT_TIMEOUT_S  # one default: the config's

# what a collective raises in a healthy rank when another rank died or hung (gloo, NCCL, the timeout)
_PEER_FAILURE = ("Connection closed by peer", "Connection reset by peer", "DistBackendError", "DistNetworkError",
                 "NCCL communicator was aborted", "Timed out", "timed out", "Broken pipe")
_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True, slots=True)
class RankInfo:
    """This process's place in the job, as torchrun exported it."""

    rank: int  # 0 .. world_size-1 over the whole job
    world_size: int
    local_rank: int  # 0 .. local_world_size-1 on this node
    local_world_size: int
    node_rank: int  # torchrun's GROUP_RANK: which node (agent) started this process
    host: str  # this machine's hostname
    master: str  # MASTER_ADDR:MASTER_PORT (the rendezvous store)

    @property
    def primary(self) -> bool:
        return self.rank == 0


def rank_info(env: Mapping[str, str] | None = None) -> RankInfo | None:
    """This process's RankInfo from torchrun's environment, or None when torchrun did not start it."""
    env = os.environ if env is None else env
    if not all(k in env for k in _TORCHRUN_VARS):
        return None
    try:
        rank, world, local = int(env["RANK"]), int(env["WORLD_SIZE"]), int(env["LOCAL_RANK"])
        local_world = int(env.get("LOCAL_WORLD_SIZE", "1"))
        node = int(env.get("GROUP_RANK", "0"))
    except ValueError as e:
        raise BadInput(f"torchrun's environment is malformed: {e}",
                       hint="launch with torchrun, which sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT") from None
    if not (0 <= rank < world and 0 <= local < max(local_world, 1)):
        raise BadInput(f"torchrun's environment is inconsistent: RANK={rank}, WORLD_SIZE={world}, LOCAL_RANK={local}, "
                       f"LOCAL_WORLD_SIZE={local_world}", hint="launch with torchrun instead of setting these by hand")
    return RankInfo(rank, world, local, local_world, node, socket.gethostname(),
                    f"{env['MASTER_ADDR']}:{env['MASTER_PORT']}")


def require_rank_info(env: Mapping[str, str] | None = None) -> RankInfo:
    info = rank_info(env)
    if info is None:
        missing = [k for k in _TORCHRUN_VARS if k not in (os.environ if env is None else env)]
        raise BadInput(f"--distributed: this process was not started by torchrun ({', '.join(missing)} not set)",
                       hint="launch with `torchrun --nnodes N --nproc-per-node P -m dflash train ...` "
                            "(see docs/distributed.md)")
    return info


def is_peer_failure(error: str) -> bool:
    """Did this error ("Type: message") come from a collective whose peer died or hung? Then the
    rank that raised it is not the root cause: the job's first failure is in another rank's log."""
    return any(m in error for m in _PEER_FAILURE)


def backend_for(drafter_devices: Sequence[str], choice: str = "auto") -> str:
    """`auto`: gloo for CPU drafters; NCCL for CUDA tensors (gradients) with gloo beside it for
    objects and barriers. `gloo` forces gloo (it all-reduces CUDA tensors too, slower: for debugging,
    or several ranks on one GPU, which NCCL refuses). `nccl` = auto, but fails for CPU drafters."""
    cuda = any(str(d).startswith("cuda") for d in drafter_devices)
    if choice not in ("auto", "gloo", "nccl"):
        raise BadInput(f"--dist-backend must be auto, gloo or nccl, not {choice!r}")
    if choice == "nccl" and not cuda:
        raise BadInput("--dist-backend nccl needs CUDA drafter devices", hint="use gloo (or auto) on CPU")
    if choice == "gloo" or not cuda:
        return "gloo"
    return "cpu:gloo,cuda:nccl"


def rank_device(info: RankInfo, requested: str) -> str:
    """The device of a rank that runs one drafter (no device lists): with `auto`, cuda:LOCAL_RANK when
    GPUs are visible (one process per GPU), else cpu; plain `cuda` is cuda:LOCAL_RANK (as torchrun
    users mean it); an explicit device (cuda:N, N, cpu) is used as given."""
    if requested not in ("auto", "cuda"):
        return requested
    import torch  # here, not at the top: `dflash --help` and rank_info() stay free of torch

    if requested == "cuda" and not torch.cuda.is_available():
        raise BadInput("--device cuda: no CUDA device is visible", hint="use --device cpu, or run on a machine with GPUs")
    if torch.cuda.is_available():
        n = torch.cuda.device_count()
        if info.local_rank >= n:
            raise BadInput(f"local rank {info.local_rank} has no GPU: {n} visible on {info.host}",
                           hint="use --nproc-per-node <= the number of GPUs, or pass --device")
        return f"cuda:{info.local_rank}"
    return "cpu"


class ProcessGroup:
    """The job's default process group, and the few collectives dflash uses. Also the engine's
    `Collective` (sum_scalars, sum_): called once per step from inside the engine's step barrier."""

    def __init__(self, info: RankInfo, backend: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        if timeout_s <= 0:
            raise BadInput(f"--dist-timeout must be > 0 seconds, got {timeout_s:g}")
        self.info = info
        self.backend = backend
        self.timeout_s = timeout_s
        self._open = False
        self._steps = 0  # step all-reduces this rank entered (sum_scalars: once per step), marked in the store

    def open(self) -> ProcessGroup:
        import torch.distributed as dist

        if not dist.is_available():
            raise BadInput("this torch build has no torch.distributed", hint="install a torch wheel with distributed support")
        timeout = datetime.timedelta(seconds=self.timeout_s)
        restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        if restart not in ("", "0"):
            # a job torchrun restarted (--max-restarts): the agent's store can still hold the killed
            # attempt's keys (gloo's peer addresses among them), and a rank that reads one first connects to
            # a dead port ("Connection refused", seen here with both the static and the c10d rendezvous).
            # This attempt's keys get their own prefix.
            store, rank, world = next(dist.rendezvous("env://", timeout=timeout))
            store = dist.PrefixStore(f"dflash/restart-{restart}/", store)
            dist.init_process_group(self.backend, store=store, rank=rank, world_size=world, timeout=timeout)
        else:
            dist.init_process_group(self.backend, timeout=timeout)
        self._open = True
        return self

    def close(self) -> None:
        if self._open:
            import torch.distributed as dist

            self._open = False
            dist.destroy_process_group()

    def __enter__(self) -> ProcessGroup:
        return self.open()

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def rank(self) -> int:
        return self.info.rank

    @property
    def world_size(self) -> int:
        return self.info.world_size

    # ------------------------------------------------------------ collectives
    def sum_(self, tensor: torch.Tensor) -> None:
        """All-reduce (sum) in place; the same result on every rank."""
        import torch
        import torch.distributed as dist

        if tensor.device.type == "cuda":
            with torch.cuda.device(tensor.device):
                dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        else:
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM)

    def sum_scalars(self, *values: float) -> tuple[float, ...]:
        import torch

        self._steps += 1
        self._mark(f"{self._steps} {self.info.host}")
        t = torch.tensor(values, dtype=torch.float64)
        self.sum_(t)
        return tuple(float(x) for x in t)

    # ------------------------------------------------------------ who stopped
    # Every rank marks in the job's store (torchrun's, beside the process group) how many step all-reduces it
    # entered. A collective that fails says only "connection closed" or "timed out"; `behind` then names the
    # ranks that never reached the one this rank waited in: the rank that died or hangs.
    _KEY = "dflash/steps-reached/"

    def _store(self):
        import torch.distributed as dist

        return dist.distributed_c10d._get_default_store()

    def _mark(self, value: str) -> None:
        try:
            self._store().set(f"{self._KEY}{self.rank}", value)
        except Exception:  # noqa: BLE001 - best effort: a diagnosis, never a reason to fail a step
            pass

    def behind(self, timeout_s: float = 5.0) -> list[str]:
        """The ranks that did not enter the step all-reduce this rank entered last ("rank 1 (node1) is 1
        step(s) behind"), read from the store; [] when all did, or when the store does not answer."""
        try:
            store = self._store()
            store.set_timeout(datetime.timedelta(seconds=timeout_s))  # the store's host may be gone: never wait long
            out = []
            for r in range(self.world_size):
                key = f"{self._KEY}{r}"
                if r == self.rank or self._steps == 0:
                    continue
                if not store.check([key]):
                    out.append(f"rank {r} never reached a step's all-reduce")
                    continue
                n, host = store.get(key).decode().split(" ", 1)
                if int(n) < self._steps:
                    out.append(f"rank {r} ({host}) is {self._steps - int(n)} step(s) behind: it never entered "
                               "the all-reduce this rank waited in")
            return out
        except Exception:  # noqa: BLE001 - the store went with the job: no diagnosis
            return []

    def barrier(self) -> None:
        import torch.distributed as dist

        dist.barrier()

    def all_gather(self, obj: Any) -> list[Any]:
        """Every rank's `obj` (picklable), in rank order, on every rank."""
        import torch.distributed as dist

        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's `obj` on every rank."""
        import torch.distributed as dist

        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def broadcast_parameters(self, module: torch.nn.Module) -> None:
        """Copy rank 0's parameters and buffers into every rank's module, in place (what DDP does at start)."""
        import torch
        import torch.distributed as dist

        with torch.no_grad():
            for t in list(module.parameters()) + list(module.buffers()):
                if t.device.type == "cuda":
                    with torch.cuda.device(t.device):
                        dist.broadcast(t.data, src=0)
                else:
                    dist.broadcast(t.data, src=0)
