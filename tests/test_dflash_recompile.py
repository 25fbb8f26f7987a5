"""What a compiled drafter compiles, counted (issue 28: one engine replica on the H200 compiled the draft
layer 8 times for 4 buckets, and 3 identical replicas each ran a full warm-and-verify pass).

- The mask_mod captures the context length as a tensor: a compiled region that receives the BlockMask
  does not guard on its value (it guarded `__closure__[2].cell_contents == 512`).
- Compiled layers: one graph per bucket, not two (layer 0's input requires grad like the others'),
  with the loss and gradients of the eager drafter.
- Engine prewarm: the first replica on a device compiles, the others reuse it in one pass that may
  not compile, and the prewarm result says which did what.

Counts are dynamo frame compiles from torch's own counters (compilewatch.tracing.counters), CPU, the
`eager`/`aot_eager` backends (dynamo + AOT autograd, no C++ toolchain).
"""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention.flex_attention import flex_attention

from compilewatch.tracing import counters
from dflash.engine import compile_safety
from dflash.engine.engine import Engine, EngineConfig, Replica
from dflash.engine.toy import ToySpec, toy_program
from dflash.model.build import empty_drafter
from dflash.model.drafter import DrafterSpec
from dflash.model.mask import block_mask_eager, build_masks, dense_mask, make_mask_mod, pad_mask_mod
from tests.helpers import requires_cuda

# eager flex on CPU is the unfused reference path; its "use torch.compile" advice is expected here
pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")

SPEC = DrafterSpec(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                   intermediate_size=128, vocab_size=100, target_layer_ids=(1, 2), num_target_layers=4, block_size=4)
BUCKETS = (16, 24, 32)  # sequence lengths: three shapes, so three graphs at most


def _frames(fn) -> tuple[int, tuple[str, ...]]:
    before = counters.snapshot()
    fn()
    d = counters.delta(before)
    return d.frames_ok, d.recompile_reasons


# ----------------------------------------------------------------------------- the mask closure
def test_context_length_in_the_mask_mod_is_not_a_compile_constant():
    """Same tensor shapes, three context lengths: compiled flex_attention (dynamic=False) compiles for the
    first and reuses that for the others. With the context length an int in the mask_mod's closure
    each length compiled again (a guard on the cell's value). The masks differ, and each output equals
    eager flex with the same BlockMask."""
    bs, n, q_len, kv_len = 16, 8, 128, 256  # padded grid, fixed: only the context length changes
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(1, 4, q_len, 16, generator=g), torch.randn(1, 2, kv_len, 16, generator=g), torch.randn(1, 2, kv_len, 16, generator=g)
    compiled = torch.compile(flex_attention, backend="eager", dynamic=False)
    masks = []
    for ctx in (96, 104, 112):  # KV 224..240: padded to 256 each time (one mask_mod code)
        anchors = torch.sort(torch.randint(0, ctx, (1, n), generator=g), 1)[0]
        real_q, real_kv = n * bs, ctx + n * bs  # the padding's real lengths vary too
        masks.append(block_mask_eager(pad_mask_mod(make_mask_mod(anchors, ctx, bs), real_q, real_kv), 1, q_len, kv_len, "cpu"))
    torch._dynamo.reset()
    got = []

    def call(m):
        with torch.no_grad():  # flex has no backward on CPU
            got.append(compiled(q, k, v, block_mask=m, enable_gqa=True))

    first, _ = _frames(lambda: call(masks[0]))
    later, reasons = _frames(lambda: [call(m) for m in masks[1:]])
    assert first >= 1 and later == 0, reasons
    with torch.no_grad():
        for out, m in zip(got, masks):
            assert torch.equal(out, flex_attention(q, k, v, block_mask=m, enable_gqa=True))
    assert not torch.equal(got[0], got[2])  # the context length did change the result


def test_a_tensor_context_length_gives_the_int_mask_bit_for_bit():
    """The dense (SDPA) mask and the flex BlockMask of a tensor-captured length are the masks of the
    same length given as an int (the loop reference in test_dflash_mask checks the int form)."""
    anchors = torch.tensor([[0, 3, 9, 17], [2, 5, 6, 20]])
    for window in (None, 6):
        a = dense_mask(make_mask_mod(anchors, 24, 4, window), 2, 16, 40, "cpu")
        b = dense_mask(make_mask_mod(anchors, torch.tensor(24), 4, window), 2, 16, 40, "cpu")
        assert a.dtype == torch.bool and torch.equal(a, b)
    flex, dense = build_masks(anchors, 24, 4, "flex")["full"], build_masks(anchors, 24, 4, "sdpa")["full"]
    assert torch.equal(flex.to_dense().bool().any(), torch.tensor(True))
    grid = dense_mask(flex.mask_mod, 2, 128, 128, "cpu")[:, :, :16, :40]  # the padded mask_mod, real region
    assert torch.equal(grid, dense)


# ----------------------------------------------------------------------------- compiled layers
def _drafter(compiled: bool, device: str = "cpu", backend: str = "aot_eager"):
    d = empty_drafter(SPEC, device)
    d.init_weights(torch.Generator(device=device).manual_seed(0))
    if compiled:
        d.compile_layers(dynamic=False, backend=backend)  # as build_drafter compiles them on CUDA (inductor)
    return d


def _step(d, seq: int, n: int = 3, attention: str = "sdpa"):
    """Forward + backward as drafter_loss runs it: the block embeddings do not require grad (frozen
    target embedding), the taps neither. Returns (loss, grads by name)."""
    g = torch.Generator().manual_seed(seq)
    bs = SPEC.block_size
    dev = d.fc.weight.device
    anchors = torch.sort(torch.randint(0, seq - bs, (2, n), generator=g), 1)[0].to(dev)
    emb, taps = torch.randn(2, n * bs, 64, generator=g).to(dev), torch.randn(2, seq, 128, generator=g).to(dev)
    pos = (anchors[:, :, None] + torch.arange(bs, device=dev)).view(2, -1)
    ctx_pos = torch.arange(seq, device=dev).expand(2, seq)
    out = d(emb, taps, pos, ctx_pos, masks=build_masks(anchors, seq, bs, attention))
    loss = out.pow(2).mean()
    loss.backward()
    grads = {k: p.grad.clone() for k, p in d.named_parameters()}
    d.zero_grad(set_to_none=True)
    return loss.detach(), grads


def test_compiled_layers_compile_once_per_bucket_not_twice():
    """Two compiled layers share one code object; with layer 0's input not requiring grad they needed
    two graphs per bucket (guard: "tensor 'x' requires_grad mismatch"). Now one per bucket, for
    shape reasons only."""
    d = _drafter(True)
    torch._dynamo.reset()
    frames, reasons = _frames(lambda: [_step(d, seq) for seq in BUCKETS])
    assert frames == len(BUCKETS), reasons
    assert not [r for r in reasons if "requires_grad" in r], reasons
    frames_again, _ = _frames(lambda: [_step(d, seq) for seq in BUCKETS])
    assert frames_again == 0


def test_the_first_layers_grad_input_changes_no_gradient():
    """The leaf that requires grad (layers_compiled) vs the plain embeddings, eager: the same loss and
    the same parameter gradients, bit for bit. And the compiled drafter gives the eager one's (the
    aot_eager graph runs the same aten ops; a tolerance covers a decomposition torch may reorder)."""
    plain, leaf = _drafter(False), _drafter(False)
    leaf.layers_compiled = True  # the input handling alone, without compiling
    compiled = _drafter(True)
    for seq in BUCKETS:
        (lp, gp), (ll, gl), (lc, gc) = _step(plain, seq), _step(leaf, seq), _step(compiled, seq)
        assert torch.equal(lp, ll) and gp.keys() == gl.keys()
        assert all(torch.equal(gp[k], gl[k]) for k in gp)
        torch.testing.assert_close(lc, lp, rtol=1e-6, atol=1e-7)
        for k in gp:
            torch.testing.assert_close(gc[k], gp[k], rtol=1e-5, atol=1e-7)


def test_no_grad_forward_is_untouched():
    """Under no_grad (eval, serving) nothing requires grad: layer 0's input is left as it is."""
    d = _drafter(True)
    with torch.no_grad():
        torch._dynamo.reset()
        frames, _ = _frames(lambda: d(torch.randn(1, 8, 64), torch.randn(1, 16, 128), torch.arange(8)[None] + 16,
                                      torch.arange(16)[None]))
    assert frames == 1


# ----------------------------------------------------------------------------- engine prewarm
def _replicas(n: int) -> list[Replica]:
    out = []
    for i in range(n):
        d = _drafter(True)
        out.append(Replica(i, "cpu", d, torch.optim.AdamW(d.parameters()), {}))
    return out


def test_prewarm_compiles_once_for_identical_replicas_on_one_device():
    """3 compiled drafter replicas on one device, 3 buckets: replica 0 compiles one graph per bucket and
    is verified; replicas 1 and 2 each run once under fail_on_recompile and compile nothing."""
    torch._dynamo.reset()
    reps = _replicas(3)
    calls = []

    def warm(rep):
        calls.append(rep.index)
        for seq in BUCKETS:
            _step(rep.model, seq)

    pre = compile_safety.prewarm_replicas(reps, warm)
    assert pre.ok, pre.verdicts
    assert [(w.index, w.mode) for w in pre.per_replica] == [(0, "compiled"), (1, "reused"), (2, "reused")]
    assert [w.frames_compiled for w in pre.per_replica] == [len(BUCKETS), 0, 0]
    assert calls == [0, 0, 1, 2]  # replica 0: warm + verify; the others: one pass each
    assert pre.compiled == 1 and len(pre.replica_s) == 3
    assert all(all(p.grad is None for p in r.model.parameters()) for r in reps)
    assert any("1 on cpu reused (0 dynamo frame(s) compiled" in v for v in pre.verdicts), pre.verdicts


def test_a_replica_that_cannot_reuse_is_warmed_on_its_own_and_says_why():
    """Replica 2 runs another bucket than the others: its reuse pass would compile, so it is warmed and
    verified by itself, reported `recompiled` with the guard failure; prewarm still succeeds."""
    torch._dynamo.reset()
    reps = _replicas(3)

    def warm(rep):
        for seq in (BUCKETS if rep.index < 2 else (40,)):
            _step(rep.model, seq)

    pre = compile_safety.prewarm_replicas(reps, warm)
    assert pre.ok, pre.verdicts
    assert [w.mode for w in pre.per_replica] == ["compiled", "reused", "recompiled"]
    rc = pre.per_replica[2]
    assert rc.frames_compiled == 1 and rc.reason and "forward" in rc.reason
    assert any("replica 2 could not reuse" in v for v in pre.verdicts)


def test_engine_report_names_compiled_and_reused_replicas():
    """End to end on the toy program (each replica its own torch.compile wrapper): the engine's
    prewarm result and verdict say one replica compiled and two reused."""
    torch._dynamo.reset()
    cfg = EngineConfig(target_devices=("cpu",), drafter_devices=("cpu", "cpu", "cpu"), steps=2, sample_every=0,
                       join_timeout=5.0)
    report = Engine(toy_program(ToySpec(compile_backend="aot_eager")), cfg).run()
    assert report.ok, report.verdicts
    assert [w.mode for w in report.prewarm.per_replica] == ["compiled", "reused", "reused"]
    assert report.prewarm.per_replica[0].frames_compiled >= 1
    frames = report.prewarm.per_replica[0].frames_compiled
    assert any(f"(1 warmed, {frames} dynamo frame(s) compiled; 2 reused that code: " in v for v in report.verdicts), report.verdicts


# ----------------------------------------------------------------------------- on a GPU (inductor, flex)
GPU_BUCKETS = (128, 200, 256)  # with 32 blocks of 4: Q 128, KV 256 / 328 (padded to 384) / 384


@pytest.mark.gpu
@requires_cuda()
def test_compiled_layers_with_flex_compile_once_per_bucket_on_gpu():
    """CUDA, inductor, the flex BlockMask whose mask_mod captures the context length as a tensor: one
    compile per bucket (the H200 / torch 2.11 log had two, plus a guard on the closure's int), and the
    loss and gradients of the eager drafter over the dense mask (SDPA), to flex-vs-SDPA tolerance."""
    eager, compiled = _drafter(False, "cuda"), _drafter(True, "cuda", "inductor")
    torch._dynamo.reset()
    got = []
    frames, reasons = _frames(lambda: got.extend(_step(compiled, s, 32, "flex") for s in GPU_BUCKETS))
    assert frames == len(GPU_BUCKETS), reasons
    assert not [r for r in reasons if "requires_grad" in r or "cell_contents" in r], reasons
    for s, (lc, gc) in zip(GPU_BUCKETS, got):
        le, ge = _step(eager, s, 32, "sdpa")
        torch.testing.assert_close(lc, le, rtol=2e-3, atol=2e-4)
        for k in ge:
            torch.testing.assert_close(gc[k], ge[k], rtol=2e-3, atol=2e-4)


@pytest.mark.gpu
@requires_cuda()
def test_prewarm_of_three_identical_replicas_compiles_once_on_gpu():
    """Three inductor-compiled drafter replicas on one GPU: replica 0 compiles, 1 and 2 reuse its code
    (one pass each under fail_on_recompile) and take a step's time, not a compile's."""
    torch._dynamo.reset()
    reps = []
    for i in range(3):
        d = _drafter(True, "cuda", "inductor")
        reps.append(Replica(i, "cuda:0", d, torch.optim.AdamW(d.parameters()), {}))

    def warm(rep):
        for s in GPU_BUCKETS:
            _step(rep.model, s, 32, "flex")

    pre = compile_safety.prewarm_replicas(reps, warm)
    assert pre.ok, pre.verdicts
    assert [w.mode for w in pre.per_replica] == ["compiled", "reused", "reused"], pre.verdicts
    assert [w.frames_compiled for w in pre.per_replica] == [len(GPU_BUCKETS), 0, 0]
