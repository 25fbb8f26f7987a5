"""What each test module did with torch when it ran: the evidence for which modules the torch matrix
runs again under the other torch versions (.ci/run).

tests/matrix.py reads statically which modules *can* reach torch: 99 of 101, because nearly every
module imports the CLI or a house package that imports torch somewhere. Many of them never run it:
help text, config and lockfile parsing, archives, signatures, the pickle scanner on bytes. A module
whose tests, run under one torch, ran no torch code, read no file of torch and started no process,
gives the same outcome under any torch: it runs once. Everything else stays in the matrix.

Recording (`COMPILEWATCH_MATRIX_RECORD=DIR`, .ci/run's first phase: the whole suite): while a test
module's tests run (setup, call, teardown: its fixtures too), the first of these marks it, with the
reason:
- a Python frame of a torch package ran (matrix.TORCH_PACKAGES: torch, transformers, triton, ...), in
  the test's thread or a thread started after the test began (sys.setprofile, threading.setprofile);
- a C function of torch was called (`torch.tensor`, a Tensor method: the profile's c_call events);
- a file of an installed torch package or its dist-info was opened (torch's source read for event
  names, its version read from its metadata: the "open" audit event, io.open_code included);
- a process was started (subprocess, os.exec*, os.posix_spawn, os.system, os.fork): it may run torch,
  and the recorder does not see into it. Only NO_TORCH_PROGRAMS (redis-server, git) are exempt;
- a test was skipped (its code did not run here: no evidence), or a test used a shared fixture
  (scope above function, from another file: its setup may have run, and touched torch, while another
  module was being recorded).
Code that tests/conftest.py runs around every test (the seeds, the FX-flag reset) is not counted, for
the reason matrix.py gives. After a module's first mark nothing more is watched for it (the profile
is off: no cost). Each process writes DIR/<worker>.json: {module: reason, or null for "nothing"}.

Using (`COMPILEWATCH_MATRIX_FROM=DIR`, the matrix phases): tests/conftest.py marks `torch_matrix` the
modules matrix.py finds sensitive, less those the record shows did nothing. A module the record does
not hold (new, renamed, not run) stays in the matrix: a new test cannot leave it by accident.
`python -m tests.touch DIR` prints the record.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import threading
from pathlib import Path

import pytest

RECORD_ENV = "COMPILEWATCH_MATRIX_RECORD"
FROM_ENV = "COMPILEWATCH_MATRIX_FROM"
NO_TORCH_PROGRAMS = frozenset({"redis-server", "redis-cli", "git"})  # started by fixtures and tests; run no Python
# torch code that runs for every caller once torch is imported, not because a test uses torch: not a mark
IGNORED_FRAMES = {
    ("package/package_importer.py", "_patched_getfile"):
        "torch.package replaces inspect.getfile process-wide; it defers to the original for anything not "
        "loaded by a torch.package importer (pytest and typer call it for every fixture and command)",
}
_SPAWN_EVENTS = ("subprocess.Popen", "os.exec", "os.posix_spawn", "os.spawn", "os.system", "os.fork", "os.forkpty")


def torch_locations(packages) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(path prefixes of the installed packages' files and dist-info dirs, dotted module prefixes) of
    `packages` (matrix.TORCH_PACKAGES' names), found without importing them."""
    paths: list[str] = []
    mods: list[str] = []
    for name in packages:
        mods.append(name)
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            spec = None
        if spec is None:
            continue
        if spec.submodule_search_locations:
            for loc in spec.submodule_search_locations:
                for d in (os.path.abspath(loc), os.path.realpath(loc)):
                    paths.append(os.path.join(d, ""))
                    paths += [str(p) + os.sep for p in Path(d).parent.glob(f"{name.split('.')[0]}-*.dist-info")]
        elif spec.origin:
            paths += [os.path.abspath(spec.origin), os.path.realpath(spec.origin)]
    return tuple(dict.fromkeys(paths)), tuple(mods)


class Recorder:
    """The pytest plugin that records (module docstring). `root`: the repo root."""

    def __init__(self, root: Path, out_dir: Path, packages, *, audit: bool = True) -> None:
        self.root, self.out_dir = root, out_dir
        self.conftest = str(root / "tests" / "conftest.py")
        self.helper_dirs = tuple(str(root / d) + os.sep for d in ("tests", "benchmarks"))  # where shared fixtures live
        self.paths, names = torch_locations(packages)
        self.mod_names, self.mod_dots = frozenset(names), tuple(n + "." for n in names)
        self.verdicts: dict[str, str | None] = {}
        self.current: str | None = None  # the module whose test is running
        if audit:  # for good: an audit hook cannot be removed (it does nothing while no test runs)
            sys.addaudithook(self._audit)

    # --- marks ---------------------------------------------------------------------------------------
    def _mark(self, reason: str, frame=None) -> None:
        mod = self.current
        if mod is None or self.verdicts.get(mod) is not None:
            return
        f = frame
        while f is not None:  # around every test: tests/conftest.py's fixtures
            if f.f_code.co_filename == self.conftest:
                return
            f = f.f_back
        self.verdicts[mod] = reason

    def _marked(self) -> bool:
        return self.current is None or self.verdicts.get(self.current) is not None

    def _profile(self, frame, event, arg):
        try:
            self._see(frame, event, arg)
        except Exception:  # never the test's problem
            pass

    def _see(self, frame, event, arg) -> None:
        if self._marked():
            sys.setprofile(None)  # this thread's: nothing more to see for this module
            return
        if event == "call":
            path = frame.f_code.co_filename
            if path.startswith(self.paths):
                short = self._short(path)
                if (short.split(os.sep, 1)[-1], frame.f_code.co_name) not in IGNORED_FRAMES:
                    self._mark(f"ran {short}:{frame.f_code.co_name}", frame)
        elif event == "c_call":
            mod = getattr(arg, "__module__", None) or type(getattr(arg, "__self__", None)).__module__
            if isinstance(mod, str) and (mod in self.mod_names or mod.startswith(self.mod_dots)):
                self._mark(f"called {mod}.{getattr(arg, '__qualname__', '?')}", frame)

    def _audit(self, event: str, args) -> None:
        try:
            self._hear(event, args)
        except Exception:  # an audit hook's exception would fail the audited call: never
            pass

    def _hear(self, event: str, args) -> None:
        if self._marked():
            return
        if event == "open":
            path = args[0]
            if isinstance(path, (str, bytes, os.PathLike)):
                p = os.fsdecode(path)
                if p.startswith(self.paths) or os.path.realpath(p).startswith(self.paths):
                    self._mark(f"opened {self._short(p)}", sys._getframe(2))
        elif event.startswith(_SPAWN_EVENTS):
            prog = self._program(event, args)
            if prog not in NO_TORCH_PROGRAMS:
                self._mark(f"started a process ({prog or event}): the recorder cannot see into it", sys._getframe(2))

    @staticmethod
    def _program(event: str, args) -> str | None:
        try:
            if event == "subprocess.Popen":
                exe, argv = args[0], args[1]
                first = exe or (argv if isinstance(argv, (str, bytes)) else argv[0])
                return os.path.basename(os.fsdecode(first).split()[0])
            if event in ("os.exec", "os.posix_spawn", "os.spawn"):  # (path, argv, env); os.spawn: (mode, path, ...)
                return os.path.basename(os.fsdecode(args[1] if event == "os.spawn" else args[0]))
        except (IndexError, TypeError, ValueError):
            pass
        return None

    def _short(self, path: str) -> str:
        for p in self.paths:
            if path.startswith(p):
                return os.path.join(os.path.basename(os.path.dirname(p)), path[len(p):]) if p.endswith(os.sep) else os.path.basename(p)
        return path

    # --- pytest hooks --------------------------------------------------------------------------------
    def _module_of(self, item) -> str:
        return str(Path(str(item.path)).resolve().relative_to(self.root))

    def _shared_fixture(self, item) -> str | None:
        info = getattr(item, "_fixtureinfo", None)
        here = str(Path(str(item.path)).resolve())
        for name in getattr(item, "fixturenames", ()):
            defs = info.name2fixturedefs.get(name) if info is not None else None
            if not defs:
                continue
            fd = defs[-1]
            src = getattr(getattr(fd.func, "__code__", None), "co_filename", "")
            scope = getattr(fd, "scope", "function")
            if scope != "function" and src.startswith(self.helper_dirs) and src != here:
                return f"uses the shared fixture {name} ({scope} scope, {Path(src).name}): set up once for several modules"
        return None

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_protocol(self, item, nextitem):
        mod = self._module_of(item)
        self.verdicts.setdefault(mod, None)
        self.current = mod
        shared = self._shared_fixture(item)
        if shared:
            self._mark(shared)
        if not self._marked():
            sys.setprofile(self._profile)
            threading.setprofile(self._profile)
        return None  # pytest runs the test (this hook only prepares)

    def pytest_runtest_logreport(self, report):
        if report.skipped and self.current is not None:
            self._mark("a test was skipped: its code did not run here")
        if report.when == "teardown":
            sys.setprofile(None)
            threading.setprofile(None)

    def pytest_runtest_logfinish(self, nodeid, location):
        self.current = None

    def pytest_sessionfinish(self, session):
        sys.setprofile(None)
        threading.setprofile(None)
        self.current = None
        worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
        self.out_dir.mkdir(parents=True, exist_ok=True)
        tmp = self.out_dir / f".{worker}-{os.getpid()}.json.tmp"
        tmp.write_text(json.dumps({"modules": self.verdicts}, indent=1, sort_keys=True), encoding="utf-8")
        os.replace(tmp, self.out_dir / f"{worker}-{os.getpid()}.json")


def in_matrix(module: str, static: bool, record: dict[str, str | None]) -> bool:
    """Whether `module` (a path relative to the root) runs under every torch: matrix.py's static verdict,
    less a record that holds the module and shows it did nothing with torch."""
    return static and not (module in record and record[module] is None)


def load(out_dir: str | os.PathLike | None) -> dict[str, str | None]:
    """The merged record of DIR ({} without one): a module any process marked keeps its reason."""
    merged: dict[str, str | None] = {}
    if not out_dir or not Path(out_dir).is_dir():
        return merged
    for f in sorted(Path(out_dir).glob("*.json")):
        for mod, reason in json.loads(f.read_text(encoding="utf-8")).get("modules", {}).items():
            if merged.get(mod) is None:
                merged[mod] = reason
    return merged


def main(argv: list[str]) -> int:
    record = load(argv[0] if argv else os.environ.get(FROM_ENV))
    for mod, reason in sorted(record.items()):
        print(f"{'MATRIX' if reason else '      '}  {mod}: {reason or 'ran no torch code, read no torch file, started no process'}")
    print(f"{sum(r is not None for r in record.values())} of {len(record)} recorded modules touched torch")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
