"""The torch matrix (tests/matrix.py): a test that touches torch cannot leave it by accident.

.ci/run runs the whole suite under torch 2.13.0 and only `-m torch_matrix` under 2.15.0 and 2.11.0, so a
sensitive test marked wrongly would silently go untested on two of the three torch versions. These
tests hold the rule on synthetic modules, check it against an independent reading of the real ones,
and keep the override table honest."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

from tests import matrix
from tests.import_graph import module_name

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]


def _module(tmp_path: Path, source: str, name: str = "test_synthetic.py") -> Path:
    path = tmp_path / name
    path.write_text(source)
    return path


SENSITIVE = {
    "torch_dynamo": "import torch._dynamo\n\n\ndef test_x():\n    pass\n",
    "lazy_in_function": "def test_x():\n    from torch.fx import symbolic_trace\n",
    "transformers": "from transformers import AutoConfig\n",
    "helper_reaching_torch": "from tests.helpers import invoke\n",  # tests/helpers.py: requires_cuda imports torch
    "project_module": "from compilewatch.tracing import torchcompat\n",
    "project_lazy_name": "from compilewatch import watch\n",  # compilewatch/__init__'s lazy map: tracing.watcher
    "whole_project_package": "import compilewatch\n",
    "cli_runner": "from typer.testing import CliRunner\nfrom cli.main import app\n",
    "python_m_compilewatch": "import subprocess, sys\nsubprocess.run([sys.executable, '-m', 'compilewatch', 'gpus'])\n",
    "torchrun_m_dflash": "cmd = ['torchrun', '--nproc-per-node', '2', '-m', 'dflash', 'train']\n",
    "console_script": "import subprocess\nsubprocess.run(['dflash', 'train', '--help'])\n",
    "python_c": "import subprocess, sys\nsubprocess.run([sys.executable, '-c', 'import sys; import torch'])\n",
    "script_by_path": "from pathlib import Path\nSCRIPT = Path('benchmarks') / 'race_cpu.py'\n",
    "package_by_fstring": "import importlib\ndef test_x(n):\n    importlib.import_module(f'tests.race_programs.{n}')\n",
}

NOT_SENSITIVE = {
    "json_only": "import json\n\n\ndef test_x():\n    assert json.loads('1') == 1\n",
    "pytest_and_hypothesis": "import pytest\nfrom hypothesis import given, strategies as st\n",
    "project_module_without_torch": "from compilewatch.errors import BadInput\n",  # its package runs, not its lazy map
    "string_naming_torch": "NAMES = ('torch', 'transformers')\n",  # a name, not an import
}


@pytest.mark.parametrize("case", sorted(SENSITIVE))
def test_a_module_that_reaches_torch_is_sensitive(tmp_path, case):
    sensitive, why = matrix.classify(_module(tmp_path, SENSITIVE[case]))
    assert sensitive, why
    assert why.split(" -> ")[-1] in matrix.TORCH_PACKAGES, why


@pytest.mark.parametrize("case", sorted(NOT_SENSITIVE))
def test_a_module_that_reaches_no_torch_is_not(tmp_path, case):
    assert matrix.classify(_module(tmp_path, NOT_SENSITIVE[case])) == (False, "reaches no torch import")


def test_a_file_that_does_not_parse_keeps_its_importer_in_the_matrix(tmp_path):
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "__init__.py").write_text("")
    (tmp_path / "tests" / "broken_helper.py").write_text("def half(:\n")
    (tmp_path / "pyproject.toml").write_text("")
    assert matrix.classify(_module(tmp_path / "tests", "from tests.broken_helper import half\n"), root=tmp_path) \
        == (True, f"tests/test_synthetic.py -> tests/broken_helper.py -> {matrix.UNREADABLE}")


def _fake_house(root: Path) -> None:
    """A package with a lazy map, as compilewatch/__init__.py has: `light` imports json, `heavy` torch."""
    (root / "pyproject.toml").write_text('[project.scripts]\ntool = "cli.main:main"\n')
    (root / "cli").mkdir()
    (root / "cli" / "__init__.py").write_text("")
    (root / "cli" / "main.py").write_text("from compilewatch import light\n")
    (root / "compilewatch").mkdir()
    (root / "compilewatch" / "__init__.py").write_text(
        'from compilewatch.light import LIGHT\n_LAZY = {"Heavy": ("compilewatch.heavy", "Heavy")}\n')
    (root / "compilewatch" / "light.py").write_text("import json\nLIGHT = 1\n")
    (root / "compilewatch" / "heavy.py").write_text("import torch\nHeavy = torch.nn.Module\n")
    (root / "tests").mkdir()


@pytest.mark.parametrize("source, sensitive", [
    ("from compilewatch.light import LIGHT\n", False),  # compilewatch/__init__ runs, its lazy names do not load
    ("from compilewatch import LIGHT\n", False),  # a name the package's own code binds
    ("from compilewatch import Heavy\n", True),  # a lazy name: loads compilewatch.heavy
    ("import compilewatch\n", True),  # any attribute may be read: all of the lazy map
    ("from compilewatch import *\n", True),
    ("from compilewatch import heavy\n", True),  # a submodule
    ("import subprocess\nsubprocess.run(['tool', '--help'])\n", False),  # console script -> cli.main -> light
])
def test_lazy_maps_load_only_what_is_asked_for(tmp_path, source, sensitive):
    _fake_house(tmp_path)
    got, why = matrix.classify(_module(tmp_path / "tests", source), root=tmp_path)
    assert got is sensitive, why


def _direct_imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
    return out


def _imports_torch(mods: set[str]) -> bool:
    return any(m == "torch" or m.startswith("torch.") for m in mods)


def test_every_module_importing_torch_or_torch_importing_project_code_is_sensitive():
    """An independent reading, one step deep: a test module whose own import statements name torch, or
    a house module whose own file imports torch, is in the matrix (the full rule goes further)."""
    torch_modules = {module_name(f) for pkg in ("cli", "dflash", "compilewatch")
                     for f in (ROOT / pkg).rglob("*.py") if _imports_torch(_direct_imports(f))}
    assert torch_modules, "no house module imports torch: the reading above is broken"
    missed = []
    for path in matrix.module_files():
        rel = str(path.relative_to(ROOT))
        mods = _direct_imports(path)
        if (_imports_torch(mods) or mods & torch_modules) and rel not in matrix.OVERRIDES \
                and not matrix.classify(path)[0]:
            missed.append(rel)
    assert missed == []


def test_every_collected_test_is_marked_as_its_module_is(request):
    """What conftest's collection hook did to this session's tests agrees with tests/matrix.py."""
    wrong = []
    for item in request.session.items:
        expected = matrix.classify(Path(str(item.path)))[0]
        if (item.get_closest_marker(matrix.MARKER) is not None) is not expected:
            wrong.append(item.nodeid)
    assert wrong == []


def test_overrides_name_test_modules_say_why_and_change_the_verdict():
    for rel, (sensitive, reason) in matrix.OVERRIDES.items():
        path = ROOT / rel
        assert path.is_file() and path.name.startswith("test_"), rel
        assert isinstance(sensitive, bool) and len(reason.split()) >= 8, (rel, reason)
        static = matrix._reach(path.resolve(), ROOT) is not None
        assert static is not sensitive, f"{rel}: the static rule already says {static}; drop the override"


def test_the_marker_is_registered():
    ini = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    assert any(m.split(":")[0] == matrix.MARKER for m in ini["markers"])
