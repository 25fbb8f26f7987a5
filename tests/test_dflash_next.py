"""After `dflash train`: the exact commands to evaluate the run and to serve its export."""

from __future__ import annotations

import json
import shlex

from cli.dflash_next import next_steps


def _result(target: str, block: int = 16, checkpoints=("runs/q8/checkpoints/step_004000",)) -> dict:
    return {"run_dir": "runs/q8", "checkpoints": list(checkpoints),
            "config": {"target": {"path": target}, "drafter": {"block_size": block}}}


def test_a_real_target_gets_eval_sglang_and_vllm_commands():
    steps = [c for c, _ in next_steps(_result("/models/Qwen3-8B"))]
    assert steps[0] == "dflash eval runs/q8"  # its held-out prompts: -n 64 decoded prompts it trained on
    assert steps[1] == ("python -m sglang.launch_server --model-path /models/Qwen3-8B --speculative-algorithm DFLASH "
                        "--speculative-draft-model-path runs/q8/checkpoints/step_004000")
    argv = shlex.split(steps[2])
    assert argv[:3] == ["vllm", "serve", "/models/Qwen3-8B"] and argv[3] == "--speculative-config"
    assert json.loads(argv[4]) == {"method": "dflash", "model": "runs/q8/checkpoints/step_004000",
                                   "num_speculative_tokens": 15}


def test_paths_with_spaces_are_quoted():
    steps = [c for c, _ in next_steps({**_result("/my models/t"), "run_dir": "my runs/a"})]
    assert shlex.split(steps[0])[2] == "my runs/a" and "--model-path '/my models/t'" in steps[1]


def test_the_embedded_target_says_why_there_is_nothing_to_serve():
    (ev, what), (cmd, note) = next_steps(_result("embedded:tiny"))
    assert ev.startswith("dflash eval runs/q8") and cmd == "" and "--target DIR" in note


def test_no_checkpoint_no_commands():
    ((cmd, note),) = next_steps(_result("/models/t", checkpoints=()))
    assert cmd == "" and "no checkpoint" in note


def test_eval_of_a_missing_path_is_bad_input_before_any_progress(tmp_path):
    from cli.dflash_main import app
    from tests.helpers import invoke

    r = invoke(app, ["eval", str(tmp_path / "nonexistent")])
    assert r.exit_code == 2
    assert "is not a dflash checkpoint or run directory" in r.stderr
    assert "[progress]" not in r.stderr and "speculative decoding on" not in r.stderr, r.stderr


def test_train_prints_the_next_steps_on_stderr(monkeypatch):
    import io

    from cli import dflash_train, output

    out, err = io.StringIO(), io.StringIO()
    monkeypatch.setattr(output, "out", output.make_console(file=out))
    monkeypatch.setattr(output, "err", output.make_console(file=err))
    dflash_train._render({"steps": 1, "total_steps": 1, "seconds": 1.0, "first_epoch_loss": 1.0,
                          "last_epoch_loss": 1.0, "last_epoch_tau_estimate": 1.0, **_result("/models/t")})
    assert "next:" in err.getvalue() and "dflash eval runs/q8\n" in err.getvalue()
    assert "vllm serve /models/t" in err.getvalue() and "next:" not in out.getvalue()  # stdout is the result


def test_docs_show_what_print_next_steps_prints(monkeypatch):
    import io
    from pathlib import Path

    from cli import output
    from cli.dflash_next import print_next_steps
    from tests.test_dflash_default_run import checked_block

    err = io.StringIO()
    monkeypatch.setattr(output, "err", output.make_console(file=err))
    print_next_steps(_result("/models/Qwen3-8B"))
    doc = Path(__file__).resolve().parents[1] / "docs" / "dflash.md"
    assert [x.rstrip() for x in err.getvalue().strip().splitlines()] == checked_block(doc, "dflash-next-steps").splitlines()
