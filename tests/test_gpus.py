"""gpus: NVML mocked (monkeypatched pynvml functions): no driver, three GPUs with the seeds' imbalance."""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import pynvml
import pytest

from cli.main import app
from compilewatch.devices import gpus
from tests.helpers import invoke, invoke_json

GB = 1024 ** 3
HIDDEN_PID = 2 ** 22 + 12345  # above Linux's pid_max: never a real process


@pytest.fixture(autouse=True)
def _fresh_nvml(monkeypatch):
    monkeypatch.setattr(gpus, "_initialized", False)


def fake_nvml(monkeypatch, devices: list[dict]) -> None:
    """Patch pynvml so NVML reports `devices`: dicts of name, used, total, util, pids [(pid, bytes)]."""

    def handle(i):
        if i >= len(devices):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return i

    def util(h):
        if devices[h].get("util") is None:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return SimpleNamespace(gpu=devices[h]["util"], memory=0)

    monkeypatch.setattr(pynvml, "nvmlInit", lambda: None)
    monkeypatch.setattr(pynvml, "nvmlSystemGetDriverVersion", lambda: "580.95.05")
    monkeypatch.setattr(pynvml, "nvmlDeviceGetCount", lambda: len(devices))
    monkeypatch.setattr(pynvml, "nvmlDeviceGetHandleByIndex", handle)
    monkeypatch.setattr(pynvml, "nvmlDeviceGetName", lambda h: devices[h].get("name", "NVIDIA H200"))
    monkeypatch.setattr(pynvml, "nvmlDeviceGetUUID", lambda h: f"GPU-{h:08d}")
    monkeypatch.setattr(pynvml, "nvmlDeviceGetMemoryInfo",
                        lambda h: SimpleNamespace(used=devices[h]["used"], total=devices[h].get("total", 141 * GB),
                                                  free=0))
    monkeypatch.setattr(pynvml, "nvmlDeviceGetUtilizationRates", util)
    monkeypatch.setattr(pynvml, "nvmlDeviceGetComputeRunningProcesses",
                        lambda h: [SimpleNamespace(pid=p, usedGpuMemory=m) for p, m in devices[h].get("pids", [])])


def no_driver(monkeypatch) -> None:
    def boom():
        raise pynvml.NVMLError(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)

    monkeypatch.setattr(pynvml, "nvmlInit", boom)


def seeds_drafters(me: int) -> list[dict]:
    """The seeds' symptom: three drafter GPUs of one trainer process, one at 40 GB, two at 72-77 GB."""
    return [
        {"used": 40 * GB, "util": 3, "pids": [(me, 39 * GB)]},
        {"used": 72 * GB, "util": 13, "pids": [(me, 71 * GB)]},
        {"used": 77 * GB, "util": 9, "pids": [(me, 76 * GB)]},
    ]


def test_no_driver(monkeypatch):
    no_driver(monkeypatch)
    st = gpus.status()
    assert not st.available and st.gpus == ()
    assert "no NVIDIA GPU/driver found" in (st.reason or "")
    assert gpus.sample() == ()
    result = invoke(app, ["gpus"])
    assert result.exit_code == 0
    assert result.stdout.strip() == "no NVIDIA GPU/driver found"
    assert invoke_json(app, ["gpus"]) == []


def test_seeds_imbalance_three_gpus(monkeypatch):
    fake_nvml(monkeypatch, seeds_drafters(os.getpid()))
    st = gpus.status()
    assert [g.memory_used // GB for g in st.gpus] == [40, 72, 77]
    (im,) = st.imbalances
    assert im.gpu == 0 and im.group == (0, 1, 2)
    assert im.others_median == 74.5 * GB and 0.53 < im.ratio < 0.54
    assert st.gpus[0].imbalance == im and st.gpus[1].imbalance is None
    proc = st.gpus[0].processes[0]
    with open("/proc/self/cmdline", "rb") as f:  # this process's, as the kernel has it: pytest's, or an xdist worker's
        own = " ".join(a.decode() for a in f.read().split(b"\0") if a)
    assert proc.visible and proc.pid == os.getpid() and proc.name and proc.cmdline == own
    assert "GPU 0 uses 40.0 GB" in st.verdicts[0] and "74.5 GB" in st.verdicts[0]

    data = invoke_json(app, ["gpus"], expect_code=1)
    assert [g["index"] for g in data] == [0, 1, 2]
    assert data[0]["imbalance"]["gpu"] == 0 and data[1]["imbalance"] is None
    assert data[0]["processes"][0]["pid"] == os.getpid()
    assert data[1]["utilization"] == 13

    result = invoke(app, ["gpus"])
    assert result.exit_code == 1
    assert "NVIDIA H200" in result.stdout and "GPU 0 uses 40.0 GB" in result.stdout


def test_balanced_and_separate_jobs_are_not_flagged(monkeypatch):
    me = os.getpid()
    devices = [
        {"used": 75 * GB, "util": 90, "pids": [(me, 74 * GB)]},
        {"used": 72 * GB, "util": 88, "pids": [(me, 71 * GB)]},
        # another job (a process this machine cannot see) with little memory: a different group
        {"used": 10 * GB, "util": None, "pids": [(HIDDEN_PID, None)]},
        {"used": 0, "util": 0, "pids": []},  # idle
    ]
    fake_nvml(monkeypatch, devices)
    st = gpus.status()
    assert st.imbalances == ()
    assert st.gpus[2].processes[0].visible is False and st.gpus[2].utilization is None
    assert any("not visible" in w for w in st.warnings)
    assert "no memory imbalance" in st.verdicts[0]
    assert invoke(app, ["gpus"]).exit_code == 0


def test_two_gpu_job_and_unattributed_processes():
    def gpu(i, used, procs=()):
        return gpus.Gpu(i, "H200", None, used, 141 * GB, 0, tuple(procs))

    p = gpus.GpuProcess(1, None, "python", "python train.py", "me", True)
    # two GPUs of one job: compared with the other one, not with a median that includes itself
    assert [im.gpu for im in gpus.find_imbalances([gpu(0, 40 * GB, [p]), gpu(1, 77 * GB, [p])])] == [0]
    # processes not visible (containers): busy GPUs still compared with each other, idle ones skipped
    found = gpus.find_imbalances([gpu(0, 20 * GB), gpu(1, 76 * GB), gpu(2, 74 * GB), gpu(3, 1 * GB)])
    assert [(im.gpu, im.job) for im in found] == [(0, "(processes not visible)")]


@pytest.mark.parametrize("values, flagged", [
    ({}, {}),  # nothing to compare
    ({"a": 1.0}, {}),  # one value: nothing to compare with
    ({"a": 40.0, "b": 77.0}, {"a": 77.0}),  # two values: against the other one
    ({"a": 40.0, "b": 40.0, "c": 40.0}, {}),  # all equal
    ({"a": 10.0, "b": 100.0, "c": 100.0, "d": 0.0}, {"a": 100.0, "d": 100.0}),  # several low ones
    ({"a": 50.0, "b": 60.0, "c": 100.0}, {}),  # one busy outlier does not flag the others (a max rule would)
    ({"a": 60.0, "b": 100.0}, {}),  # exactly at 60%: not below
    ({"a": 59.0, "b": 100.0}, {"a": 100.0}),
    ({"a": 0.0, "b": 0.0}, {}),  # the other's median is 0: nothing to be below
    ({"a": 0.0, "b": 0.0, "c": 5.0}, {"a": 2.5, "b": 2.5}),  # c: others' median 0, not flagged
])
def test_low_outliers_is_the_one_imbalance_rule(values, flagged):
    assert gpus.low_outliers(values) == flagged


def test_low_outliers_ratio_and_dflash_engine_verdict_use_it():
    from dflash.engine.report import _imbalance

    assert gpus.low_outliers({"a": 50.0, "b": 100.0}, ratio=0.4) == {}
    dev = lambda d, util, alloc: SimpleNamespace(device=d, utilization_pct=util, allocated_bytes=alloc)  # noqa: E731
    samples = SimpleNamespace(devices=(dev("cuda:0", 90.0, 70 * GB), dev("cuda:1", 5.0, 71 * GB),
                                       dev("cuda:2", 60.0, 72 * GB), dev("cuda:3", 0.0, 1 * GB)))
    report = SimpleNamespace(steps=[SimpleNamespace(samples=samples)], drafter_devices=("cuda:0", "cuda:1", "cuda:2"))
    (v,) = _imbalance(report)  # cuda:3 is not a drafter device; memory is balanced; 60 vs median(90, 5) = 47.5: fine
    assert v.startswith("drafter device cuda:1 is at 5 utilization vs a median of 75 on the other drafter devices")


def test_sample_is_cheap_and_skips_processes(monkeypatch):
    fake_nvml(monkeypatch, seeds_drafters(os.getpid()))

    def no_process_scan(h):
        raise AssertionError("sample() must not list processes")

    monkeypatch.setattr(pynvml, "nvmlDeviceGetComputeRunningProcesses", no_process_scan)
    s = gpus.sample()
    assert [(x.index, x.memory_used // GB, x.utilization) for x in s] == [(0, 40, 3), (1, 72, 13), (2, 77, 9)]


def test_watch_json_lines(monkeypatch):
    fake_nvml(monkeypatch, seeds_drafters(os.getpid()))
    result = invoke(app, ["gpus", "--watch", "0", "--count", "2", "--json"])
    assert result.exit_code == 0
    lines = result.stdout.strip().splitlines()
    assert len(lines) == 2 and all(len(json.loads(x)) == 3 for x in lines)
