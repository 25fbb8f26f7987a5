"""Identical drafter replicas on one device share compiled code: the first replica's warm-up compiles
(dynamo frames, counted by compilewatch.prewarm), the next ones' compile nothing (issue 28: an engine
with 3 replicas on one H200 prewarmed 3 x 26 s). CPU, compiled layers with the aot_eager backend (dynamo +
AOT autograd, no C++ toolchain needed): the dynamo-level reuse is what this checks; on a GPU the
engine's prewarm reports each replica's warm time (PrewarmResult.replica_s) for the inductor case."""

from __future__ import annotations

import torch

from compilewatch import prewarm
from dflash.model.build import empty_drafter
from dflash.model.drafter import DrafterSpec

SPEC = DrafterSpec(hidden_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                   intermediate_size=128, vocab_size=100, target_layer_ids=(1, 2), num_target_layers=4, layer_types=("full_attention",))


def _replica():
    d = empty_drafter(SPEC, "cpu")
    d.init_weights(torch.Generator().manual_seed(0))
    d.compile_layers(dynamic=False, backend="aot_eager")  # as build_drafter compiles them on CUDA
    return d


def _step(d):
    def run(device):
        x = torch.randn(1, 8, 64, requires_grad=True)
        out = d(x, torch.randn(1, 24, 128), torch.arange(8)[None] + 24, torch.arange(24)[None])
        out.sum().backward()
    return run


def test_identical_replicas_on_one_device_compile_once():
    torch._dynamo.reset()
    frames = [prewarm(["cpu"], _step(_replica()), verify=False).warm[0].frames_compiled for _ in range(3)]
    assert frames[0] >= 1 and frames[1:] == [0, 0], frames
