"""Soak: a trainer SIGKILLed at random moments (most inside a checkpoint save) and resumed, again and
again, ends bit-identical to an uninterrupted run; a disk that fills up mid-save stops the run cleanly
(exit 1, previous checkpoint intact, the resume command) and, once space is freed, it resumes to the
same bits. CPU, a tiny run: hundreds of steps, a checkpoint every few.

Trials are forked from a forkserver that preloaded torch, transformers and dflash
(tests/dflash_soak_child.py): each starts in well under a second. Kill points, a third each: a
random file operation of the background checkpoint writer (fsync/replace/rename/link/unlink/rmtree,
counted in the child: exact points inside a save); a random time after the first step (SIGKILL from
this process: random moments, any phase); one of the first file operations of the process (the
lock, cleanup of leftovers, metrics.jsonl, the first save). The seeds are fixed; which moments the timed
kills hit varies with the machine's speed, and the assertion holds for every one of them.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import random
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from dflash.checkpoint import store

STEPS, EVERY, KILLS = 200, 4, 24
TRIAL_LIMIT_S = 120  # a trial is a fraction of a second to a few seconds; a hang fails instead of blocking CI


@pytest.fixture(scope="module")
def ctx():
    c = mp.get_context("forkserver")
    c.set_forkserver_preload(["tests.dflash_soak_child"])
    return c


@pytest.fixture(scope="module")
def soak_data(tmp_path_factory):
    """Short chats of the tiny vocabulary (no regeneration: the soak is about checkpoints, not data)."""
    from dflash.data.dataset import embedded_prompts
    from dflash.data.regen import write_jsonl

    d = tmp_path_factory.mktemp("soak")
    rng = random.Random(3)
    convs = []
    for conv in embedded_prompts(48, seed=7):
        words = conv[0]["content"].split()
        convs.append([conv[0], {"role": "assistant", "content": " ".join(rng.choice(words) for _ in range(40))}])
    write_jsonl(convs, d / "chat.jsonl")
    return d


def overrides(run: Path, data: Path) -> dict:
    return {"data.path": str(data / "chat.jsonl"), "data.regenerate": False, "data.max_length": 64,
            "data.buckets": "[64]", "data.batch_size": 1, "data.num_anchors": 4, "data.cache_dir": str(data / "cache"),
            "train.max_steps": STEPS, "checkpoint.every": EVERY, "checkpoint.keep_last": 2,
            "checkpoint.out_dir": str(run), "metrics.log_every": 1, "metrics.tensorboard": False,
            "eval.at_end": False}


def run_child(ctx, target, args, *, kill_after: float | None = None, started=None) -> int:
    p = ctx.Process(target=target, args=args)
    p.start()
    if kill_after is not None:
        if started.wait(TRIAL_LIMIT_S):
            time.sleep(kill_after)  # the random moment itself (not a synchronization)
        os.kill(p.pid, signal.SIGKILL)
    p.join(TRIAL_LIMIT_S)
    if p.is_alive():
        p.kill()
        pytest.fail("a soak trial hung")
    return p.exitcode


def final_state(run: Path) -> dict:
    latest = store.latest_checkpoint(run)
    assert latest is not None and latest.name == f"step_{STEPS:06d}"
    return store.load_training_state(latest)


def losses(run: Path) -> list[tuple[int, float]]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [(r["step"], r["loss"]) for r in rows if "event" not in r]


def assert_same_state(a: dict, b: dict) -> None:
    assert a["step"] == b["step"] == STEPS
    assert a["model"].keys() == b["model"].keys()
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k
    sa, sb = a["optimizer"]["state"], b["optimizer"]["state"]
    assert sa.keys() == sb.keys()
    for i in sa:
        for k in sa[i]:
            assert torch.equal(sa[i][k], sb[i][k]), (i, k)
    assert a["optimizer"]["param_groups"] == b["optimizer"]["param_groups"]


@pytest.fixture(scope="module")
def reference(ctx, soak_data, tmp_path_factory):
    from tests.dflash_soak_child import trial

    run = tmp_path_factory.mktemp("ref") / "run"
    assert run_child(ctx, trial, (overrides(run, soak_data),)) == 0
    return final_state(run), losses(run)


def test_sigkill_at_random_moments_then_resume_ends_bit_identical(ctx, soak_data, reference, tmp_path):
    from tests.dflash_soak_child import trial

    run = tmp_path / "run"
    cfg = overrides(run, soak_data)
    rng = random.Random(28)
    kills = {"in a save": 0, "at random": 0, "at start": 0}
    for i in range(KILLS):
        started = ctx.Event()
        kind = ("in a save", "at random", "at start")[i % 3]
        if kind == "in a save":  # an exact file operation of the background writer: staging, publishing, retention
            code = run_child(ctx, trial, (cfg, started, rng.randint(1, 24), True))
        elif kind == "at random":  # a random moment after the first step: any phase of any thread
            code = run_child(ctx, trial, (cfg, started), kill_after=rng.uniform(0.0, 0.25), started=started)
        else:  # an early file operation: the lock, leftovers' cleanup, metrics.jsonl's truncation, the first save
            code = run_child(ctx, trial, (cfg, started, rng.randint(1, 8)))
        assert code in (0, -signal.SIGKILL), code
        if code == 0:
            break  # the run reached its end before this trial's kill
        kills[kind] += 1
        # whatever the kill hit, the newest checkpoint is whole (and loadable)
        latest = store.latest_checkpoint(run)
        if latest is not None:
            store.load_training_state(latest)
    print(f"soak: kills {kills}")
    assert sum(kills.values()) >= 20, f"only {kills} trials were killed before the run ended"
    assert kills["in a save"] >= 7, kills
    assert run_child(ctx, trial, (cfg,)) == 0  # the last resume runs to the end
    want_state, want_losses = reference
    assert_same_state(final_state(run), want_state)
    assert losses(run) == want_losses  # one row per step, the replayed steps' losses the same bits
    ck = run / "checkpoints"
    names = sorted(p.name for p in ck.iterdir())
    assert names == ["latest", f"step_{STEPS - EVERY:06d}", f"step_{STEPS:06d}"], names  # keep_last 2, no leftovers
    assert not (run / ".lock").exists()


def _tmpfs(path: Path, mib: int) -> bool:
    """Mount a tmpfs of `mib` MiB on `path` (root only). True only when `path` is then verifiably that
    small filesystem of its own: the test fills it to the brim, which must never reach the real disk."""
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0 or os.environ.get("DFLASH_SOAK_NO_MOUNT"):  # the latter: exercise the injected path
        return False
    if subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={mib}m", "tmpfs", str(path)],
                      capture_output=True).returncode != 0:
        return False
    own = os.stat(path).st_dev != os.stat(path.parent).st_dev
    if own and shutil.disk_usage(path).total <= 2 * mib << 20:
        return True
    subprocess.run(["umount", "-l", str(path)], capture_output=True)  # mounted, but not what was asked for
    return False


def test_disk_full_mid_save_stops_cleanly_then_resumes_bit_identical(ctx, soak_data, reference, tmp_path):
    """A real full disk on a small tmpfs when this host lets us mount one (root), else injected ENOSPC."""
    from tests.dflash_soak_child import cli_trial

    mnt = tmp_path / "small"
    mounted = _tmpfs(mnt, 64)
    try:
        run = mnt / "run"
        args = ["--out", str(run)]
        for k, v in overrides(run, soak_data).items():
            if k != "checkpoint.out_dir":
                args += ["--set", f"{k}={v}"]
        err = tmp_path / "stderr.txt"
        fault = {"fill_at": 10, "fill_dir": str(mnt)} if mounted else {"enospc_at": 10}
        p = ctx.Process(target=cli_trial, args=(args, str(err)), kwargs=fault)
        p.start()
        p.join(TRIAL_LIMIT_S)
        code = p.exitcode
        text = err.read_text()
        assert code == 1, text[-3000:]
        assert "Traceback" not in text
        assert "No space left on device" in text or "not enough disk" in text
        assert "checkpoint at step 40 NOT saved" in text  # the 10th save: skipped, training went on
        assert "training goes on" in text
        assert f"final checkpoint (step {STEPS}) could not be written" in text
        assert "".join(f"dflash train --out {run} --resume".split()) in "".join(text.split())
        latest = store.latest_checkpoint(run)
        assert latest.name == "step_000036"  # the last save before the disk filled: intact, named
        store.load_training_state(latest)
        assert not any(p.name.startswith(".step_") for p in (run / "checkpoints").iterdir())  # no staging left
        if mounted:
            (mnt / "filler").unlink()  # space freed
        p = ctx.Process(target=cli_trial, args=(["--out", str(run), "--resume"], str(err)))
        p.start()
        p.join(TRIAL_LIMIT_S)
        assert p.exitcode == 0, err.read_text()[-3000:]
        want_state, want_losses = reference
        assert_same_state(final_state(run), want_state)
        assert losses(run) == want_losses
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(mnt)], capture_output=True)
