"""Red-team findings on the engine under torchrun (CPU, gloo on 127.0.0.1, free ports; every launch bounded
by a subprocess timeout and --dist-timeout):

- Ctrl-C in a torchrun rank saved its checkpoint but the rank exited 1 with "error: ... the engine ended
  interrupted" (a CheckFailed, torchrun's root cause) instead of 130 like `dflash train` without torchrun.
- A rank killed mid-step: the rank left waiting said only "another rank stopped or hung" (gloo names a
  socket, not a rank); it now names the rank that never entered the step's all-reduce.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.dflash_helpers import write_word_chats

ROOT = Path(__file__).resolve().parents[1]
SETS = ["--set", "data.regenerate=false", "--set", "data.batch_size=2", "--set", "eval.at_end=false",
        "--set", "metrics.tensorboard=false", "--set", "checkpoint.every=100"]

# a rank entry that sends SIGINT to its own process from inside optimizer_step(STEP) of rank 0, once: the point
# is an Event in the training itself, not a sleep (the engine then stops at the step boundary and saves)
SIGINT_ENTRY = '''
import os, signal, threading
from dflash.training.trainer import Trainer
STEP = int(os.environ["RT_SIGINT_STEP"])
_orig, fired = Trainer.optimizer_step, threading.Event()
def patched(self, step):
    if os.environ["RANK"] == "0" and step == STEP and not fired.is_set():
        fired.set()
        os.kill(os.getpid(), signal.SIGINT)
    return _orig(self, step)
Trainer.optimizer_step = patched
from cli.dflash_main import main
main()
'''


@pytest.fixture(scope="module")
def chat_file(tmp_path_factory):
    return write_word_chats(tmp_path_factory.mktemp("rt-engine-data") / "chat.jsonl")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(**extra: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "NO_COLOR": "1", **extra}


def _torchrun(where: list[str], entry: str, args: list[str], env: dict[str, str], **kw) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torch.distributed.run", *where, entry, "train", *args, *SETS, "--dist-timeout", "30"]
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)


def _finish(p: subprocess.Popen, timeout: float = 180) -> tuple[int, str, str]:
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        out, err = p.communicate()
        raise AssertionError(f"hung: {err[-3000:]}")
    return p.returncode, out, err


def test_ctrl_c_in_a_torchrun_rank_saves_the_checkpoint_and_exits_130_not_an_error(tmp_path, chat_file):
    entry = tmp_path / "sigint_rank.py"
    entry.write_text(SIGINT_ENTRY)
    run = tmp_path / "run"
    where = ["--nnodes", "1", "--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port", str(_free_port())]
    p = _torchrun(where, str(entry), ["--data", str(chat_file), "--out", str(run), "--max-steps", "6",
                                      "--target-devices", "cpu", "--drafter-devices", "cpu,cpu"],
                  _env(RT_SIGINT_STEP="1"))
    rc, out, err = _finish(p)
    assert rc != 0  # torchrun: a rank did not finish
    assert re.search(r"failed \(exitcode: 130\) local_rank: 0", err), err[-4000:]  # rank 0: Ctrl-C's code
    assert "error: rank 0" not in err and "ended interrupted" not in err, err[-4000:]
    assert "interrupted after 2 step(s); saved." in out
    assert sorted(x.name for x in (run / "checkpoints").glob("step_*")) == ["step_000002"]  # the step boundary


def test_a_killed_rank_is_named_by_the_rank_left_waiting_for_it_within_the_dist_timeout(tmp_path, chat_file):
    """Two torchrun agents (two 'nodes' on this host): node 1's rank is SIGKILLed inside step 2
    (tests/dist_kill_rank.py); node 0's agent does not stop its rank, whose all-reduce fails: its error
    names rank 1."""
    run, port = tmp_path / "run", str(_free_port())
    args = ["--data", str(chat_file), "--out", str(run), "--max-steps", "4", "--target-devices", "cpu",
            "--drafter-devices", "cpu,cpu"]
    env = _env(DFLASH_TEST_KILL_RANK="1", DFLASH_TEST_KILL_STEP="1")
    procs = [_torchrun(["--nnodes", "2", "--node-rank", str(k), "--nproc-per-node", "1", "--master-addr", "127.0.0.1",
                        "--master-port", port], str(ROOT / "tests" / "dist_kill_rank.py"), args, env) for k in (0, 1)]
    (rc0, _, err0), (rc1, _, _) = [_finish(p) for p in procs]
    assert rc0 != 0 and rc1 != 0
    line = next(x for x in err0.splitlines() if x.startswith("error: rank 0"))
    assert "another rank stopped or hung (rank 1 (" in line and "1 step(s) behind" in line, line


def test_behind_names_the_ranks_that_did_not_enter_the_step_all_reduce(monkeypatch):
    import torch.distributed as dist

    from dflash.distributed.group import ProcessGroup, RankInfo

    store = dist.HashStore()
    groups = [ProcessGroup(RankInfo(r, 3, r, 3, 0, f"h{r}", "127.0.0.1:1"), "gloo") for r in range(3)]
    for g in groups:
        monkeypatch.setattr(g, "_store", lambda: store)
    for n, g in zip((3, 2), groups):  # rank 0 entered 3 step all-reduces, rank 1 two, rank 2 none
        for _ in range(n):
            g._steps += 1
            g._mark(f"{g._steps} {g.info.host}")
    assert groups[0].behind() == ["rank 1 (h1) is 1 step(s) behind: it never entered the all-reduce this rank "
                                  "waited in", "rank 2 never reached a step's all-reduce"]
    assert groups[1].behind() == ["rank 2 never reached a step's all-reduce"]
    assert groups[2].behind() == []  # it entered none: nothing to compare
    monkeypatch.setattr(groups[0], "_store", lambda: (_ for _ in ()).throw(RuntimeError("store gone")))
    assert groups[0].behind() == []
