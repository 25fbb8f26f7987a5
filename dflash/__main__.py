"""`python -m dflash ...` (and `torchrun ... -m dflash train ...`): the installed `dflash` command.

The library does not import the CLI (cli/ sits on top of dflash/): this runs the `dflash` console
script the distribution declares (pyproject's [project.scripts]), found through its entry point.
"""

from __future__ import annotations

import sys
from importlib.metadata import entry_points


def main() -> int:
    found = entry_points(group="console_scripts", name="dflash")
    if not found:
        print("error: the `dflash` command is not installed (no `dflash` console script in this environment)\n"
              "hint: install the distribution that provides it, e.g. `pip install -e .` in the source tree",
              file=sys.stderr)
        return 2
    cmd = next(iter(found)).load()
    return cmd() or 0


if __name__ == "__main__":
    sys.exit(main())
