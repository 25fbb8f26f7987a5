"""`python -m dflash ...` (and `torchrun ... -m dflash train ...`): the `dflash` command."""

from cli.dflash_main import main

if __name__ == "__main__":
    main()
