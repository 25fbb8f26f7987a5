"""The README's main command, end to end: `dflash train` with no arguments (about 30-60 s on 2 cores)."""

from __future__ import annotations

import pytest

from cli.dflash_main import app
from tests.helpers import invoke_json


@pytest.mark.slow
def test_default_train_learns_and_reports_tau(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the default run dir is runs/<recipe>-<time> under the cwd
    data = invoke_json(app, ["train"])
    assert data["steps"] == data["total_steps"] == 288
    assert data["last_epoch_loss"] < data["first_epoch_loss"] - 0.3  # loss goes down
    ev = data["eval"]
    assert ev["outputs_match"] and ev["tau"] > 1.0 and ev["max_tau"] == 8  # τ > 1 with real decoding
    assert (tmp_path / data["run_dir"] / "checkpoints" / "latest").is_file()
