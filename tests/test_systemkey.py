"""The system key from files equals torch's own `CacheBase.get_system()["hash"]`.

Run under every installed torch (the fast path knows each variant by its source):
  .venv/bin/python -m pytest tests/test_systemkey.py                       (torch 2.13 CPU, no triton)
  PYTHONPATH=$PWD /work/venvs/t2.15.0/bin/python -m pytest tests/test_systemkey.py   (2.15 CUDA wheel, triton 3.9)
  PYTHONPATH=$PWD /work/venvs/t2.11.0/bin/python -m pytest tests/test_systemkey.py   (2.11, triton 3.6)
On the GPU machine benchmarks/lock_key_check.py compares the two with a real device.
"""

from __future__ import annotations

import os
import pkgutil
import sys
import types

import pytest

from compilewatch.env import systemkey
from compilewatch.env.systemkey import DeviceView, Unsure


@pytest.fixture
def fresh_torch_key():
    from torch._inductor.codecache import CacheBase

    CacheBase.get_system.cache_clear()
    yield CacheBase
    CacheBase.get_system.cache_clear()


def test_installed_torch_is_a_known_variant():
    variant, _ = systemkey.get_system_variant(systemkey.package_dir("torch"))
    assert variant in ("device-or-empty", "triton-always")


def test_fast_key_equals_torchs_key_on_this_machine(fresh_torch_key):
    fast = systemkey.fast_key()
    assert fast.method == "files"
    assert fast.key == str(fresh_torch_key.get_system()["hash"])


def test_fast_key_equals_torchs_key_with_a_gpu(monkeypatch, fresh_torch_key):
    """The device form of the key: torch told it has a current CUDA device named like the NVML one."""
    import torch

    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: types.SimpleNamespace(name="NVIDIA H200"))
    real = systemkey.torch_version_facts
    monkeypatch.setattr(systemkey, "torch_version_facts", lambda d: {**real(d), "cuda": "13.0"})
    view = DeviceView("13.0", ("NVIDIA H200", "NVIDIA H200"), ("GPU-aa", "GPU-bb"), (False, False))
    fast = systemkey.fast_key(devices=view)
    assert (fast.method, fast.device) == ("files", "NVIDIA H200")
    assert fast.key == str(fresh_torch_key.get_system()["hash"])


def test_triton_key_equals_tritons_own():
    triton_dir = systemkey.package_dir("triton")
    if triton_dir is None:
        pytest.skip("triton is not installed with this torch")
    from torch._inductor.runtime.triton_compat import triton_key

    mine, from_memo = systemkey.triton_key(triton_dir, use_memo=False)
    assert not from_memo and mine == triton_key()


def test_walk_matches_pkgutil(tmp_path, monkeypatch):
    """The file walk yields what pkgutil.walk_packages yields, in its order (subpackages depth first,
    dirs without __init__ skipped, a package before a module of the same name)."""
    root = tmp_path / "cwwalk"
    for rel in ("__init__.py", "b.py", "a/__init__.py", "a/z.py", "a/sub/__init__.py", "a/sub/m.py",
                "notpkg/x.py", "c.py", "c/__init__.py", "c/k.py"):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    expected = []
    for info in pkgutil.walk_packages([str(root)], prefix="cwwalk."):
        expected.append(info.module_finder.find_spec(info.name).origin)
    for name in [m for m in sys.modules if m.startswith("cwwalk")]:
        monkeypatch.delitem(sys.modules, name)
    assert systemkey.walk_module_files(str(root), set()) == expected


def test_triton_key_memo(tmp_path, monkeypatch):
    files = [tmp_path / n for n in ("cache.py", "compiler.py", "libtriton.so", "core.py")]
    for i, f in enumerate(files):
        f.write_bytes(b"x" * (i + 1))
        os.utime(f, ns=(1_000_000_000, 1_000_000_000))  # old: trusted by the memo
    inputs = ("3.9.0", str(files[0]), [str(files[1])], str(files[2]), [str(files[3])])
    monkeypatch.setattr(systemkey, "triton_key_inputs", lambda d: inputs)
    first, memo1 = systemkey.triton_key(tmp_path)
    again, memo2 = systemkey.triton_key(tmp_path)
    assert first.startswith("3.9.0") and (memo1, memo2) == (False, True) and again == first
    files[3].write_bytes(b"changed")
    os.utime(files[3], ns=(1_000_000_000, 1_000_000_000))
    changed, memo3 = systemkey.triton_key(tmp_path)
    assert not memo3 and changed != first
    assert systemkey.memo_path().is_file() and str(systemkey.memo_path()).startswith(os.environ["COMPILEWATCH_STATE_DIR"])


H200 = DeviceView("13.0", ("NVIDIA H200", "NVIDIA H200"), ("GPU-aa11", "GPU-bb22"), (False, False))


@pytest.mark.parametrize("view, cuda, env, expected", [
    (None, "13.0", {}, None),  # no driver
    (H200, None, {}, None),  # a CPU build of torch never sees the GPU
    (H200, "13.0", {}, "NVIDIA H200"),
    (H200, "13.0", {"CUDA_VISIBLE_DEVICES": "1"}, "NVIDIA H200"),
    (H200, "13.0", {"CUDA_VISIBLE_DEVICES": "GPU-bb"}, "NVIDIA H200"),
    (DeviceView("13.0", (), (), ()), "13.0", {}, None),
])
def test_current_device_name(view, cuda, env, expected):
    assert systemkey.current_device_name(view, cuda, env) == expected


@pytest.mark.parametrize("view, cuda, env, why", [
    (DeviceView("13.0", ("NVIDIA H200", "NVIDIA A100"), ("GPU-a", "GPU-b"), (False, False)), "13.0", {}, "different models"),
    (DeviceView("13.0", ("NVIDIA H200",), ("GPU-a",), (True,)), "13.0", {}, "MIG"),
    (DeviceView("12.8", ("NVIDIA H200",), ("GPU-a",), (False,)), "13.0", {}, "driver supports CUDA 12.8"),
    (H200, "13.0", {"CUDA_VISIBLE_DEVICES": "MIG-1"}, "CUDA_VISIBLE_DEVICES"),
    (H200, "13.0", {"CUDA_VISIBLE_DEVICES": ""}, "CUDA_VISIBLE_DEVICES"),
    (DeviceView(None, (), (), (), error="NVML: Unknown Error"), "13.0", {}, "NVML cannot be read"),
])
def test_unsure_device_cases(view, cuda, env, why):
    with pytest.raises(Unsure, match=why):
        systemkey.current_device_name(view, cuda, env)


def test_visible_count():
    assert systemkey.visible_count(H200, {}) == 2
    assert systemkey.visible_count(H200, {"CUDA_VISIBLE_DEVICES": "1"}) == 1
    assert systemkey.visible_count(H200, {"CUDA_VISIBLE_DEVICES": "0,7,1"}) == 1  # CUDA stops at 7
    assert systemkey.visible_count(None, {}) == 0


def test_unknown_torch_code_falls_back_to_torch(monkeypatch, fresh_torch_key):
    monkeypatch.setattr(systemkey, "KNOWN_GET_SYSTEM", {})
    k = systemkey.key(devices=None)
    assert k.method == "torch" and "not a variant compilewatch has read" in k.reason
    assert k.key == str(fresh_torch_key.get_system()["hash"])


def test_gpu_host_it_cannot_read_falls_back(monkeypatch, fresh_torch_key):
    monkeypatch.setattr(systemkey, "torch_version_facts", lambda d: {"__version__": "2.x", "cuda": "13.0"})
    mixed = DeviceView("13.0", ("NVIDIA H200", "NVIDIA A100"), ("GPU-a", "GPU-b"), (False, False))
    k = systemkey.key(devices=mixed)
    assert k.method == "torch" and "different models" in k.reason


def test_source_block():
    text = "class A:\n    @staticmethod\n    def f():\n        x = 1\n\n        return x\n\n    @staticmethod\n    def g():\n        pass\n"
    assert systemkey.source_block(text, "def f(") == "    def f():\n        x = 1\n\n        return x\n"
