"""Session 16's red team of how `dflash train` stops, each finding pinned.

- A second signal while the run closed (Ctrl-C twice, SIGINT then SIGTERM, SIGTERM then Ctrl-C) was raised
  inside the wait for the checkpoint writer: the checkpoint was left half-staged (`.step_*.partial-PID`),
  the run lock stale, the message a bare `interrupted` or a false "before training started", and with
  SIGTERM in the mix the process aborted in the writer's C++ code (exit 134). Now the first signal
  stops the run and later ones are held off until it has closed.
- Ctrl-C while the run started printed a bare `interrupted`, and SIGTERM there said "nothing of the run to
  resume" on a resume whose run directory holds checkpoints.
- The multi-device engine stopped by SIGTERM and then a Ctrl-C (or Ctrl-C twice) while its result was shown:
  that second signal met Python's default handler again and replaced the resume command with a bare
  `interrupted` (exit 130 after a SIGTERM).
- SIGTERM killed `dflash prepare` where it stood: the build's staging directory (`.tmp-KEY-...`) stayed in
  the data cache for good (never read, never removed).
- Ctrl-C after the last step of a run without an end-of-run eval said "the end-of-run evaluation did not
  finish".

The process tests run `dflash train` (or `dflash.train`) in a child of this module that signals itself at
an exact point (inside the checkpoint writer's save; the second signal once the loop waits for it in
`Saver.close`): no sleeps.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from cli.dflash_main import app
from cli.signals import EXIT_SIGTERM
from tests.dflash_helpers import write_word_chats
from tests.helpers import invoke

ROOT = Path(__file__).resolve().parents[1]
FAST = ["--set", "data.regenerate=false", "--set", "metrics.log_every=1", "--set", "eval.at_end=false"]


def _child(sigs: list[int], lib: bool, args: list[str]) -> None:
    """In the child: signal this process from inside the first checkpoint's save (the writer thread), the
    first signal at once, each later one once the loop waits for the write in `Saver.close`; then run."""
    from dflash.checkpoint import store, writer

    me, waiting = os.getpid(), threading.Event()
    real_save, real_close = store.save_checkpoint, writer.Saver.close

    def save(*a, **kw):
        if not waiting.is_set() and threading.current_thread().name == "dflash-checkpoint":
            for i, s in enumerate(sigs):
                if i:
                    waiting.wait()
                os.kill(me, s)
            waiting.wait()  # the loop has stopped and waits for this write: now write it
        return real_save(*a, **kw)

    def close(self):
        waiting.set()
        return real_close(self)

    store.save_checkpoint, writer.Saver.close = save, close
    if not lib:
        app(args=["train", *args], prog_name="dflash")
        return
    import dflash

    overrides = dict(x.split("=", 1) for x in args)
    cfg = dflash.build_config("tiny", None, {k: json.loads(v) if v[:1].isdigit() or v in ("true", "false") else v
                                             for k, v in overrides.items()})
    try:
        dflash.train(cfg)
    except KeyboardInterrupt as e:
        print(getattr(e, "message", "bare"), file=sys.stderr)
        sys.exit(130)


def _run(tmp_path: Path, sigs: list[int], *, lib: bool = False) -> tuple[int, str, Path]:
    data, out = write_word_chats(tmp_path / "chat.jsonl"), tmp_path / "run"
    if lib:
        args = [f"data.path={data}", f"checkpoint.out_dir={out}", "train.max_steps=4", "checkpoint.every=2",
                "data.regenerate=false", "eval.at_end=false", f"data.cache_dir={tmp_path / 'cache'}"]
    else:
        args = ["--data", str(data), "--out", str(out), "--max-steps", "4", "--set", "checkpoint.every=2",
                "--set", f"data.cache_dir={tmp_path / 'cache'}", *FAST]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    env["COMPILEWATCH_PROGRESS_INTERVAL"] = "3600"
    code = ("import sys; from tests.test_dflash_interrupt_s16 import _child; "
            f"_child({[int(s) for s in sigs]!r}, {lib!r}, sys.argv[1:])")

    def default_signals():
        signal.signal(signal.SIGINT, signal.SIG_DFL)  # Python installs its KeyboardInterrupt handler
        signal.signal(signal.SIGTERM, signal.SIG_DFL)

    p = subprocess.run([sys.executable, "-c", code, *args], cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                       stderr=subprocess.PIPE, text=True, timeout=300, preexec_fn=default_signals)
    return p.returncode, p.stderr, out


def _losses(run: Path) -> dict[int, float]:
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r and "event" not in r}


@pytest.mark.parametrize("sigs, code", [((signal.SIGINT, signal.SIGINT), 130),
                                        ((signal.SIGINT, signal.SIGTERM), 130),
                                        ((signal.SIGTERM, signal.SIGINT), EXIT_SIGTERM)],
                         ids=["ctrl-c-twice", "int-then-term", "term-then-int"])
def test_a_second_signal_while_a_checkpoint_is_written_does_not_cut_it(tmp_path, sigs, code):
    rc, err, out = _run(tmp_path, list(sigs))
    assert rc == code, err
    last = err.strip().splitlines()[-1]
    prefix = "SIGTERM: " if code == EXIT_SIGTERM else ""
    assert last == (f"{prefix}interrupted at step 2 of 4: the newest checkpoint is {out}/checkpoints/step_000002 "
                    f"(0 step(s) behind); continue with `dflash train --out {out} --resume`"), err
    assert "Traceback" not in err and "terminate called" not in err
    if sigs[1] == signal.SIGINT:  # a person pressing Ctrl-C again is told why nothing happens, once
        assert err.count("· stopping: the run is closing") == 1, err
    ckpts = out / "checkpoints"
    assert sorted(x.name for x in ckpts.iterdir()) == ["latest", "step_000002"]  # written whole, nothing staged
    assert not (out / ".lock").exists()
    if sigs != (signal.SIGINT, signal.SIGINT):
        return
    r = invoke(app, ["train", "--out", str(out), "--resume", "--json"])  # what the message says to run
    assert r.exit_code == 0 and "took over" not in r.stderr, r.stderr
    whole = tmp_path / "whole"
    r = invoke(app, ["train", "--data", str(tmp_path / "chat.jsonl"), "--out", str(whole), "--max-steps", "4",
                     "--set", "checkpoint.every=2", "--set", f"data.cache_dir={tmp_path / 'cache'}", *FAST, "--json"])
    assert r.exit_code == 0, r.stderr
    assert _losses(out) == _losses(whole) and len(_losses(whole)) == 4  # bit-identical


def test_the_library_finishes_the_checkpoint_when_a_second_ctrl_c_comes_while_it_waits(tmp_path):
    """dflash.train from a program (Python's own SIGINT handler, no CLI): the second KeyboardInterrupt,
    raised in the wait for the writer, used to leave that wait with the write running."""
    rc, err, out = _run(tmp_path, [signal.SIGINT, signal.SIGINT], lib=True)
    assert rc == 130, err
    assert err.strip().splitlines()[-1].startswith("interrupted at step 2 of 4: the newest checkpoint is "), err
    assert sorted(x.name for x in (out / "checkpoints").iterdir()) == ["latest", "step_000002"]
    assert not (out / ".lock").exists()


def test_ctrl_c_while_a_resume_starts_names_the_checkpoint_it_would_go_on_from(tmp_path, monkeypatch):
    from dflash.training import build

    data, out = write_word_chats(tmp_path / "chat.jsonl"), tmp_path / "run"
    args = ["train", "--data", str(data), "--out", str(out), "--set", "checkpoint.every=2", *FAST]
    r = invoke(app, [*args, "--max-steps", "2"])
    assert r.exit_code == 0, r.stderr

    def stop(*a, **kw):
        raise KeyboardInterrupt  # Ctrl-C while the data is read

    monkeypatch.setattr(build, "load_training_data", stop)
    r = invoke(app, ["train", "--out", str(out), "--resume", "--max-steps", "4"])
    assert r.exit_code == 130
    assert r.stderr.strip().splitlines()[-1] == (
        f"interrupted before training started: the newest checkpoint is {out}/checkpoints/step_000002 (step 2); "
        f"continue with `dflash train --out {out} --resume`"), r.stderr
    assert not (out / ".lock").exists()
    fresh = tmp_path / "fresh"
    r = invoke(app, ["train", "--data", str(data), "--out", str(fresh), *FAST])
    assert r.exit_code == 130
    assert r.stderr.strip().splitlines()[-1] == (
        f"interrupted before training started: nothing saved in {fresh}; run the command again to start over")


def test_ctrl_c_after_the_last_step_of_a_run_without_an_eval_says_it_is_complete(tmp_path, monkeypatch):
    from dflash.checkpoint import writer

    real = writer.Saver.finish

    def finish(self, steps_done):
        real(self, steps_done)
        raise KeyboardInterrupt  # after the final checkpoint is written

    monkeypatch.setattr(writer.Saver, "finish", finish)
    data, out = write_word_chats(tmp_path / "chat.jsonl"), tmp_path / "run"
    r = invoke(app, ["train", "--data", str(data), "--out", str(out), "--max-steps", "2", *FAST])
    assert r.exit_code == 130
    assert r.stderr.strip().splitlines()[-1] == (
        f"interrupted after the last step (2): the run is complete, its final checkpoint "
        f"{out}/checkpoints/step_000002 is saved"), r.stderr


def _prepare_child(args: list[str]) -> None:
    """In the child: SIGTERM this process while the first shard is tokenized, then `dflash prepare ARGS`."""
    from dflash.data import cache

    real = cache.encode_shard

    def encode(*a, **kw):
        os.kill(os.getpid(), signal.SIGTERM)
        return real(*a, **kw)

    cache.encode_shard = encode
    app(args=["prepare", *args], prog_name="dflash")


def test_sigterm_while_dflash_prepare_tokenizes_leaves_no_unfinished_build(tmp_path):
    data, root = write_word_chats(tmp_path / "chat.jsonl"), tmp_path / "cache"
    code = "import sys; from tests.test_dflash_interrupt_s16 import _prepare_child; _prepare_child(sys.argv[1:])"
    p = subprocess.run([sys.executable, "-c", code, str(data), "--cache-dir", str(root), "-j", "1"], cwd=ROOT,
                       stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, timeout=300,
                       preexec_fn=lambda: signal.signal(signal.SIGTERM, signal.SIG_DFL))
    assert p.returncode == EXIT_SIGTERM, p.stderr
    assert p.stderr.strip().splitlines()[-1] == ("SIGTERM: interrupted before the cache was complete: an unfinished "
                                                 "build is removed, never read; run the command again"), p.stderr
    assert [x.name for x in root.iterdir() if not x.name.endswith(".lock")] == []  # no `.tmp-KEY-...` left


def _engine_child(args: list[str]) -> None:
    """In the child: SIGTERM at step 3 of an engine run, a Ctrl-C while its result is shown, then `dflash train`."""
    import cli.dflash_train as train_cli
    from dflash.training import trainer

    real_metrics, real_render = trainer.Trainer.write_metrics, train_cli.render_engine

    def write_metrics(self, m):
        real_metrics(self, m)
        if m.step == 3:
            os.kill(os.getpid(), signal.SIGTERM)

    def render_engine(report):
        os.kill(os.getpid(), signal.SIGINT)
        return real_render(report)

    trainer.Trainer.write_metrics, train_cli.render_engine = write_metrics, render_engine
    app(args=["train", *args], prog_name="dflash")


def test_the_engine_stopped_by_sigterm_keeps_its_resume_command_through_a_second_signal(tmp_path):
    data, out = write_word_chats(tmp_path / "chat.jsonl"), tmp_path / "run"
    args = ["--data", str(data), "--out", str(out), "--max-steps", "8", "--set", "checkpoint.every=2",
            "--set", f"data.cache_dir={tmp_path / 'cache'}", "--target-devices", "cpu", "--drafter-devices", "cpu,cpu",
            *FAST]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    env["COMPILEWATCH_PROGRESS_INTERVAL"] = "3600"
    code = "import sys; from tests.test_dflash_interrupt_s16 import _engine_child; _engine_child(sys.argv[1:])"

    def default_signals():
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)

    p = subprocess.run([sys.executable, "-c", code, *args], cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                       stderr=subprocess.PIPE, text=True, timeout=300, preexec_fn=default_signals)
    assert p.returncode == EXIT_SIGTERM, p.stderr
    last = p.stderr.strip().splitlines()[-1]
    assert last.startswith("SIGTERM: interrupted at step ") and f"continue with `dflash train --out {out} --resume`" in last
    assert "Traceback" not in p.stderr and not (out / ".lock").exists()
