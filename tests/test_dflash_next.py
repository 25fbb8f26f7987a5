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
    assert steps[0] == "dflash eval runs/q8 -n 64"
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
