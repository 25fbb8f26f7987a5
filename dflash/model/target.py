"""The frozen target LLM: loading (local directory only), hidden-state taps, the embedded tiny target.

- A real target is any Hugging Face causal LM in a local directory, loaded with transformers
  (`local_files_only=True`: nothing is ever downloaded), frozen, in bf16 on GPU.
- Taps: `hidden_states[layer_id + 1]` (entry 0 is the embedding output) for the configured ids, or
  the default formula (dflash.model.drafter.default_layer_ids), concatenated on the last dim. The training
  forward runs the decoder only up to the last tapped layer (the default taps of a 36-layer target
  stop at layer 33: 34 of 36 layers, no final norm, no LM head), capturing the tapped layers' outputs
  itself; with `target.compile` on CUDA those layers run compiled (one graph, shared by every layer,
  per sequence length). Eval and regen use the whole model, eagerly (its RMSNorms one fused kernel each
  on a GPU: dflash.model.fused_norm).
- The mask token `<|MASK|>` is added to the tokenizer when missing (never reuse pad) and the caller is
  told; embedding rows are only resized when the new id does not fit (Qwen3's table has spare rows).
- `embedded:tiny` builds a small Qwen3 from a config with a fixed seed and a local word-level tokenizer
  with a chat template, so the whole pipeline runs offline on a CPU.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import pickle
import threading
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from compilewatch import BadInput
from dflash.config import EMBEDDED_TARGET, TargetConfig
from dflash.data.packing import run_bounds
from dflash.model import fp8, packed_attention
from dflash.model.drafter import default_layer_ids
from dflash.model.fused_norm import fuse_norms

TINY_SEED = 1234  # the embedded target's weights depend on this alone
TINY_SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "[UNK]"]
TINY_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@dataclass
class Target:
    """A loaded, frozen target and what the drafter needs from it."""

    model: nn.Module
    tokenizer: object  # a transformers tokenizer with a chat template
    layer_ids: tuple[int, ...]
    mask_token_id: int
    device: torch.device
    dtype: torch.dtype
    source: str  # the directory, or embedded:tiny
    notes: list[str] = field(default_factory=list)  # things the user should be told (mask token added, ...)
    compile_taps: bool = False  # run the tapped decoder layers compiled in `taps` (read at the first `taps`; the model stays eager)
    _tapper: "_Tapper | bool | None" = field(default=None, init=False, repr=False, compare=False)  # False: not buildable

    @property
    def config(self):
        return self.model.config

    @property
    def hidden_size(self) -> int:
        return int(self.config.hidden_size)

    @property
    def num_layers(self) -> int:
        return int(self.config.num_hidden_layers)

    @property
    def vocab_size(self) -> int:
        return int(self.model.get_input_embeddings().weight.shape[0])

    @property
    def embed(self) -> nn.Module:
        return self.model.get_input_embeddings()

    @property
    def head(self) -> nn.Module:
        return self.model.get_output_embeddings()

    @property
    def eos_ids(self) -> list[int]:
        ids = self.config.eos_token_id
        ids = [ids] if isinstance(ids, int) else list(ids or [])
        tok_eos = getattr(self.tokenizer, "eos_token_id", None)
        if tok_eos is not None and tok_eos not in ids:
            ids.append(tok_eos)
        return ids

    @property
    def has_body(self) -> bool:
        """False for an `embed_head_on` view: it holds no decoder layers, so no taps."""
        return not isinstance(self.model, EmbedHead)

    def embed_head_on(self, device: torch.device) -> "Target":
        """This target as a drafter device needs it: a copy of the frozen embedding and LM head on
        `device` (tied weights stay tied), the same tokenizer, taps, mask token and config; no body."""
        return dataclasses.replace(self, model=EmbedHead(self.model, device), device=device, notes=[])

    @torch.no_grad()
    def taps(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
             runs: tuple[torch.Tensor, int] | None = None) -> torch.Tensor:
        """(B, S) right-padded ids -> (B, S, k·H) concatenated taps. Padding sits after the valid
        tokens, so causal attention keeps it out of every valid position; no attention mask needed.
        `position_ids` (B, S): packed rows (dflash/data/packing.py), positions restarting at each
        conversation; transformers' masking makes that a block-diagonal causal mask (with no
        attention mask and no cache, it reads packed sequences from the positions). On a GPU the
        truncated decoder attends within each conversation by flash varlen instead
        (dflash.model.packed_attention); `runs` (PackedBatch.run_bounds) saves reading the positions."""
        tapper = self.tapper()
        if tapper is not None:
            return tapper(input_ids, position_ids, runs)
        where = {} if position_ids is None else {"position_ids": position_ids}
        try:  # logits_to_keep=1: skip the (S × vocab) logits nobody reads
            out = self.model(input_ids=input_ids, output_hidden_states=True, use_cache=False, logits_to_keep=1, **where)
        except TypeError:  # a model class without logits_to_keep
            out = self.model(input_ids=input_ids, output_hidden_states=True, use_cache=False, **where)
        return torch.cat([out.hidden_states[i + 1] for i in self.layer_ids], dim=-1)

    def tapper(self) -> "_Tapper | None":
        """The truncated decoder `taps` runs (built once), or None for a model whose decoder is not
        the usual `layers` + `norm` layout (then `taps` runs the whole model, as before)."""
        if self._tapper is None and self.has_body:
            with _TAPPER_LOCK:
                if self._tapper is None:
                    self._tapper = _Tapper.build(self.model, self.layer_ids, self.compile_taps)
        return self._tapper or None

    @property
    def layers_run(self) -> int:
        """Decoder layers one `taps` call runs (what its FLOPs count)."""
        t = self.tapper()
        return t.depth if t is not None else self.num_layers


_TAPPER_LOCK = threading.Lock()


class _TapLayer(nn.Module):
    """One decoder layer of the truncated view: calls the layer (or its compiled forward) and keeps
    its output when it is tapped. Attributes the decoder's loop reads (`attention_type`, ...) come
    from the layer."""

    def __init__(self, layer: nn.Module, index: int, tapper: "_Tapper", compiled: bool) -> None:
        super().__init__()
        self.layer = layer
        self.index = index
        # a compiled *forward*, not layer.compile(): the model's own modules stay eager (eval, regen) and
        # the layer's own hooks stay out of the graph. (Hooks on its submodules run inside: transformers'
        # output-capture hooks, installed once anyone asks the model for output_hidden_states, read a
        # ContextVar dynamo cannot trace and break the graph; the training forward never asks.)
        self._fn = torch.compile(layer.forward, dynamic=False) if compiled else layer.__call__
        self._tapper = [tapper]  # in a list: not a submodule

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules["layer"], name)

    def forward(self, *args, **kwargs):
        out = self._fn(*args, **kwargs)
        self._tapper[0].keep(self.index, out[0] if isinstance(out, tuple) else out)
        return out


class _Tapper:
    """A shallow view of the target's decoder that runs layers 0..max(taps) and nothing after them
    (the final norm only when the last layer is tapped: `hidden_states[L]` is normed). It shares every
    module and parameter with the model; the model itself is not changed."""

    def __init__(self, view: nn.Module, layer_ids: tuple[int, ...], depth: int, last_normed: bool,
                 varlen: bool = False) -> None:
        self.view, self.layer_ids, self.depth, self.last_normed = view, layer_ids, depth, last_normed
        self._local = threading.local()  # per calling thread: the outputs of this call's tapped layers
        # packed rows (position_ids given): flash attention within each conversation instead of transformers'
        # dense block-diagonal mask (dflash.model.packed_attention; CUDA, bf16/fp16, the sdpa implementation)
        self.varlen = varlen

    @classmethod
    def build(cls, model: nn.Module, layer_ids: tuple[int, ...], compiled: bool) -> "_Tapper | bool":
        """The view, or False when the model's decoder is not `layers` (ModuleList) + `norm`."""
        decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
        layers, norm = getattr(decoder, "layers", None), getattr(decoder, "norm", None)
        L = int(model.config.num_hidden_layers)
        if not (isinstance(layers, nn.ModuleList) and len(layers) == L and isinstance(norm, nn.Module)):
            return False
        depth = max(layer_ids) + 1
        param = next(model.parameters(), None)
        varlen = (param is not None and getattr(model.config, "_attn_implementation", None) == "sdpa"
                  and packed_attention.varlen_ok(param.device, param.dtype))
        tapper = cls(None, layer_ids, depth, last_normed=depth == L, varlen=varlen)  # type: ignore[arg-type]
        view = copy.copy(decoder)  # shares parameters, buffers and hooks; gets its own module table
        view._modules = dict(decoder._modules)
        view._modules["layers"] = nn.ModuleList(_TapLayer(layers[i], i, tapper, compiled) for i in range(depth))
        if not tapper.last_normed:
            view._modules["norm"] = nn.Identity()
        tapper.view = view
        return tapper

    def keep(self, index: int, hidden: torch.Tensor) -> None:
        kept = getattr(self._local, "kept", None)
        if kept is not None and index in self.layer_ids:
            kept[index] = hidden

    def __call__(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
                 runs: tuple[torch.Tensor, int] | None = None) -> torch.Tensor:
        self._local.kept = kept = {}
        where = {} if position_ids is None else {"position_ids": position_ids}
        docs = contextlib.nullcontext()
        if position_ids is not None and self.varlen:
            bounds, longest = runs if runs is not None else run_bounds(position_ids)  # (without: one GPU sync)
            if bounds.numel() - 1 > input_ids.shape[0]:  # a row holds more than one run: attend within each
                packed_attention.install()
                where[packed_attention.MARKER] = True
                docs = packed_attention.documents(bounds.to(input_ids.device, non_blocking=True), longest)
        try:
            with docs:
                out = self.view(input_ids=input_ids, use_cache=False, **where)
        finally:
            self._local.kept = None
        if self.last_normed:  # hidden_states[L] of the whole model is the normed output
            kept[self.depth - 1] = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
        return torch.cat([kept[i] for i in self.layer_ids], dim=-1)


class EmbedHead(nn.Module):
    """What a drafter device needs of the target: its frozen embedding and LM head, nothing else."""

    def __init__(self, target_model: nn.Module, device: torch.device) -> None:
        super().__init__()
        embed, head = copy.deepcopy((target_model.get_input_embeddings(), target_model.get_output_embeddings()))
        self.embed, self.head = embed.to(device), head.to(device)  # deepcopy of the pair keeps tied weights tied
        self.config = target_model.config
        self.requires_grad_(False)

    def get_input_embeddings(self) -> nn.Module:
        return self.embed

    def get_output_embeddings(self) -> nn.Module:
        return self.head

    def forward(self, *args, **kwargs):
        raise RuntimeError("a drafter device holds no target body: taps come from the target workers")


def resolve_device(spec: str) -> torch.device:
    """`auto` -> cuda:0 when a GPU is visible, else cpu; anything else through compilewatch.devices.spec."""
    from compilewatch import parse_device

    if spec == "auto":
        return torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    return torch.device(parse_device(spec))


def resolve_dtype(spec: str, device: torch.device) -> torch.dtype:
    if spec == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"bf16": torch.bfloat16, "fp32": torch.float32}[spec]


# ---------------------------------------------------------------- the embedded tiny target
def tiny_words(n: int = 300) -> list[str]:
    """A fixed vocabulary of pronounceable words (consonant-vowel syllables)."""
    cons, vows = "bdfgklmnprstvz", "aeiou"
    syll = [c + v for c in cons for v in vows]  # 70 syllables
    words = list(syll)
    for a in syll:
        for b in syll:
            if len(words) >= n:
                return words
            words.append(a + b)
    return words[:n]


def build_tiny_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(TINY_SPECIAL + ["user", "assistant", "system"] + tiny_words())}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="[UNK]", eos_token="<|im_end|>",
                                  pad_token="<|endoftext|>", additional_special_tokens=["<|im_start|>", "<|im_end|>"])
    tok.chat_template = TINY_CHAT_TEMPLATE
    return tok


def tiny_target_config(vocab_size: int, **overrides):
    from transformers import Qwen3Config

    padded = (vocab_size + 63) // 64 * 64  # spare rows, like Qwen3's table (the mask token fits)
    fields = dict(
        vocab_size=padded, hidden_size=64, intermediate_size=192, num_hidden_layers=6,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
        rope_theta=10000.0, tie_word_embeddings=False, initializer_range=0.02,
        eos_token_id=2, pad_token_id=0, bos_token_id=None,
    )
    return Qwen3Config(**{**fields, **overrides})


def build_tiny_target():
    """(model, tokenizer): a 6-layer, 64-wide Qwen3 with fixed-seed random weights; no download."""
    from transformers import Qwen3ForCausalLM

    tok = build_tiny_tokenizer()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(TINY_SEED)
        model = Qwen3ForCausalLM(tiny_target_config(len(tok)))
    return model, tok


# ---------------------------------------------------------------- loading
# A target loads in stages (issue 39), each its own function: the tokenizer (with the mask token), the
# config, what the drafter and the data need of it (`TargetShape`), the model (weights straight from
# safetensors onto the device: dflash.model.weights), then the frozen Target. `load_target` runs them
# one after another; dflash.model.target_load runs them in threads, beside the start's other work.
from dflash.model.target_dir import check_dir, check_target  # noqa: E402 - the loading section's own imports
from dflash.model.weights import BUILDING  # noqa: E402

_check_dir = check_dir  # dflash.model.target_dir: the torch-free check a start runs first


def _check_template(tok, source: str) -> None:
    if getattr(tok, "chat_template", None) is None:
        raise BadInput(f"the target tokenizer at {source!r} has no chat template",
                       hint="DFlash data is rendered through the target's chat template; add one to tokenizer_config.json")


def _target_dir(cfg: TargetConfig) -> Path:
    """The target's directory, checked (BadInput for an unknown embedded name or a bad directory)."""
    check_target(cfg)
    return Path(cfg.path).expanduser()


# what torch.load and load_state_dict say of a file that is no checkpoint, or of weights of other shapes
_DAMAGED_FILE_WORDS = ("PytorchStreamReader", "zip archive", "Error(s) in loading state_dict", "size mismatch")


def _load_errors() -> tuple[type[BaseException], ...]:
    """What transformers raises for a model directory's bad files: OSError/ValueError/TypeError/KeyError,
    and huggingface_hub's strict-dataclass validation of a config.json field of the wrong type."""
    try:
        from huggingface_hub.errors import StrictDataclassError
    except ImportError:  # an older huggingface_hub: it has no strict config dataclasses
        return (OSError, ValueError, TypeError, KeyError)
    return (OSError, ValueError, TypeError, KeyError, StrictDataclassError)


def _config_failure(path: Path, e: BaseException) -> BadInput:
    """BadInput for a target whose config.json (read by both the tokenizer and the config loaders)
    cannot be used: it names config.json, not the loader that tripped over it."""
    from compilewatch import one_line

    return BadInput(f"the target's config.json in {str(path)!r} cannot be used: "
                    f"{one_line(str(e).replace(chr(92) + 'n', ' '), 300)}",
                    hint="it must be the JSON object the model was saved with (a model_type and typed fields): "
                         "restore the model directory's config.json")


def _config_json_broken(path: Path, e: BaseException) -> bool:
    """Whether a loader's error `e` came from the directory's config.json rather than its tokenizer
    files: it names config.json, it is a typed field's validation error, or config.json is no JSON object."""
    import json

    strict = _load_errors()[4:]
    if "config.json" in str(e) or (strict and isinstance(e, strict)):
        return True
    try:
        with open(path / "config.json", "rb") as fh:
            return not isinstance(json.loads(fh.read(64 << 20)), dict)
    except (OSError, ValueError):
        return True


def shipped_tokenizer(cfg: TargetConfig):
    """The target's tokenizer as shipped (no mask token added): the embedded tiny one, or a checked
    local directory's (nothing is downloaded). BadInput, on one line, when it cannot be loaded."""
    if cfg.path == EMBEDDED_TARGET:
        return build_tiny_tokenizer()
    from transformers import AutoTokenizer

    from compilewatch import one_line

    path = _target_dir(cfg)
    try:
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except _load_errors() as e:  # transformers' text carries literal "\n"s
        if _config_json_broken(path, e):
            raise _config_failure(path, e) from None
        raise BadInput(f"could not load the target's tokenizer from {str(path)!r}: "
                       f"{one_line(str(e).replace(chr(92) + 'n', ' '), 300)}",
                       hint="the directory needs the tokenizer files (tokenizer.json or what its "
                            "tokenizer_config.json names) beside config.json") from None


def tokenizer_with_mask(cfg: TargetConfig):
    """(tokenizer, mask token id, notes): the target's tokenizer (no weights) with its chat template
    checked and the mask token added when missing; the notes say what was added."""
    tok = shipped_tokenizer(cfg)
    _check_template(tok, cfg.path)
    mask_id, notes = add_mask_token(tok, cfg.mask_token)
    return tok, mask_id, notes


def load_tokenizer(cfg: TargetConfig):
    """The target's tokenizer alone (no weights), with the mask token added exactly as load_target
    adds it: what `dflash prepare` tokenizes with, so its cache key matches the trainer's."""
    return tokenizer_with_mask(cfg)[0]


def load_config(cfg: TargetConfig):
    """The target's transformers config (its config.json; embedded:tiny's own), no weights."""
    if cfg.path == EMBEDDED_TARGET:
        return tiny_target_config(len(build_tiny_tokenizer()))  # the expression build_tiny_target uses
    from transformers import AutoConfig

    path = _target_dir(cfg)
    try:
        return AutoConfig.from_pretrained(str(path), local_files_only=True)
    except _load_errors() as e:
        raise _config_failure(path, e) from None


def add_mask_token(tokenizer, mask_token: str) -> tuple[int, list[str]]:
    """The mask token's id, adding it to the tokenizer when missing (the tokenizer alone)."""
    notes: list[str] = []
    if mask_token not in tokenizer.get_vocab():
        tokenizer.add_tokens([mask_token], special_tokens=True)
        notes.append(f"added {mask_token} to the tokenizer (id {tokenizer.convert_tokens_to_ids(mask_token)})")
    return int(tokenizer.convert_tokens_to_ids(mask_token)), notes


def ensure_mask_token(model: nn.Module, tokenizer, mask_token: str) -> tuple[int, list[str]]:
    """The mask token's id, adding the token (and embedding rows if needed) when missing."""
    mid, notes = add_mask_token(tokenizer, mask_token)
    rows = model.get_input_embeddings().weight.shape[0]
    if mid >= rows:
        model.resize_token_embeddings(len(tokenizer))
        notes.append(f"resized the target's embeddings {rows} -> {len(tokenizer)} rows for {mask_token}")
    return mid, notes


def choose_taps(requested: tuple[int, ...] | None, num_layers: int, num_draft_layers: int) -> tuple[int, ...]:
    """The configured taps (checked: in range, distinct) or the default spread; BadInput when impossible."""
    if requested is None:
        try:
            return default_layer_ids(num_layers, num_draft_layers)
        except ValueError:
            raise BadInput(f"{num_draft_layers} draft layers need {num_draft_layers} distinct target layers to tap, "
                           f"and the target has {num_layers}",
                           hint=f"use drafter.num_layers <= {num_layers}, or set target.layer_ids "
                                "(fewer taps than draft layers)") from None
    bad = [i for i in requested if not 0 <= i < num_layers]
    if bad:
        raise BadInput(f"target.layer_ids {list(requested)}: {bad} out of range for a {num_layers}-layer target",
                       hint=f"use ids in [0, {num_layers - 1}] or leave target.layer_ids unset for the default")
    if len(set(requested)) != len(requested):
        raise BadInput(f"target.layer_ids {list(requested)} repeats a layer",
                       hint="each tap must be a different layer (a repeated tap adds no information)")
    return tuple(requested)


@dataclass(frozen=True)
class TargetShape:
    """What the drafter and the data need of a target before its weights are in: the values the
    loaded Target will have (its config, tokenizer, taps, mask token, embedding rows), so a start can
    build the drafter and open the data cache while the weights load (dflash.model.target_load)."""

    config: object
    tokenizer: object
    layer_ids: tuple[int, ...]
    mask_token_id: int
    vocab_size: int  # embedding rows once the mask token is in (ensure_mask_token's resize rule)
    source: str
    notes: tuple[str, ...] = ()

    @property
    def hidden_size(self) -> int:
        return int(self.config.hidden_size)

    @property
    def num_layers(self) -> int:
        return int(self.config.num_hidden_layers)


def target_shape(cfg: TargetConfig, num_draft_layers: int) -> TargetShape:
    """The target's tokenizer, config, taps and mask token, no weights (BadInput for a bad target)."""
    tok, mask_id, notes = tokenizer_with_mask(cfg)
    config = load_config(cfg)
    layer_ids = choose_taps(cfg.layer_ids, int(config.num_hidden_layers), num_draft_layers)
    rows = int(config.vocab_size)
    return TargetShape(config=config, tokenizer=tok, layer_ids=layer_ids, mask_token_id=mask_id,
                       vocab_size=rows if mask_id < rows else len(tok), source=cfg.path, notes=tuple(notes))


def weight_files(cfg: TargetConfig) -> list[Path] | None:
    """The safetensors files a directory target's weights are read from straight onto a device (None:
    embedded, transformers 4, or no safetensors checkpoint: the model loads through from_pretrained)."""
    from importlib.metadata import PackageNotFoundError, version

    from dflash.model.weights import safetensors_files

    if cfg.path.startswith("embedded:"):
        return None
    try:
        if int(version("transformers").split(".")[0]) < 5:
            return None
    except (PackageNotFoundError, ValueError):
        return None
    return safetensors_files(Path(cfg.path).expanduser())


def _load_dir(path: Path, dtype: torch.dtype, device: torch.device | None = None, *, config=None,
              weights: dict[str, torch.Tensor] | None = None) -> nn.Module:
    """The model of a local HF directory. With transformers 5 and a safetensors checkpoint: the
    weights read straight onto `device` (`weights`, read already beside other work, or read here) and
    assigned as the parameters of a model built without allocating or initializing any
    (dflash.model.weights); otherwise from_pretrained, which on a GPU with transformers 5 reads onto
    `device` (`device_map`: needs accelerate) and elsewhere loads on the CPU (moved by the caller)."""
    import transformers
    from transformers import AutoModelForCausalLM

    _check_dir(path)
    device = torch.device(device or "cpu")
    major = int(transformers.__version__.split(".")[0])
    if major >= 5 and config is not None:
        model = _from_weights(path, config, dtype, device, weights)
        if model is not None:
            return model
    where = {}
    if device.type == "cuda" and major >= 5:
        where = {"device_map": {"": device}}
    try:
        with BUILDING:
            return AutoModelForCausalLM.from_pretrained(str(path), local_files_only=True, dtype=dtype, **where)
    except RuntimeError as e:  # only what a damaged file raises; the rest (out of memory, a CUDA error) as it was
        if not any(w in str(e) for w in _DAMAGED_FILE_WORDS):
            raise
        from compilewatch import one_line

        raise BadInput(f"could not load the target from {str(path)!r}: {one_line(str(e), 300)}",
                       hint="its weights are damaged (or do not match its config.json): restore the model "
                            "directory, or use a safetensors checkpoint") from None
    except (OSError, ValueError, pickle.UnpicklingError) as e:  # a .bin checkpoint: torch.load's
        import re  # weights_only refusal of a pickle, or a file that is no checkpoint

        from compilewatch import one_line

        why = one_line(str(e), 300)
        if isinstance(e, pickle.UnpicklingError):  # torch's text goes on to suggest weights_only=False: not repeated
            m = re.search(r"WeightsUnpickler error:\s*([^\n]+)", str(e))
            why = "torch.load(weights_only=True) refused its pickle" + (f" ({one_line(m.group(1), 120)})" if m else "")
        raise BadInput(f"could not load the target from {str(path)!r}: {why}",
                       hint="its weights are damaged, or a pytorch_model.bin that torch.load(weights_only=True) "
                            "refuses (it never runs a pickle's code): use a safetensors checkpoint") from None


def read_target_weights(path: Path, files: list[Path], device: torch.device,
                        stop: threading.Event | None = None) -> dict[str, torch.Tensor]:
    """dflash.model.weights.read_weights of a target's files; a damaged file is BadInput naming the target."""
    from safetensors import SafetensorError

    from dflash.model.weights import read_weights

    try:
        return read_weights(files, device, stop)
    except (OSError, ValueError, SafetensorError) as e:
        raise BadInput(f"could not load the target from {str(path)!r}: {e}") from None


def _from_weights(path: Path, config, dtype: torch.dtype, device: torch.device,
                  weights: dict[str, torch.Tensor] | None):
    """dflash.model.weights' path, with what from_pretrained also sets (the config's name, the
    generation config of generation_config.json); None when that path does not apply."""
    from transformers import GenerationConfig

    from dflash.model.weights import model_from_weights, safetensors_files

    if weights is None:
        files = safetensors_files(path)
        if files is None:
            return None
        weights = read_target_weights(path, files, device)
    config = copy.deepcopy(config)  # as from_pretrained: the caller's config is not changed
    config.name_or_path = str(path)
    try:
        model = model_from_weights(config, weights, dtype, device)
    finally:
        weights.clear()  # a fallback reads again: never two copies on the device
    if model is not None and model.can_generate():  # as from_pretrained (adjust_generation_fn) does
        try:
            model.generation_config = GenerationConfig.from_pretrained(str(path), local_files_only=True)
        except OSError:  # no generation_config.json: one made from config.json
            model.generation_config = GenerationConfig.from_pretrained(
                str(path), config_file_name="config.json", _from_model_config=True, local_files_only=True)
    return model


def load_model(cfg: TargetConfig, config, dtype: torch.dtype, device: torch.device,
               weights: dict[str, torch.Tensor] | None = None) -> nn.Module:
    """The target's model in `dtype` (`config`: load_config's; `weights`: read_weights' of its files)."""
    if cfg.path == EMBEDDED_TARGET:
        with BUILDING:
            return build_tiny_target()[0].to(dtype)
    return _load_dir(_target_dir(cfg), dtype, device, config=config, weights=weights)


def finish_target(cfg: TargetConfig, shape: TargetShape, model: nn.Module, device: torch.device,
                  dtype: torch.dtype) -> Target:
    """The frozen Target of `model` and its shape's tokenizer and taps (embedding rows added if the
    mask token needs them)."""
    mask_id, notes = ensure_mask_token(model, shape.tokenizer, cfg.mask_token)
    model.requires_grad_(False)
    model.eval()
    model.to(device)
    norms = fuse_norms(model)  # eager on a GPU: one kernel a norm (eval and regen decode steps)
    if norms:
        notes.append(norms)
    if cfg.fp8:
        notes.append(fp8.quantize_decoder(model))
    return Target(model=model, tokenizer=shape.tokenizer, layer_ids=shape.layer_ids, mask_token_id=mask_id,
                  device=device, dtype=dtype, source=cfg.path, notes=[*shape.notes, *notes],
                  compile_taps=cfg.compile and device.type == "cuda")


def check_fp8(cfg: TargetConfig, device: torch.device, dtype: torch.dtype) -> None:
    """BadInput, before any weight is read, when `target.fp8` is set and cannot run here."""
    why = fp8.unsupported(device, dtype) if cfg.fp8 else None
    if why is not None:
        raise BadInput(f"target.fp8 = true: {why}. Set target.fp8 = false (the default) to run the target in "
                       f"{dtype_name(dtype)}, or run on such a GPU.")


def dtype_name(dtype: torch.dtype) -> str:
    return {torch.bfloat16: "bf16", torch.float32: "fp32", torch.float16: "fp16"}.get(dtype, str(dtype))


def load_target(cfg: TargetConfig, num_draft_layers: int, device: torch.device,
                dtype_spec: str | None = None) -> Target:
    """Load (or build) the target, freeze it, choose the taps, make sure the mask token exists: the
    stages above, one after another (a start runs them beside its other work: target_load)."""
    dtype = resolve_dtype(dtype_spec or cfg.dtype, device)
    check_fp8(cfg, device, dtype)
    shape = target_shape(cfg, num_draft_layers)
    return finish_target(cfg, shape, load_model(cfg, shape.config, dtype, device), device, dtype)
