"""dflash.eval.attention: the eval's forwards run with cuDNN's sdpa off (its first-call kernel builds
cost a first eval seconds on a GPU), every other sdpa switch as the process had it, and all of them as
they were once the eval ends, returned or raised (CPU, the tiny target: the switches are process flags,
read by every forward whatever its device)."""

from __future__ import annotations

import pytest
import torch

from dflash.eval import attention, baseline_store
from dflash.eval.evaluate import evaluate_drafter
from tests.dflash_helpers import tiny_target  # noqa: F401 (fixture)
from tests.test_eval_batched import NEW, mixed_prompts, trained_drafter


def _switches() -> dict[str, bool]:
    b = torch.backends.cuda
    return {"cudnn": b.cudnn_sdp_enabled(), "flash": b.flash_sdp_enabled(),
            "efficient": b.mem_efficient_sdp_enabled(), "math": b.math_sdp_enabled()}


@pytest.fixture(scope="module")
def drafter(tiny_target):
    return trained_drafter(tiny_target, sliding=False)


@pytest.fixture
def seen(tiny_target, drafter):
    """The switches at every forward of the target and the drafter during the test."""
    got: list[tuple[str, dict[str, bool]]] = []
    hooks = [m.register_forward_pre_hook(lambda mod, args, name=name: got.append((name, _switches())))
             for name, m in (("target", tiny_target.model), ("drafter", drafter.layers[0].input_layernorm))]
    before = _switches()
    yield got
    for h in hooks:
        h.remove()
    for name, on in before.items():  # whatever a failing test left
        getattr(torch.backends.cuda, {"cudnn": "enable_cudnn_sdp", "flash": "enable_flash_sdp",
                                      "efficient": "enable_mem_efficient_sdp", "math": "enable_math_sdp"}[name])(on)


@pytest.mark.parametrize("batched", [True, False], ids=["batched", "reference"])
def test_every_forward_of_an_eval_runs_without_cudnn_sdpa_and_the_switch_comes_back(drafter, tiny_target, seen,
                                                                                     batched):
    torch.backends.cuda.enable_cudnn_sdp(True)
    torch.backends.cuda.enable_flash_sdp(False)  # a user's own choice: kept inside and after
    evaluate_drafter(drafter, tiny_target, mixed_prompts(tiny_target, 2), NEW, drafter.spec.block_size,
                     batched=batched)
    assert {name for name, _ in seen} == {"target", "drafter"}
    assert all(s == {"cudnn": False, "flash": False, "efficient": True, "math": True} for _, s in seen)
    assert _switches() == {"cudnn": True, "flash": False, "efficient": True, "math": True}


def test_an_eval_that_raises_puts_the_switch_back(drafter, tiny_target, seen, monkeypatch):
    from dflash.eval import evaluate

    torch.backends.cuda.enable_cudnn_sdp(True)

    def boom(*a, **k):
        assert not torch.backends.cuda.cudnn_sdp_enabled()
        raise RuntimeError("out of memory (injected)")

    monkeypatch.setattr(evaluate, "evaluate_batched", boom)
    with pytest.raises(RuntimeError, match="injected"):
        evaluate_drafter(drafter, tiny_target, mixed_prompts(tiny_target, 2), NEW, drafter.spec.block_size)
    assert torch.backends.cuda.cudnn_sdp_enabled()


def test_a_kept_plain_baseline_applies_only_to_evals_with_the_same_attention_kernels(tiny_target, monkeypatch):
    """A baseline measured with cuDNN's sdpa (before this module) decoded with other kernels: not reused."""
    ident = baseline_store.identity(tiny_target)
    assert ident["attention"] == attention.NAME
    monkeypatch.setattr(baseline_store, "ATTENTION", "sdpa with cuDNN")
    assert baseline_store.identity(tiny_target) != ident
