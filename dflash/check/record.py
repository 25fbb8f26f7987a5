"""What an export records about what it was trained with, and the same facts read from a target now.

The record sits in the export's config.json under `dflash_training` (so an export copied as the two
files serving engines need still carries it; SGLang and vLLM ignore the key). It holds:

- `trained`: the DFlash fields as trained (taps, mask token id, RoPE, sizes, block size). config.json's
  own fields are what the engines read; when someone edits them, the record still says what the
  drafter learned.
- `tokenizer`: digests of the target tokenizer's vocabulary (as shipped, before `<|MASK|>` is added)
  and of its special tokens, the special tokens themselves, eos/pad/bos, the mask token and the id
  training used for it.
- `chat_template`: a digest of the template, its text (up to 64 KB), its rendering of one fixed
  conversation (SAMPLE_CONVERSATION), the generation prompt it appends, and, when the template has an
  `enable_thinking` switch, the generation prompt with thinking on and off and which one is the
  default training rendered with (dflash renders without the switch: the template's default).

`build_record` runs at every save (dflash.checkpoint.store); the tokenizer's facts are computed once
per process and target (a Qwen3 tokenizer takes about a second). `tokenizer_facts` on a target's
tokenizer now gives what dflash.check.static compares against.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import json
from pathlib import Path
from typing import Any

from compilewatch import BadInput
from dflash.config import EMBEDDED_TARGET

RECORD_KEY = "dflash_training"  # config.json key holding the record
FORMAT = "dflash-training-record"
VERSION = 1
TEMPLATE_TEXT_LIMIT = 64 << 10  # characters of the chat template kept verbatim
SPECIAL_LIMIT = 512  # special tokens listed by name (the digest covers all)

SAMPLE_CONVERSATION = [  # rendered through the template at save and at check: any change shows
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is two plus two?"},
    {"role": "assistant", "content": "Four."},
    {"role": "user", "content": "And three plus three?"},
]


def digest(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, ensure_ascii=False).encode()).hexdigest()[:32]


def target_tokenizer(path: str):
    """The target's tokenizer as shipped (no mask token added): the embedded tiny one, or a local
    directory's (nothing is downloaded). BadInput when it cannot be loaded."""
    from dflash.config import TargetConfig
    from dflash.model.target import shipped_tokenizer

    return shipped_tokenizer(TargetConfig(path=path))


def _template_text(tok) -> str | None:
    t = getattr(tok, "chat_template", None)
    if isinstance(t, dict):  # named templates: the default one renders chats
        t = t.get("default") or next(iter(t.values()), None)
    return t if isinstance(t, str) else None


def _render(tok, conv, gen: bool, template: str | None = None, **kw) -> str:
    extra = {"chat_template": template} if template is not None else {}
    return tok.apply_chat_template(conv, tokenize=False, add_generation_prompt=gen, **extra, **kw)


def render_prompt(tok, conv, template: str | None = None) -> str:
    """A prompt as dflash renders it (generation prompt on; `template`: another template's text)."""
    return _render(tok, conv, True, template)


def _generation_prompt(tok, template: str | None = None, **kw) -> str:
    head = SAMPLE_CONVERSATION[:2]
    with_gen, without = _render(tok, head, True, template, **kw), _render(tok, head, False, template, **kw)
    return with_gen[len(without):] if with_gen.startswith(without) else with_gen


def template_facts(tok, template: str | None = None) -> dict[str, Any]:
    """The chat template's digest, text, rendering of SAMPLE_CONVERSATION, generation prompt and
    thinking switch (`template`: render this text instead of the tokenizer's own)."""
    text = template if template is not None else _template_text(tok)
    if text is None:
        return {"digest": None, "text": None, "sample": None, "generation_prompt": None, "thinking": None,
                "error": "the tokenizer has no chat template"}
    out: dict[str, Any] = {"digest": digest(text), "text": text if len(text) <= TEMPLATE_TEXT_LIMIT else None,
                           "chars": len(text)}
    try:
        out["sample"] = _render(tok, SAMPLE_CONVERSATION, True, template)
        out["generation_prompt"] = _generation_prompt(tok, template)
        thinking = None
        if "enable_thinking" in text:
            on = _generation_prompt(tok, template, enable_thinking=True)
            off = _generation_prompt(tok, template, enable_thinking=False)
            default = "on" if out["generation_prompt"] == on else "off" if out["generation_prompt"] == off else "other"
            thinking = {"switch": True, "default": default, "on_prompt": on, "off_prompt": off}
        else:
            thinking = {"switch": False}
        out["thinking"] = thinking
    except Exception as e:  # noqa: BLE001 - a template that raises (jinja, a role it rejects) is a fact to record
        out.update(sample=None, generation_prompt=None, thinking=None, error=f"{type(e).__name__}: {str(e)[:200]}")
    return out


def tokenizer_facts(tok, mask_token: str) -> dict[str, Any]:
    """The tokenizer's vocabulary and special tokens (as given: call before adding the mask token),
    the id the mask token has or would get when added as training adds it, and the template's facts."""
    vocab = tok.get_vocab()
    special = set(getattr(tok, "all_special_tokens", []) or [])
    for t in (getattr(tok, "added_tokens_decoder", None) or {}).values():
        if getattr(t, "special", False):
            special.add(str(t.content))
    special_sorted = sorted(special)
    shipped = vocab.get(mask_token)
    return {
        "size": len(tok), "vocab_digest": digest(sorted(vocab.items())),
        "special_tokens": special_sorted[:SPECIAL_LIMIT], "special_digest": digest(special_sorted),
        "eos_token": getattr(tok, "eos_token", None), "pad_token": getattr(tok, "pad_token", None),
        "bos_token": getattr(tok, "bos_token", None),
        "mask_token": mask_token,
        "mask_token_shipped": shipped is not None,  # in the tokenizer as shipped, or added by training
        "mask_token_id": int(shipped) if shipped is not None else _added_id(tok, mask_token),
        "chat_template": template_facts(tok),
    }


def _added_id(tok, mask_token: str) -> int:
    """The id the mask token gets when added the way training adds it (on a copy of `tok`)."""
    from dflash.model.target import add_mask_token

    mid, _ = add_mask_token(copy.deepcopy(tok), mask_token)
    return mid


@functools.lru_cache(maxsize=4)
def _cached_facts(path: str, mask_token: str) -> str:
    return json.dumps(tokenizer_facts(target_tokenizer(path), mask_token))


_JSON_NAMES = {str: "a string", int: "an integer", bool: "true or false", dict: "an object", type(None): "null"}
_STR = (str, type(None))
_TOKENIZER_FIELDS = {"size": (int,), "vocab_digest": _STR, "special_digest": _STR, "eos_token": _STR,
                     "pad_token": _STR, "bos_token": _STR, "mask_token": _STR, "mask_token_shipped": (bool,),
                     "mask_token_id": (int, type(None)), "chat_template": (dict, type(None))}
_TEMPLATE_FIELDS = {"digest": _STR, "text": _STR, "sample": _STR, "generation_prompt": _STR,
                    "thinking": (dict, type(None)), "error": _STR}
_THINKING_FIELDS = {"switch": (bool,), "default": _STR, "on_prompt": _STR, "off_prompt": _STR}


def read_record(cfg_json: dict[str, Any], where: str) -> dict[str, Any] | None:
    """config.json's training record, every field `dflash check` reads checked for its type (a record
    from an edited or foreign config.json is untrusted input); None when there is none. BadInput naming
    the first field that is not what a save writes."""
    rec = cfg_json.get(RECORD_KEY)
    if rec is None:
        return None

    def bad(field: str, want: str, got: Any) -> BadInput:
        name = ".".join(x for x in (RECORD_KEY, field.lstrip(".")) if x)
        return BadInput(f"{where}: {name}: expected {want}, got {json.dumps(got)[:60]}",
                        hint="the export's config.json was edited or damaged: restore it from the checkpoint it "
                             "came from, or export again")

    def fields(d: Any, spec: dict[str, tuple], at: str) -> None:
        if not isinstance(d, dict):
            raise bad(at, "an object", d)
        for k, types in spec.items():
            if k in d and (not isinstance(d[k], types) or (bool not in types and isinstance(d[k], bool))):
                raise bad(f"{at}.{k}", " or ".join(_JSON_NAMES[t] for t in types), d[k])

    fields(rec, {"trained": (dict, type(None)), "tokenizer": (dict, type(None)), "error": _STR}, "")
    trained = rec.get("trained") or {}
    taps = trained.get("target_layer_ids", [])
    if not isinstance(taps, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in taps):
        raise bad("trained.target_layer_ids", "a list of integers", taps)
    tok = rec.get("tokenizer")
    if tok is not None:
        fields(tok, _TOKENIZER_FIELDS, "tokenizer")
        special = tok.get("special_tokens", [])
        if not isinstance(special, list) or not all(isinstance(t, str) for t in special):
            raise bad("tokenizer.special_tokens", "a list of strings", special)
        tpl = tok.get("chat_template")
        if tpl is not None:
            fields(tpl, _TEMPLATE_FIELDS, "tokenizer.chat_template")
            if tpl.get("thinking") is not None:
                fields(tpl["thinking"], _THINKING_FIELDS, "tokenizer.chat_template.thinking")
    return rec


def build_record(config_toml: str, spec) -> dict[str, Any]:
    """The record a save writes (the training config's target and mask token; `spec`: the drafter's).
    Never raises: a tokenizer that cannot be read gives a record saying why (a save must not fail)."""
    import tomllib

    rec: dict[str, Any] = {"format": FORMAT, "version": VERSION, "trained": trained_fields(spec)}
    try:
        cfg = tomllib.loads(config_toml)
        t = cfg.get("target", {})
        path, mask = str(t.get("path", EMBEDDED_TARGET)), str(t.get("mask_token", "<|MASK|>"))
        rec["target"] = path
        rec["data"] = str(cfg.get("data", {}).get("path", ""))
        rec["tokenizer"] = json.loads(_cached_facts(path, mask))
    except Exception as e:  # noqa: BLE001 - the record is for `dflash check`; the save goes on without it
        rec["error"] = f"{type(e).__name__}: {str(e)[:300]}"
    return rec


def trained_fields(spec) -> dict[str, Any]:
    return {
        "hidden_size": spec.hidden_size, "vocab_size": spec.vocab_size, "num_target_layers": spec.num_target_layers,
        "target_layer_ids": list(spec.target_layer_ids), "mask_token_id": spec.mask_token_id,
        "rope_theta": spec.rope_theta, "rope_scaling": dict(spec.rope_scaling) if spec.rope_scaling else None,
        "block_size": spec.block_size, "num_hidden_layers": spec.num_hidden_layers,
    }
