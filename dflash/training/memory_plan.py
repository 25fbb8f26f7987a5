"""How many chunks a packed micro-batch's drafter blocks run in (`data.pack_chunks = "auto"`).

A packed micro-batch computes a fixed number of drafter blocks (`ChatDataset.block_budget`: 2,048 for the
qwen3_8b recipe on uniform 3,072-token chats, up to 4x that on data with short answers). Running them in
one chunk is fastest (one backward, the largest GEMMs: 1.3-1.7% more tokens/s than two chunks on an H200),
but the activations saved for the backward grow with the blocks; chunks bound them
(`dflash.model.loss.loss_backward`: each chunk has its own backward, the summed gradient is the same).

`pack_chunks` predicts a training step's peak memory from the shapes alone and picks the fewest chunks
whose prediction fits `FIT` of the device's memory. The prediction is an upper bound by construction (it
counts every activation a decoder layer could save, where inductor recomputes some of them) plus slack for
the allocator and cuBLAS. Measured on one H200 (torch 2.11, Qwen3-8B shape, docs/benchmarks.md), peaks
allocated / predicted: uniform chats (2,048 blocks) 1 chunk 53.6 / 62.2 GiB, 2 chunks 46.7 / 50.7; mixed
lengths (3,664 blocks) 1 chunk 71.2 / 80.3, 2 chunks 55.8 / 59.8. So an H200 (139.8 GiB) runs the recipe in one chunk, and an 80 GB GPU in one chunk on
uniform chats and two on mixed ones.

The choice depends on the device, never the data's plan: under "auto" the block budget is a multiple of
8 x AUTO_MAX_CHUNKS, so every choice divides it and a run resumed on another GPU trains on the same batches.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dflash.config import AUTO_MAX_CHUNKS

FIT = 0.9  # of the device's total memory: the rest for the CUDA context, other processes' and fragmentation
SLACK = 1.1  # times the counted bytes, plus SLACK_BYTES: the allocator's rounding and cuBLAS workspaces
SLACK_BYTES = 1 << 30
CHOICES = tuple(c for c in (1, 2, 4, 8) if c <= AUTO_MAX_CHUNKS)  # "auto"'s; the budget is a multiple of 8 x the last


@dataclass(frozen=True)
class ChunkPlan:
    chunks: int
    predicted_bytes: int  # the step's predicted peak at `chunks`
    device_bytes: int | None  # the device's total memory (None: not a GPU, nothing predicted)
    fits: bool

    def note(self) -> str:
        if self.device_bytes is None:
            return f"data.pack_chunks auto: {self.chunks} (not a GPU: nothing to bound)"
        gib = 2 ** 30
        what = "fits" if self.fits else "does not fit even at the most chunks; lower data.pack_blocks"
        return (f"data.pack_chunks auto: {self.chunks} (predicted peak {self.predicted_bytes / gib:.1f} GiB, "
                f"{what} {FIT:.0%} of the device's {self.device_bytes / gib:.1f} GiB)")


def attention_dims(config) -> tuple[int, int, int]:
    """(query heads, K/V heads, head dim) of a transformers decoder config (K/V heads default to the query
    heads, the head dim to hidden / heads)."""
    heads = int(config.num_attention_heads)
    kv = int(getattr(config, "num_key_value_heads", None) or heads)
    return heads, kv, int(getattr(config, "head_dim", None) or int(config.hidden_size) // heads)


def target_parameters(config) -> int:
    """A decoder-only transformer's parameters from its config (embedding, layers, norms, LM head)."""
    h = int(config.hidden_size)
    _, _, d = attention_dims(config)
    vocab = int(config.vocab_size)
    per_layer_norms = 2 * h + 2 * d
    tied = bool(getattr(config, "tie_word_embeddings", False))
    return vocab * h * (1 if tied else 2) + decoder_linear_parameters(config) + int(config.num_hidden_layers) * per_layer_norms + h


def decoder_linear_parameters(config) -> int:
    """The decoder layers' linear weights (q, k, v, o, gate, up, down): what `target.fp8` stores in one byte."""
    h = int(config.hidden_size)
    heads, kv, d = attention_dims(config)
    return int(config.num_hidden_layers) * (h * heads * d * 2 + h * kv * d * 2 + 3 * h * int(config.intermediate_size))


def drafter_block_bytes(spec, dtype_bytes: int = 2) -> int:
    """Activations one drafter block saves for its backward, at most: per token and layer the layer's input,
    its normed copy, q, the attention output, the residual and its normed copy, the post-attention input
    (7 x hidden), the block's own k and v, and gate, up and their product (3 x intermediate), in the
    compute dtype; plus the final norm's output that the head reads."""
    h, kv = spec.hidden_size, spec.num_key_value_heads * spec.head_dim
    per_token_layer = 7 * h + 2 * kv + 3 * spec.intermediate_size
    return spec.block_size * (spec.num_hidden_layers * per_token_layer + h) * dtype_bytes


def predicted_peak_bytes(*, spec, drafter_params: int, target_params: int, rows: int, row_len: int,
                         blocks: int, chunks: int, target_dtype_bytes: int = 2, vocab: int, target_fp8_params: int = 0) -> int:
    """A packed step's peak at `chunks` chunks (the module doc): the target's weights (`target_fp8_params` of
    them in one byte: target.fp8), the drafter's fp32 weights, gradients and AdamW moments, the taps, the target
    forward's largest transients, one chunk's context and blocks, and the fused head + CE's row chunk of fp32
    logits (three of its size at once)."""
    from dflash.model.head_ce import CHUNK_ELEMENTS

    h, kv, k_taps = spec.hidden_size, spec.num_key_value_heads * spec.head_dim, len(spec.target_layer_ids)
    tokens = rows * row_len
    fixed = (target_params - target_fp8_params) * target_dtype_bytes + target_fp8_params + drafter_params * 16
    taps = tokens * k_taps * h * target_dtype_bytes
    target_transient = tokens * (3 * spec.intermediate_size + 4 * h) * target_dtype_bytes
    context = tokens * (2 * h + spec.num_hidden_layers * 2 * kv) * 2  # the fused context and every layer's K/V
    head = 3 * min(CHUNK_ELEMENTS, max(1, blocks // chunks) * spec.block_size * vocab) * 4
    acts = -(-blocks // chunks) * drafter_block_bytes(spec)
    counted = fixed + taps + max(target_transient, context + acts + head)
    return int(counted * SLACK) + SLACK_BYTES


def pack_chunks(requested, *, packed: bool, device: torch.device, spec, drafter_params: int, target_config,
                rows: int, row_len: int, blocks: int, target_dtype_bytes: int = 2, target_fp8: bool = False) -> ChunkPlan:
    """`data.pack_chunks` resolved: an integer as given; "auto" (packed, on a GPU) `fewest_chunks` for the
    memory PyTorch may use there."""
    if requested != "auto":
        return ChunkPlan(int(requested), 0, None, True)
    if not packed or device.type != "cuda":
        return ChunkPlan(1, 0, None, True)
    return fewest_chunks(device_memory(device), spec=spec, drafter_params=drafter_params,
                         target_params=target_parameters(target_config), rows=rows, row_len=row_len, blocks=blocks,
                         target_dtype_bytes=target_dtype_bytes, vocab=int(target_config.vocab_size),
                         target_fp8_params=decoder_linear_parameters(target_config) if target_fp8 else 0)


def fewest_chunks(total: int, **shapes) -> ChunkPlan:
    """The fewest of CHOICES whose predicted peak (`predicted_peak_bytes(**shapes)`) fits FIT of `total`
    bytes; the most of them when none does (its note says so)."""
    plan = None
    for c in CHOICES:
        need = predicted_peak_bytes(chunks=c, **shapes)
        plan = ChunkPlan(c, need, total, need <= FIT * total)
        if plan.fits:
            return plan
    return plan  # type: ignore[return-value]


def device_memory(device: torch.device) -> int:
    """The memory PyTorch may use on a GPU: its total, times the process's cap where one was set
    (torch.cuda.set_per_process_memory_fraction; the getter exists from torch 2.8 on)."""
    index = device.index if device.index is not None else torch.cuda.current_device()  # "cuda": the current one
    total = torch.cuda.get_device_properties(index).total_memory
    getter = getattr(torch.cuda, "get_per_process_memory_fraction", None)
    return int(total * (getter(index) if getter is not None else 1.0))


def plan_for(cfg, *, spec, drafter, target_config, block_budget: int, device: torch.device,
             target_dtype: torch.dtype) -> ChunkPlan:
    """`pack_chunks` for a run of `cfg` (the trainer's and the start's drafter warm-up ask the same)."""
    return pack_chunks(cfg.data.pack_chunks, packed=cfg.data.pack, device=device, spec=spec,
                       drafter_params=sum(p.numel() for p in drafter.parameters()), target_config=target_config,
                       rows=cfg.data.batch_size, row_len=cfg.data.max_length, blocks=block_budget,
                       target_dtype_bytes=target_dtype.itemsize, target_fp8=cfg.target.fp8)


def out_of_memory(e: BaseException) -> str | None:
    """The allocator's complaint, on one line, when `e` says a device ran out of memory (CUDA's
    torch.OutOfMemoryError; the CPU allocator's RuntimeError "can't allocate memory"); else None."""
    text = str(e)
    if isinstance(e, torch.OutOfMemoryError) or (isinstance(e, RuntimeError) and "can't allocate memory" in text):
        line = " ".join(text.split())
        cut = line.find("you tried to allocate")  # the CPU allocator's useful part; CUDA's starts with it
        return (line[cut:] if cut >= 0 else line)[:300]
    return None
