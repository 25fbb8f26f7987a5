"""Versions in a lock are versions (session 16): `python.version: "abc"` was read as an upgrade of Python
(a critical change, exit 1) and an empty torch version as an upgrade to "v"; a damaged or edited lock is
bad input (exit 2, the field named), and every lock this machine writes is read back."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cli.main import app
from compilewatch.env import lock as envlock
from compilewatch.errors import BadInput
from tests.helpers import invoke

SEEDS = Path(__file__).parent / "fixtures" / "env" / "seeds"


def _seed() -> dict:
    return json.loads((SEEDS / "old.lock.json").read_text())


@pytest.mark.parametrize("field, value, named", [
    ("python.version", "abc", "python.version"),
    ("python.version", "", "python.version"),
    ("python.version", "3", "python.version"),
    ("python.version", "3.12.3 ; rm -rf", "python.version"),
    ("torch.version", "", "torch.version"),
    ("torch.version", "2.13 beta", "torch.version"),
    ("distributions.0.version", "", "distributions[0].version"),
    ("distributions.0.version", "1.0\n2.0", "distributions[0].version"),
    ("distributions.0.version", "9" * 201, "distributions[0].version"),
])
def test_a_lock_whose_version_is_not_one_is_bad_input_naming_the_field(tmp_path, field, value, named):
    data = _seed()
    *path, last = field.split(".")
    at = data
    for k in path:
        at = at[int(k)] if k.isdigit() else at[k]
    at[int(last) if last.isdigit() else last] = value
    bad = tmp_path / "bad.lock.json"
    bad.write_text(json.dumps(data))
    with pytest.raises(BadInput, match=named.replace("[", r"\[").replace("]", r"\]")):
        envlock.load_lock(bad)
    r = invoke(app, ["diff-env", str(SEEDS / "old.lock.json"), str(bad)])
    assert r.exit_code == 2, r.output
    assert named in r.output and "Traceback" not in r.output
    assert "compilewatch lock -o" in r.output  # what to do


@pytest.mark.parametrize("version", ["3.12.3", "3.14.0rc1", "3.11.7+", "3.13.0b2+", "3.10"])
def test_real_python_version_spellings_are_read(tmp_path, version):
    data = _seed()
    data["python"]["version"] = version
    p = tmp_path / "ok.lock.json"
    p.write_text(json.dumps(data))
    assert envlock.load_lock(p).python.version == version


@pytest.mark.parametrize("version", ["1.0.0-SNAPSHOT", "0.1.dev0+g1234.d20200101", "2019.3", "1.2.3~rc1", "unknown"])
def test_legacy_distribution_versions_are_read(tmp_path, version):
    data = _seed()
    data["distributions"][0]["version"] = version
    p = tmp_path / "ok.lock.json"
    p.write_text(json.dumps(data))
    assert envlock.load_lock(p).distributions[0].version == version


def test_this_machines_lock_reads_back(tmp_path):
    """What `lock` writes here (every installed distribution, this Python) passes the reader's checks."""
    lock = envlock.snapshot(with_gpus=False)
    p = tmp_path / "here.lock.json"
    r = invoke(app, ["lock", "-o", str(p)])
    assert r.exit_code == 0, r.output
    assert envlock.load_lock(p).python.version == lock.python.version


def test_the_writer_skips_a_distribution_the_reader_would_refuse(tmp_path):
    site = tmp_path / "site"
    for name, version in (("good-pkg", "1.0"), ("bad-pkg", "1.0\x07")):
        info = site / f"{name.replace('-', '_')}-1.0.dist-info"
        info.mkdir(parents=True)
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    notes: list[str] = []
    got = envlock.scan_distributions([str(site)], notes)
    assert [d.name for d in got] == ["good-pkg"]
    assert any("bad-pkg" in n or "1.0\\x07" in n for n in notes), notes
