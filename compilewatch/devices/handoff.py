"""Hand control to the user's program after `warm`: in this process when possible, else exec.

In-process (`python script.py ...`, `script.py ...`, `python -m module ...`, `-m module ...`): the
program runs in this interpreter through `runpy`, with `sys.argv` set as Python would set it. What
warm compiled in memory (dynamo's compiled code, guards, inductor's loaded kernels) is still there:
the program's threads start warm, *if* they call the same compiled callables that warm ran.

exec (anything else, or a `python` that is not this interpreter, or interpreter options such as
`python -u` / `python -c`): `os.execvp` replaces this process. Memory is gone; only the on-disk
caches (inductor FX-graph / AOTAutograd / triton) carry over, so the program still runs dynamo and
its first calls still compile (from cache hits).
"""

from __future__ import annotations

import importlib.machinery
import os
import re
import runpy
import shlex
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from compilewatch.errors import BadInput

_PYTHON_RE = re.compile(r"^python(\d+(\.\d+)?)?$")


@dataclass(frozen=True, slots=True)
class HandOff:
    mode: Literal["in-process", "exec"]
    kind: Literal["script", "module", "command"]
    target: str  # the script path, the module name, or the executable
    argv: tuple[str, ...]  # in-process: the new sys.argv; exec: the exec'd argv
    reason: str  # one line: why this mode

    def describe(self) -> str:
        if self.mode == "in-process":
            return (f"running {self.kind} {self.target} in this process ({self.reason}): compiled state in "
                    "memory carries over")
        return f"exec {shlex.join(self.argv)} ({self.reason}): only the on-disk caches carry over"


def _same_interpreter(exe: str) -> tuple[bool, str | None]:
    found = shutil.which(exe)
    if found is None:
        return False, None
    same_dir = os.path.dirname(os.path.abspath(found)) == os.path.dirname(os.path.abspath(sys.executable))
    return same_dir and Path(found).resolve() == Path(sys.executable).resolve(), found


def _script(path: str, args: list[str], reason: str) -> HandOff:
    if not Path(path).is_file():
        raise BadInput(f"script {path!r} does not exist", hint="give the path of a Python file to run after warm")
    return HandOff("in-process", "script", path, (path, *args), reason)


def _module(rest: list[str], reason: str) -> HandOff:
    if len(rest) < 2 or not rest[1]:
        raise BadInput("-m needs a module name", hint="e.g. -- python -m mypkg.train --epochs 1")
    top = rest[1].split(".")[0]
    # the top-level package, found without importing anything (as `python -m` looks: the current dir first);
    # run_in_process would otherwise fail after warm, with runpy's traceback
    if top not in sys.builtin_module_names and top not in sys.modules and \
            importlib.machinery.PathFinder.find_spec(top, [os.getcwd(), *sys.path]) is None:
        raise BadInput(f"module {rest[1]!r} not found (no {top!r} in the current dir or on sys.path)",
                       hint="check the module name after -m, install its package, or run from the folder that holds it")
    return HandOff("in-process", "module", rest[1], (rest[1], *rest[2:]), reason)


def plan(cmd: list[str]) -> HandOff:
    """Decide how `cmd` runs after warm. Raises BadInput for a missing script/command."""
    if not cmd:
        raise BadInput("empty command after --", hint="e.g. compilewatch warm --devices 0 -- python train.py")
    first, rest = cmd[0], list(cmd[1:])
    if first == "-m":
        return _module(cmd, "-m module")
    if first.endswith(".py"):
        return _script(first, rest, "a Python script")
    if _PYTHON_RE.match(os.path.basename(first)):
        same, found = _same_interpreter(first)
        if found is None:
            raise BadInput(f"command {first!r} not found on PATH")
        if not same:
            return HandOff("exec", "command", first, tuple(cmd),
                           f"{found} is not this interpreter ({sys.executable})")
        if not rest:
            return HandOff("exec", "command", first, tuple(cmd), "no script given")
        if rest[0] == "-m":
            return _module(rest, "python -m module, same interpreter")
        if not rest[0].startswith("-"):
            return _script(rest[0], rest[1:], "python script, same interpreter")
        return HandOff("exec", "command", first, tuple(cmd),
                       f"interpreter option {rest[0]}: only `python SCRIPT` and `python -m MODULE` run in-process")
    if shutil.which(first) is None:
        raise BadInput(f"command {first!r} not found", hint="check the command after --, or give its full path")
    return HandOff("exec", "command", first, tuple(cmd), "not a Python script or module")


def run_in_process(h: HandOff) -> None:
    """Run a script/module as `__main__` here, as `python` would (argv, sys.path[0]). A SystemExit
    from the program propagates."""
    if h.mode != "in-process":
        raise ValueError("run_in_process needs an in-process hand-off")
    sys.argv = list(h.argv)
    if h.kind == "script":
        sys.path.insert(0, os.path.dirname(os.path.abspath(h.target)))
        runpy.run_path(h.target, run_name="__main__")
    else:
        if os.getcwd() not in sys.path and "" not in sys.path:
            sys.path.insert(0, os.getcwd())
        runpy.run_module(h.target, run_name="__main__", alter_sys=True)


def exec_command(h: HandOff) -> None:
    """Replace this process with the command (never returns)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os.execvp(h.argv[0], list(h.argv))
