"""A torchrun entry for tests: `dflash` with one rank made to fail at one optimizer step.

    torchrun ... tests/dist_fail_rank.py train ...   (DFLASH_TEST_FAIL_RANK, DFLASH_TEST_FAIL_STEP)

The failure is a plain Python exception inside a drafter replica's optimizer step, raised after the
step's gradients were summed across ranks (and after rank 0's checkpoint of that step boundary).
"""

import os

from dflash.training.trainer import Trainer

FAIL_RANK = int(os.environ["DFLASH_TEST_FAIL_RANK"])
FAIL_STEP = int(os.environ["DFLASH_TEST_FAIL_STEP"])

if int(os.environ["RANK"]) == FAIL_RANK:
    _original = Trainer.optimizer_step

    def _failing(self, step):
        if step == FAIL_STEP:
            raise RuntimeError(f"injected failure on rank {FAIL_RANK} at step {step}")
        return _original(self, step)

    Trainer.optimizer_step = _failing

from cli.dflash_main import main  # noqa: E402

main()
