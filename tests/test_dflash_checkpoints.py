"""Long-run checkpoints (issue 28): retention, disk checks, the background writer's policy, leftovers,
periodic eval. CPU, the small config of tests/dflash_helpers.py (a few steps each)."""

from __future__ import annotations

import errno
import json
import threading

import pytest
import torch

from compilewatch.errors import BadInput
from dflash.checkpoint import diskspace, retention, writer
from dflash.checkpoint import store as ckpt
from dflash.training.trainer import Trainer
from tests.dflash_helpers import chat_file, small_config, tiny_target  # noqa: F401 - fixtures


def train(cfg, events=None, resume=False):
    t = Trainer.from_config(cfg, resume=resume, on_event=(lambda k, d: events.append((k, d))) if events is not None else None)
    try:
        t.train()
    finally:
        t.close()
    return t


def names(run):
    return sorted(p.name for p in (run / "checkpoints").iterdir())


def test_keep_last_and_export_every_bound_the_checkpoints(tmp_path, chat_file):
    (tmp_path / "checkpoints").mkdir(parents=True)
    (tmp_path / "checkpoints" / "my-notes.txt").write_text("mine")  # never touched
    events = []
    train(small_config(tmp_path, chat_file, **{"train.max_steps": 7, "checkpoint.every": 1, "checkpoint.keep_last": 2,
                                              "checkpoint.export_every": 3}), events)
    assert names(tmp_path) == ["latest", "my-notes.txt", "step_000003", "step_000006", "step_000007"]
    assert {p.name for p in (tmp_path / "checkpoints" / "step_000007").iterdir()} >= {"training_state.pt", "manifest.json"}
    exported = tmp_path / "checkpoints" / "step_000003"  # an older multiple of export_every: its export only
    assert sorted(p.name for p in exported.iterdir()) == ["config.json", "manifest.json", "model.safetensors",
                                                         "train_config.toml"]
    assert "training_state.pt" not in json.loads((exported / "manifest.json").read_text())["files"]
    assert ckpt.resolve_checkpoint(exported) == exported  # still an export `dflash eval` reads
    assert [c.name for c in ckpt.complete_checkpoints(tmp_path)] == ["step_000006", "step_000007"]
    saved = [d for k, d in events if k == "checkpoint"]
    assert [d["step"] for d in saved] == list(range(1, 8))
    assert saved[4]["stripped"] == ["step_000003"] and saved[2]["removed"] == ["step_000001"]  # once 4, 5 exist
    disk = next(d for k, d in events if k == "disk")
    assert disk["saves"] == 7 and disk["peak_bytes"] >= 3 * disk["checkpoint_bytes"]


def test_not_enough_disk_before_training_stops_with_the_numbers(tmp_path, chat_file, monkeypatch):
    monkeypatch.setattr(diskspace, "free_bytes", lambda path: 1000)
    t = Trainer.from_config(small_config(tmp_path, chat_file))
    with pytest.raises(BadInput, match=r"not enough disk for a checkpoint .*1.0 KB free, one checkpoint needs "
                                       r"[0-9.]+ MB \(estimated") as e:
        t.train()
    t.close()
    assert "keep_last" in e.value.message and "--out" in e.value.hint
    assert ckpt.latest_checkpoint(tmp_path) is None and t.step == 0  # nothing trained


def test_a_failed_periodic_save_is_skipped_training_goes_on_and_the_next_save_works(tmp_path, chat_file, monkeypatch):
    real, calls = ckpt.save_checkpoint, []

    def flaky(*a, **k):
        calls.append(1)
        if len(calls) == 2:
            raise OSError(errno.EIO, "Input/output error")
        return real(*a, **k)

    monkeypatch.setattr(ckpt, "save_checkpoint", flaky)
    events = []
    t = train(small_config(tmp_path, chat_file, **{"train.max_steps": 6, "checkpoint.every": 2}), events)
    skipped = [d for k, d in events if k == "checkpoint-skipped"]
    assert len(skipped) == 1 and skipped[0]["step"] == 4 and "Input/output error" in skipped[0]["reason"]
    assert skipped[0]["newest"].endswith("step_000002") and "next save is at step 6" in skipped[0]["then"]
    assert t.step == 6 and names(tmp_path) == ["latest", "step_000002", "step_000006"]
    assert any("checkpoint at step 4 skipped" in n for n in t.notes)
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r.get("event") == "checkpoint-skipped"] == [4]


def test_a_bug_in_the_background_write_is_raised_in_the_loop(tmp_path, chat_file, monkeypatch):
    def broken(*a, **k):
        raise TypeError("not a disk problem")

    monkeypatch.setattr(ckpt, "save_checkpoint", broken)
    t = Trainer.from_config(small_config(tmp_path, chat_file, **{"checkpoint.every": 1}))
    with pytest.raises(TypeError, match="not a disk problem"):
        t.train()
    t.close()


def test_a_save_still_running_when_the_next_is_due_is_waited_for(tmp_path, chat_file, monkeypatch):
    real, order = ckpt.save_checkpoint, []
    entered, release = threading.Event(), threading.Event()

    def slow(run_dir, step, *a, **k):
        if step == 1:
            entered.set()
            assert release.wait(60)
        out = real(run_dir, step, *a, **k)
        order.append(f"written {step}")
        return out

    real_snapshot = writer.snapshot

    def snap(buffers, step, *a, **k):
        order.append(f"snapshot {step}")
        return real_snapshot(buffers, step, *a, **k)

    monkeypatch.setattr(ckpt, "save_checkpoint", slow)
    monkeypatch.setattr(writer, "snapshot", snap)
    helper = threading.Thread(target=lambda: (entered.wait(60), release.set()))
    helper.start()
    t = train(small_config(tmp_path, chat_file, **{"train.max_steps": 3, "checkpoint.every": 1}))
    helper.join()
    assert order == ["snapshot 1", "written 1", "snapshot 2", "written 2", "snapshot 3", "written 3"]
    assert len(t.checkpoints) == 3 and len(t.saver.blocked_s) == 3


def test_host_buffers_are_reused_and_background_equals_inline(tmp_path, chat_file):
    a = train(small_config(tmp_path / "bg", chat_file, **{"checkpoint.every": 2}))
    b = train(small_config(tmp_path / "inline", chat_file, **{"checkpoint.every": 2, "checkpoint.background": False}))
    sa, sb = (ckpt.load_training_state(ckpt.latest_checkpoint(r)) for r in (tmp_path / "bg", tmp_path / "inline"))
    assert all(torch.equal(sa["model"][k], sb["model"][k]) for k in sa["model"])
    assert all(torch.equal(sa["optimizer"]["state"][i][k], sb["optimizer"]["state"][i][k])
               for i in sa["optimizer"]["state"] for k in sa["optimizer"]["state"][i])
    bufs = writer.HostBuffers()
    x = torch.arange(6.0)
    first = bufs.copy("x", x)
    x += 1
    again = bufs.copy("x", x)
    assert again is first and torch.equal(first, x) and bufs.bytes == 24
    bufs.reserve({"y": torch.zeros(3, 2)})  # allocated ahead (on CUDA: beside training), filled by copy
    assert bufs.copy("y", torch.ones(3, 2)) is bufs._bufs["y"] and bufs.bytes == 48
    assert a.saver.buffers.bytes == 3 * 4 * sum(p.numel() for p in a.drafter.parameters()) + 4 * len(
        a.optimizer.state)  # fp32 weights + two AdamW moments (+ the step counters)


def test_leftovers_of_killed_saves_are_cleaned_by_the_next_owner_and_a_stale_pointer_is_ignored(tmp_path, chat_file):
    train(small_config(tmp_path, chat_file, **{"train.max_steps": 4, "checkpoint.every": 2}))
    ck = tmp_path / "checkpoints"
    (ck / ".step_000006.partial-999999").mkdir()
    (ck / ".step_000006.partial-999999" / "model.safetensors").write_bytes(b"half")
    (ck / ".step_000002.deleting-12").mkdir()
    (ck / ".latest.x1y2.tmp").write_text("step_000")
    import os

    (ck / "latest").write_text("step_000002\n")  # written after step 4 was published: a deliberate rewind, kept
    assert ckpt.latest_checkpoint(tmp_path).name == "step_000002"
    published = (ck / "step_000004").stat().st_mtime_ns
    os.utime(ck / "latest", ns=(published - 10**9, published - 10**9))  # a kill between publishing step 4 and
    assert ckpt.latest_checkpoint(tmp_path).name == "step_000004"       # rewriting `latest`: the newer one wins
    t = Trainer.from_config(small_config(tmp_path, chat_file, **{"train.max_steps": 6}), resume=True)
    t.close()
    assert t.step == 4 and names(tmp_path) == ["latest", "step_000002", "step_000004"]
    assert any("removed what killed saves left" in n and ".step_000006.partial-999999" in n for n in t.notes)
    assert retention.clean_leftovers(tmp_path) == []


def test_periodic_eval_reports_tau_and_its_cost(tmp_path, chat_file):
    events = []
    train(small_config(tmp_path, chat_file, **{"train.max_steps": 4, "eval.every": 2, "eval.every_prompts": 2,
                                              "eval.max_new_tokens": 8}), events)
    evals = [d for k, d in events if k == "periodic_eval"]
    assert [e["step"] for e in evals] == [2, 4] and all(e["prompts"] == 2 and e["seconds"] > 0 for e in evals)
    assert all(1.0 <= e["tau"] <= e["max_tau"] for e in evals)
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r.get("event") == "periodic_eval"] == [2, 4]


def test_startup_phases_are_timed(tmp_path, chat_file):
    events = []
    train(small_config(tmp_path, chat_file, **{"train.max_steps": 2}), events)
    # the start's phases overlap (issue 39): data and drafter from the target's shape while the target
    # loads, then the Trainer; "imports" is reported once per process (by whichever start sees it end)
    done = [d["name"] for k, d in events if k == "phase-done" and d["name"] != "imports"]
    assert done == ["data", "drafter", "target", "trainer", "first step"]
    events = []
    train(small_config(tmp_path, chat_file, **{"train.max_steps": 3}), events, resume=True)
    assert [d["name"] for k, d in events if k == "phase-done" and d["name"] != "imports"] == [
        "data", "drafter", "target", "resume state", "trainer", "first step"]
    assert all(d["at"] >= d["seconds"] >= 0 for k, d in events if k == "phase-done")


def test_engine_saves_in_the_background_and_evaluates_periodically(tmp_path, chat_file):
    """The engine (1 target worker, 2 drafter replicas on CPU): saves from inside its step barrier go
    through the same writer, the periodic eval runs there too, and the run waits for the last write."""
    from dflash.run import train as run_train

    cfg = small_config(tmp_path, chat_file, **{"train.max_steps": 4, "checkpoint.every": 2, "eval.every": 2,
                                              "eval.every_prompts": 2, "eval.max_new_tokens": 8,
                                              "topology.target_devices": "cpu", "topology.drafter_devices": "cpu,cpu"})
    events = []
    out = run_train(cfg, on_event=lambda k, d: events.append((k, d)))
    assert out.engine.outcome == "ok" and out.engine.max_param_diff == 0.0
    assert [d["step"] for k, d in events if k == "checkpoint"] == [2, 4]
    assert [d["step"] for k, d in events if k == "periodic_eval"] == [2, 4]
    assert names(tmp_path) == ["latest", "step_000002", "step_000004"]
    assert len(out.engine.prewarm.replica_s) == 2


def test_a_run_directory_that_vanished_fails_the_saves_cleanly(tmp_path, chat_file):
    """The run directory deleted under a running trainer: the periodic save is skipped (training goes
    on), the final one stops the run with CheckFailed; nothing is recreated in its place."""
    import shutil

    from compilewatch.errors import CheckFailed

    run = tmp_path / "run"
    events = []

    def on_event(kind, data):
        events.append((kind, data))
        if kind == "step" and data["metrics"].step == 1:
            shutil.rmtree(run)

    t = Trainer.from_config(small_config(run, chat_file, **{"train.max_steps": 4, "checkpoint.every": 2}),
                            on_event=on_event)
    with pytest.raises(CheckFailed, match=r"final checkpoint \(step 4\) could not be written: FileNotFoundError.*"
                                          r"no checkpoint of this run is on disk"):
        t.train()
    t.close()
    assert [d["step"] for k, d in events if k == "checkpoint-skipped"] == [2, 4] and t.step == 4
    assert not run.exists()


def test_a_newest_checkpoint_deleted_under_the_run_does_not_stop_the_next_save(tmp_path, chat_file):
    """Someone removes the newest checkpoint while training runs (`latest` then names nothing): the
    next save estimates its size without it and writes; only --resume reports a damaged newest one."""
    import shutil

    def on_event(kind, data):
        if kind == "checkpoint" and data["step"] == 2:
            shutil.rmtree(data["path"])

    t = Trainer.from_config(small_config(tmp_path, chat_file, **{"train.max_steps": 4, "checkpoint.every": 2}),
                            on_event=on_event)
    try:
        t.train()
    finally:
        t.close()
    assert names(tmp_path) == ["latest", "step_000004"]
