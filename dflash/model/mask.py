"""The DFlash training mask, written once as a flex `mask_mod`, and the attention backend choice.

Layout: Q = N blocks × B slots; KV = [context S | the same N×B block tokens]. Block j (anchor a_j):
- sees context positions `kv < a_j`, **strictly**: the anchor's own target hidden state is not
  available at inference (the anchor is the target's bonus token, not yet verified), and `<=` here
  trains a drafter that copies the answer from the context (~70% train accuracy, τ ≈ 1 served);
- sees its own block's B slots, bidirectionally (sliding-window layers: causally, as served);
- sees nothing else (no other block).
Rows never end up empty (a block always sees itself), so SDPA never produces NaN; blocks beyond a
sequence's valid length are masked in the loss instead.

Backends: `flex` builds a BlockMask (`block_mask_eager`: what `create_block_mask` builds, evaluated in
bands of query tiles without compiling) and runs `torch.compile(flex_attention)`
(CUDA; flex has no backward on CPU); `sdpa` evaluates the *same* mask_mod over the full grid into a
dense boolean mask for `scaled_dot_product_attention` (CPU, and the fallback). The choice is made
once per device type by `detect_backend`; `train.attention` overrides it.

Flex lengths are padded up to multiples of its block size (`FLEX_BLOCK` = 128): compiled flex_attention
finds no kernel for short non-aligned lengths (H200, torch 2.11: NoValidChoicesError at Q 96 / KV 160).
The BlockMask is built over the padded grid (padded query rows see nothing, padded key columns are
never visible), `flex_attend` zero-pads q/k/v to the mask's lengths and slices the output back. Rows
with no visible key come out as 0 (finite) and get no gradient. Aligned lengths (real DFlash shapes:
Q = 512×16, KV = 3072 + 8192) are untouched; the SDPA path never pads.

The compiled pieces live behind `compiled_kernels()` so a multi-device engine can warm them on each
device, one device after another, before worker threads start (compilewatch's warm barrier).
"""

from __future__ import annotations

import functools
from typing import Callable, Literal

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from compilewatch import BadInput

Backend = Literal["flex", "sdpa"]


def _index_scalar(value: int | torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """`value` as a 0-d tensor of `like`'s dtype on its device (a fill, no host-to-device copy)."""
    if isinstance(value, torch.Tensor):
        return value.to(device=like.device, dtype=like.dtype).reshape(())
    return torch.full((), int(value), dtype=like.dtype, device=like.device)


def make_mask_mod(anchors: torch.Tensor, ctx_len: int | torch.Tensor, block_size: int,
                  sliding_window: int | None = None) -> Callable:
    """mask_mod(b, h, q_idx, kv_idx) -> bool for anchors (B, N). Pure tensor ops: it broadcasts,
    vmaps (flex) and compiles.

    `ctx_len` is captured as a 0-d tensor (like `anchors`), never as a Python int: a compiled region
    that receives the BlockMask (a `train.compile_layers` layer) guards on the mask_mod's closure, and an
    int cell there is a constant guard (`__closure__[i].cell_contents == 512`, H200 / torch 2.11): a
    recompile for every context length, even where the shapes are dynamic. A tensor cell is guarded
    on its dtype/device/shape only. `block_size` and `sliding_window` stay ints: fixed for a run."""
    ctx = _index_scalar(ctx_len, anchors)

    def mask_mod(b, h, q_idx, kv_idx):
        j = q_idx // block_size  # which block the query is in
        anchor = anchors[b, j]
        in_ctx = kv_idx < ctx
        ctx_ok = in_ctx & (kv_idx < anchor)  # strict: positions before the anchor only
        kv_blk = kv_idx - ctx
        same_block = (~in_ctx) & (kv_blk // block_size == j)
        if sliding_window is None:
            return ctx_ok | same_block
        q_pos = anchor + q_idx % block_size
        ctx_ok = ctx_ok & (q_pos - kv_idx < sliding_window)
        causal = (kv_blk % block_size) <= (q_idx % block_size)
        return ctx_ok | (same_block & causal)

    return mask_mod


FLEX_BLOCK = 128  # flex's sparse block size (create_block_mask's default BLOCK_SIZE), passed explicitly


def flex_len(n: int) -> int:
    """`n` rounded up to a multiple of FLEX_BLOCK: the length flex sees for a real length `n`."""
    return -(-n // FLEX_BLOCK) * FLEX_BLOCK


def pad_mask_mod(mask_mod: Callable, q_len: int, kv_len: int, device: torch.device | str | None = None) -> Callable:
    """`mask_mod` over the padded (flex_len(q_len), flex_len(kv_len)) grid: False on padded rows and
    columns, `mask_mod` inside (indices clamped so it never indexes past its real lengths). The same
    `mask_mod` when both lengths are already aligned. The real lengths are captured as 0-d int64
    tensors on `device` (default CPU), not ints, for the reason `make_mask_mod` gives."""
    if flex_len(q_len) == q_len and flex_len(kv_len) == kv_len:
        return mask_mod
    q_n = torch.full((), q_len, dtype=torch.long, device=device)
    kv_n = torch.full((), kv_len, dtype=torch.long, device=device)

    def padded(b, h, q_idx, kv_idx):
        real = (q_idx < q_n) & (kv_idx < kv_n)
        return real & mask_mod(b, h, torch.minimum(q_idx, q_n - 1), torch.minimum(kv_idx, kv_n - 1))

    return padded


def dense_mask(mask_mod: Callable, batch: int, q_len: int, kv_len: int, device, q_start: int = 0) -> torch.Tensor:
    """Evaluate `mask_mod` by broadcasting over query rows [q_start, q_len) and every key:
    (B, 1, q_len - q_start, KV) bool (the whole grid for SDPA)."""
    b = torch.arange(batch, device=device)[:, None, None, None]
    h = torch.zeros((), dtype=torch.long, device=device)
    q = torch.arange(q_start, q_len, device=device)[None, None, :, None]
    kv = torch.arange(kv_len, device=device)[None, None, None, :]
    return mask_mod(b, h, q, kv).expand(batch, 1, q_len - q_start, kv_len)


MASK_CHUNK_ELEMENTS = 1 << 25  # mask entries evaluated at once by `block_mask_eager` (32 MB of bools)


def _ordered(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, 1, Qb, KVb) bool -> (count (B, 1, Qb), column indices with the True ones first), int32:
    create_block_mask's own layout."""
    count = blocks.sum(-1, dtype=torch.int32)
    order = torch.argsort(blocks.to(torch.int8), dim=-1, descending=True, stable=True).to(torch.int32)
    return count, order


def block_mask_eager(mask_mod: Callable, batch: int, q_len: int, kv_len: int, device) -> BlockMask:
    """The BlockMask `create_block_mask(mask_mod, batch, None, q_len, kv_len, BLOCK_SIZE=FLEX_BLOCK)`
    builds, without compiling anything: `mask_mod` is evaluated eagerly in bands of query tiles
    (never the whole Q×KV grid at once), reduced per 128×128 tile to "any visible" and "all visible".
    Lengths must be multiples of FLEX_BLOCK (`build_masks` pads). Why not the compiled
    create_block_mask: on H200 / torch 2.11 its first compile at DFlash shapes took 212 s of a 236 s
    cold first training step (Triton precompiling ~112 kernel variants), and 9 s even from a warm cache."""
    if q_len % FLEX_BLOCK or kv_len % FLEX_BLOCK:
        raise ValueError(f"block_mask_eager: lengths must be multiples of {FLEX_BLOCK}, got {q_len}, {kv_len}")
    qb, kvb = q_len // FLEX_BLOCK, kv_len // FLEX_BLOCK
    band = max(1, MASK_CHUNK_ELEMENTS // (batch * FLEX_BLOCK * kv_len)) * FLEX_BLOCK  # query rows per band
    anys, alls = [], []
    for q0 in range(0, q_len, band):
        q1 = min(q_len, q0 + band)
        m = dense_mask(mask_mod, batch, q1, kv_len, device, q_start=q0)  # (B, 1, rows, KV)
        tiles = m.reshape(batch, 1, (q1 - q0) // FLEX_BLOCK, FLEX_BLOCK, kvb, FLEX_BLOCK)
        anys.append(tiles.any(5).any(3))  # (B, 1, rows/128, KVb)
        alls.append(tiles.all(5).all(3))
    any_v, all_v = torch.cat(anys, 2), torch.cat(alls, 2)  # (B, 1, qb, KVb): the bands cover every query tile
    partial, full = _ordered(any_v & ~all_v), _ordered(all_v)
    return BlockMask.from_kv_blocks(partial[0], partial[1], full[0], full[1], BLOCK_SIZE=FLEX_BLOCK,
                                    mask_mod=mask_mod, seq_lengths=(q_len, kv_len))


def is_block_mask(mask) -> bool:
    return isinstance(mask, BlockMask)


@functools.cache
def flex_compiles_on(device_type: str) -> bool:
    """Whether compiled flex_attention (with backward) is available on this device type. Cached."""
    if device_type != "cuda" or not torch.cuda.is_available():
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def detect_backend(device: torch.device | str, requested: str = "auto") -> Backend:
    """`auto` -> flex where it compiles (CUDA + triton), else sdpa. `flex` on CPU is bad input."""
    device_type = torch.device(device).type
    if requested == "sdpa":
        return "sdpa"
    if requested == "flex":
        if not flex_compiles_on(device_type):
            raise BadInput(f"train.attention=flex needs a CUDA device with triton (device is {device_type})",
                           hint="flex_attention has no backward on CPU; use train.attention=sdpa or auto")
        return "flex"
    if requested != "auto":
        raise BadInput(f"train.attention={requested!r}", hint="expected auto, flex or sdpa")
    return "flex" if flex_compiles_on(device_type) else "sdpa"


_USE_COMPILED_FLEX = True  # override for tests and benchmarks: use_compiled_flex(False)


def use_compiled_flex(enabled: bool) -> None:
    """Force eager flex_attention on CUDA (benchmarks compare it; tests check fast == fallback)."""
    global _USE_COMPILED_FLEX
    _USE_COMPILED_FLEX = enabled


@functools.cache
def _compiled_flex():
    return torch.compile(flex_attention, dynamic=False)


def flex_attention_fn(device: torch.device) -> Callable:
    """Compiled flex_attention on CUDA; the eager (dense math, forward-only) one elsewhere.

    Inside a region dynamo is already compiling (`train.compile_layers`: each draft layer compiled)
    it is plain flex_attention, which that compile lowers itself: calling the `functools.cache`d
    `_compiled_flex` there made dynamo trace through the cache wrapper and warn on every run."""
    if device.type == "cuda" and _USE_COMPILED_FLEX and not torch.compiler.is_compiling():
        return _compiled_flex()
    return flex_attention


def flex_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_mask: BlockMask) -> torch.Tensor:
    """flex_attention (GQA) with q (B, nh, Q, D), k/v (B, nkv, KV, D) zero-padded to the BlockMask's
    aligned lengths (from `build_masks`); returns (B, nh, Q, D). No padding when already aligned."""
    q_len, kv_len = q.shape[-2], k.shape[-2]
    q_pad, kv_pad = block_mask.seq_lengths  # multiples of FLEX_BLOCK
    if q_pad != q_len:
        q = F.pad(q, (0, 0, 0, q_pad - q_len))  # (B, nh, Q_pad, D): extra rows see nothing
    if kv_pad != kv_len:
        k = F.pad(k, (0, 0, 0, kv_pad - kv_len))  # (B, nkv, KV_pad, D): extra columns never visible
        v = F.pad(v, (0, 0, 0, kv_pad - kv_len))
    out = flex_attention_fn(q.device)(q, k, v, block_mask=block_mask, enable_gqa=True)  # (B, nh, Q_pad, D)
    return out if q_pad == q_len else out[:, :, :q_len]


# ---------------------------------------------------------------- packed micro-batches
def make_packed_mask_mod(anchor_row: torch.Tensor, doc_start: torch.Tensor, anchor_col: torch.Tensor,
                         row_len: int, ctx_len: int, block_size: int, sliding_window: int | None = None) -> Callable:
    """The packed layout's mask_mod (dflash/data/packing.py): Q = N blocks × B slots of one row; KV =
    [the context: R rows of `row_len` taps, flattened | the N×B block tokens]. Block j (its conversation
    in row `anchor_row[j]` from column `doc_start[j]`, its anchor at column `anchor_col[j]`) sees the
    context of its own conversation strictly before its anchor, and its own block: the very keys the
    padded layout gives it (`make_mask_mod`), at the same relative positions. Lengths are captured as
    0-d tensors (see make_mask_mod)."""
    ctx = _index_scalar(ctx_len, anchor_col)
    width = _index_scalar(row_len, anchor_col)

    def mask_mod(b, h, q_idx, kv_idx):
        j = q_idx // block_size
        row, start, col = anchor_row[j], doc_start[j], anchor_col[j]
        in_ctx = kv_idx < ctx
        kv_c = torch.minimum(kv_idx, ctx - 1)
        kv_col = kv_c % width
        ctx_ok = in_ctx & (kv_c // width == row) & (kv_col >= start) & (kv_col < col)
        kv_blk = kv_idx - ctx
        same_block = (~in_ctx) & (kv_blk // block_size == j)
        if sliding_window is None:
            return ctx_ok | same_block
        ctx_ok = ctx_ok & (col + q_idx % block_size - kv_col < sliding_window)
        causal = (kv_blk % block_size) <= (q_idx % block_size)
        return ctx_ok | (same_block & causal)

    return mask_mod


def _tile_counts(lo: torch.Tensor, hi: torch.Tensor, q_tiles: int, kv_tiles: int, full: bool) -> torch.Tensor:
    """(q_tiles, kv_tiles) int32: for each query tile, how many of its rows' key intervals [lo, hi)
    touch (full=False) or cover (full=True) each key tile. A difference array per row, then a cumsum."""
    q = torch.arange(lo.numel(), device=lo.device)
    if full:
        t0, t1 = (lo + FLEX_BLOCK - 1) // FLEX_BLOCK, hi // FLEX_BLOCK
    else:
        t0, t1 = lo // FLEX_BLOCK, (hi + FLEX_BLOCK - 1) // FLEX_BLOCK
    keep = t1 > t0
    qt, t0, t1 = q[keep] // FLEX_BLOCK, t0[keep], t1[keep]
    diff = torch.zeros(q_tiles, kv_tiles + 1, dtype=torch.int32, device=lo.device)
    one = torch.ones_like(qt, dtype=torch.int32)
    diff.index_put_((qt, t0), one, accumulate=True)
    diff.index_put_((qt, t1), -one, accumulate=True)
    return diff.cumsum(1, dtype=torch.int32)[:, :kv_tiles]


def _packed_intervals(anchor_row: torch.Tensor, doc_start: torch.Tensor, anchor_col: torch.Tensor, row_len: int,
                      ctx_len: int, block_size: int, sliding_window: int | None):
    """Each query row's two key intervals in the packed layout, [c_lo, c_hi) (its conversation's context
    before the anchor; sliding: within the window) and [s_lo, s_hi) (its own block; sliding: causally),
    over the padded query grid (padded rows: empty intervals). Returns (q_len, kv_len, q_pad, kv_pad,
    (c_lo, c_hi, s_lo, s_hi))."""
    n = anchor_col.numel()
    q_len, kv_len = n * block_size, ctx_len + n * block_size
    q_pad, kv_pad = flex_len(q_len), flex_len(kv_len)
    q = torch.arange(q_len, device=anchor_col.device)
    j, k = q // block_size, q % block_size
    base = anchor_row[j] * row_len
    c_lo, c_hi = base + doc_start[j], base + anchor_col[j]  # the context before the anchor
    if sliding_window is not None:
        c_lo = torch.maximum(c_lo, c_hi + k - sliding_window + 1)
    c_hi = torch.maximum(c_hi, c_lo)
    s_lo = ctx_len + j * block_size  # its own block (sliding: causally)
    s_hi = s_lo + (k + 1 if sliding_window is not None else block_size)
    z = torch.zeros(q_pad - q_len, dtype=torch.long, device=q.device)  # padded query rows: no key at all
    return q_len, kv_len, q_pad, kv_pad, tuple(torch.cat([t, z]) for t in (c_lo, c_hi, s_lo, s_hi))


def interval_mask_mod(c_lo: torch.Tensor, c_hi: torch.Tensor, s_lo: torch.Tensor, s_hi: torch.Tensor) -> Callable:
    """mask_mod of per-query-row key intervals: visible iff kv in [c_lo, c_hi) or [s_lo, s_hi). Four
    loads per row and four compares per element (no division), for flex's partial tiles."""

    def mask_mod(b, h, q_idx, kv_idx):
        return ((kv_idx >= c_lo[q_idx]) & (kv_idx < c_hi[q_idx])) | ((kv_idx >= s_lo[q_idx]) & (kv_idx < s_hi[q_idx]))

    return mask_mod


def packed_block_mask(anchor_row: torch.Tensor, doc_start: torch.Tensor, anchor_col: torch.Tensor, row_len: int,
                      ctx_len: int, block_size: int, sliding_window: int | None = None,
                      device: torch.device | str | None = None) -> BlockMask:
    """The BlockMask of `make_packed_mask_mod` over the padded grid, from each query row's two key
    intervals (its conversation's context before the anchor, its own block) instead of evaluating the
    mask over Q × KV: the packed grid is large (Q 32 K × KV 45 K at 8B) and almost all of it empty.
    The same tiles `block_mask_eager` finds, and its mask_mod (`interval_mask_mod` over those intervals:
    no division per element) gives the row formula's answer everywhere (tests/test_packing.py checks both).

    It is computed where the block tensors are and lands on `device` (default: there). The training step
    passes the batch's CPU copy and its GPU: built on the GPU, the tile counts' boolean indexing waits for
    the GPU (six host syncs a mask, each leaving the GPU idle while the host queues the next work; H200,
    torch 2.11); built on the CPU (~13 ms for an 8B chunk on a 2-core box, while the GPU still runs the
    step's earlier work), the mask's few small tensors are copied over from pinned memory without waiting."""
    _q_len, _kv_len, q_pad, kv_pad, (c_lo, c_hi, s_lo, s_hi) = _packed_intervals(
        anchor_row, doc_start, anchor_col, row_len, ctx_len, block_size, sliding_window)
    qb, kvb = q_pad // FLEX_BLOCK, kv_pad // FLEX_BLOCK
    touched = _tile_counts(c_lo, c_hi, qb, kvb, False) + _tile_counts(s_lo, s_hi, qb, kvb, False)
    covered = _tile_counts(c_lo, c_hi, qb, kvb, True) + _tile_counts(s_lo, s_hi, qb, kvb, True)
    any_v = (touched > 0)[None, None]
    all_v = (covered == FLEX_BLOCK)[None, None]  # every row of the tile sees every key of it
    partial, full = _ordered(any_v & ~all_v), _ordered(all_v)
    tensors = _to_device((*partial, *full, c_lo, c_hi, s_lo, s_hi), device)
    return BlockMask.from_kv_blocks(*tensors[:4], BLOCK_SIZE=FLEX_BLOCK, mask_mod=interval_mask_mod(*tensors[4:]),
                                    seq_lengths=(q_pad, kv_pad))


def _to_device(tensors: tuple[torch.Tensor, ...], device: torch.device | str | None) -> tuple[torch.Tensor, ...]:
    """`tensors` on `device` (None: where they are). From the CPU to a GPU through pinned memory, without a
    host sync (the caching host allocator keeps a pinned buffer until its copy is done)."""
    if device is None or all(t.device == torch.device(device) for t in tensors):
        return tensors
    device = torch.device(device)
    if device.type == "cuda":
        return tuple((t.pin_memory() if t.device.type == "cpu" else t).to(device, non_blocking=True) for t in tensors)
    return tuple(t.to(device) for t in tensors)


def build_packed_masks(anchor_row: torch.Tensor, doc_start: torch.Tensor, anchor_col: torch.Tensor, row_len: int,
                       ctx_len: int, block_size: int, backend: Backend, sliding_window: int | None = None,
                       need_sliding: bool = False, device: torch.device | str | None = None) -> dict:
    """`build_masks` for a packed micro-batch (batch 1): {"full": m, "sliding": m or None}, on `device`
    (default: where the block tensors are; flex masks are built where the tensors are, then moved:
    `packed_block_mask`)."""
    windows = {"full": None, **({"sliding": sliding_window} if need_sliding else {})}
    out: dict = {"full": None, "sliding": None}
    q_len = anchor_col.numel() * block_size
    if backend != "flex" and device is not None:  # the dense mask is as large as the grid: build it in place
        anchor_row, doc_start, anchor_col = _to_device((anchor_row, doc_start, anchor_col), device)
    for kind, window in windows.items():
        if backend == "flex":
            out[kind] = packed_block_mask(anchor_row, doc_start, anchor_col, row_len, ctx_len, block_size, window,
                                          device)
        else:
            mod = make_packed_mask_mod(anchor_row, doc_start, anchor_col, row_len, ctx_len, block_size, window)
            out[kind] = dense_mask(mod, 1, q_len, ctx_len + q_len, anchor_col.device)
    return out


def compiled_kernels() -> dict[str, Callable]:
    """The compiled callables a training step uses (for per-device warm-up, then a compile freeze)."""
    return {"flex_attention": _compiled_flex()}


def build_masks(anchors: torch.Tensor, ctx_len: int, block_size: int, backend: Backend,
                sliding_window: int | None = None, need_sliding: bool = False) -> dict:
    """The masks one step needs: {"full": m, "sliding": m or None}; m is a BlockMask over the padded
    (flex_len(Q), flex_len(KV)) grid (flex; use it through `flex_attend`) or a dense (B, 1, Q, KV) bool
    tensor (sdpa)."""
    batch, n = anchors.shape
    q_len, kv_len = n * block_size, ctx_len + n * block_size
    mods = {"full": make_mask_mod(anchors, ctx_len, block_size)}
    if need_sliding:
        mods["sliding"] = make_mask_mod(anchors, ctx_len, block_size, sliding_window)
    out: dict = {"full": None, "sliding": None}
    for kind, mod in mods.items():
        if backend == "flex":
            q_pad, kv_pad = flex_len(q_len), flex_len(kv_len)
            out[kind] = block_mask_eager(pad_mask_mod(mod, q_len, kv_len, anchors.device), batch, q_pad, kv_pad, anchors.device)
        else:
            out[kind] = dense_mask(mod, batch, q_len, kv_len, anchors.device)
    return out
