"""doctor: JSON schema, problem verdicts (stuck FX flag, foreign cache key, GPU imbalance) exit 1."""

from __future__ import annotations

import dataclasses
import os

import pytest

from cli.main import app
from compilewatch import doctor, torchinfo
from compilewatch.devices import gpus
from compilewatch.tracing import torchcompat
from tests.helpers import invoke, invoke_json
from tests.test_gpus import fake_nvml, no_driver, seeds_drafters


@pytest.fixture(autouse=True)
def _no_gpu(monkeypatch):
    monkeypatch.setattr(gpus, "_initialized", False)
    no_driver(monkeypatch)


def test_cache_dir_and_source_come_from_the_cache_layout(monkeypatch, tmp_path):
    """One rule for "where the cache is and why" (compilewatch.cache.layout.default_root): `cache
    where` judges by the environment now; doctor by the variables as they were before torch set
    TORCHINDUCTOR_CACHE_DIR itself."""
    from compilewatch.cache.local import layout

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "c"))
    assert layout.default_root() == (tmp_path / "c", "TORCHINDUCTOR_CACHE_DIR")
    assert layout.locate().source == "TORCHINDUCTOR_CACHE_DIR"
    assert layout.default_root({}) == (tmp_path / "c", "default")  # set by torch, not by the user
    st = doctor.cache_status({})
    assert (st.path, st.source) == (str(tmp_path / "c"), "default")


def test_doctor_json_on_a_clean_cpu_machine():
    data = invoke_json(app, ["doctor"])
    assert set(data) == {"env", "cache", "gpus", "fx", "dynamo", "verdicts", "ok", "remote"}
    assert data["ok"] is True
    assert data["env"]["torch"].startswith("2.")
    # conftest points TORCHINDUCTOR_CACHE_DIR at tmp_path: doctor says where it came from
    assert data["cache"]["source"] == "TORCHINDUCTOR_CACHE_DIR"
    assert data["cache"]["path"] == os.environ["TORCHINDUCTOR_CACHE_DIR"]
    assert data["cache"]["system_key"] == torchinfo.system_key()
    assert data["gpus"]["available"] is False
    layout = torchcompat.fx_flag_layout().kind
    assert data["fx"]["layout"] == layout and data["fx"]["global_flag"] is (layout == "global")
    assert data["fx"]["flag_now"] is False and data["fx"]["stuck"] is False
    assert data["dynamo"]["recompile_limit"] >= 1
    levels = {v["level"] for v in data["verdicts"]}
    assert "problem" not in levels
    fx = [v for v in data["verdicts"] if v["topic"] == "fx-flag"]
    warn = [v for v in fx if v["level"] == "warn"]  # the class-level nn.Module patch: not fixed on any torch yet
    assert warn and "compilewatch warm" in warn[0]["advice"]
    assert any("not fixed in torch" in v["message"] and "nn.Module.__call__" in v["message"] for v in warn)


def test_config_per_thread_is_measured():
    import torch

    per_thread = doctor.dynamo_limits().config_per_thread
    major, minor = (int(x) for x in torch.__version__.split(".")[:2])
    if (major, minor) >= (2, 12):
        assert per_thread is True  # torch/_dynamo/config: ContextVar-backed (per thread) since 2.12


def test_stuck_fx_flag_is_a_problem():
    torchcompat.set_fx_flag(True)  # this thread's flag where torch keeps it per thread; conftest resets it
    result = invoke(app, ["doctor"])
    assert result.exit_code == 1
    assert "stuck" in result.stdout


def test_cache_system_key(tmp_path):
    root = torchinfo.inductor_cache_dir()
    (root / "cache").mkdir(parents=True)
    (root / "cache" / ("ab" * 32)).write_text("{}")
    st = doctor.cache_status()
    assert st.exists and st.files == 1 and st.system_key_match is False
    data = invoke_json(app, ["doctor"], expect_code=1)
    assert any(v["level"] == "problem" and "other system key" in v["message"] for v in data["verdicts"])
    (root / "cache" / torchinfo.system_key()).write_text("{}")
    assert doctor.cache_status().system_key_match is True
    data = invoke_json(app, ["doctor"])  # entries for this key exist: the others are dead weight, not a problem
    assert any(v["level"] == "info" and "never hit here" in v["message"] for v in data["verdicts"])


def test_gpu_imbalance_is_a_problem(monkeypatch):
    fake_nvml(monkeypatch, seeds_drafters(os.getpid()))
    data = invoke_json(app, ["doctor"], expect_code=1)
    assert data["gpus"]["available"] and len(data["gpus"]["gpus"]) == 3
    assert any(v["topic"] == "gpus" and v["level"] == "problem" and "GPU 0 uses 40.0 GB" in v["message"]
               for v in data["verdicts"])


@pytest.mark.parametrize("layout", ["global", "thread_local"])
def test_verdicts_say_what_this_torch_fixed_and_what_not(layout, monkeypatch):
    """doctor's race verdicts follow the probed layout (simulated here, so both columns are checked on any torch)."""
    monkeypatch.setattr(torchcompat, "fx_flag_layout", lambda: torchcompat.FlagLayout(layout, "simulated"))
    fx = doctor.FxFacts(layout == "global", False, True, False, layout=layout, race=torchcompat.race_facts())
    verdicts = doctor._verdicts(doctor.env_facts(), doctor.cache_status(), doctor.gpu_summary(), fx,
                                doctor.dynamo_limits())
    fx = {(v.level, v.message.split(": ", 1)[1]) for v in verdicts if v.topic == "fx-flag"}
    flag = ("ok", torchcompat.FLAG_FIXED) if layout == "thread_local" else ("warn", torchcompat.FLAG_NOT_FIXED)
    assert flag in fx and ("warn", torchcompat.PATCH_NOT_FIXED) in fx and ("warn", torchcompat.PATCHER_NOT_FIXED) in fx


def test_doctor_on_an_unrecognised_torch_does_not_raise(monkeypatch):
    monkeypatch.setattr(torchcompat, "fx_flag_layout", lambda: torchcompat.FlagLayout("unknown", "simulated layout"))
    data = invoke_json(app, ["doctor"])
    assert data["fx"]["layout"] == "unknown" and data["fx"]["flag_now"] is None
    assert any(v["level"] == "warn" and "simulated layout" in v["message"] for v in data["verdicts"])


def test_recompile_limit_warns_when_gpus_reach_it():
    env = dataclasses.replace(doctor.env_facts(), device_count=8)
    limits = dataclasses.replace(doctor.dynamo_limits(), recompile_limit=8)
    verdicts = doctor._verdicts(env, doctor.cache_status(), doctor.gpu_summary(), doctor.fx_facts(), limits)
    (v,) = [v for v in verdicts if v.topic == "dynamo"]
    assert v.level == "warn" and "8 GPUs" in v.message
