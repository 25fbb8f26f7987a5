"""Issue 31, the cache and the CLI under faults: work linear in the cache, no lock held while
planning, a killed load repaired by the next command, no move while torch compiles into the dir,
no debris from a killed `compilewatch run`, a closed pipe ends quietly.

Processes are synchronized by what they print (a blocking read of a line), never by sleeping;
each child runs under a time limit (tests/limits.py).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from compilewatch.cache.archive import save as archive
from compilewatch.cache.local import layout, manage, swap
from compilewatch.cache.local.lock import CacheLocked, cache_lock
from compilewatch.errors import CheckFailed
from compilewatch.tracing import runner
from tests.cache_helpers import big_cache, make_cache, tree
from tests.limits import REPO, cli, one_clear_line, python


# --- prune ------------------------------------------------------------------------------------------
def test_prune_of_10000_files_is_linear(tmp_path):
    """20,000 files took 351 s when each removed entry scanned every file (10,000: ~90 s); ~1 s now."""
    root = big_cache(tmp_path / "c", 10_000, size=8)
    real = cli("cache", "prune", "--max-size", "0", "--dir", str(root), "--json", timeout=60)
    assert real.rc == 0, real.stderr[-2000:]
    assert layout.walk(root).files == ()


def test_prune_plans_without_the_lock_and_holds_it_only_to_move(tmp_path, monkeypatch):
    root = make_cache(tmp_path / "c", n_fx=3, n_codegen=3)
    seen = {}
    real_walk, real_move = layout.walk, layout.move_aside

    def walk(r):
        with cache_lock(root, timeout=0):  # free: another compilewatch command could take it now
            seen["walk"] = "free"
        return real_walk(r)

    def move_aside(r, rels, dest):
        with pytest.raises(CacheLocked):
            with cache_lock(root, timeout=0):
                pass
        seen["move"] = "held"
        return real_move(r, rels, dest)

    monkeypatch.setattr(manage.layout, "walk", walk)
    monkeypatch.setattr(manage.layout, "move_aside", move_aside)
    res = manage.prune(0, root)
    assert seen == {"walk": "free", "move": "held"} and res.removed


def test_prune_refuses_when_the_cache_was_swapped_while_it_planned(tmp_path, monkeypatch):
    root = make_cache(tmp_path / "c", n_fx=2)
    real_walk = layout.walk

    swapped_in = {}

    def walk(r):
        w = real_walk(r)
        os.rename(root, tmp_path / "elsewhere")  # a `cache load` in between
        make_cache(root, n_fx=1)
        swapped_in.update(tree(root))
        return w

    monkeypatch.setattr(manage.layout, "walk", walk)
    with pytest.raises(Exception, match="was replaced while prune was planning"):
        manage.prune(0, root)
    assert tree(root) == swapped_in  # the cache now in place is not touched


# --- a load killed between its two renames --------------------------------------------------------
_KILL_AFTER = """
import os, signal, sys
real = os.rename
def rename(a, b):
    if sys.argv[3] == "before-first":
        os.kill(os.getpid(), signal.SIGKILL)
    real(a, b)
    if ".backup-" in str(b):
        os.kill(os.getpid(), signal.SIGKILL)
os.rename = rename
{call}
"""


def _kill_mid_swap(new: Path, target: Path, when: str) -> None:
    call = ("from compilewatch.cache.local import swap, layout\n"
            "swap.swap_in(__import__('pathlib').Path(sys.argv[1]), __import__('pathlib').Path(sys.argv[2]), "
            "new_is_temp=True, backup_for=lambda t: layout.timestamped_sibling(t, 'backup'))")
    o = python(_KILL_AFTER.format(call=call), str(new), str(target), when, timeout=60)
    assert o.rc == -signal.SIGKILL, o.stderr[-2000:]


def test_cache_load_killed_between_its_renames_is_completed_by_the_next_command(tmp_path):
    src = make_cache(tmp_path / "src", n_fx=2)
    archive.save(tmp_path / "a.tar", src, mega=False)
    dst = make_cache(tmp_path / "dst", n_fx=1, triton=False)
    old = tree(dst)
    o = python(_KILL_AFTER.format(call="from compilewatch.cache.archive import load\nload.load(sys.argv[1], sys.argv[2])"),
               str(tmp_path / "a.tar"), str(dst), "after-first", timeout=120, mem=None)
    assert o.rc == -signal.SIGKILL, o.stderr[-2000:]
    assert not dst.exists() and swap.journal_for(dst).exists()  # the window the issue found
    ls = cli("cache", "ls", "--dir", str(dst), timeout=60)
    assert ls.rc == 0 and "repaired: completed an interrupted swap" in ls.stderr, ls.stderr[-2000:]
    got, want = tree(dst), tree(src)
    assert set(got) == set(want)
    assert all(got[k] == want[k] for k in want if "triton" not in k)  # triton paths point at dst (relocate)
    backups = [p for p in tmp_path.iterdir() if p.name.startswith("dst.backup-")]
    assert len(backups) == 1 and tree(backups[0]) == old
    assert not swap.journal_for(dst).exists() and not [p for p in tmp_path.iterdir() if ".load-" in p.name]


def test_a_killed_swap_whose_new_tree_is_gone_rolls_back(tmp_path):
    new = make_cache(tmp_path / ".dst.load-x", n_fx=2)
    dst = make_cache(tmp_path / "dst", n_fx=1, triton=False)
    old = tree(dst)
    _kill_mid_swap(new, dst, "after-first")
    import shutil

    shutil.rmtree(new)  # the staging dir lost too (a tmp cleaner)
    assert swap.recover(dst) is not None and tree(dst) == old
    assert not swap.journal_for(dst).exists()


def test_a_swap_killed_before_its_first_rename_leaves_the_cache_and_drops_the_staging(tmp_path):
    new = make_cache(tmp_path / ".dst.load-x", n_fx=2)
    dst = make_cache(tmp_path / "dst", n_fx=1, triton=False)
    old = tree(dst)
    _kill_mid_swap(new, dst, "before-first")
    assert swap.journal_for(dst).exists()
    layout.locate(dst)  # any cache command
    assert tree(dst) == old and not new.exists() and not swap.journal_for(dst).exists()


def test_recover_leaves_a_swap_that_is_still_running(tmp_path):
    new = make_cache(tmp_path / ".dst.load-x", n_fx=2)
    dst = make_cache(tmp_path / "dst", n_fx=1, triton=False)
    _kill_mid_swap(new, dst, "after-first")
    with cache_lock(dst):  # the load is alive and holds the lock: not ours to finish
        assert swap.recover(dst) is None
    assert swap.recover(dst) is not None and dst.is_dir()


# --- clear while torch compiles -------------------------------------------------------------------
_HOLD = """
import sys
{setup}
print("ready", flush=True)
sys.stdin.read()
"""


def _holding(setup: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    p = subprocess.Popen([sys.executable, "-c", _HOLD.format(setup=setup)], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True, env=env)
    assert p.stdout.readline().strip() == "ready"
    return p


def _release(p: subprocess.Popen) -> None:
    p.stdin.close()
    p.wait(timeout=30)


def test_clear_refuses_while_torch_holds_a_kernel_lock(tmp_path):
    root = make_cache(tmp_path / "c")
    lock = next((root / "locks").iterdir())
    before = tree(root)
    # torch.utils._filelock.FileLock is this class with wait counters: the same flock
    p = _holding(f"from filelock import FileLock\nlock = FileLock({str(lock)!r})\nlock.acquire()")
    try:
        with pytest.raises(CheckFailed, match="torch is compiling into it") as e:
            manage.clear(root)
        assert e.value.exit_code == 1 and lock.name in e.value.message and tree(root) == before
    finally:
        _release(p)
    assert manage.clear(root).backup is not None  # the compile finished: clear goes ahead


def test_clear_refuses_while_a_live_process_writes_an_entry(tmp_path):
    root = make_cache(tmp_path / "c")
    p = _holding(f"import os\nf = open(os.path.join({str(root)!r}, 'fxgraph', '.%d.1.tmp' % os.getpid()), 'wb')")
    try:
        o = cli("cache", "clear", "--dir", str(root), timeout=60)
        one_clear_line(o, 1, words=f"pid {p.pid}")
        assert root.is_dir()
    finally:
        _release(p)


def test_a_dead_writers_temp_file_does_not_block_clear(tmp_path):
    root = make_cache(tmp_path / "c")
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    (root / "fxgraph" / f".{gone.pid}.1.tmp").write_bytes(b"half")
    assert manage.clear(root).backup is not None


# --- a SIGKILLed `compilewatch run` ---------------------------------------------------------------
def test_a_killed_run_leaves_a_dir_the_next_run_removes(tmp_path):
    env = dict(os.environ, TMPDIR=str(tmp_path), PYTHONPATH=str(REPO))
    prog = "import sys; print('started', flush=True); sys.stdin.read()"
    p = subprocess.Popen([sys.executable, "-c", "from cli.main import main; main()", "run", "--", sys.executable, "-c", prog],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    try:
        assert p.stdout.readline().strip() == "started"
        left = [d for d in tmp_path.iterdir() if d.name.startswith(runner.RUN_DIR_PREFIX)]
        assert len(left) == 1 and (left[0] / "owner").is_file()
        p.kill()  # SIGKILL: no chance to clean up; the program gets SIGTERM (PR_SET_PDEATHSIG)
        p.wait(timeout=30)
    finally:
        p.stdin.close()
    assert left[0].is_dir()
    o = cli("run", "--", sys.executable, "-c", "pass", env=env, timeout=60)
    assert o.rc == 0, o.stderr[-2000:]
    assert not [d for d in tmp_path.iterdir() if d.name.startswith(runner.RUN_DIR_PREFIX)]


def test_stale_run_dir_rules(tmp_path):
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    dead = tmp_path / f"{runner.RUN_DIR_PREFIX}{gone.pid}-abc"
    mine = tmp_path / f"{runner.RUN_DIR_PREFIX}{os.getpid()}-def"
    old_form, fresh_form = tmp_path / f"{runner.RUN_DIR_PREFIX}zzold", tmp_path / f"{runner.RUN_DIR_PREFIX}zznew"
    for d in (dead, mine, old_form, fresh_form):
        d.mkdir()
    (mine / "owner").write_text(f"{os.getpid()} {runner._process_start(os.getpid())!r}\n")
    (dead / "owner").write_text(f"{gone.pid} 1.0\n")
    os.utime(old_form, (0, 0))
    removed = runner.clean_stale_run_dirs(tmp_path)
    assert sorted(removed) == sorted([str(dead), str(old_form)])
    assert mine.is_dir() and fresh_form.is_dir()


# --- a closed pipe ----------------------------------------------------------------------------------
@pytest.mark.parametrize("args", [("cache", "ls"), ("cache", "ls", "--json"), ("--help",)])
def test_a_closed_stdout_exits_141_without_a_message(tmp_path, args):
    root = big_cache(tmp_path / "c", 400, size=8)
    r, w = os.pipe()
    os.close(r)  # `| head -1` that has already exited: every write fails with EPIPE
    try:
        extra = ("--dir", str(root)) if args[0] == "cache" else ()
        o = cli(*args, *extra, stdout=w, timeout=60)
    finally:
        os.close(w)
    assert o.rc == 141 and o.stderr == "", (o.rc, o.stderr[-2000:])
