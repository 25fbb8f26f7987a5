"""`compilewatch run -- CMD ...`: run a program with the watcher installed in its Python processes.

The child gets `compilewatch/tracing/_boot` first on PYTHONPATH (its sitecustomize arms the watcher, see
autowatch) and COMPILEWATCH_RUN_DIR, a fresh directory where every process that imports torch
writes `watch-<pid>.jsonl`. While the child runs, problem events are handed to `on_event` as they
appear (so a stall is visible while the program still hangs); when it exits, the per-process
reports are merged by time into one report and summarized. The child's exit code is passed through.
The child runs in its own process group; SIGTERM, SIGHUP and SIGINT sent to `compilewatch run` are
forwarded to that group, and the report is still written and the run directory removed.

A run directory is `<tmp>/compilewatch-run-<pid>-<random>/` with an `owner` file (pid and process
start time). A `compilewatch run` killed with SIGKILL cannot remove its own; the next run removes
every such directory of this user whose owner is gone (`clean_stale_run_dirs`).
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Sequence

import compilewatch
from compilewatch.errors import BadInput
from compilewatch.tracing.watch_events import WatchEvent, WatchSummary, read_events, summarize

_BOOT = Path(__file__).resolve().parent / "_boot"
_PKG_ROOT = Path(compilewatch.__file__).resolve().parent.parent


@dataclass(frozen=True, slots=True)
class RunResult:
    command: tuple[str, ...]
    exit_code: int
    wall_s: float
    report: str | None  # the merged JSONL report, when one was asked for
    timeline: str | None
    processes: tuple[int, ...]  # pids that were watched (imported torch)
    summary: WatchSummary
    signals: tuple[int, ...] = ()  # signals we received and forwarded to the program's process group


class _Tail:
    """Reads new complete lines from the per-process reports while the child runs."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self.offsets: dict[Path, int] = {}

    def poll(self) -> list[WatchEvent]:
        import json

        out = []
        for p in sorted(self.run_dir.glob("watch-*.jsonl")):
            try:
                with open(p, encoding="utf-8") as f:
                    f.seek(self.offsets.get(p, 0))
                    data = f.read()
            except OSError:
                continue
            end = data.rfind("\n") + 1
            self.offsets[p] = self.offsets.get(p, 0) + len(data[:end].encode())
            for line in data[:end].splitlines():
                try:
                    out.append(WatchEvent.from_json(json.loads(line)))
                except (ValueError, KeyError):
                    continue
        return out


def child_env(run_dir: Path, stall_after: float, repair: bool, base: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ if base is None else base)
    parts = [str(_BOOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    if "site-packages" not in _PKG_ROOT.parts and "dist-packages" not in _PKG_ROOT.parts:
        parts.append(str(_PKG_ROOT))  # a source checkout: make compilewatch importable (last)
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(parts))
    env["COMPILEWATCH_RUN_DIR"] = str(run_dir)
    env["COMPILEWATCH_STALL_AFTER"] = repr(float(stall_after))
    env["COMPILEWATCH_REPAIR"] = "1" if repair else "0"
    return env


def _check_runnable(prog: str) -> None:
    """BadInput, before anything starts, when `prog` cannot be what the program's run starts with: not on
    PATH (a name without a '/' is only looked up there, even when a file of that name is here), missing, a
    directory, or not executable. A file that is executable but no program is found when it is started."""
    hint = "give the program to run after --, e.g. -- python train.py"
    if "/" not in prog:
        if shutil.which(prog) is not None:
            return
        if os.path.lexists(prog):
            raise BadInput(f"{prog} is not a command on PATH (a name without a '/' is looked up there; the {prog} in "
                           "this directory is not)", hint=f"run it as ./{prog} if it is a program, or through its "
                                                          f"interpreter: -- python {prog}")
        raise BadInput(f"command not found: {prog}", hint=hint)
    if not os.path.exists(prog):
        raise BadInput(f"no such file: {prog}", hint=hint)
    if os.path.isdir(prog):
        raise BadInput(f"{prog} is a directory, not a program", hint=hint)
    if not os.access(prog, os.X_OK):
        raise BadInput(f"{prog} is not executable",
                       hint=f"run it through its interpreter (-- python {prog}), or make it executable (chmod +x)")


def run_watched(command: Sequence[str], *, report: str | os.PathLike[str] | None = None,
                timeline: str | os.PathLike[str] | None = None, stall_after: float = 300.0, repair: bool = False,
                on_event: Callable[[WatchEvent], None] | None = None, stdout=None) -> RunResult:
    """Run `command` with the watcher in every Python process of it that imports torch."""
    command = tuple(command)
    if not command:
        raise BadInput("no command to run", hint="compilewatch run [OPTIONS] -- python train.py ...")
    if not stall_after > 0:  # nan too: it would turn stall detection off without a word
        raise BadInput(f"--stall-after must be > 0 seconds, got {stall_after:g}",
                       hint="leave --stall-after out for 300 s")
    _check_runnable(command[0])
    from compilewatch.fsutil import check_writable, same_file

    if report is not None and timeline is not None and same_file(report, timeline):
        raise BadInput(f"--report and --timeline are the same file ({report}): the timeline would overwrite the "
                       "report", hint="give each its own file, e.g. --report watch.jsonl --timeline watch.json")
    for out in (report, timeline):  # before the program runs, not after it ran for hours
        if out is not None:
            check_writable(out)
    clean_stale_run_dirs()
    _repair_cache_swap()
    run_dir = _make_run_dir()
    tail = _Tail(run_dir)
    t0 = time.perf_counter()
    forwarded: list[int] = []
    try:
        # The child runs in its own session and process group, so that a signal meant for the run
        # (SIGTERM from timeout/Slurm/Kubernetes, SIGHUP, Ctrl-C's SIGINT) reaches the whole program,
        # torchrun's workers included, through us: we forward it to the group, wait for the program to
        # exit, and still write the report.
        with _forward_signals(forwarded) as group:
            try:
                proc = subprocess.Popen(list(command), env=child_env(run_dir, stall_after, repair), stdout=stdout,
                                        start_new_session=True, preexec_fn=_die_with_parent())
            except OSError as e:  # not executable (EACCES), not a program (ENOEXEC), a directory, ...
                what = ("is not a program this system can run (a script without a #! line, or a binary for "
                        "another machine)" if e.errno == errno.ENOEXEC else f"cannot be run: {e.strerror or e}")
                raise BadInput(f"{command[0]} {what}", hint="run it through its interpreter, e.g. -- python FILE"
                               + (", or make it executable (chmod +x)" if e.errno == errno.EACCES else "")) from None
            group.append(proc.pid)
            for sig in list(forwarded):  # arrived while the child was starting
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, sig)
            while True:
                try:
                    code = proc.wait(timeout=0.5)
                    break
                except subprocess.TimeoutExpired:
                    pass
                if on_event is not None:
                    for ev in tail.poll():
                        on_event(ev)
        if on_event is not None:
            for ev in tail.poll():
                on_event(ev)
        wall = time.perf_counter() - t0
        events: list[WatchEvent] = []
        for p in sorted(run_dir.glob("watch-*.jsonl")):
            events.extend(read_events(p))
        events.sort(key=lambda e: (e.time, e.pid, e.seq))
        report_path = None
        if report is not None:
            import json

            from compilewatch.fsutil import atomic_write_text
            from compilewatch.serialize import to_jsonable

            text = "".join(json.dumps(to_jsonable(e.to_json())) + "\n" for e in events)
            atomic_write_text(Path(report), text)
            report_path = str(report)
        timeline_path = None
        if timeline is not None:
            from compilewatch.tracing.timeline import write_timeline

            write_timeline(events, timeline)
            timeline_path = str(timeline)
        summary = summarize(e for e in events if e.kind != "end")
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
    exit_code = code if code >= 0 else 128 - code  # killed by a signal: the shell's convention
    return RunResult(command, exit_code, wall, report_path, timeline_path,
                     tuple(sorted({e.pid for e in events})), summary, tuple(forwarded))


def _repair_cache_swap() -> None:
    """Complete or roll back a `cache load` killed between its renames before the program compiles
    into torch's cache dir (compilewatch.cache.local.swap; one stat when there is nothing to repair)."""
    from compilewatch import torchinfo
    from compilewatch.cache.local import swap

    try:
        swap.recover(torchinfo.inductor_cache_dir())
    except OSError:
        pass


RUN_DIR_PREFIX = "compilewatch-run-"


def _process_start(pid: int) -> float | None:
    try:
        import psutil

        return psutil.Process(pid).create_time()
    except Exception:  # noqa: BLE001 - gone, not ours to see, or psutil unavailable
        return None


def _make_run_dir() -> Path:
    from compilewatch.fsutil import write_failed

    base = Path(tempfile.gettempdir())
    try:
        run_dir = Path(tempfile.mkdtemp(prefix=f"{RUN_DIR_PREFIX}{os.getpid()}-", dir=base))
    except OSError as e:  # a full or read-only temp dir: say so before the program runs
        raise write_failed(base / f"{RUN_DIR_PREFIX}{os.getpid()}-*", e) from None
    try:  # the owner file only sharpens the stale-dir rule (the pid is in the name)
        (run_dir / "owner").write_text(f"{os.getpid()} {_process_start(os.getpid())!r}\n")
    except OSError:
        pass
    return run_dir


def clean_stale_run_dirs(tmp: str | os.PathLike[str] | None = None) -> list[str]:
    """Remove the run directories in `tmp` (default: the temp dir) that belong to this user and whose
    `compilewatch run` is gone (its pid is not running, or runs a process that started at another
    time: the pid was reused). Directories of the older unnamed form (`compilewatch-run-<random>`)
    are removed when nothing changed in them for a day. Returns what was removed."""
    base = Path(tmp if tmp is not None else tempfile.gettempdir())
    removed = []
    try:
        names = [n for n in os.listdir(base) if n.startswith(RUN_DIR_PREFIX)]
    except OSError:
        return removed
    for name in names:
        d = base / name
        try:
            st = os.lstat(d)
        except OSError:
            continue
        if not os.path.isdir(d) or os.path.islink(d) or st.st_uid != os.getuid():
            continue
        pid_text = name[len(RUN_DIR_PREFIX):].split("-", 1)[0]
        if pid_text.isdigit():
            pid = int(pid_text)
            started = _process_start(pid)
            try:
                recorded = (d / "owner").read_text().split()[1]
            except (OSError, IndexError):
                recorded = None
            alive = started is not None and (recorded in (None, "None") or recorded == repr(started))
            if alive:
                continue
        elif time.time() - st.st_mtime < 86400:
            continue
        shutil.rmtree(d, ignore_errors=True)
        removed.append(str(d))
    return removed


FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)
_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def _die_with_parent() -> Callable[[], None] | None:
    """A preexec function that makes the child get SIGTERM when we die (Linux `PR_SET_PDEATHSIG`).

    Forwarding covers the signals we can catch; SIGKILL (an OOM kill, Slurm's or Kubernetes' kill after
    the grace period) stops us with no chance to forward, and the program, in its own session, would run
    on unwatched. The kernel sends the signal when the thread that started the child exits; run_watched
    waits for the child in that thread, so it is never early. Only the direct child gets it: torchrun
    passes SIGTERM on to its workers; other programs' own children are theirs to stop. None (nothing
    done) where prctl is not available."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes

        prctl = ctypes.CDLL(None, use_errno=True).prctl  # resolved here: the child only calls it
    except (OSError, AttributeError):
        return None
    parent = os.getpid()
    term = int(signal.SIGTERM)

    def preexec() -> None:
        prctl(_PR_SET_PDEATHSIG, term, 0, 0, 0)
        if os.getppid() != parent:  # we died between fork and prctl: the signal will never come
            os.kill(os.getpid(), term)

    return preexec


@contextlib.contextmanager
def _forward_signals(forwarded: list[int]) -> Iterator[list[int]]:
    """While the child runs, SIGTERM / SIGHUP / SIGINT sent to us go to the child's process group
    (the pid the caller appends to the yielded list; Python handlers only work in the main thread:
    elsewhere nothing is installed)."""
    group: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield group
        return

    def forward(signum: int, _frame: object) -> None:
        forwarded.append(signum)
        if group:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(group[0], signum)

    old = {sig: signal.signal(sig, forward) for sig in FORWARDED_SIGNALS}
    try:
        yield group
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)
