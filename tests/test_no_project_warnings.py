"""No warning points at the project's own code while dynamo compiles the mask path.

`dflash train` on a GPU compiles each draft layer (`train.compile_layers`), whose attention calls
`dflash.model.mask.flex_attention_fn(cuda)`. That called the `functools.cache`d `_compiled_flex`
under dynamo, which warned "Dynamo detected a call to a functools.lru_cache-wrapped function at
'mask.py:180'" with a stack, first thing in every GPU run. The same trace runs on CPU: dynamo traces
Python, the device is only an argument, so a `torch.device("cuda")` reaches the same branch here.

A warning is the project's when it was raised from a file of compilewatch/, dflash/ or cli/, or its
message names one (dynamo's warnings are raised inside torch and quote the user's frame).
"""

from __future__ import annotations

import functools
import warnings
from pathlib import Path

import pytest
import torch

from dflash.model import mask

from tests import conftest

ROOT = Path(__file__).resolve().parents[1]


def project_warnings(records, dirs=None) -> list[str]:
    if dirs is None:
        return conftest.project_warnings(records)
    return [f"{r.filename}:{r.lineno}: {r.message}" for r in records
            if str(r.filename).startswith(dirs) or any(d in str(r.message) for d in dirs)]


def _compile_and_record(fn, *args):
    torch._dynamo.reset()
    with warnings.catch_warnings(record=True) as records:
        warnings.simplefilter("always")
        out = torch.compile(fn, backend="eager", fullgraph=True)(*args)
    return out, records


def test_the_compiled_mask_path_warns_nothing_of_ours():
    anchors = torch.tensor([[3, 9]])
    ctx_len, bs = 16, 4

    def step(q, k, v):
        fn = mask.flex_attention_fn(torch.device("cuda"))  # the branch a compiled CUDA draft layer takes
        assert fn is mask.flex_attention  # inside a compile: the plain op, lowered by that compile
        m = mask.build_masks(anchors, ctx_len, bs, "sdpa")["full"]  # (B, 1, Q, KV) bool
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=m)

    q = torch.randn(1, 2, 2 * bs, 8)
    k = v = torch.randn(1, 2, ctx_len + 2 * bs, 8)
    out, records = _compile_and_record(step, q, k, v)
    assert out.shape == (1, 2, 2 * bs, 8)
    assert project_warnings(records) == []


def test_outside_a_compile_cuda_gets_the_compiled_flex_attention():
    assert mask.flex_attention_fn(torch.device("cuda")) is mask._compiled_flex()
    assert mask.flex_attention_fn(torch.device("cpu")) is mask.flex_attention


@functools.cache
def _cached_helper() -> int:
    return 1


def test_the_check_sees_dynamo_tracing_a_cached_function_of_a_project_file():
    """The same warning from a file of tests/ is caught when tests/ counts as the project: the check
    above would see the old mask.py call."""
    _, records = _compile_and_record(lambda x: x + _cached_helper(), torch.ones(2))
    found = project_warnings(records, dirs=(str(ROOT / "tests"),))
    if not found:
        pytest.fail("dynamo did not warn about the lru_cache-wrapped call: " + repr([str(r.message)[:100] for r in records]))
    assert "lru_cache" in found[0]
