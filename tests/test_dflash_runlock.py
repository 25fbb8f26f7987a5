"""`RUN/.lock` that is not a regular file (a FIFO, a directory) is one clear exit-2 message, never a
hang: the lock is opened non-blocking and its type checked on the descriptor (dflash/checkpoint/runlock.py)."""

from __future__ import annotations

import os
import re

import pytest

from cli.dflash_main import app
from compilewatch.errors import BadInput
from dflash.checkpoint.runlock import LOCK_NAME, RunLock
from tests.dflash_helpers import write_word_chats
from tests.helpers import invoke, time_limit


@pytest.mark.parametrize("make, words", [(os.mkfifo, "is not a regular file (a FIFO)"),
                                         (os.mkdir, "is a directory")])
def test_a_lock_that_is_not_a_file_is_bad_input_at_once(tmp_path, make, words):
    lock = tmp_path / LOCK_NAME
    make(lock)
    with time_limit(30), pytest.raises(BadInput, match=re.escape(words)) as e:  # before: open() of the FIFO never returned
        RunLock(tmp_path).acquire()
    assert "the run lock" in e.value.message and str(lock) in e.value.message
    assert "remove" in e.value.hint and os.path.lexists(lock)  # the user's file is left alone


def test_a_lock_replaced_by_a_fifo_while_held_is_left_alone_on_release(tmp_path):
    held = RunLock(tmp_path).acquire()
    (tmp_path / LOCK_NAME).unlink()
    os.mkfifo(tmp_path / LOCK_NAME)
    with time_limit(30):
        held.release()  # never raises, never blocks, never removes what is not its lock
    assert os.path.lexists(tmp_path / LOCK_NAME)


def test_dflash_train_on_a_run_dir_whose_lock_is_a_fifo_exits_2(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    os.mkfifo(run / LOCK_NAME)
    data = write_word_chats(tmp_path / "chat.jsonl")
    with time_limit(120):
        r = invoke(app, ["train", "--out", str(run), "--data", str(data), "--max-steps", "1"])
    assert r.exit_code == 2 and "Traceback" not in r.stderr + r.stdout, r.stderr[-2000:]
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "is not a regular file (a FIFO)" in errors[0], r.stderr
