"""diff-env's ranking: the seeds' change, inferred CUDA flavours, lock-only facts, thresholds."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from compilewatch.env import diff as envdiff
from compilewatch.env.diff import diff_envs, diff_files
from compilewatch.env.formats import load_env
from compilewatch.env.formats.model import EnvSpec, Package
from compilewatch.env.lock import CacheSummary, GpuInfo, load_lock
from compilewatch.errors import BadInput

FX = Path(__file__).parent / "fixtures" / "env"
SEEDS = FX / "seeds"


def _find(diff, subject):
    hits = [c for c in diff.changes if c.subject == subject]
    assert len(hits) == 1, (subject, [c.headline for c in diff.changes])
    return hits[0]


def _spec(*pkgs, fmt="requirements", python=None, path="x"):
    return EnvSpec(path=path, format=fmt, packages=tuple(Package(n, v) for n, v in pkgs), python=python)


def test_seeds_freeze_cu128_to_cu130_and_transformers():
    d = diff_files(SEEDS / "old-freeze.txt", SEEDS / "new-freeze.txt")
    torch = _find(d, "torch")
    assert torch.severity == "critical"
    assert torch.headline == "Updated torch v2.11.0+cu128 -> v2.11.0+cu130"
    assert "keyed on CUDA 12.8" in torch.consequence and "CUDA 13.0" in torch.consequence
    assert torch.note is None  # the labels say it: nothing inferred
    tf = _find(d, "transformers")
    assert (tf.severity, tf.headline) == ("warning", "Updated transformers v5.6.0 -> v5.8.1")
    assert _find(d, "sglang").headline == "Added sglang v0.5.9"
    assert _find(d, "sglang").severity == "warning"
    assert _find(d, "nvidia-cudnn").headline == \
        "Updated nvidia-cudnn v9.10.2.21 [nvidia-cudnn-cu12] -> v9.19.0.56 [nvidia-cudnn-cu13]"
    libs = _find(d, "CUDA libraries")  # the flavour's other CUDA packages: one line, details kept
    assert libs.severity == "warning" and len(libs.details) == 15
    assert _find(d, "xgrammar").severity == "info"
    assert d.counts == {"critical": 1, "warning": 8, "info": 3}
    assert [c.severity for c in d.changes] == sorted((c.severity for c in d.changes), key=envdiff.SEVERITIES.index)
    assert d.fails("critical") and d.fails("info")
    assert all(c.consequence.endswith(".") for c in d.changes)


def test_seeds_pypi_freeze_infers_the_flavour_and_says_so():
    d = diff_files(SEEDS / "old-freeze-pypi.txt", SEEDS / "new-freeze-pypi.txt")
    torch = _find(d, "torch")
    assert torch.severity == "critical"
    assert torch.headline == "Updated torch v2.11.0 (cu128, inferred) -> v2.11.0 (cu130, inferred)"
    assert "nvidia-cuda-runtime-cu12 12.8.90" in torch.note and "nvidia-cuda-runtime 13.0.96" in torch.note
    assert (d.old.torch_flavour, d.new.torch_flavour) == ("cu128", "cu130")
    assert not any("inferred" in n for n in d.notes)  # said once, on the change
    same = diff_files(SEEDS / "new-freeze-pypi.txt", SEEDS / "new-freeze-pypi.txt")
    assert same.changes == () and any("cu130 is inferred from nvidia-cuda-runtime 13.0.96" in n for n in same.notes)


def test_flavour_from_suffix_only_and_same_family_is_not_a_change():
    old = _spec(("torch", "2.11.0"), ("nvidia-cublas-cu12", "12.8.4.1"))
    new = _spec(("torch", "2.11.0+cu128"), ("nvidia-cublas-cu12", "12.8.4.1"))
    assert envdiff.torch_flavour(old) == ("cu12", "nvidia-cublas-cu12 (1 nvidia-*-cu12 packages)")
    assert diff_envs(old, new).changes == ()  # cu12 (inferred) vs cu128: not a claim we can make
    newer = _spec(("torch", "2.11.0"), ("nvidia-cublas", "13.1.0.3"), ("nvidia-nccl-cu13", "2.28.9"))
    assert _find(diff_envs(old, newer), "torch").severity == "critical"


def test_unknown_flavour_is_a_note_not_a_change():
    d = diff_envs(_spec(("torch", "2.11.0"), path="a.txt"), _spec(("torch", "2.11.0+cu130"), path="b.txt"))
    assert d.changes == ()
    assert any(n.startswith("a.txt: torch's CUDA flavour is unknown") for n in d.notes)


def test_seeds_locks_cache_gone_and_system_key():
    d = diff_files(SEEDS / "old.lock.json", SEEDS / "new.lock.json")
    assert _find(d, "torch").headline == "Updated torch v2.11.0+cu128 -> v2.11.0+cu130"
    cache = _find(d, "inductor cache")
    assert cache.severity == "critical"
    assert cache.headline == "Removed inductor cache /tmp/torchinductor_root (353.0 MB, 1204 files)"
    assert _find(d, "inductor system key").severity == "critical"
    assert _find(d, "cuDNN (torch)").headline == "Updated cuDNN (torch) 9.10.2 -> 9.19.0"
    assert _find(d, "NCCL (torch)").severity == "warning"
    # torch's own cuDNN/NCCL supersede the package lines; unchanged facts are not reported
    subjects = {c.subject for c in d.changes}
    assert not {"nvidia-cudnn", "nvidia-nccl", "driver", "GPU architecture", "python"} & subjects
    assert d.counts["critical"] == 3


def test_identical_environments():
    d = diff_files(SEEDS / "old.lock.json", SEEDS / "old.lock.json")
    assert d.changes == () and not d.fails("info")


def test_lock_against_freeze_ignores_what_pip_freeze_omits():
    lock = load_env(SEEDS / "old.lock.json")
    pkgs = tuple(p for p in lock.packages) + (Package("pip", "25.3"), Package("setuptools", "80.9.0"))
    with_pip = dataclasses.replace(lock, packages=pkgs)
    d = diff_envs(with_pip, load_env(SEEDS / "old-freeze.txt"))
    assert d.changes == ()
    assert any("pip freeze omits them" in n for n in d.notes)
    assert any("compare only between two compilewatch locks" in n for n in d.notes)


def test_uv_lock_with_several_torch_versions():
    d = diff_files(FX / "uv-multi-source/uv.lock", FX / "uv-multi-source-new/uv.lock")
    torch = _find(d, "torch")
    assert torch.severity == "critical"
    assert "v2.11.0+cu128 (https://download.pytorch.org/whl/cu128)" in torch.old
    assert "v2.11.0+cu130 (https://download.pytorch.org/whl/cu130)" in torch.new
    assert "v2.11.0+cpu" in torch.old and "v2.11.0+cpu" in torch.new


def test_conda_cuda_build_to_cpu_build_and_python_minor():
    d = diff_files(FX / "conda/environment.yml", FX / "conda/environment-new.yml")
    torch = _find(d, "torch")
    assert torch.headline == "Updated torch v2.5.1 (cu124, inferred) -> v2.5.1 (cpu, inferred)"
    assert "CPU-only" in torch.consequence
    py = _find(d, "python")
    assert (py.severity, py.headline) == ("critical", "Updated python 3.12.7 -> 3.13.1")
    assert _find(d, "transformers").severity == "warning"


def test_conda_explicit_pytorch_channel_to_conda_forge():
    d = diff_files(FX / "conda/explicit.txt", FX / "conda/explicit-new.txt")
    torch = _find(d, "torch")
    assert torch.headline == "Updated torch v2.5.1 (cu124, inferred) -> v2.7.1 (cu128, inferred)"
    assert "conda build" in torch.note
    assert _find(d, "triton").severity == "critical"


def test_python_micro_is_info_and_thresholds():
    d = diff_envs(_spec(("rich", "14.0.0"), python="3.12.3"), _spec(("rich", "15.0.0"), python="3.12.7"))
    assert _find(d, "python").severity == "info"
    assert not d.fails("critical") and not d.fails("warning") and d.fails("info")
    w = diff_envs(_spec(("transformers", "5.6.0")), _spec(("transformers", "5.8.1")))
    assert not w.fails("critical") and w.fails("warning")
    down = diff_envs(_spec(("transformers", "5.8.1")), _spec(("transformers", "5.6.0")))
    assert down.changes[0].headline == "Downgraded transformers v5.8.1 -> v5.6.0"
    with pytest.raises(BadInput, match="unknown severity"):
        d.fails("fatal")


def test_one_project_in_three_uv_formats_diffs_clean():
    d = FX / "uv-sources"
    assert [c.headline for c in diff_files(d / "uv.lock", d / "pylock.toml").changes] == \
        ["Removed drafter-sources v0.1.0"]  # uv export leaves out the project itself
    assert diff_files(d / "pylock.toml", d / "requirements.txt").changes == ()  # unknown versions are no change


def test_source_change_at_same_version():
    old = EnvSpec("a", "requirements", (Package("kernels", "0.4.0"),))
    new = EnvSpec("b", "requirements", (Package("kernels", "0.4.0", source="git+https://x/k@abc"),))
    c = _find(diff_envs(old, new), "kernels")
    assert c.headline == "Changed kernels v0.4.0 (index) -> v0.4.0 (git+https://x/k@abc)"
    assert c.severity == "warning"


# --- lock-only facts, built from the seeds' lock by changing one fact at a time ----------------------


@pytest.fixture()
def base():
    return load_env(SEEDS / "old.lock.json")


def _with(side, **lock_changes):
    return dataclasses.replace(side, lock=dataclasses.replace(side.lock, **lock_changes))


def test_gpu_architecture_count_and_devices(base):
    h100 = tuple(dataclasses.replace(g, name="NVIDIA H100 80GB HBM3") for g in base.lock.gpus)
    arch = _find(diff_envs(base, _with(base, gpus=h100)), "GPU architecture")
    assert arch.severity == "critical"
    assert arch.headline == "Changed GPU architecture 8x NVIDIA H200 (sm 9.0) -> 8x NVIDIA H100 80GB HBM3 (sm 9.0)"
    assert _find(diff_envs(base, _with(base, gpus=base.lock.gpus[:4])), "GPU count").severity == "warning"
    other = tuple(dataclasses.replace(g, uuid_hash="f" * 16) for g in base.lock.gpus)
    assert _find(diff_envs(base, _with(base, gpus=other)), "GPUs").severity == "info"


def test_driver_change_and_driver_too_old_for_torch(base):
    newer = dataclasses.replace(base.lock.driver, version="590.10.01")
    c = _find(diff_envs(base, _with(base, driver=newer)), "driver")
    assert (c.severity, c.headline) == ("warning", "Updated driver 580.95.05 (CUDA 13.0) -> 590.10.01 (CUDA 13.0)")
    old_driver = dataclasses.replace(base.lock.driver, version="570.133.20", cuda="12.8")
    torch13 = dataclasses.replace(base.lock.torch, cuda="13.0", version="2.11.0+cu130")
    d = diff_envs(base, _with(base, driver=old_driver, torch=torch13))
    too_old = _find(d, "driver vs torch CUDA")
    assert too_old.severity == "critical" and "fail to initialize" in too_old.consequence


def test_cache_dir_moved_env_vars_and_cpu(base):
    ind = dataclasses.replace(base.lock.inductor, cache_dir="/data/inductor",
                              cache=CacheSummary(dir="/data/inductor", exists=False, files=0, bytes=0))
    env = {**base.lock.env, "TORCHINDUCTOR_MAX_AUTOTUNE": "1", "OMP_NUM_THREADS": "16"}
    cpu = dataclasses.replace(base.lock.cpu, isa_flags=("avx", "avx2", "fma"), model="AMD EPYC 9654")
    d = diff_envs(base, _with(base, inductor=ind, env=env, env_left_out=("HF_TOKEN", "WANDB_API_KEY"), cpu=cpu))
    moved = _find(d, "inductor cache dir")
    assert moved.severity == "critical" and "/data/inductor" in moved.consequence
    assert _find(d, "env TORCHINDUCTOR_MAX_AUTOTUNE").severity == "warning"
    assert _find(d, "env OMP_NUM_THREADS").headline == "Changed env OMP_NUM_THREADS 8 -> 16"
    assert _find(d, "env OMP_NUM_THREADS").severity == "info"
    secret = _find(d, "env WANDB_API_KEY")
    assert secret.headline == "Added env WANDB_API_KEY (secret, not recorded)"
    assert _find(d, "CPU ISA flags").severity == "warning"
    assert _find(d, "CPU model").severity == "info"


def test_cache_content_changed_is_info(base):
    grown = dataclasses.replace(base.lock.inductor.cache, files=1300, bytes=400_000_000)
    d = diff_envs(base, _with(base, inductor=dataclasses.replace(base.lock.inductor, cache=grown)))
    assert _find(d, "inductor cache").severity == "info"


def test_torch_build_differs_at_same_version(base):
    other = dataclasses.replace(base.lock.torch, git_version="0" * 40)
    assert _find(diff_envs(base, _with(base, torch=other)), "torch build").severity == "critical"


def test_torch_added_is_critical():
    d = diff_envs(_spec(("rich", "15.0.0")), _spec(("rich", "15.0.0"), ("torch", "2.11.0+cu130")))
    assert _find(d, "torch").headline == "Added torch v2.11.0+cu130"
    assert _find(d, "torch").severity == "critical"


def test_gpu_hash_is_all_a_lock_holds():
    lock = load_lock(SEEDS / "old.lock.json")
    assert all(isinstance(g, GpuInfo) and len(g.uuid_hash) == 16 for g in lock.gpus)
