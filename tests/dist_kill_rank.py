"""A torchrun entry for tests: `dflash` with one rank SIGKILLed at one optimizer step, on the job's
first attempt only (TORCHELASTIC_RESTART_COUNT 0): torchrun (`--max-restarts`) then restarts every rank.

    torchrun --max-restarts 1 ... tests/dist_kill_rank.py train ...   (DFLASH_TEST_KILL_RANK, DFLASH_TEST_KILL_STEP)
"""

import os
import signal

from dflash.training.trainer import Trainer

KILL_RANK = int(os.environ["DFLASH_TEST_KILL_RANK"])
KILL_STEP = int(os.environ["DFLASH_TEST_KILL_STEP"])

if int(os.environ["RANK"]) == KILL_RANK and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
    _original = Trainer.optimizer_step

    def _killed(self, step):
        if step == KILL_STEP:
            os.kill(os.getpid(), signal.SIGKILL)
        return _original(self, step)

    Trainer.optimizer_step = _killed

from cli.dflash_main import main  # noqa: E402

main()
