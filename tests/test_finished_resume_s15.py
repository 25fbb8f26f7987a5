"""`dflash.train(cfg, resume=True)` on a run that already reached its last step steps nothing and does not
run the end-of-run eval again (it ran when the run finished; `dflash train --resume` says "run complete"
without building anything). Before, the library call evaluated again: at 8B, 64 prompts, ~50 s for nothing."""

from __future__ import annotations

from dflash.run import train
from tests.dflash_helpers import chat_file, small_config, tiny_target  # noqa: F401 (fixtures)


def test_resuming_a_finished_run_through_the_library_does_not_evaluate_it_again(tmp_path, chat_file):
    overrides = {"train.max_steps": 2, "eval.at_end": True, "eval.num_prompts": 2, "eval.max_new_tokens": 4}
    first = train(small_config(tmp_path, chat_file, **overrides))
    assert first.result.steps == 2 and first.result.eval is not None  # the end eval ran once, at the end
    again = train(small_config(tmp_path, chat_file, **overrides), resume=True)
    assert again.result.steps == 2 and again.result.eval is None
