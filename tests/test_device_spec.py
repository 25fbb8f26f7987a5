"""compilewatch.devices.spec: one message naming every device asked for and why none / some are
usable (a CPU-only torch, no CUDA driver, CUDA_VISIBLE_DEVICES hiding the GPUs, too few GPUs)."""

from __future__ import annotations

import pytest
import torch

from cli.main import app
from compilewatch.devices import spec
from compilewatch.errors import BadInput
from tests.helpers import invoke


def _gpus(monkeypatch, *, cuda: str | None, count: int) -> None:
    monkeypatch.setattr(torch.version, "cuda", cuda)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)


def _error(specs: str) -> BadInput:
    with pytest.raises(BadInput) as e:
        spec.parse_devices(specs)
    return e.value


def test_no_driver_names_every_device_asked_for(monkeypatch):
    _gpus(monkeypatch, cuda="13.0", count=0)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    e = _error("5,6,7")
    assert e.message == ("asked for cuda:5, cuda:6, cuda:7: none of them is visible to this process: "
                         "no CUDA driver or GPU is present (torch.cuda.is_available() is False)")
    assert "CUDA_VISIBLE_DEVICES" not in e.hint and "(device cpu)" in e.hint and "--devices" not in e.hint


def test_cpu_only_torch(monkeypatch):
    _gpus(monkeypatch, cuda=None, count=0)
    assert "is a CPU-only build" in _error("0").message


def test_cuda_visible_devices_hiding_every_gpu(monkeypatch):
    _gpus(monkeypatch, cuda="13.0", count=0)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    e = _error("0,1")
    assert e.message.endswith("CUDA_VISIBLE_DEVICES='' hides every GPU") and "unset" in e.hint


def test_too_few_gpus_names_the_missing_ones(monkeypatch):
    _gpus(monkeypatch, cuda="13.0", count=2)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5")
    e = _error("0,1,5")
    assert e.message == ("asked for cuda:0, cuda:1, cuda:5: cuda:5 is not visible to this process: "
                         "this process sees 2 GPU(s): cuda:0, cuda:1")
    assert "CUDA_VISIBLE_DEVICES='4,5' renumbers" in e.hint
    assert spec.parse_devices("1,0") == ["cuda:1", "cuda:0"]


def test_warm_cli_says_it_once_and_exits_2(monkeypatch):
    _gpus(monkeypatch, cuda="13.0", count=0)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    r = invoke(app, ["warm", "--devices", "5,6,7"])
    assert r.exit_code == 2
    assert "asked for cuda:5, cuda:6, cuda:7: none of them is visible" in r.stderr
    assert "no CUDA driver or GPU is present" in r.stderr and "Traceback" not in r.stderr
