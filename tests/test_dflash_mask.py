"""dflash.model.mask: the mask_mod against a loop reference, flex BlockMask == dense mask, flex vs SDPA forward."""

from __future__ import annotations

import pytest
import torch

from compilewatch.errors import BadInput
from dflash.model.mask import (FLEX_BLOCK, build_masks, dense_mask, detect_backend, flex_attend, flex_len, make_mask_mod,
                         pad_mask_mod)

# eager flex on CPU is the unfused reference path; its "use torch.compile" advice is expected here
pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")


def reference_mask(anchors, ctx_len, bs, window=None):
    """Plain loops over the DFlash paper's mask: block j sees context kv < anchor_j and its own block, nothing else."""
    b, n = anchors.shape
    q_len, kv_len = n * bs, ctx_len + n * bs
    rows = []
    for bi in range(b):
        anc = anchors[bi].tolist()
        for q in range(q_len):
            j, k = divmod(q, bs)
            a = anc[j]
            row = []
            for kv in range(kv_len):
                if kv < ctx_len:
                    ok = kv < a and (window is None or (a + k) - kv < window)
                else:
                    jj, kk = divmod(kv - ctx_len, bs)
                    ok = jj == j and (window is None or kk <= k)
                row.append(ok)
            rows.append(row)
    return torch.tensor(rows, dtype=torch.bool).view(b, 1, q_len, kv_len)


ANCHORS = torch.tensor([[0, 3, 9, 17], [2, 5, 6, 20]])


@pytest.mark.parametrize("window", [None, 6])
def test_dense_mask_equals_loop_reference(window):
    mod = make_mask_mod(ANCHORS, 24, 4, window)
    got = dense_mask(mod, 2, 16, 24 + 16, "cpu")
    assert torch.equal(got, reference_mask(ANCHORS, 24, 4, window))
    # strictness: the anchor's own context position is never visible to its block
    for bi in range(2):
        for j, a in enumerate(ANCHORS[bi].tolist()):
            if a < 24:
                assert not got[bi, 0, j * 4: (j + 1) * 4, a].any()


def test_dense_mask_equals_torch_create_mask():
    """Our broadcasting evaluation agrees with flex's own vmap-based dense mask of the same mask_mod."""
    from torch.nn.attention.flex_attention import create_mask

    mod = make_mask_mod(ANCHORS, 24, 4)
    assert torch.equal(dense_mask(mod, 2, 16, 40, "cpu"), create_mask(mod, 2, 1, 16, 40, device="cpu"))


def test_flex_block_mask_equals_dense_reference():
    """The BlockMask create_block_mask builds covers exactly the dense mask (checked through its mask_mod
    on every partial block and its full/empty block bookkeeping, via to_dense and attention)."""
    bs, ctx = 8, 200
    anchors = torch.tensor([[0, 40, 100, 150, 160, 190, 60, 10] * 4])  # 32 blocks -> Q_LEN 256 (two 128-blocks)
    anchors, _ = torch.sort(anchors)
    m = build_masks(anchors, ctx, bs, "flex")["full"]
    dense = reference_mask(anchors, ctx, bs)
    # block level: a (q-block, kv-block) tile is present iff the dense mask has any True in it
    tiles = m.to_dense()[0, 0].bool()
    qb, kb = m.BLOCK_SIZE
    q_len, kv_len = dense.shape[-2:]
    for i in range(tiles.shape[0]):
        for k in range(tiles.shape[1]):
            any_true = dense[0, 0, i * qb:(i + 1) * qb, k * kb:(k + 1) * kb].any().item()
            assert bool(tiles[i, k]) == any_true, (i, k)
    # element level: flex attention with the BlockMask (KV 456 padded to 512) == SDPA with the dense reference
    torch.manual_seed(0)
    q = torch.randn(1, 2, q_len, 16)
    k, v = torch.randn(1, 2, kv_len, 16), torch.randn(1, 2, kv_len, 16)
    torch.testing.assert_close(flex_attend(q, k, v, m),
                               torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=dense),
                               atol=2e-5, rtol=1e-4)


def test_flex_and_sdpa_drafter_forward_agree_on_cpu():
    """The fast path (flex BlockMask) and the fallback (dense SDPA) give the same drafter forward."""
    from tests.test_dflash_model import make_drafter

    torch.manual_seed(3)
    d = make_drafter()
    anchors = torch.tensor([[1, 4, 9, 12], [0, 2, 7, 15]])
    seq, bs = 20, 4
    ctx, blocks = torch.randn(2, seq, 64), torch.randn(2, 16, 32)
    pos = (anchors[:, :, None] + torch.arange(bs)).view(2, 16)
    ctx_pos = torch.arange(seq).expand(2, seq)
    with torch.no_grad():  # flex has no backward on CPU (torch/nn/attention/flex_attention.py): compare forwards
        out_flex = d(blocks, ctx, pos, ctx_pos, masks=build_masks(anchors, seq, bs, "flex"))
        out_sdpa = d(blocks, ctx, pos, ctx_pos, masks=build_masks(anchors, seq, bs, "sdpa"))
    torch.testing.assert_close(out_flex, out_sdpa, atol=1e-5, rtol=1e-4)


def _qkv(b, q_len, kv_len, nh=4, nkv=2, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, nh, q_len, d, generator=g), torch.randn(b, nkv, kv_len, d, generator=g),
            torch.randn(b, nkv, kv_len, d, generator=g))


@pytest.mark.parametrize("bs, n, ctx, window", [
    (16, 6, 64, None),  # Q 96, KV 160: the H200 failure's shape (issue #7 follow-up), padded to 128 / 256
    (4, 5, 7, 6),  # Q 20, KV 27, sliding window
    (16, 8, 128, None),  # Q 128, KV 256: aligned, no padding
    (8, 32, 256, 5),  # Q 256, KV 512: aligned, sliding window
])
def test_padded_flex_forward_equals_sdpa_dense(bs, n, ctx, window):
    """Flex over the padded grid, sliced back, == SDPA with the dense mask, for aligned and short
    non-aligned lengths (eager flex forward on CPU: the same mask_mod the compiled kernel runs)."""
    g = torch.Generator().manual_seed(n)
    anchors = torch.sort(torch.randint(0, ctx + 1, (2, n), generator=g), dim=1)[0]
    q_len, kv_len = n * bs, ctx + n * bs
    m = build_masks(anchors, ctx, bs, "flex", window, need_sliding=window is not None)
    dense = build_masks(anchors, ctx, bs, "sdpa", window, need_sliding=window is not None)
    kind = "full" if window is None else "sliding"
    assert m[kind].seq_lengths == (flex_len(q_len), flex_len(kv_len))
    assert all(x % FLEX_BLOCK == 0 for x in m[kind].seq_lengths)
    q, k, v = _qkv(2, q_len, kv_len)
    out = flex_attend(q, k, v, m[kind])
    assert out.shape == q.shape
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=dense[kind], enable_gqa=True)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)


def test_padding_is_a_no_op_for_aligned_lengths():
    mod = make_mask_mod(ANCHORS, 24, 4)
    assert flex_len(128) == 128 and flex_len(256) == 256 and flex_len(1) == 128 and flex_len(129) == 256
    assert pad_mask_mod(mod, 128, 384) is mod  # aligned: the mask_mod itself
    anchors = torch.tensor([[0, 50, 100, 120, 128, 130, 200, 250]])  # 8 blocks of 16: Q 128, KV 256 + 128
    m = build_masks(anchors, 256, 16, "flex")["full"]
    assert m.seq_lengths == (128, 384) and m.mask_mod.__name__ == "mask_mod"  # not wrapped
    q, k, v = _qkv(1, 128, 384)
    from torch.nn.attention.flex_attention import flex_attention

    torch.testing.assert_close(flex_attend(q, k, v, m), flex_attention(q, k, v, block_mask=m, enable_gqa=True))


def test_padded_rows_and_columns_are_masked_and_finite():
    """Padded query rows see nothing (flex gives finite 0 there), padded key columns are never visible:
    garbage in the padding changes nothing in the real rows."""
    anchors = torch.tensor([[3, 10, 20, 30, 40, 50]])
    mod = make_mask_mod(anchors, 64, 16)
    padded = pad_mask_mod(mod, 96, 160)
    grid = dense_mask(padded, 1, 128, 256, "cpu")[0, 0]
    assert torch.equal(grid[:96, :160], dense_mask(mod, 1, 96, 160, "cpu")[0, 0])
    assert not grid[96:].any() and not grid[:, 160:].any()
    m = build_masks(anchors, 64, 16, "flex")["full"]
    from torch.nn.attention.flex_attention import flex_attention

    q, k, v = _qkv(1, 128, 256)
    full = flex_attention(q, k, v, block_mask=m, enable_gqa=True)  # (1, 4, 128, 16) over the padded grid
    assert torch.isfinite(full).all() and not full[:, :, 96:].any()  # fully masked rows: exactly 0
    k2, v2 = k.clone(), v.clone()
    k2[:, :, 160:], v2[:, :, 160:] = 1e4, -1e4  # padded columns: no weight in real rows
    torch.testing.assert_close(flex_attention(q, k2, v2, block_mask=m, enable_gqa=True)[:, :, :96], full[:, :, :96])


def test_backend_detection_once_with_override():
    assert detect_backend("cpu") == "sdpa"  # flex has no backward on CPU
    assert detect_backend("cpu", "sdpa") == "sdpa"
    with pytest.raises(BadInput, match="flex"):
        detect_backend("cpu", "flex")
    with pytest.raises(BadInput):
        detect_backend("cpu", "fast")


def zlab_attention_mask(q_len, kv_len, *, is_causal, sliding_window):
    """The authors' inference mask (z-lab/dflash `_attention_mask`): queries are the last q_len positions
    of the keys [context | block]; sliding layers are causal (`is_causal` = sliding_attention) with
    `q_pos - k_pos < sliding_window`; full layers pass no mask (see everything)."""
    q_pos = kv_len - q_len + torch.arange(q_len)[:, None]
    k_pos = torch.arange(kv_len)[None, :]
    visible = torch.ones(q_len, kv_len, dtype=torch.bool)
    if is_causal:
        visible &= k_pos <= q_pos
    if sliding_window is not None:
        visible &= q_pos - k_pos < sliding_window
    return visible


@pytest.mark.parametrize("start, bs, window", [(5, 4, 4), (20, 4, 6), (40, 8, 16), (3, 8, 64)])
def test_sliding_and_full_layers_match_the_reference_inference_mask(start, bs, window):
    """One block at inference (anchor = start, context = positions 0..start-1): our masks equal the
    reference's for both layer kinds; training blocks use the same mask_mod per anchor."""
    anchors = torch.tensor([[start]])
    m = build_masks(anchors, start, bs, "sdpa", window, need_sliding=True)
    ref_sliding = zlab_attention_mask(bs, start + bs, is_causal=True, sliding_window=window)
    assert torch.equal(m["sliding"][0, 0], ref_sliding)
    assert bool(m["full"][0, 0].all())  # full layers: whole context and the whole block, bidirectional


@pytest.mark.parametrize("window", [None, 20])
def test_block_mask_eager_equals_create_block_mask(monkeypatch, window):
    """`block_mask_eager` (bands of query tiles, nothing compiled) builds the very BlockMask that
    flex's own create_block_mask builds from the same padded mask_mod: same partial and full block
    counts and indices, for two sequences, padded lengths and several bands."""
    from torch.nn.attention.flex_attention import create_block_mask

    from dflash.model import mask as masks

    monkeypatch.setattr(masks, "MASK_CHUNK_ELEMENTS", 2 * 128 * 1024)  # bands of one 128-row tile
    bs, ctx = 8, 600
    g = torch.Generator().manual_seed(5)
    anchors = torch.stack([torch.sort(torch.randperm(ctx - bs, generator=g)[:40])[0] for _ in range(2)])
    q_len, kv_len = 40 * bs, ctx + 40 * bs  # 320 / 920 -> padded 384 / 1024
    mod = masks.pad_mask_mod(make_mask_mod(anchors, ctx, bs, window), q_len, kv_len)
    q_pad, kv_pad = masks.flex_len(q_len), masks.flex_len(kv_len)
    got = masks.block_mask_eager(mod, 2, q_pad, kv_pad, "cpu")
    want = create_block_mask(mod, 2, None, q_pad, kv_pad, device="cpu", BLOCK_SIZE=masks.FLEX_BLOCK)
    for name in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    assert got.seq_lengths == want.seq_lengths and got.BLOCK_SIZE == want.BLOCK_SIZE
    assert int(got.kv_num_blocks.sum()) > 0
    assert (int(got.full_kv_num_blocks.sum()) > 0) == (window is None)  # a 20-wide window fills no 128 tile
