"""Readers of every environment format, on fixtures made with the real tools (tests/fixtures/env/README.md)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from compilewatch.env.formats import detect_format, load_env
from compilewatch.errors import BadInput

FX = Path(__file__).parent / "fixtures" / "env"


def _by_name(env):
    return env.by_name()


@pytest.mark.parametrize("rel, fmt", [
    ("pip-freeze.txt", "requirements"),
    ("requirements-options.txt", "requirements"),
    ("uv-project/uv.lock", "uv.lock"),
    ("uv-project/pylock.toml", "pylock"),
    ("uv-project/requirements.txt", "requirements"),
    ("conda/environment.yml", "conda-yaml"),
    ("conda/explicit.txt", "conda-explicit"),
    ("seeds/old.lock.json", "lock"),
])
def test_detects_each_format(rel, fmt):
    path = FX / rel
    assert detect_format(path, path.read_text()) == fmt
    assert load_env(path).format == fmt


def test_detection_by_content_when_the_name_says_nothing(tmp_path):
    for rel, fmt in [("uv-project/uv.lock", "uv.lock"), ("uv-project/pylock.toml", "pylock"),
                     ("conda/explicit.txt", "conda-explicit"), ("conda/environment.yml", "conda-yaml"),
                     ("seeds/old.lock.json", "lock")]:
        target = tmp_path / f"env-{fmt}.dat"
        shutil.copy(FX / rel, target)
        assert load_env(target).format == fmt, rel


def test_real_pip_freeze_direct_urls_vcs_and_editable():
    pkgs = _by_name(load_env(FX / "pip-freeze.txt"))
    (attn,) = pkgs["attnops"]
    assert attn.version == "1.2.0+cu128"  # from the wheel file name in `@ file://...whl`
    assert attn.source == "/tmp/fx/wheels/attnops-1.2.0+cu128-py3-none-any.whl"  # file:// and #sha256 dropped
    (tool,) = pkgs["localtool"]
    assert tool.source == "git+file:///tmp/fx/localtool@64d5cf9d22b99a42b546572d086dabc9cb224e2a"
    (kern,) = pkgs["tinykernels"]  # "-e /tmp/fx/tinykernels" under "# Editable install ... (tinykernels==0.3.1)"
    assert (kern.editable, kern.version, kern.source) == (True, "0.3.1", "/tmp/fx/tinykernels")
    assert pkgs["typing-extensions"][0].version == "4.16.0"  # names canonicalized


def test_real_freeze_keeps_torch_local_label_and_editable_project():
    pkgs = _by_name(load_env(FX / "pip-freeze-torch-cpu.txt"))
    assert pkgs["torch"][0].version == "2.13.0+cpu"
    assert pkgs["compilewatch"][0].editable


def test_requirements_options_markers_hashes_and_urls():
    env = load_env(FX / "requirements-options.txt")
    pkgs = _by_name(env)
    assert sorted(p.version for p in pkgs["torch"]) == ["2.11.0", "2.11.0+cu128"]
    assert {p.marker for p in pkgs["torch"]} == {'sys_platform == "linux"', 'sys_platform == "darwin"'}
    assert pkgs["flash-attn"][0].version.startswith("2.8.3+cu12torch2.8")  # %2B decoded
    assert pkgs["numpy"][0].version is None and pkgs["numpy"][0].spec == "<3,>=1.26"
    assert pkgs["wandb"][0].version == "0.23.1"  # continuation line with --hash
    assert pkgs["dflash-kernels"][0].editable  # -e git+...#egg=dflash-kernels
    assert pkgs["httpcore"][0].version == "1.0.9"  # bare wheel URL
    assert pkgs["transformers"][0].version == "5.6.0"
    assert any("-r requirements-dev.txt is not followed" in n for n in env.notes)
    assert any("-c constraints.txt" in n for n in env.notes)


def test_uv_lock_export_and_pylock_agree():
    """Three files uv wrote for one project name the same packages and versions."""
    lock = load_env(FX / "uv-project/uv.lock")
    pylock = load_env(FX / "uv-project/pylock.toml")
    reqs = load_env(FX / "uv-project/requirements.txt")

    def pairs(env):
        return {(p.name, p.version) for p in env.packages}

    assert pairs(pylock) == pairs(reqs)
    assert pairs(lock) - {("drafter-train", "0.1.0")} == pairs(pylock)
    # one name, several versions (split by python_full_version markers)
    assert sorted(p.version for p in _by_name(lock)["networkx"]) == ["3.6.1", "3.7"]
    assert _by_name(lock)["drafter-train"][0].source == "."  # the virtual root project


def test_pylock_with_pytorch_index_wheel(tmp_path):
    """A +cu128 wheel from PyTorch's index: the `+` is `%2B` in the URL (packaging >= 26.4 reads it)."""
    f = tmp_path / "pylock.toml"
    f.write_text('lock-version = "1.0"\ncreated-by = "uv"\n\n[[packages]]\nname = "torch"\nversion = "2.11.0+cu128"\n'
                 'index = "https://download.pytorch.org/whl/cu128"\nwheels = [{ url = "https://download.pytorch.org/'
                 'whl/cu128/torch-2.11.0%2Bcu128-cp312-cp312-manylinux_2_28_x86_64.whl", hashes = { sha256 = "'
                 + "ab" * 32 + '" } }]\n')
    (torch,) = load_env(f).packages
    assert (torch.version, torch.source) == ("2.11.0+cu128", "https://download.pytorch.org/whl/cu128")


@pytest.mark.parametrize("fmt", ["uv.lock", "pylock.toml", "requirements.txt"])
def test_uv_sources_git_path_and_editable_read_alike(fmt):
    """uv lock / uv export of a project with a git, a local-wheel and an editable dependency."""
    pkgs = _by_name(load_env(FX / "uv-sources" / fmt))
    assert pkgs["localtool"][0].source == "git+file:///tmp/fx/localtool@64d5cf9d22b99a42b546572d086dabc9cb224e2a"
    assert pkgs["attnops"][0].source == "/tmp/fx/wheels/attnops-1.2.0+cu128-py3-none-any.whl"
    assert pkgs["attnops"][0].version == "1.2.0+cu128"
    assert (pkgs["tinykernels"][0].source, pkgs["tinykernels"][0].editable) == ("tinykernels", True)
    assert pkgs["packaging"][0].version == "26.4" and pkgs["packaging"][0].source is None


def test_uv_lock_keeps_every_torch_by_version_and_source():
    torch = _by_name(load_env(FX / "uv-multi-source/uv.lock"))["torch"]
    assert sorted((p.version, p.source) for p in torch) == [
        ("2.11.0", None),
        ("2.11.0+cpu", "https://download.pytorch.org/whl/cpu"),
        ("2.11.0+cu128", "https://download.pytorch.org/whl/cu128"),
    ]


def test_conda_environment_yml():
    env = load_env(FX / "conda/environment.yml")
    pkgs = _by_name(env)
    assert env.python == "3.12.7"
    assert "python" not in pkgs
    (torch,) = pkgs["torch"]  # conda's "pytorch"
    assert (torch.version, torch.build) == ("2.5.1", "py3.12_cuda12.4_cudnn9.1.0_0")
    assert pkgs["pytorch-cuda"][0].version == "12.4"
    assert pkgs["transformers"][0].version == "4.46.3"  # from the pip: section
    assert pkgs["flash-attn"][0].version.startswith("2.7.0.post2+cu12torch2.5")


def test_conda_explicit():
    env = load_env(FX / "conda/explicit.txt")
    pkgs = _by_name(env)
    assert env.python == "3.12.7"
    assert pkgs["torch"][0].build == "py3.12_cuda12.4_cudnn9.1.0_0"
    assert pkgs["triton"][0].version == "3.1.0"
    new = _by_name(load_env(FX / "conda/explicit-new.txt"))
    assert (new["torch"][0].version, new["torch"][0].build) == ("2.7.1", "cuda128_mkl_py312_h30b5a27_300")


def test_lock_file_as_a_side():
    env = load_env(FX / "seeds/old.lock.json")
    assert env.python == "3.12.3"
    assert env.lock is not None and env.lock.torch.version == "2.11.0+cu128"
    assert _by_name(env)["transformers"][0].version == "5.6.0"


@pytest.mark.parametrize("rel, where, words, kept", [
    ("freeze-bad-requirement.txt", "freeze-bad-requirement.txt:3:", "not a requirement", {"packaging", "rich", "typer"}),
    ("requirements-unknown-option.txt", "requirements-unknown-option.txt:4:", "unknown option '--frobnicate'",
     {"torch"}),
])
def test_invalid_requirement_lines_are_skipped_with_a_note(rel, where, words, kept):
    """A line pip would reject is a note naming file:line; the rest of the file is still read."""
    env = load_env(FX / "malformed" / rel)
    assert {p.name for p in env.packages} == kept
    assert any(where in n and words in n for n in env.notes), env.notes


def test_a_file_without_one_requirement_is_bad_input(tmp_path):
    f = tmp_path / "notes.txt"
    f.write_text("this is not\na requirements file !!\n")
    with pytest.raises(BadInput, match=r"notes.txt:1: not a requirement"):
        load_env(f)


@pytest.mark.parametrize("rel, where, words", [
    ("uv.lock", "uv.lock:8:", "invalid TOML"),
    ("uv-missing-name.lock", "uv-missing-name.lock:9:", "[[package]] #2 has no name"),
    ("pylock.toml", "pylock.toml:11:", "packages[1].name"),
    ("pylock.syntax.toml", "pylock.syntax.toml:3:", "invalid TOML"),
    ("environment.yml", "environment.yml:5:", "invalid YAML"),
    ("environment-no-deps.yml", "environment-no-deps.yml:1:", "dependencies"),
    ("conda-explicit.txt", "conda-explicit.txt:4:", "not a conda package URL"),
    ("lock-truncated.json", "lock-truncated.json:", "invalid JSON"),
    ("lock-newer-schema.json", "lock-newer-schema.json:", "schema version 99"),
    ("lock-missing-python.json", "lock-missing-python.json:", "missing the field 'python'"),
])
def test_malformed_files_name_file_and_line(rel, where, words):
    with pytest.raises(BadInput) as info:
        load_env(FX / "malformed" / rel)
    assert where in info.value.message
    assert words in info.value.message


def test_name_at_url_without_spaces(tmp_path):
    f = tmp_path / "r.txt"
    f.write_text("attnops@ file:///w/attnops-1.2.0-py3-none-any.whl\ngit+https://github.com/x/k.git@v1#egg=kernels\n")
    pkgs = _by_name(load_env(f))
    assert (pkgs["attnops"][0].version, pkgs["attnops"][0].source) == ("1.2.0", "/w/attnops-1.2.0-py3-none-any.whl")
    assert pkgs["kernels"][0].source == "git+https://github.com/x/k.git@v1"


def test_format_override_and_unknown_format(tmp_path):
    with pytest.raises(BadInput, match="unknown format"):
        load_env(FX / "pip-freeze.txt", "poetry")
    with pytest.raises(BadInput, match="invalid TOML"):
        load_env(FX / "pip-freeze.txt", "pylock")
    assert load_env(FX / "pip-freeze.txt", "freeze").format == "requirements"  # alias


def test_missing_file_and_directory(tmp_path):
    with pytest.raises(BadInput, match="no such file"):
        load_env(tmp_path / "nope.txt")
    with pytest.raises(BadInput, match="is a directory"):
        load_env(tmp_path)
