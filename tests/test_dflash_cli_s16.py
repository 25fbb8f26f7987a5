"""`dflash train`'s command line, session 16. SIGTERM (a scheduler's stop, `kill PID`) ends a run the way
Ctrl-C does: the trainer closes (a checkpoint being written is finished), the lock is released, the step
reached and the resume command are said, exit 143. Before, the default action killed it where it stood,
silently. And a mistyped setting names the nearest one."""

from __future__ import annotations

import json
import signal

import pytest

from cli.dflash_main import app
from cli.signals import EXIT_SIGTERM, sigterm_as_interrupt
from tests.dflash_helpers import signal_after_first_checkpoint
from tests.helpers import invoke


@pytest.fixture
def default_sigterm():
    old = signal.signal(signal.SIGTERM, signal.SIG_DFL)
    yield
    signal.signal(signal.SIGTERM, old)


def test_the_first_sigterm_interrupts_a_second_is_ignored_and_the_default_comes_back(default_sigterm, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    with sigterm_as_interrupt(distributed=False) as state:
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGTERM)
        assert state["terminated"] and signal.getsignal(signal.SIGTERM) is signal.SIG_IGN
        signal.raise_signal(signal.SIGTERM)  # ignored while the run closes
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def test_torchrun_ranks_and_a_programs_own_handler_are_left_alone(default_sigterm, monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with sigterm_as_interrupt(distributed=False) as state:
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL and not state["terminated"]
    monkeypatch.delenv("RANK")
    with sigterm_as_interrupt(distributed=True):
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL

    def mine(signum, frame):
        pass

    signal.signal(signal.SIGTERM, mine)
    with sigterm_as_interrupt(distributed=False):
        assert signal.getsignal(signal.SIGTERM) is mine
    assert signal.getsignal(signal.SIGTERM) is mine


def test_sigterm_from_another_process_stops_the_run_with_143_and_the_resume_command(tmp_path):
    """`dflash train` in a process of its own, SIGTERM sent once its first checkpoint is reported (read from
    its stderr: no sleeps); then the lock is free and `--resume` goes on from that checkpoint."""
    code, text, out = signal_after_first_checkpoint(tmp_path, signal.SIGTERM)
    assert code == EXIT_SIGTERM, text
    last = text.strip().splitlines()[-1]
    assert last.startswith("SIGTERM: interrupted at step "), text
    assert f"continue with `dflash train --out {out} --resume`" in last and "Traceback" not in text
    assert not any(x.name.startswith(".step_") for x in (out / "checkpoints").iterdir())  # nothing half-staged
    r = invoke(app, ["train", "--out", str(out), "--resume", "--max-steps", "4", "--json"])
    assert r.exit_code == 0, r.stderr
    assert json.loads(r.stdout)["steps"] == 4
    assert "took over" not in r.stderr + r.stdout  # the lock was released, not left behind


@pytest.mark.parametrize("key, near", [("train.max_step", "train.max_steps"), ("trian.max_steps", "train.max_steps"),
                                       ("data.batchsize", "data.batch_size"), ("eval.evry", "eval.every")])
def test_a_mistyped_setting_names_the_nearest_one(tmp_path, key, near):
    """(Also session 16's first hour: a typo listed the section's fields but not the one meant.)"""
    r = invoke(app, ["train", "--set", f"{key}=10", "--out", str(tmp_path / "run")])
    assert r.exit_code == 2 and f"(did you mean {near}?)" in r.stderr and "Traceback" not in r.stderr
    bad = tmp_path / "my.toml"
    sec, field = key.split(".")
    bad.write_text(f"[{sec}]\n{field} = 10\n")
    r = invoke(app, ["train", "--config", str(bad), "--out", str(tmp_path / "run")])
    assert r.exit_code == 2 and f"did you mean {near}?" in r.stderr, r.stderr
    assert not (tmp_path / "run").exists()
