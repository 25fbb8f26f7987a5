"""The lock snapshot: distributions with direct-URL facts, torch facts, GPUs through NVML, secrets."""

from __future__ import annotations

import json
import sys
import types

import pytest

from compilewatch.env import lock as envlock
from compilewatch.env.lock import lock_from_dict, parse_lock, snapshot
from compilewatch.serialize import to_jsonable


def _dist(site, name, version, direct_url=None):
    d = site / f"{name.replace('-', '_')}-{version}.dist-info"
    d.mkdir(parents=True)
    (d / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    if direct_url is not None:
        (d / "direct_url.json").write_text(json.dumps(direct_url))


def test_distributions_with_direct_url_facts_and_shadowing(tmp_path):
    first, second = tmp_path / "a", tmp_path / "b"
    _dist(first, "torch", "2.11.0+cu130")
    _dist(first, "localtool", "0.3.1", {"url": "https://github.com/x/localtool",
                                        "vcs_info": {"vcs": "git", "commit_id": "64d5cf9d"}})
    _dist(first, "tinykernels", "0.3.1", {"url": "file:///src/tinykernels", "dir_info": {"editable": True}})
    _dist(first, "attnops", "1.2.0", {"url": "file:///w/attnops-1.2.0-py3-none-any.whl", "archive_info": {}})
    _dist(second, "torch", "2.8.0")  # shadowed: later on the path
    notes: list[str] = []
    dists = {d.name: d for d in envlock.scan_distributions([str(first), str(second)], notes)}
    assert dists["torch"].version == "2.11.0+cu130"
    assert any("torch 2.8.0 is shadowed by 2.11.0+cu130" in n for n in notes)
    assert dists["localtool"].source == "git+https://github.com/x/localtool@64d5cf9d"
    assert dists["tinykernels"].editable and dists["tinykernels"].source == "file:///src/tinykernels"
    assert dists["attnops"].source == "file:///w/attnops-1.2.0-py3-none-any.whl"


def test_env_vars_by_prefix_with_secrets_left_out():
    env, left_out = envlock.env_vars({
        "TORCHINDUCTOR_CACHE_DIR": "/c", "TORCH_COMPILE_CACHE_KEY_TAG": "v2", "HF_TOKEN": "hf_abc",
        "HF_HOME": "/hf", "NCCL_DEBUG": "INFO", "CUDA_VISIBLE_DEVICES": "0,1", "TRITON_PASSWORD": "x",
        "PYTORCH_SECRET_SAUCE": "y", "HOME": "/root", "AWS_SECRET_ACCESS_KEY": "z", "OMP_NUM_THREADS": "8",
    })
    assert env == {"CUDA_VISIBLE_DEVICES": "0,1", "HF_HOME": "/hf", "NCCL_DEBUG": "INFO", "OMP_NUM_THREADS": "8",
                   "TORCHINDUCTOR_CACHE_DIR": "/c", "TORCH_COMPILE_CACHE_KEY_TAG": "v2"}
    assert left_out == ("HF_TOKEN", "PYTORCH_SECRET_SAUCE", "TRITON_PASSWORD")  # names only, values never kept


def test_cpu_flags_from_cpuinfo_text():
    cpu = envlock.cpu_info("processor\t: 0\nmodel name\t: Intel Xeon 8480+\nflags\t\t: fpu sse avx2 fma "
                           "avx512f amx_tile amx_bf16 ht\n\nprocessor\t: 1\nflags\t: fpu\n")
    assert cpu.model == "Intel Xeon 8480+"
    assert cpu.isa_flags == ("amx_bf16", "amx_tile", "avx2", "avx512f", "fma")


def test_cache_summary_fingerprints_the_dir(tmp_path):
    assert envlock._cache_summary(str(tmp_path / "none")) == envlock.CacheSummary(
        dir=str(tmp_path / "none"), exists=False, files=0, bytes=0)
    key = "fab" + "c" * 49  # an inductor cache is recognised by its structure: fxgraph/<2>/f<key>/
    (tmp_path / "fxgraph" / "ab" / key).mkdir(parents=True)
    (tmp_path / "fxgraph" / "ab" / key / "entry").write_bytes(b"x" * 100)
    (tmp_path / "cd").mkdir()
    (tmp_path / "cd" / ("ccd" + "1" * 49 + ".py")).write_bytes(b"y" * 20)
    s = envlock._cache_summary(str(tmp_path))
    assert (s.exists, s.files, s.bytes) == (True, 2, 120)
    assert s.fingerprint and s.fingerprint.startswith("xxh3-128:")
    (tmp_path / "notes.txt").write_text("a dir that is not an inductor cache is only counted")
    (tmp_path / "src").mkdir()
    s = envlock._cache_summary(str(tmp_path))
    assert (s.exists, s.files, s.fingerprint) == (True, 3, None)


def test_no_nvidia_driver_is_a_note_not_an_error(monkeypatch):
    fake = types.ModuleType("pynvml")

    class NVMLError(Exception):
        pass

    def init():
        raise NVMLError("NVML Shared Library Not Found")

    fake.NVMLError, fake.nvmlInit = NVMLError, init
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    notes: list[str] = []
    assert envlock._gpu_facts(notes) == (None, ())
    assert notes == ["no NVIDIA GPU/driver (NVML: NVML Shared Library Not Found)"]


def test_gpus_through_nvml_with_hashed_uuids(monkeypatch):
    fake = types.ModuleType("pynvml")
    fake.NVMLError = type("NVMLError", (Exception,), {})
    calls = []
    fake.nvmlInit = lambda: calls.append("init")
    fake.nvmlShutdown = lambda: calls.append("shutdown")
    fake.nvmlSystemGetDriverVersion = lambda: "580.95.05"
    fake.nvmlSystemGetCudaDriverVersion = lambda: 13000
    fake.nvmlDeviceGetCount = lambda: 2
    fake.nvmlDeviceGetHandleByIndex = lambda i: i
    fake.nvmlDeviceGetCudaComputeCapability = lambda h: (9, 0)
    fake.nvmlDeviceGetUUID = lambda h: f"GPU-41c95a43-ce96-fff3-33e0-739a3931d60{h}".encode()
    fake.nvmlDeviceGetName = lambda h: b"NVIDIA H200"
    fake.nvmlDeviceGetMemoryInfo = lambda h: types.SimpleNamespace(total=150_754_820_096)
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    driver, gpus = envlock._gpu_facts([])
    assert (driver.version, driver.cuda) == ("580.95.05", "13.0")
    assert [(g.index, g.name, g.capability) for g in gpus] == [(0, "NVIDIA H200", "9.0"), (1, "NVIDIA H200", "9.0")]
    assert len({g.uuid_hash for g in gpus}) == 2
    assert all("41c95a43" not in g.uuid_hash for g in gpus)  # hashed, never the UUID itself
    assert calls == ["init", "shutdown"]


def test_snapshot_of_this_process_round_trips(tmp_path):
    import torch

    lock = snapshot(with_gpus=False)
    assert lock.schema == "compilewatch.lock" and lock.schema_version == envlock.SCHEMA_VERSION
    assert lock.torch.version == torch.__version__ and lock.torch.cuda == torch.version.cuda
    assert lock.inductor.cache_dir == str(tmp_path / "inductor-cache")  # conftest's TORCHINDUCTOR_CACHE_DIR
    assert lock.inductor.cache.files == 0  # torch's cache_dir() creates the dir when it resolves it
    assert lock.inductor.system_key
    assert lock.python.version == ".".join(map(str, sys.version_info[:3]))
    assert any(d.name.lower() == "torch" for d in lock.distributions)
    assert lock.env["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "inductor-cache")
    again = parse_lock(json.dumps(to_jsonable(lock)), "lock.json")
    assert again == lock


def test_lock_from_dict_rejects_other_json():
    from compilewatch.errors import BadInput

    with pytest.raises(BadInput, match="not a compilewatch lock"):
        lock_from_dict({"packages": []}, where="x.json")
    with pytest.raises(BadInput, match="x.json:1: invalid JSON"):
        parse_lock("{", "x.json")
