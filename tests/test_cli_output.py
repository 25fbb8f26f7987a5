"""Output that survives pipes and logs: help examples that never wrap mid-command, no 80-column
truncation off a terminal, progress as plain log lines, the diff-env summary on its own line."""

from __future__ import annotations

import inspect
import io
import re

import pytest
import typer
from rich.console import Console

import cli.dflash_main as dflash_main
import cli.main as cw_main
from cli import output, progress
from tests.helpers import invoke


def _leaves(cmd, path):
    if hasattr(cmd, "commands"):
        for name, sub in cmd.commands.items():
            yield from _leaves(sub, [*path, name])
    else:
        yield path, cmd


ALL = [(app, path, cmd) for app, name in ((cw_main.app, "compilewatch"), (dflash_main.app, "dflash"))
       for path, cmd in _leaves(typer.main.get_command(app), [])]


@pytest.mark.parametrize("app, path, cmd", ALL, ids=[" ".join(p) for _, p, _ in ALL])
def test_help_examples_fit_80_columns(app, path, cmd, monkeypatch):
    """Every example line of every command's --help comes out whole in an 80-column help."""
    monkeypatch.setenv("COLUMNS", "80")
    doc = inspect.getdoc(cmd.callback) or ""
    if "Examples:" not in doc:
        return
    examples = [ln.strip() for ln in doc.split("Examples:", 1)[1].splitlines() if ln.strip()]
    r = invoke(app, [*path, "--help"])
    assert r.exit_code == 0
    shown = {ln.strip() for ln in r.stdout.splitlines()}
    for ex in examples:
        assert ex.replace("\\\\", "\\") in shown, f"{' '.join(path)}: example wrapped: {ex}"


def test_off_a_terminal_nothing_is_cut_to_80_columns():
    buf = io.StringIO()
    c = output.make_console(file=buf)
    assert not c.is_terminal and c.width >= 1000
    from rich.table import Table

    t = Table("path", "size", box=None)
    long_path = "/tmp/torchinductor_root/fxgraph/" + "a" * 150 + "/entry"
    t.add_row(long_path, "880.0 MB")
    c.print(t)
    text = buf.getvalue()
    assert long_path in text and "880.0 MB" in text


def test_progress_off_a_terminal_is_plain_periodic_lines():
    buf = io.StringIO()
    con = Console(file=buf, width=1000, no_color=True)
    with progress.Progress(console=con, interval_s=0) as p:
        t = p.add("save", total=4)
        for i in range(1, 5):
            p.update(t, completed=i, info=f"file {i}")
        u = p.add("scan")  # no total: counts only; stopped before it finished
        p.update(u, advance=7)
    lines = buf.getvalue().splitlines()
    assert lines[0].startswith("[progress] save started 0/4 (0.0%) elapsed 0:00:00")
    assert any(re.match(r"\[progress\] save 2/4 \(50\.0%\) elapsed \d:\d\d:\d\d left ~\d:\d\d:\d\d \| file 2", ln)
               for ln in lines)
    assert any(ln.startswith("[progress] save done 4/4 (100.0%)") for ln in lines)
    assert lines[-1].startswith("[progress] scan stopped at 7 elapsed")
    assert "\x1b" not in buf.getvalue()  # no cursor movement, no colour


def test_progress_lines_are_throttled():
    buf = io.StringIO()
    with progress.Progress(console=Console(file=buf, width=1000), interval_s=3600) as p:
        t = p.add("train", total=100)
        for i in range(1, 100):
            p.update(t, completed=i)
    assert len(buf.getvalue().splitlines()) == 2  # started, and where it stopped; nothing in between


def test_diff_env_summary_is_its_own_line(tmp_path):
    old, new = tmp_path / "old.txt", tmp_path / "new.txt"
    old.write_text("torch==2.11.0\n")
    new.write_text("torch==2.13.0\n")
    r = invoke(cw_main.app, ["diff-env", str(old), str(new)])
    assert r.exit_code == 1
    last = r.stdout.rstrip("\n").splitlines()[-1]
    assert last.startswith("→") and last.endswith("exit 1: changes at or above critical")
    assert r.stdout.endswith("\n")


def test_train_summary_is_one_screen():
    from cli.dflash_train import summary
    from dflash.config import build_config

    cfg = build_config("tiny", None, {"checkpoint.out_dir": "runs/x", "topology.target_devices": "0,1",
                                      "topology.drafter_devices": "2", "topology.stall_after": "60"})
    text = summary(cfg, resumed=["topology.stall_after"])
    assert len(text.splitlines()) <= 10 and "[target]" not in text and "lr = " not in text
    for fact in ("recipe tiny", "embedded:tiny ", "embedded:tiny-chat",
                 "target workers cuda:0,cuda:1, drafter replicas cuda:2", "stall after 60 s, prewarm on, guard on",
                 "resumed  devices and engine settings from runs/x/config.toml; from the command line: stall_after",
                 "6 epochs", "runs/x", "--print-config"):
        assert fact in text, fact


def test_a_bar_at_80_columns_keeps_its_count_elapsed_and_eta():
    """The step line's info gives way on a narrow terminal, not the count, elapsed time or ETA."""
    buf = io.StringIO()
    con = Console(file=buf, width=80, force_terminal=True, color_system=None)
    with progress.Progress(console=con) as p:
        t = p.add("train", total=1000)
        p.update(t, completed=10, info="loss 3.123 acc₁ 0.12 τ≈1.23 12.3k tok/s 1.2 GB, eval τ 2.31 and more")
        p._rich.refresh()
    last = buf.getvalue().replace("\r", "\n").splitlines()[-2]
    assert "10/1,000" in last and re.search(r"\d:\d\d:\d\d [-\d]:[-\d]{2}:[-\d]{2}", last) and last.rstrip().endswith("…")
    assert len(last.replace("\x1b[2K", "")) <= 80


def test_a_phase_with_a_known_size_starts_with_its_total():
    from cli.dflash_progress import TrainProgress

    buf = io.StringIO()
    tp = TrainProgress()
    tp.progress = progress.Progress(console=Console(file=buf, width=1000, no_color=True), interval_s=0)
    with tp:
        tp("phase", {"name": "eval", "prompts": 8})
        tp("phase", {"name": "regenerate", "conversations": 13})
    assert "[progress] eval started 0/8" in buf.getvalue()
    assert "[progress] regenerate started 0/13" in buf.getvalue()


def test_a_periodic_eval_line_says_what_the_first_eval_paid_and_what_ran_beside():
    from cli.dflash_progress import TrainProgress

    buf = io.StringIO()
    tp = TrainProgress()
    tp.progress = progress.Progress(console=Console(file=buf, width=1000, no_color=True), interval_s=0)
    base = {"tau": 2.5, "max_tau": 16, "speedup": 1.8, "prompts": 4}
    with tp:
        tp("periodic_eval", {**base, "step": 500, "seconds": 14.2, "warmed_up": True, "waited_for_pinning_s": 2.34,
                             "parts_s": {"warm_up": 3.0, "plain": 5.5, "speculative": 5.0, "weigh": 0.7}, "beside": []})
        tp("periodic_eval", {**base, "step": 1000, "seconds": 5.0, "warmed_up": False, "waited_for_pinning_s": 0.0,
                             "parts_s": {"warm_up": 0.0, "plain": 0.0, "speculative": 4.9, "weigh": 0.1},
                             "beside": ["a checkpoint write"]})
        tp("periodic_eval", {**base, "step": 1500, "seconds": 7.0, "warmed_up": True, "waited_for_pinning_s": 0.0,
                             "plain_baseline": "step 500, from eval_baseline.json",
                             "parts_s": {"warm_up": 3.0, "plain": 0.0, "speculative": 3.9, "weigh": 0.1}, "beside": []})
        tp("periodic_eval", {**base, "step": 2000, "seconds": 40.0, "warmed_up": True, "waited_for_pinning_s": 0.0,
                             "plain_baseline": "measured", "parts_s": {"reference": 39.0, "weigh": 1.0}, "beside": []})
    first, second, resumed, reference = [line for line in buf.getvalue().splitlines() if "eval at step" in line]
    assert reference.endswith("on 4 prompts, 40.0 s")  # the batch-1 reference: no setup to name
    assert resumed.endswith("7.0 s (first eval of this process: 3.0 s of it warm-up; plain baseline of step 500, "
                            "from eval_baseline.json)")
    assert "14.2 s (first eval: 8.5 s of it warm-up and the plain baseline, reused later)" in first
    assert "waited 2.3 s for the checkpoint buffers to be pinned first" in first and "beside" not in first
    assert second.endswith("5.0 s; a checkpoint write ran beside it")


def test_counts_agree_with_their_number():
    assert (output.count(1, "variable"), output.count(0, "variable"), output.count(3, "entry", "entries")) == \
        ("1 variable", "0 variables", "3 entries")
