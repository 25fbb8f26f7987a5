"""Preallocated K/V for batched decoding: one slot per position, written in place, never grown.

A row's token at position p lives in slot p of its row (prompts are right-padded, so every row starts
at slot 0). A forward writes each of its tokens' K/V at the slots its positions name (`write_pos`,
(b, T)); attention reads the whole buffer and an attention mask keeps each query to the slots that
hold that row's committed tokens and the block itself. What a rejected draft or a prompt's padding
wrote stays in its slot, masked, until a later round writes over it: nothing is cropped or copied,
so the buffers' addresses never change (what a CUDA graph needs) except when finished rows are
dropped (`select`: new, smaller buffers; with `keep_full`, slots kept for later decodes of as many
rows, dflash.eval.reuse, the full batch's stay for `restore`). With `keep_sizes` (slots whose CUDA
graphs are kept too) each batch size has its own buffers, made at its first `select` and written in place after that
(`select` copies the rows that stay into them; `restore` goes back to the full batch's), so a graph
captured for a batch size reads the same addresses at every decode; what an earlier decode left in
them is masked like any stale slot until written over.

- `TargetSlots` is what the target's attention layers see as their cache: the one method transformers'
  Qwen3/Llama attention calls, `update(key_states, value_states, layer_idx, ...)` (5.17 passes no
  more, 5.24 a `kwargs=` mapping), and `get_seq_length`. The model is given every layer's mask
  itself (an `attention_mask` dict), so no other Cache method is needed. Buffers are made at the
  first write, from the key states' shape and dtype.
- `ContextSlots` is the drafter's context: per draft layer the K/V of the target taps it has seen,
  and the block being drafted right after them (dflash.eval.draft_step).
"""

from __future__ import annotations

import torch


def write(buf: torch.Tensor, rows: torch.Tensor | None, pos: torch.Tensor, x: torch.Tensor) -> None:
    """buf (B, nkv, L, D)[rows[b], :, pos[b, t]] = x (b, nkv, T, D)[b, :, t]; rows None = every row."""
    x = x.transpose(1, 2)  # (b, T, nkv, D): the indexed dims first, as advanced indexing lays them out
    if rows is None:
        rows = torch.arange(buf.shape[0], device=buf.device)
    buf[rows[:, None], :, pos] = x.to(buf.dtype)


class TargetSlots:
    """The target's K/V cache for `rows` rows of `length` slots (duck-typed transformers Cache)."""

    is_compileable = False  # read by transformers' generate only; this cache is never given to it

    def __init__(self, rows: int, length: int, keep_full: bool = False, keep_sizes: bool = False) -> None:
        self.rows, self.length, self.full_rows = rows, length, rows
        self.keep_full, self.keep_sizes = keep_full or keep_sizes, keep_sizes
        self.k: dict[int, torch.Tensor] = {}
        self.v: dict[int, torch.Tensor] = {}
        self.sizes: dict[int, tuple[dict[int, torch.Tensor], dict[int, torch.Tensor]]] = {rows: (self.k, self.v)}
        self.write_pos: torch.Tensor | None = None  # (b, T) slots of this forward's tokens
        self.write_rows: torch.Tensor | None = None  # (b,) rows of this forward
        self.kv_len: int | None = None  # slots attention reads (None: all); eager forwards read fewer
        self.prefill = False  # the rows were empty: attention needs only this forward's own K/V

    def set_step(self, write_pos: torch.Tensor, *, rows: torch.Tensor | None = None, kv_len: int | None = None,
                 prefill: bool = False) -> None:
        """What the next forward writes and reads (`rows` None: every row, one index for all its layers)."""
        if rows is None:
            rows = torch.arange(write_pos.shape[0], device=write_pos.device)
        self.write_pos, self.write_rows, self.kv_len, self.prefill = write_pos, rows, kv_len, prefill

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Write this forward's K/V (b, nkv, T, D) at `write_pos`; return what attention reads."""
        if layer_idx not in self.k:
            b, nkv, _, d = key_states.shape
            shape = (self.rows, nkv, self.length, d)
            self.k[layer_idx] = torch.zeros(shape, dtype=key_states.dtype, device=key_states.device)
            self.v[layer_idx] = torch.zeros(shape, dtype=value_states.dtype, device=value_states.device)
        kb, vb = self.k[layer_idx], self.v[layer_idx]
        write(kb, self.write_rows, self.write_pos, key_states)
        write(vb, self.write_rows, self.write_pos, value_states)
        if self.prefill:  # nothing before these tokens: their own K/V, causal (transformers' sdpa path)
            return key_states, value_states
        n = self.length if self.kv_len is None else self.kv_len
        return kb[:, :, :n], vb[:, :, :n]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Slots in use as transformers asks (only when no position ids are given: never here)."""
        return self.kv_len or 0

    def select(self, keep: torch.Tensor) -> None:
        """Keep only rows `keep` (indices, in their new order): finished rows leave the batch."""
        n = int(keep.numel())
        if not self.keep_sizes:  # new buffers (`keep_full`: the full batch's stay, for `restore`)
            self.k = {i: t.index_select(0, keep) for i, t in self.k.items()}
            self.v = {i: t.index_select(0, keep) for i, t in self.v.items()}
            if not self.keep_full:
                self.sizes.pop(self.full_rows, None)
        else:
            dst = self.sizes.get(n)
            if dst is None:
                dst = self.sizes[n] = tuple({i: t.new_empty((n, *t.shape[1:])) for i, t in d.items()}
                                            for d in (self.k, self.v))
            for src, out in zip((self.k, self.v), dst):
                for i, t in src.items():
                    torch.index_select(t, 0, keep, out=out[i])
            self.k, self.v = dst
        self.rows = n

    def restore(self) -> None:
        """The full batch's buffers again: a new decode of as many rows (`keep_full`, or no select yet)."""
        self.k, self.v = self.sizes[self.full_rows]
        self.rows = self.full_rows


class ContextSlots:
    """The drafter's per-layer context K/V (B, nkv, L, D), allocated once."""

    def __init__(self, num_layers: int, rows: int, length: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device, keep_full: bool = False, keep_sizes: bool = False) -> None:
        shape = (rows, num_kv_heads, length, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.rows, self.length, self.full_rows = rows, length, rows
        self.keep_full, self.keep_sizes = keep_full or keep_sizes, keep_sizes
        self.sizes: dict[int, tuple[list[torch.Tensor], list[torch.Tensor]]] = {rows: (self.k, self.v)}

    def select(self, keep: torch.Tensor) -> None:
        """Keep only rows `keep` (indices, in their new order); `keep_sizes`: as TargetSlots.select."""
        n = int(keep.numel())
        if not self.keep_sizes:
            self.k = [k.index_select(0, keep) for k in self.k]
            self.v = [v.index_select(0, keep) for v in self.v]
            if not self.keep_full:
                self.sizes.pop(self.full_rows, None)
        else:
            dst = self.sizes.get(n)
            if dst is None:
                dst = self.sizes[n] = tuple([t.new_empty((n, *t.shape[1:])) for t in d] for d in (self.k, self.v))
            for src, out in zip((self.k, self.v), dst):
                for t, o in zip(src, out):
                    torch.index_select(t, 0, keep, out=o)
            self.k, self.v = dst
        self.rows = n

    def restore(self) -> None:
        """The full batch's buffers again: a new decode of as many rows (`keep_full`, or no select yet)."""
        self.k, self.v = self.sizes[self.full_rows]
        self.rows = self.full_rows


FIT = 0.9  # of the memory free for them: the rest for the forwards' activations and the allocator


def slot_bytes(drafter, target, rows: int, length: int, graphs: bool) -> int:
    """What a speculative decode's slots take (`rows` rows of `length` slots): the target's K/V in every
    layer and the drafter's context K/V; with CUDA graphs kept, up to twice that (a buffer per batch size)."""
    from dflash.training.memory_plan import attention_dims

    cfg = target.model.config
    _, nkv, d = attention_dims(cfg)
    elem = torch.finfo(target.dtype).bits // 8
    att = drafter.layers[0].self_attn
    d_elem = torch.finfo(next(drafter.parameters()).dtype).bits // 8
    per_slot = int(cfg.num_hidden_layers) * 2 * nkv * d * elem + len(drafter.layers) * 2 * att.nkv * att.d * d_elem
    return rows * length * per_slot * (2 if graphs else 1)


def free_bytes(device: torch.device) -> int | None:
    """Memory a decode can still take on `device` (None: not known): a GPU's free memory plus what torch's
    allocator holds unused; a CPU's available memory."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))
    if device.type == "cpu":
        import psutil

        return int(psutil.virtual_memory().available)
    return None


EVAL_HINT = "lower --max-new-tokens or the number of prompts (-n)"


def check_fits(drafter, target, rows: int, longest: int, max_new_tokens: int, length: int, graphs: bool,
               hint: str = EVAL_HINT, shortest: bool = False) -> None:
    """BadInput, before anything is allocated, when the decode's slots cannot fit the device's free memory
    (a huge --max-new-tokens: on a CPU the kernel's OOM killer would end the process without a word).
    `hint`: what to lower, in the caller's own options. `shortest`: `longest` is a lower bound on the
    prompts' length (checked before the prompts are made, dflash.eval.evaluate.eval_checkpoint)."""
    need, free = slot_bytes(drafter, target, rows, length, graphs), free_bytes(target.device)
    if free is None or need <= FIT * free:
        return
    from compilewatch import BadInput

    gib = 2 ** 30
    raise BadInput(f"decoding {rows} prompt(s) of {'at least' if shortest else 'up to'} {longest} tokens plus "
                   f"{max_new_tokens} new ones needs "
                   f"~{need / gib:.1f} GiB of K/V slots on {target.device}; {free / gib:.1f} GiB is free there",
                   hint=hint)
