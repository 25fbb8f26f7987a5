"""lock / diff-env / doctor, red-teamed (session 14): where `lock -o` writes, hostile lock files, the
environment variables that matter most, and inductor cache dirs torch cannot use."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from cli.main import app
from compilewatch.errors import BadInput
from tests.helpers import invoke

SEEDS = Path(__file__).parent / "fixtures" / "env" / "seeds"


@pytest.fixture
def fixture_lock(monkeypatch, tmp_path):
    """`lock` without collecting anything (the 8-GPU seed lock), with a private inductor cache dir."""
    from compilewatch.env import lock as envlock

    fixture = envlock.load_lock(SEEDS / "old.lock.json")
    monkeypatch.setattr("cli.env.envlock.snapshot", lambda **kw: fixture)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    return fixture


# --- lock -o -------------------------------------------------------------------------------------


def test_lock_o_refuses_a_device_or_fifo_instead_of_replacing_it(fixture_lock, tmp_path):
    from cli.env import _lock_target

    # as root, the atomic rename replaced /dev/null with a regular file; only the check runs here
    with pytest.raises(BadInput, match="character device"):
        _lock_target(Path("/dev/null"))
    fifo = tmp_path / "env.lock.json"
    os.mkfifo(fifo)
    r = invoke(app, ["lock", "-o", str(fifo)])
    assert r.exit_code == 2 and "is a FIFO" in r.stderr and "lock --json >" in r.stderr
    assert "Traceback" not in r.stderr
    assert fifo.is_fifo()  # still the user's FIFO


def test_lock_o_writes_through_a_symlink_and_refuses_a_loop(fixture_lock, tmp_path):
    real = tmp_path / "locks" / "2026.lock.json"
    real.parent.mkdir()
    real.write_text("old")
    link = tmp_path / "current.lock.json"
    link.symlink_to(real)
    r = invoke(app, ["lock", "-o", str(link)])
    assert r.exit_code == 0, r.stderr
    assert link.is_symlink() and json.loads(real.read_text())["schema"] == "compilewatch.lock"
    loop = tmp_path / "loop.json"
    loop.symlink_to(loop)
    r = invoke(app, ["lock", "-o", str(loop)])
    assert r.exit_code == 2 and "symlink loop" in r.stderr
    assert loop.is_symlink()


def test_lock_o_refuses_to_write_inside_the_inductor_cache(fixture_lock, tmp_path):
    cache = tmp_path / "inductor"
    (cache / "fxgraph").mkdir(parents=True)
    r = invoke(app, ["lock", "-o", str(cache / "fxgraph" / "env.lock.json")])
    assert r.exit_code == 2 and "would be written inside the cache it describes" in " ".join(r.stderr.split())
    assert list((cache / "fxgraph").iterdir()) == []
    ok = invoke(app, ["lock", "-o", str(tmp_path / "inductor.lock.json")])  # beside it, a name that shares the prefix
    assert ok.exit_code == 0, ok.stderr


# --- hostile lock files ----------------------------------------------------------------------------


def _seed() -> dict:
    return json.loads((SEEDS / "old.lock.json").read_text())


def _write(tmp_path: Path, name: str, data: dict | str) -> Path:
    p = tmp_path / name
    p.write_text(data if isinstance(data, str) else json.dumps(data))
    return p


def test_diff_env_refuses_a_lock_with_a_duplicate_key(tmp_path):
    text = json.dumps(_seed())
    dup = _write(tmp_path, "dup.lock.json", text[:-1] + ', "torch": {"version": "2.99.0", "cuda": null}}')
    r = invoke(app, ["diff-env", str(SEEDS / "old.lock.json"), str(dup)])
    assert r.exit_code == 2 and "the key 'torch' appears twice" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize("field, value", [("files", -1), ("bytes", 10**400)])
def test_diff_env_refuses_counts_out_of_range(tmp_path, field, value):
    data = _seed()
    data["inductor"]["cache"][field] = value  # -1 read as "the cache is gone"; 10**400 raised OverflowError
    bad = _write(tmp_path, "bad.lock.json", data)
    for args in ([str(SEEDS / "old.lock.json"), str(bad)], [str(bad), str(SEEDS / "new.lock.json")]):
        r = invoke(app, ["diff-env", *args])
        assert r.exit_code == 2, r.stdout
        assert f"inductor.cache.{field}: expected a count" in r.stderr and "Traceback" not in r.stderr


def _env_diff(tmp_path, old_env: dict, new_env: dict, **both):
    old, new = _seed(), _seed()
    old["env"], new["env"] = old_env, new_env
    old.update(both)
    new.update(both)
    r = invoke(app, ["diff-env", str(_write(tmp_path, "o.lock.json", old)), str(_write(tmp_path, "n.lock.json", new)),
                     "--json"])
    return r.exit_code, json.loads(r.stdout)["changes"]


@pytest.mark.parametrize("name, value", [("TORCHINDUCTOR_FX_GRAPH_CACHE", "0"),
                                         ("TORCHINDUCTOR_FORCE_DISABLE_CACHES", "1"),
                                         ("TORCH_COMPILE_DISABLE", "1")])
def test_diff_env_a_variable_that_turns_caches_or_compile_off_is_critical(tmp_path, name, value):
    code, changes = _env_diff(tmp_path, {}, {name: value})
    assert code == 1
    assert changes[0]["subject"] == f"env {name}" and changes[0]["severity"] == "critical"
    assert "compiles from scratch" in changes[0]["consequence"] or "runs eagerly" in changes[0]["consequence"]
    code, changes = _env_diff(tmp_path, {}, {name: "1" if value == "0" else "0"})  # the default: a risk only
    assert code == 0 and changes[0]["severity"] == "warning"


def test_diff_env_cuda_visible_devices_hiding_every_gpu_is_critical_else_a_risk(tmp_path):
    for hidden in ("", "-1", "garbage"):
        code, changes = _env_diff(tmp_path, {}, {"CUDA_VISIBLE_DEVICES": hidden})
        assert code == 1 and changes[0]["subject"] == "env CUDA_VISIBLE_DEVICES", hidden
        assert changes[0]["severity"] == "critical" and "leaves torch no GPU" in changes[0]["consequence"]
    code, changes = _env_diff(tmp_path, {"CUDA_VISIBLE_DEVICES": "0,1"}, {"CUDA_VISIBLE_DEVICES": "1,0"})
    assert code == 0 and changes[0]["severity"] == "warning"  # was info: "not compile configuration"
    assert "cuda:N" in changes[0]["consequence"]
    # no GPU on either side: hiding none is a risk, not a finding
    code, changes = _env_diff(tmp_path, {}, {"CUDA_VISIBLE_DEVICES": ""}, gpus=[])
    assert [c["severity"] for c in changes if c["subject"] == "env CUDA_VISIBLE_DEVICES"] == ["warning"]


def test_diff_env_torch_dynamo_variables_are_compile_configuration(tmp_path):
    code, changes = _env_diff(tmp_path, {}, {"TORCH_DYNAMO_AUTOMATIC_DYNAMIC_SHAPES": "0"})
    assert changes[0]["severity"] == "warning" and "compile configuration" in changes[0]["consequence"]


# --- inductor cache dirs torch cannot use (doctor, warm, probe) --------------------------------------


@pytest.mark.parametrize("kind, said", [("dangling", "dangling symlink"), ("loop", "symlink loop"),
                                        ("fifo", "is a FIFO"), ("file", "is a file")])
def test_cache_dir_check_names_what_the_path_is(monkeypatch, tmp_path, kind, said):
    from compilewatch.torchinfo import check_cache_dir_usable

    p = tmp_path / "cache"
    if kind == "dangling":
        p.symlink_to(tmp_path / "nowhere")
    elif kind == "loop":
        p.symlink_to(p)
    elif kind == "fifo":
        os.mkfifo(p)
    else:
        p.write_text("")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(p))
    with pytest.raises(BadInput, match=said):  # was "is a file" for every one of them
        check_cache_dir_usable()
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(p / "sub"))
    with pytest.raises(BadInput, match="lies under"):
        check_cache_dir_usable()


def test_cache_dir_that_cannot_be_created_is_bad_input_not_a_traceback(monkeypatch, tmp_path):
    from compilewatch import torchinfo

    parent = tmp_path / "readonly"
    parent.mkdir()
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(parent / "cache"))
    real_access = os.access
    monkeypatch.setattr(torchinfo.os, "access", lambda p, mode: False if Path(p) == parent else real_access(p, mode))
    with pytest.raises(BadInput, match="cannot be created"):  # torch's os.makedirs raised inside `import torch._dynamo`
        torchinfo.check_cache_dir_usable()
    (parent / "cache").mkdir()
    torchinfo.check_cache_dir_usable()  # exists: doctor's verdict says it is not writable


def test_doctor_an_unwritable_cache_is_a_problem(monkeypatch, tmp_path):
    from compilewatch import doctor

    cache = tmp_path / "cache"
    cache.mkdir()
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(cache))
    monkeypatch.setattr(doctor.os, "access", lambda p, mode: False)
    st = doctor.cache_status()
    assert st.exists and st.writable is False
    env = doctor.EnvFacts("3.11.7", "Linux x86_64", "2.13.0+cpu", None, None, None, None, False, 0, {})
    gpus = doctor.GpuSummary(False, "no driver", None, (), ())
    fx = doctor.FxFacts(True, False, True, None, layout="global")
    dyn = doctor.DynamoLimits(8, 256, False, True, True)
    problems = [v for v in doctor._verdicts(env, st, gpus, fx, dyn) if v.level == "problem"]
    assert len(problems) == 1 and "not writable" in problems[0].message


def test_diff_env_a_pytorch_runtime_variable_is_not_called_compile_configuration(tmp_path):
    """PYTORCH_CUDA_ALLOC_CONF was reported as 'compile configuration ... part of the FX-graph cache key'."""
    from compilewatch.env.diff import _env_change

    sev, why = _env_change("PYTORCH_CUDA_ALLOC_CONF", None, "expandable_segments:True", None, None)
    assert sev == "warning" and "runtime setting" in why and "not part of any cache key" in why
    sev, why = _env_change("TORCHINDUCTOR_MAX_AUTOTUNE", None, "1", None, None)
    assert sev == "warning" and "FX-graph cache key" in why
