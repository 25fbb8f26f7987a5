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


def _normalize(text: str, exact: bool) -> list[str]:
    """Wall times (seconds, speedup) and run-dir timestamps masked; with `exact` False every number."""
    import re

    text = re.sub(r"(runs/tiny)(-\d{8}-\d{6})?", r"\1", text)
    text = re.sub(r"in [\d.]+ s:", "in <s> s:", text)
    text = re.sub(r"speedup [\d.]+x", "speedup <x>x", text)
    if not exact:
        text = re.sub(r"\d+\.\d+", "<n>", text)
    return [line.rstrip() for line in text.strip().splitlines()]


def checked_block(doc, name: str) -> str:
    """The fenced block after `<!-- checked: NAME -->` in a docs file."""
    import re

    m = re.search(rf"<!-- checked: {re.escape(name)} -->\n```[^\n]*\n(.*?)\n```", doc.read_text(), re.S)
    assert m, f"no checked block {name} in {doc}"
    return m.group(1)


@pytest.mark.slow
def test_docs_show_what_dflash_train_prints(tmp_path, monkeypatch):
    """docs/dflash.md's stdout block of `dflash train` is this run's stdout: exact on torch 2.13.0
    (deterministic on CPU) but for wall times, the same lines with other numbers on other torch."""
    import io
    from pathlib import Path

    import torch

    from cli import dflash_train, output

    monkeypatch.chdir(tmp_path)
    data = invoke_json(app, ["train", "--out", "runs/tiny"])
    buf = io.StringIO()
    monkeypatch.setattr(output, "out", output.make_console(file=buf))
    dflash_train._render(data)
    exact = torch.__version__.split("+")[0] == "2.13.0"
    doc = Path(__file__).resolve().parents[1] / "docs" / "dflash.md"
    assert _normalize(buf.getvalue(), exact) == _normalize(checked_block(doc, "dflash-train-stdout"), exact)
