"""The torch-touch record (tests/touch.py): a module that did anything with torch under one torch stays
in the matrix; only a module that ran no torch code, read no torch file and started no process leaves it.

A pytest run in a child process on synthetic test modules, with a conftest that registers the recorder,
as tests/conftest.py does under COMPILEWATCH_MATRIX_RECORD. Version-sensitive itself (what is a Python
frame of torch and what a C function differs by release), so it runs under every torch of the matrix."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests import matrix, touch

ROOT = Path(__file__).resolve().parents[1]

CONFTEST = """
import os
from pathlib import Path

import pytest

from tests import matrix, touch


def pytest_configure(config):
    root = Path(__file__).resolve().parents[1]
    config.pluginmanager.register(touch.Recorder(root, Path(os.environ["SYNTHETIC_RECORD"]), matrix.TORCH_PACKAGES))


@pytest.fixture(autouse=True)
def _seeded():
    import torch  # as the real conftest does around every test: not the test's touch

    torch.manual_seed(0)
    yield
    torch.manual_seed(0)


@pytest.fixture(scope="session")
def shared_path(tmp_path_factory):
    return tmp_path_factory.mktemp("shared")
"""

MODULES = {  # name: (source, expected reason's start, or None: nothing done with torch)
    "test_pure": ("def test_a():\n    assert 'x'.upper() == 'X'\n", None),
    "test_import_only_at_collection": ("import torch\n\n\ndef test_a():\n    assert 1 + 1 == 2\n", None),
    "test_git_only": ("import subprocess\n\n\ndef test_a():\n    subprocess.run(['git', '--version'], capture_output=True)\n",
                      None),
    "test_torch_python": ("import torch\n\n\ndef test_a():\n    torch.nn.Identity()\n", "ran torch/"),
    "test_torch_c": ("import torch\n\n\ndef test_a():\n    assert torch.ones(2).sum().item() == 2\n", "called torch"),
    "test_torch_in_a_thread": ("import threading\nimport torch\n\n\ndef test_a():\n"
                               "    t = threading.Thread(target=lambda: torch.ones(2).sum())\n    t.start()\n    t.join()\n",
                               "called torch"),
    "test_torch_in_a_fixture": ("import pytest\nimport torch\n\n\n@pytest.fixture(scope='module')\ndef big():\n"
                                "    return torch.zeros(3).tolist()\n\n\ndef test_a(big):\n    assert big == [0.0] * 3\n",
                                "called torch"),
    "test_reads_torch_source": ("import torch\n\n\ndef test_a():\n    with open(torch.__file__) as f:\n        f.read(10)\n",
                                "opened torch/"),
    "test_reads_torch_metadata": ("from importlib.metadata import version\n\n\ndef test_a():\n    version('torch')\n",
                                  "opened torch-"),
    "test_spawns_python": ("import subprocess, sys\n\n\ndef test_a():\n    subprocess.run([sys.executable, '-c', 'pass'])\n",
                           "started a process"),
    "test_skips": ("import pytest\n\n\ndef test_a():\n    pytest.skip('not here')\n", "a test was skipped"),
    "test_shared_fixture": ("def test_a(shared_path):\n    assert shared_path.is_dir()\n", "uses the shared fixture shared_path"),
}


@pytest.fixture(scope="module")
def record(tmp_path_factory) -> dict:
    base = tmp_path_factory.mktemp("touch")
    (base / "tests").mkdir()
    (base / "tests" / "conftest.py").write_text(CONFTEST)
    for name, (source, _) in MODULES.items():
        (base / "tests" / f"{name}.py").write_text(source)
    out = base / "record"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "SYNTHETIC_RECORD": str(out)}
    env.pop(touch.RECORD_ENV, None)
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:xdist", "-p", "no:cacheprovider",
                        str(base / "tests")], cwd=base, env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    (f,) = out.glob("*.json")  # one process: one file
    assert json.loads(f.read_text())["modules"] == touch.load(out)
    return touch.load(out)


@pytest.mark.parametrize("name", sorted(MODULES))
def test_each_kind_of_touch_is_recorded_and_nothing_else(record, name):
    expected = MODULES[name][1]
    got = record[f"tests/{name}.py"]
    if expected is None:
        assert got is None, got
    else:
        assert got is not None and got.startswith(expected), got


def test_a_recorded_module_that_did_nothing_leaves_the_matrix_and_every_other_stays():
    record = {"tests/test_a.py": None, "tests/test_b.py": "called torch.ones"}
    assert not touch.in_matrix("tests/test_a.py", True, record)
    assert touch.in_matrix("tests/test_b.py", True, record)
    assert touch.in_matrix("tests/test_new.py", True, record)  # not recorded: a new module stays
    assert not touch.in_matrix("tests/test_b.py", False, record)  # the static rule's "no torch" stands
    assert touch.in_matrix("tests/test_a.py", True, {})  # no record at all: the static rule


def test_a_mark_from_any_process_wins_when_records_merge(tmp_path):
    (tmp_path / "gw0-1.json").write_text(json.dumps({"modules": {"tests/test_a.py": None, "tests/test_b.py": None}}))
    (tmp_path / "gw1-2.json").write_text(json.dumps({"modules": {"tests/test_a.py": "started a process (x)"}}))
    assert touch.load(tmp_path) == {"tests/test_a.py": "started a process (x)", "tests/test_b.py": None}
    assert touch.load(tmp_path / "missing") == {} and touch.load(None) == {}


def test_the_recorder_never_breaks_an_audited_call(tmp_path):
    """Audit hooks cannot be removed and an exception in one fails the audited call: the recorder's
    hook swallows its own errors (here: a path it cannot decode)."""
    rec = touch.Recorder(ROOT, tmp_path, matrix.TORCH_PACKAGES, audit=False)  # called by hand below
    rec.current = "tests/test_x.py"
    rec._audit("open", (object(), "r", 0))  # not a path: not a mark, no error
    rec._audit("open", (b"\xff/x", "r", 0))
    assert rec.verdicts == {}
    rec._audit("subprocess.Popen", (None, None, None, None))  # no program to name: still a process
    rec._audit("os.posix_spawn", ("/usr/bin/git", ["git"], {}))
    assert rec.verdicts == {"tests/test_x.py": "started a process (subprocess.Popen): the recorder cannot see into it"}
    rec.verdicts.clear()
    rec._audit("os.posix_spawn", ("/usr/bin/git", ["git"], {}))
    rec._audit("os.exec", ("/usr/bin/redis-server", ["redis-server"], {}))
    assert rec.verdicts == {}


def test_the_matrix_marker_of_this_session_follows_its_record(request):
    """What conftest's collection hook did agrees with touch.in_matrix over this session's record."""
    record = touch.load(os.environ.get(touch.FROM_ENV))
    wrong = []
    for item in request.session.items:
        rel = str(Path(str(item.path)).resolve().relative_to(ROOT))
        expected = touch.in_matrix(rel, matrix.classify(Path(str(item.path)))[0], record)
        if (item.get_closest_marker(matrix.MARKER) is not None) is not expected:
            wrong.append(item.nodeid)
    assert wrong == []


def test_ci_records_in_its_first_phase_and_reads_the_record_in_the_matrix_phases():
    ci = (ROOT / ".ci" / "run").read_text()
    assert f"export {touch.RECORD_ENV}=" in ci and f"{touch.FROM_ENV}=" in ci
    readme_cmd = textwrap.dedent(ci.split("# --- README quick start")[1]).splitlines()[1]
    assert "pytest" in readme_cmd and touch.RECORD_ENV not in readme_cmd  # the README's command stays verbatim
