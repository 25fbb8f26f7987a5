"""`dflash`: the DFlash drafter trainer's CLI (root app; commands live in their own modules)."""

from __future__ import annotations

import dflash
from cli import dflash_check, dflash_eval, dflash_prepare, dflash_regen, dflash_train
from cli.app import make_root_app, run_app

app = make_root_app("dflash", "Train DFlash block-diffusion drafters, safe with threads and torch.compile.",
                    dflash.__version__,
                    "dflash: DFlash drafter training. Exit codes: 0 ok, 1 a failed check, 2 bad input or usage.")

app.command("train")(dflash_train.train_cmd)
app.command("eval")(dflash_eval.eval_cmd)
app.command("regen")(dflash_regen.regen_cmd)
app.command("prepare")(dflash_prepare.prepare_cmd)
app.command("check")(dflash_check.check_cmd)


def main() -> None:
    run_app(app)


if __name__ == "__main__":
    main()
