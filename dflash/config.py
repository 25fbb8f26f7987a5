"""One typed config for a dflash run: nested dataclasses, named recipes, TOML in and out.

Every field carries a comment that says what it does and why its default is what it is. Choices are
`Literal[...]`; `__post_init__` raises `ValueError` naming the field. A run's config comes from a recipe
(`tiny()` is the embedded default, `qwen3_8b()` the paper's setup), optionally a TOML file, then
overrides (`--set optim.lr=3e-4`); the resolved config is printed at start and saved with every
checkpoint, so `load_toml(saved)` rebuilds it exactly.

TOML has no null: `None` is written as the string "none" and read back as None for Optional fields.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

EMBEDDED_TARGET = "embedded:tiny"  # the tiny Qwen3 target built locally from a config (no download)
EMBEDDED_DATA = "embedded:tiny-chat"  # the shipped prompts, answered by the target (dflash regen)
GAMMA_BY_BLOCK = {16: 7.0, 10: 5.0, 8: 4.0}  # loss decay γ per block size (DFlash paper / SpecForge)

AUTO_MAX_CHUNKS = 4
"""data.pack_chunks "auto" picks 1, 2 or 4 chunks (dflash/training/memory_plan.py)."""


def _need(cond: bool, name: str, msg: str) -> None:
    if not cond:
        raise ValueError(f"{name}: {msg}")


@dataclass(kw_only=True, slots=True)
class TargetConfig:
    path: str = EMBEDDED_TARGET
    """A local Hugging Face model directory (never downloaded), or `embedded:tiny`."""
    layer_ids: tuple[int, ...] | None = None
    """Target layers whose outputs feed the drafter (`hidden_states[id + 1]`); None = the default formula."""
    dtype: Literal["auto", "bf16", "fp32"] = "auto"
    """Target weights: auto = bf16 on GPU, fp32 on CPU (CPU bf16 matmuls are slow)."""
    mask_token: str = "<|MASK|>"
    """The block's mask token; added to the tokenizer when missing (never reuse pad)."""
    compile: bool = True
    """On CUDA, run the target's decoder layers compiled in the training forward (one graph per
    bucket length, shared by every layer); eval and regen run the model eagerly."""
    fp8: bool = False
    """Run the target's decoder linears as FP8 GEMMs (e4m3, a scale per weight row and per token;
    dflash.model.fp8): ~1.1x the training step at 8B and half the decoder's weight memory, on GPUs of
    compute capability 8.9 and up. The drafter then trains on a quantized target's hidden states, and
    evals decode with it: for a target that will be served in FP8. Off: the target runs in its dtype."""

    def __post_init__(self) -> None:
        _need(bool(self.path), "target.path", "must be a model directory or embedded:tiny")
        if self.layer_ids is not None:
            _need(len(self.layer_ids) > 0 and all(i >= 0 for i in self.layer_ids), "target.layer_ids",
                  "must be a non-empty list of layer indices >= 0")
        _need(bool(self.mask_token), "target.mask_token", "must not be empty")


@dataclass(kw_only=True, slots=True)
class DrafterConfig:
    num_layers: int = 5
    """Draft decoder layers (the paper uses 5); also the number of target taps by default."""
    block_size: int = 16
    """Tokens per block: the anchor plus block_size-1 masked slots it predicts (paper: 16)."""
    intermediate_size: int | None = None
    """SwiGLU width; None = the target's."""
    num_attention_heads: int | None = None
    """Query heads; None = the target's."""
    num_key_value_heads: int | None = None
    """K/V heads (GQA); None = the target's."""
    head_dim: int | None = None
    """Per-head width; None = the target's."""
    sliding_window: int | None = None
    """Window (in positions) of the sliding-attention layers; None = no sliding layers."""
    sliding_layers: tuple[int, ...] = ()
    """Draft layer indices that use sliding-window attention (causal inside the block, as served)."""

    def __post_init__(self) -> None:
        _need(self.num_layers >= 1, "drafter.num_layers", "must be >= 1")
        _need(self.block_size >= 2, "drafter.block_size", "must be >= 2 (an anchor plus at least one prediction)")
        for name in ("intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim"):
            v = getattr(self, name)
            _need(v is None or v >= 1, f"drafter.{name}", "must be >= 1 or none")
        _need(all(0 <= i < self.num_layers for i in self.sliding_layers), "drafter.sliding_layers",
              f"indices must be in [0, {self.num_layers})")
        _need(not self.sliding_layers or (self.sliding_window or 0) >= self.block_size, "drafter.sliding_window",
              "sliding layers need a window >= block_size")


@dataclass(kw_only=True, slots=True)
class DataConfig:
    path: str = EMBEDDED_DATA
    """Chat JSONL (`messages` or ShareGPT `conversations`), or `embedded:tiny-chat`."""
    regenerate: bool = False
    """Regenerate assistant turns with the target before training (what `dflash regen` does)."""
    regen_max_new_tokens: int = 256
    """Longest regenerated answer."""
    max_length: int = 3072
    """Sequences are truncated to this many tokens (paper: 3072)."""
    max_record_chars: int | None = None
    """A conversation with more characters than this (all turns) is skipped before it reaches the
    tokenizer (a counted skip reason; an error with strict); None = 64 x max_length, far more text
    than max_length tokens (a token is ~4 characters). Its JSONL line may hold at most
    16 x this many bytes + 64 KiB (JSON escapes take up to 12 bytes a character): a longer line is
    skipped unread."""
    num_anchors: int = 512
    """Blocks per sequence, sampled without replacement from loss-masked positions in [0, S-B]."""
    batch_size: int = 4
    """Sequences per micro-batch (on one device)."""
    buckets: tuple[int, ...] = ()
    """Padded sequence lengths (few shapes = few recompiles); empty = powers of two up to max_length.
    Unpacked batches only (`pack = false`)."""
    pack: bool = False
    """Pack conversations back to back into `batch_size` rows of `max_length` tokens (document masks),
    and compute only their valid blocks, up to `batch_size` x `num_anchors` a micro-batch
    (dflash/data/packing.py): the same losses per block as padded batches, without their padding.
    false = one right-padded conversation per row, `num_anchors` block slots each. The qwen3_8b recipe
    packs; the tiny recipe and a bare config do not (yet: their tests pin the padded layout's numbers)."""
    pack_blocks: int | None = None
    """Packed: the blocks a micro-batch computes (one drafter shape a run). None = from the data: its
    blocks per token (anchors per sequence over its tokens) times the micro-batch's tokens, at least
    `batch_size` x `num_anchors` (what a padded micro-batch computes) and at most 4 x that (memory):
    on data with short answers the rows then fill before the blocks run out."""
    pack_chunks: int | Literal["auto"] = 1
    """Packed: the drafter runs a micro-batch's blocks in this many equal chunks, each with the
    micro-batch's whole context and its own backward: the activation memory of one chunk, the same
    gradient. The block budget is rounded to a multiple of 8 x this. "auto": the fewest of 1, 2, 4 whose
    predicted peak fits 90% of the GPU's memory (dflash/training/memory_plan.py; the budget is then a
    multiple of 32, so the batches do not depend on the GPU)."""
    strict: bool = False
    """Any skipped record (unreadable or oversized line, no assistant turn, one that starts with the
    assistant, refused by the chat template, no anchor position) is bad input (exit 2) instead of a
    counted skip."""
    cache_dir: str | None = None
    """Where tokenized data is cached (memory-mapped, keyed by data, tokenizer, template, max length
    and code version; dflash/data/cache.py): None = $DFLASH_DATA_CACHE, else ~/.cache/dflash/data
    (shared by runs and resumes); "off" = tokenize in memory at every start."""
    workers: int | None = None
    """Processes that tokenize when the cache is built; None = one per CPU core (small data: none)."""
    accept_changed: bool = False
    """--resume only: go on when the data file's contents differ from what the checkpoint recorded
    (edited in place under the same path) instead of refusing (dflash/checkpoint/data_check.py). For
    that one resume: the run's config.toml keeps false, so a later change is asked about again."""

    def __post_init__(self) -> None:
        _need(bool(self.path), "data.path", "must be a JSONL file or embedded:tiny-chat")
        _need(self.max_length >= 2, "data.max_length", "must be >= 2")
        _need(self.num_anchors >= 1, "data.num_anchors", "must be >= 1")
        _need(self.batch_size >= 1, "data.batch_size", "must be >= 1")
        _need(self.regen_max_new_tokens >= 1, "data.regen_max_new_tokens", "must be >= 1")
        _need(self.max_record_chars is None or self.max_record_chars >= 1, "data.max_record_chars", "must be >= 1 or none")
        _need(self.workers is None or self.workers >= 1, "data.workers", "must be >= 1 or none")
        _need(self.pack_blocks is None or self.pack_blocks >= self.num_anchors, "data.pack_blocks",
              "must be >= data.num_anchors (a sequence's blocks fit one micro-batch) or none")
        _need(self.pack_chunks == "auto" or self.pack_chunks >= 1, "data.pack_chunks", 'must be >= 1 or "auto"')
        _need(self.pack_blocks is None or self.pack_blocks % self.chunk_quantum() == 0, "data.pack_chunks",
              'must divide data.pack_blocks ("auto" may pick 4: a multiple of 4)')
        _need(self.cache_dir is None or (bool(self.cache_dir) and self.cache_dir.lower() not in ("false", "no", "0")),
              "data.cache_dir", 'must be a directory, "off" (tokenize in memory) or none')
        _need(all(b >= 1 for b in self.buckets) and list(self.buckets) == sorted(set(self.buckets)),
              "data.buckets", "must be increasing positive lengths")

    def chunk_quantum(self) -> int:
        """The chunk counts the block budget must divide by: data.pack_chunks, or under "auto" the most
        it may pick (dflash.training.memory_plan.AUTO_MAX_CHUNKS)."""
        return self.pack_chunks if self.pack_chunks != "auto" else AUTO_MAX_CHUNKS

    def record_chars(self) -> int:
        """The most characters a conversation may have (max_record_chars, or 64 x max_length)."""
        return self.max_record_chars if self.max_record_chars is not None else 64 * self.max_length

    def line_bytes(self) -> int:
        """The most bytes one JSONL line may have: 16 bytes a character (escapes) plus 64 KiB of keys."""
        return 16 * self.record_chars() + (64 << 10)

    def bucket_lengths(self) -> tuple[int, ...]:
        if self.buckets:
            return tuple(b for b in self.buckets if b < self.max_length) + (self.max_length,)
        out, b = [], 64
        while b < self.max_length:
            out.append(b)
            b *= 2
        return (*out, self.max_length)


@dataclass(kw_only=True, slots=True)
class OptimConfig:
    lr: float = 6e-4
    """Peak learning rate (SpecForge's Qwen3-8B run)."""
    min_lr_ratio: float = 0.0
    """Final lr as a fraction of the peak."""
    schedule: Literal["cosine", "wsd", "constant"] = "cosine"
    """cosine: warmup then cosine decay; wsd: warmup, stable, linear decay over `decay_ratio`."""
    warmup_ratio: float = 0.04
    """Fraction of steps spent warming up linearly (paper: 4%)."""
    decay_ratio: float = 0.2
    """wsd only: fraction of steps in the final decay."""
    weight_decay: float = 0.0
    """AdamW decoupled weight decay."""
    beta1: float = 0.9
    """AdamW β1."""
    beta2: float = 0.95
    """AdamW β2 (0.95: steadier than 0.999 for short, high-lr runs)."""
    eps: float = 1e-8
    """AdamW ε."""
    clip: float = 1.0
    """Gradient-norm clip (paper: 1.0); 0 disables."""

    def __post_init__(self) -> None:
        _need(self.lr > 0, "optim.lr", "must be > 0")
        _need(0 <= self.min_lr_ratio <= 1, "optim.min_lr_ratio", "must be in [0, 1]")
        _need(0 <= self.warmup_ratio < 1, "optim.warmup_ratio", "must be in [0, 1)")
        _need(0 < self.decay_ratio <= 1, "optim.decay_ratio", "must be in (0, 1]")
        _need(self.weight_decay >= 0, "optim.weight_decay", "must be >= 0")
        _need(0 <= self.beta1 < 1 and 0 <= self.beta2 < 1, "optim.beta1", "betas must be in [0, 1)")
        _need(self.clip >= 0, "optim.clip", "must be >= 0 (0 disables clipping)")


@dataclass(kw_only=True, slots=True)
class TrainConfig:
    epochs: int = 6
    """Passes over the data (paper: 6); anchors are resampled every epoch."""
    max_steps: int | None = None
    """Stop after this many optimizer steps (also sets the schedule length); None = epochs."""
    grad_accum: int = 1
    """Micro-batches per optimizer step."""
    seed: int = 0
    """Seeds init, shuffling and anchors: the same seed gives the same losses."""
    dtype: Literal["auto", "bf16", "fp32"] = "auto"
    """Compute dtype: bf16 autocast over fp32 master weights on GPU (auto), fp32 on CPU."""
    attention: Literal["auto", "flex", "sdpa"] = "auto"
    """flex = compiled flex_attention (GPU); sdpa = dense mask from the same mask_mod (CPU, fallback)."""
    gamma: float | None = None
    """Loss decay γ in w_k = exp(-(k-1)/γ); None = by block size (16: 7, 10: 5, 8: 4)."""
    compile_layers: bool = True
    """CUDA: also torch.compile each draft layer, fusing the fp32 norms, RoPE and SwiGLU (H200, Qwen3-8B
    shapes: 129.0 vs 161.5 ms/step, docs/benchmarks.md; cold first step about +19 s). Attention is
    compiled (flex) either way; CPU never compiles layers."""
    cpu_threads: int | None = None
    """torch intra-op threads when training on CPU; None = torch's default. Tiny models want 1: on a
    busy 2-core machine two spinning OpenMP threads made the tiny run 12x slower (65 s vs 5 s)."""

    def __post_init__(self) -> None:
        _need(self.cpu_threads is None or self.cpu_threads >= 1, "train.cpu_threads", "must be >= 1 or none")
        _need(self.epochs >= 1, "train.epochs", "must be >= 1")
        _need(self.max_steps is None or self.max_steps >= 1, "train.max_steps", "must be >= 1 or none")
        _need(self.grad_accum >= 1, "train.grad_accum", "must be >= 1")
        _need(self.gamma is None or self.gamma > 0, "train.gamma", "must be > 0 or none")


DEFAULT_DIST_TIMEOUT_S = 1800.0  # a collective's wait: well above a cold qwen3_8b first step (238 s, one H200)
DEFAULT_STALL_AFTER_S = 300.0  # the engine's watchdog: no committed step for this long = a stall
DEFAULT_QUEUE_DEPTH = 2  # target batches a worker may hold ready: one in use, one ahead


def check_engine_settings(stall_after: float, queue_depth: int, where: str = "") -> None:
    """The engine's settings' checks, shared by TopologyConfig (`where="topology."`) and the engine's
    own EngineConfig: the one place they live."""
    _need(stall_after > 0, f"{where}stall_after", "must be > 0 seconds")
    _need(queue_depth >= 1, f"{where}queue_depth", "must be >= 1")


def _device_list(value: tuple[str, ...], name: str) -> tuple[str, ...]:
    """Device names normalized once (`5` -> `cuda:5`, `cuda` -> `cuda:0`); a device may repeat."""
    from compilewatch import normalize_device, BadInput

    try:
        return tuple(normalize_device(d) for d in value)
    except BadInput as e:
        raise ValueError(f"{name}: {e.message}; {e.hint}") from None


@dataclass(kw_only=True, slots=True)
class TopologyConfig:
    """Where the run trains and how its threads are watched. Recorded in the run's config.toml, so
    `--resume` continues on the same devices (explicit flags override). Under torchrun every rank reads
    the same section; the devices are each node's own."""

    device: str = "auto"
    """One device (cpu, cuda, cuda:N, N) or auto (first GPU, else CPU); under torchrun without device
    lists auto and cuda mean cuda:LOCAL_RANK. Must stay auto with drafter_devices."""
    target_devices: tuple[str, ...] = ()
    """Engine: one target worker thread per entry (0,1,2,3,4; cpu and repeats allowed); empty = one device."""
    drafter_devices: tuple[str, ...] = ()
    """Engine: one drafter replica thread per entry; replica 0 (the trainer: its optimizer, checkpoints
    and metrics) runs on the first. Empty = one device."""
    stall_after: float = DEFAULT_STALL_AFTER_S
    """Engine: no committed step for this many seconds = a stall: dump every thread's stack and stop.
    Prewarm runs before the watchdog; a step and, under torchrun, rank 0's checkpoint save must fit."""
    prewarm: bool = True
    """Engine: compile every replica's step in the main thread, one device after another, before the
    worker threads start (false = the cross-thread compile race: for experiments only)."""
    guard: bool = True
    """Engine: forbid compiles while the worker threads run (a late compile raises instead of racing)."""
    queue_depth: int = DEFAULT_QUEUE_DEPTH
    """Engine: batches each target worker may hold ready (2: one in use, one ahead)."""
    dist_backend: Literal["auto", "gloo", "nccl"] = "auto"
    """torchrun: auto = NCCL for CUDA drafters with gloo beside it, gloo on CPU; gloo or nccl to force."""
    dist_timeout: float = DEFAULT_DIST_TIMEOUT_S
    """torchrun: seconds a rank may wait in a collective before it fails (must exceed the slowest
    rank's prewarm and rank 0's checkpoint save)."""

    def __post_init__(self) -> None:
        _need(bool(self.device), "topology.device", "must be cpu, cuda, cuda:N, N or auto")
        if self.device not in ("auto", "cuda"):  # under torchrun both mean the rank's own GPU
            self.device = _device_list((self.device,), "topology.device (--device)")[0]
        self.target_devices = _device_list(self.target_devices, "topology.target_devices (--target-devices)")
        self.drafter_devices = _device_list(self.drafter_devices, "topology.drafter_devices (--drafter-devices)")
        _need(bool(self.target_devices) == bool(self.drafter_devices), "topology.target_devices",
              "target_devices and drafter_devices go together (e.g. 0,1,2,3,4 and 5,6,7), or both empty")
        _need(not self.drafter_devices or self.device == "auto", "topology.device",
              "must stay auto with drafter_devices (--device does not go with --drafter-devices): the trainer "
              "(replica 0) runs on the first drafter device; drop --device")
        check_engine_settings(self.stall_after, self.queue_depth, "topology.")
        _need(self.dist_timeout > 0, "topology.dist_timeout", "must be > 0 seconds")

    @property
    def engine(self) -> bool:
        """Train with the multi-device engine (target workers and drafter replicas in threads)."""
        return bool(self.drafter_devices)

    @property
    def trainer_device(self) -> str:
        """The Trainer's device: drafter replica 0's (the first drafter device) on the engine, else
        `device`. The one place this rule lives."""
        return self.drafter_devices[0] if self.drafter_devices else self.device


@dataclass(kw_only=True, slots=True)
class CheckpointConfig:
    out_dir: str | None = None
    """Run directory; None = runs/<recipe>-<timestamp>."""
    every: int = 500
    """Save (export + training state) every N steps; the last step is always saved."""
    keep_last: int = 2
    """Full checkpoints (training state + export) kept; older ones are removed once a newer one is
    complete (at 8B each is ~14.7 GB: 2 keeps a run's disk use bounded and survives one bad save)."""
    export_every: int = 0
    """Older checkpoints whose step is a multiple of this keep their exported drafter (config.json +
    model.safetensors, ~2 GB at 8B) when their training state is removed; 0 = keep none."""
    background: bool = True
    """Write checkpoints in a background thread: the loop only waits for a copy into pinned host
    buffers (dflash/checkpoint/writer.py); false = write inline (the loop waits for the disk)."""

    def __post_init__(self) -> None:
        _need(self.every >= 1, "checkpoint.every", "must be >= 1")
        _need(self.keep_last >= 1, "checkpoint.keep_last", "must be >= 1 (the newest checkpoint is what --resume reads)")
        _need(self.export_every >= 0, "checkpoint.export_every", "must be >= 0 (0 = keep no older exports)")


@dataclass(kw_only=True, slots=True)
class MetricsConfig:
    log_every: int = 10
    """Write a metrics row every N steps (the first and last are always written)."""
    tensorboard: bool = False
    """Also write TensorBoard scalars to RUN/tensorboard (needs `pip install tensorboard`; a run that asks
    for it without the package stops before training, with that hint)."""

    def __post_init__(self) -> None:
        _need(self.log_every >= 1, "metrics.log_every", "must be >= 1")


MAX_EVAL_PROMPTS = 65536  # an eval's prompts (config and -n): more is a typo, and would be made before any check


@dataclass(kw_only=True, slots=True)
class EvalConfig:
    at_end: bool = False
    """Run real speculative decoding after training and report τ and speedup."""
    num_prompts: int = 16
    """Prompts: the first user turn of the dataset's last records (held out of training when the
    dataset has more than twice as many), or held-out embedded prompts."""
    max_new_tokens: int = 128
    """Tokens generated per prompt (both plain and speculative decoding)."""
    every: int = 0
    """Also measure τ by real speculative decoding every N steps while training (metrics.jsonl event
    "periodic_eval", the progress line); 0 = never. Its cost (seconds) is in the same row."""
    every_prompts: int = 4
    """Held-out prompts of each periodic eval (the first of the eval prompts): few, so it stays cheap."""
    baseline_cache: str | None = None
    """Where runs on this machine share plain baselines (a periodic eval's plain decode of its prompts,
    which only the target, prompts, budget, device and versions decide; dflash/eval/baseline_store.py):
    a new run of the same target takes one at its first eval instead of decoding plainly again. None =
    $DFLASH_EVAL_CACHE, else ~/.cache/dflash/eval; "off" = not shared (a run still keeps its own in
    RUN/eval_baseline.json for its resumes)."""

    def __post_init__(self) -> None:
        _need(1 <= self.num_prompts <= MAX_EVAL_PROMPTS, "eval.num_prompts", f"must be in [1, {MAX_EVAL_PROMPTS}]")
        _need(self.max_new_tokens >= 1, "eval.max_new_tokens", "must be >= 1")
        _need(self.every >= 0, "eval.every", "must be >= 0 (0 = no periodic eval)")
        _need(1 <= self.every_prompts <= MAX_EVAL_PROMPTS, "eval.every_prompts", f"must be in [1, {MAX_EVAL_PROMPTS}]")
        _need(self.baseline_cache is None or (isinstance(self.baseline_cache, str) and bool(self.baseline_cache)),
              "eval.baseline_cache", 'must be a directory, "off" or none')


@dataclass(kw_only=True, slots=True)
class CacheConfig:
    """Compiled-artifact caches shared across a cluster (docs/cache-remote.md)."""

    remote: str | None = None
    """torch's own Redis remote caches for every rank and process of the run: redis://HOST:PORT[/DB]
    (rediss:// for TLS). Turns on the FX-graph and AOTAutograd remote caches before the first
    compile; a rank that finds the key compiled by another fetches it instead of compiling. A server
    that is down never blocks training (torch compiles locally) and the rank report says so. The URL
    is kept in RUN/config.toml like every setting: with a password in it, prefer
    TORCHINDUCTOR_REDIS_URL + TORCHINDUCTOR_FX_GRAPH_REMOTE_CACHE=1 in the environment. None = off
    (unless the environment turns torch's remote caches on itself)."""

    def __post_init__(self) -> None:
        if self.remote is not None:
            _need(isinstance(self.remote, str) and self.remote.startswith(("redis://", "rediss://", "unix://")),
                  "cache.remote", "must be a Redis URL: redis://HOST:PORT[/DB] (rediss:// for TLS)")


@dataclass(kw_only=True, slots=True)
class Config:
    recipe: str = "tiny"
    """The recipe this config started from (recorded for people; loading applies it first)."""
    target: TargetConfig = field(default_factory=TargetConfig)
    drafter: DrafterConfig = field(default_factory=DrafterConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    topology: TopologyConfig = field(default_factory=TopologyConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)

    def __post_init__(self) -> None:
        _need(self.recipe in RECIPES, "recipe", f"unknown recipe {self.recipe!r}; known: {', '.join(RECIPES)}")
        _need(self.train.gamma is not None or self.drafter.block_size in GAMMA_BY_BLOCK, "train.gamma",
              f"no default γ for block_size {self.drafter.block_size}; set train.gamma")
        _need(self.data.max_length >= self.drafter.block_size, "data.max_length", "must be >= drafter.block_size")
        if self.target.layer_ids is not None:
            _need(len(self.target.layer_ids) >= 1, "target.layer_ids", "must not be empty")

    @property
    def gamma(self) -> float:
        return self.train.gamma if self.train.gamma is not None else GAMMA_BY_BLOCK[self.drafter.block_size]


# ---------------------------------------------------------------- recipes
def tiny() -> Config:
    """The embedded default: a tiny target and data built locally; about 30 s on a 2-core CPU."""
    return Config(
        recipe="tiny",
        target=TargetConfig(path=EMBEDDED_TARGET),
        drafter=DrafterConfig(num_layers=2, block_size=8),
        data=DataConfig(path=EMBEDDED_DATA, regenerate=True, regen_max_new_tokens=48, max_length=96,
                        num_anchors=12, batch_size=8, buckets=(64, 96)),
        optim=OptimConfig(lr=3e-3, warmup_ratio=0.05, weight_decay=0.0),
        train=TrainConfig(epochs=6, seed=0, cpu_threads=1),
        checkpoint=CheckpointConfig(every=100),
        metrics=MetricsConfig(log_every=5),
        eval=EvalConfig(at_end=True, num_prompts=8, max_new_tokens=48),
    )


def qwen3_8b() -> Config:
    """The paper's setup (SpecForge reference run): Qwen3-8B target, 5 draft layers, B=16."""
    return Config(
        recipe="qwen3_8b",
        target=TargetConfig(path="Qwen3-8B"),
        drafter=DrafterConfig(num_layers=5, block_size=16),
        # 4 x 3,072 tokens per GPU per step as in the reference (4 sequences there), packed: one micro-batch
        # of 4 rows, its drafter blocks in as few chunks as the GPU has memory for (the loss denominator is
        # global, so any chunking is exactly the whole step's gradient). One H200, mixed-length chats: 1 chunk
        # 10,747 tokens/s at a 71.2 GiB peak, 2 chunks 10,613 at 55.8 GiB (docs/benchmarks.md); "auto" picks 1
        # there and 2 on an 80 GB GPU (dflash/training/memory_plan.py)
        data=DataConfig(path="data/train.jsonl", max_length=3072, num_anchors=512, batch_size=4,
                        buckets=(512, 1024, 2048, 3072), pack=True, pack_chunks="auto"),
        optim=OptimConfig(lr=6e-4, warmup_ratio=0.04, clip=1.0),
        train=TrainConfig(epochs=6, grad_accum=1),
        checkpoint=CheckpointConfig(every=1000),
        metrics=MetricsConfig(log_every=10),
        eval=EvalConfig(at_end=False),
    )


RECIPES = {"tiny": tiny, "qwen3_8b": qwen3_8b}


# ---------------------------------------------------------------- overrides and TOML
def _sections(cfg: Config) -> dict[str, Any]:
    return {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}


def _coerce(value: Any, tp: Any, name: str) -> Any:
    """Convert a TOML/CLI value to the annotated type `tp`, or raise ValueError naming the field."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None or (isinstance(value, str) and value.lower() in ("none", "null")):
            if type(None) in args:
                return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return _coerce(value, a, name)
            except ValueError as e:
                errors.append(str(e))
        raise ValueError(errors[0] if errors else f"{name}: bad value {value!r}")
    if origin is Literal:
        if value not in args:
            raise ValueError(f"{name}: {value!r} is not one of {', '.join(map(repr, args))}")
        return value
    if origin is tuple:
        if isinstance(value, str):
            text = value.strip()
            if text.count("[") != text.count("]") or text.count("[") > 1 or \
                    ("[" in text and not (text.startswith("[") and text.endswith("]"))):
                raise ValueError(f"{name}: expected a list such as [256, 512], got {value!r} (unbalanced brackets)")
            value = [v for v in text.replace("[", "").replace("]", "").split(",") if v.strip()]
        if not isinstance(value, (list, tuple)):
            raise ValueError(f"{name}: expected a list, got {value!r}")
        return tuple(_coerce(v, args[0], name) for v in value)
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
            return value.lower() in ("true", "1", "yes")
        raise ValueError(f"{name}: expected true/false, got {value!r}")
    if tp is int:  # a whole float (TOML `3.0`, --set 3.0 or 1e3) is that integer; 3.5 or 1e30 is no integer
        try:
            if isinstance(value, bool) or not isinstance(value, (int, float, str)):
                raise ValueError
            if isinstance(value, str) and value.strip().lstrip("+-").replace("_", "").isdigit():
                return int(value.strip())
            f = float(value)
            if not f.is_integer() or abs(f) > 2 ** 53:  # past 2**53 a float is not the integer written
                raise ValueError
            return int(f)
        except (TypeError, ValueError, OverflowError):
            raise ValueError(f"{name}: expected an integer, got {value!r}") from None
    if tp is float:
        try:
            f = float(value)
        except (TypeError, ValueError):
            raise ValueError(f"{name}: expected a number, got {value!r}") from None
        if isinstance(value, bool) or not math.isfinite(f):
            raise ValueError(f"{name}: expected a finite number, got {value!r}")
        return f
    if tp is str:  # an integer is fine (a device index); a TOML true/false, number or table is no path or name
        if isinstance(value, bool) or not isinstance(value, (str, int)):
            raise ValueError(f"{name}: expected a string (in quotes), got {value!r}")
        return str(value)
    raise ValueError(f"{name}: unsupported type {tp!r}")


@dataclass(frozen=True)
class FieldInfo:
    key: str  # section.field
    type: Any  # the annotated type (bool, int, float, str, tuple[str, ...], a Literal, X | None)
    default: Any  # the field's default in the section's dataclass


def field_info(key: str) -> FieldInfo:
    """The type and default of config field `key` ("topology.stall_after"), read from the config
    tree: what a command-line option mirroring the field is built from. ValueError names an unknown key."""
    sec_name, _, fname = key.partition(".")
    sections = typing.get_type_hints(Config)
    if sec_name not in sections or not dataclasses.is_dataclass(sections[sec_name]):
        raise ValueError(f"{key}: unknown section")
    sec_cls = sections[sec_name]
    fields = {f.name: f for f in dataclasses.fields(sec_cls)}
    if fname not in fields:
        raise ValueError(f"{key}: unknown field; {sec_name} has {', '.join(fields)}")
    f = fields[fname]
    default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
    return FieldInfo(key, typing.get_type_hints(sec_cls)[fname], default)


RENAMED = {"train.device": "topology.device"}
"""Keys that moved (old name -> new): still read from older runs' config.toml and from --set."""


def apply_overrides(cfg: Config, overrides: dict[str, Any]) -> Config:
    """Return a new Config with dotted-key overrides applied (`{"optim.lr": "3e-4"}`); validates."""
    sections = {name: dataclasses.asdict(sec) if dataclasses.is_dataclass(sec) else sec
                for name, sec in _sections(cfg).items()}
    for key, value in overrides.items():
        key = RENAMED.get(key, key)
        parts = key.split(".")
        if len(parts) == 1 and parts[0] == "recipe":
            sections["recipe"] = str(value)
            continue
        known = [f"{n}.{f}" for n, v in sections.items() if isinstance(v, dict) for f in v]
        near = "".join(f" (did you mean {k}?)" for k in difflib.get_close_matches(key, known, n=1, cutoff=0.8))
        if len(parts) != 2 or parts[0] not in sections or not isinstance(sections[parts[0]], dict):
            raise ValueError(f"{key}: unknown setting{near}; expected section.field with a section among "
                             f"{', '.join(k for k, v in sections.items() if isinstance(v, dict))}")
        sec_name, fname = parts
        hints = typing.get_type_hints(type(getattr(cfg, sec_name)))
        if fname not in hints:
            raise ValueError(f"{key}: unknown field{near}; {sec_name} has {', '.join(hints)}")
        sections[sec_name][fname] = _coerce(value, hints[fname], key)
    built = {}
    for name, val in sections.items():
        if isinstance(val, dict):
            built[name] = type(getattr(cfg, name))(**val)
        else:
            built[name] = val
    return Config(**built)


def parse_set(items: list[str]) -> dict[str, str]:
    """Parse `--set a.b=value` items into a dict (values stay strings; TOML-ish lists allowed)."""
    out = {}
    for item in items:
        if "=" not in item:
            raise ValueError(f"--set {item!r}: expected section.field=value, e.g. optim.lr=3e-4")
        k, v = item.split("=", 1)
        out[k.strip()] = v.strip()
    return out


def _flatten(data: dict[str, Any]) -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for k, v in data.items():
        if isinstance(v, dict):
            for k2, v2 in v.items():
                flat[f"{k}.{k2}"] = v2
        else:
            flat[k] = v
    return flat


MAX_CONFIG_BYTES = 1 << 20  # a full config is ~2 KB


def load_toml(path: str | Path, overrides: dict[str, Any] | None = None) -> Config:
    """Read a TOML config: its `recipe` (default tiny) first, then its tables, then `overrides`.

    The file is untrusted input: a missing, huge, binary or malformed file, or a field of the wrong
    type, is BadInput naming the file (never a traceback)."""
    from compilewatch import BadInput, loads_toml, one_line, read_text

    path = Path(path)
    text = read_text(path, limit=MAX_CONFIG_BYTES, what="TOML config file")
    try:
        data = loads_toml(text, str(path))  # compilewatch's one TOML reader: bounded key depth
        recipe = str(data.get("recipe", "tiny"))
        if recipe not in RECIPES:
            raise ValueError(f"recipe: unknown recipe {one_line(repr(recipe), 60)}; known: {', '.join(RECIPES)}")
        flat = _flatten(data)
        flat.pop("recipe", None)
        cfg = apply_overrides(RECIPES[recipe](), flat)
    except (ValueError, TypeError, RecursionError) as e:  # TOMLDecodeError is a ValueError
        raise BadInput(f"{path}: bad config: {one_line(e, 300)}",
                       hint="see `dflash train --print-config` for every field") from None
    return apply_overrides(cfg, overrides or {})


def build_config(recipe: str = "tiny", toml_path: str | Path | None = None,
                 overrides: dict[str, Any] | None = None) -> Config:
    """The one way a run's config is made: recipe or TOML file, then overrides."""
    if toml_path is not None:
        return load_toml(toml_path, overrides)
    if recipe not in RECIPES:
        raise ValueError(f"recipe: unknown recipe {recipe!r}; known: {', '.join(RECIPES)}")
    return apply_overrides(RECIPES[recipe](), overrides or {})


def _toml_value(v: Any) -> str:
    if v is None:
        return '"none"'
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    s = str(v).replace("\\", "\\\\").replace('"', '\\"')
    return f'"{s}"'


def to_toml(cfg: Config) -> str:
    """The full config as TOML (loads back to an equal Config)."""
    lines = [f"recipe = {_toml_value(cfg.recipe)}"]
    for name, sec in _sections(cfg).items():
        if not dataclasses.is_dataclass(sec):
            continue
        lines += ["", f"[{name}]"]
        for f in dataclasses.fields(sec):
            lines.append(f"{f.name} = {_toml_value(getattr(sec, f.name))}")
    return "\n".join(lines) + "\n"


def to_dict(cfg: Config) -> dict[str, Any]:
    return dataclasses.asdict(cfg)
