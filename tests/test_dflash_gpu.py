"""GPU checks for the trainer's fast path (run on the GPU machine: pytest -m gpu tests/test_dflash_gpu.py)."""

from __future__ import annotations

import pytest
import torch

from tests.dflash_helpers import chat_file, record_losses, small_config, tiny_target  # noqa: F401 (fixtures)
from tests.helpers import requires_cuda

pytestmark = [pytest.mark.gpu, requires_cuda(bf16=True)]


@pytest.mark.parametrize("n, seq", [(64, 256), (24, 64)])  # Q/KV 256/512 aligned; 96/160 padded to 128/256
def test_compiled_flex_matches_sdpa_forward_and_backward(n, seq):
    """Compiled flex_attention (BlockMask) and SDPA with the dense mask: same outputs and gradients,
    finite, also for short non-aligned lengths (flex pads them to its 128 block; issue #7 follow-up)."""
    from dflash.model.mask import build_masks
    from tests.test_dflash_model import make_drafter

    dev = torch.device("cuda")
    torch.manual_seed(0)
    d = make_drafter(head_dim=16).to(dev).train()  # triton flex kernels want head_dim >= 16
    anchors = torch.sort(torch.randperm(seq - 6, device=dev)[:n])[0][None].expand(2, n).contiguous()  # Q_LEN 4n
    bs = 4
    ctx, blocks = torch.randn(2, seq, 64, device=dev), torch.randn(2, n * bs, 32, device=dev)
    pos = (anchors[:, :, None] + torch.arange(bs, device=dev)).view(2, -1)
    ctx_pos = torch.arange(seq, device=dev).expand(2, seq)
    outs, grads = [], []
    for backend in ("flex", "sdpa"):
        d.zero_grad()
        out = d(blocks, ctx, pos, ctx_pos, masks=build_masks(anchors, seq, bs, backend))
        out.square().mean().backward()
        outs.append(out.detach())
        grads.append(d.fc.weight.grad.clone())
        assert torch.isfinite(grads[-1]).all() and all(torch.isfinite(p.grad).all() for p in d.parameters())
    torch.testing.assert_close(outs[0], outs[1], atol=2e-4, rtol=2e-3)
    torch.testing.assert_close(grads[0], grads[1], atol=2e-4, rtol=2e-3)


def test_tiny_training_on_gpu_with_flex_and_bf16(tmp_path, chat_file):
    from dflash.training.trainer import Trainer

    on_event, losses = record_losses()
    t = Trainer.from_config(small_config(tmp_path, chat_file, **{"topology.device": "cuda", "train.max_steps": 8}),
                            on_event=on_event)
    try:
        assert t.backend == "flex" and t.compute_dtype == torch.bfloat16 and t.target.dtype == torch.bfloat16
        r = t.train()
    finally:
        t.close()
    assert r.steps == 8 and all(torch.isfinite(torch.tensor(loss)) for _, loss in losses)


def test_compiled_layers_train_and_eval_on_gpu(tmp_path, chat_file):
    from dflash.training.trainer import Trainer

    t = Trainer.from_config(small_config(tmp_path, chat_file, **{
        "topology.device": "cuda", "train.max_steps": 4, "train.compile_layers": "true", "eval.at_end": "true",
        "eval.num_prompts": 2, "eval.max_new_tokens": 16}))
    try:
        r = t.train()
    finally:
        t.close()
    assert r.steps == 4 and r.eval.outputs_match
