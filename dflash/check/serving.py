"""What SGLang's and vLLM's DFlash loaders read from an export's config.json, checked field by field.

The field list was taken from the engines' source as of these versions (no engine is installed
here; docs/check.md says the same):
- SGLang `python/sglang/srt/speculative/dflash_utils.py` at commit 00731f0bc9fa
  (`parse_dflash_draft_config`, `get_dflash_layer_types`, `get_dflash_attention_sliding_window_size`).
- vLLM `vllm/model_executor/models/qwen3_dflash.py` at commit 036a00d1f5d0
  (`_resolve_layer_attention`, `_dflash_layer_causal`, `DFlashQwen3DecoderLayer`, `DFlashQwen3Model`).

What they read, and how each can go wrong:
- `architectures` must name `DFlashDraftModel` (both pick the draft model class by it).
- `dflash_config.mask_token_id`: an int >= 0 or SGLang rejects it; absent, SGLang looks up
  `dflash_config.mask_token` (default `<|MASK|>`) in the target's tokenizer.
- `dflash_config.target_layer_ids`: absent, both derive the default spread from the target's depth
  (`round(1 + i·(L-4)/(n-1))`), which differs from taps trained otherwise; ids out of range: rejected.
- `block_size` and `num_target_layers`: SGLang reads `dflash_config.X` first, then the top level.
- `num_hidden_layers` (required), `hidden_size`, `num_attention_heads`, `num_key_value_heads`,
  `head_dim`, `intermediate_size`, `rms_norm_eps`, `attention_bias`, `max_position_embeddings`,
  `vocab_size`, `hidden_act`.
- RoPE: vLLM builds it from `rope_parameters` (transformers 5) and defaults a missing `rope_theta`
  to 1,000,000 (`set_default_rope_theta`); SGLang reads `rope_theta` + `rope_scaling`. Both must agree.
- `is_neox_style` (vLLM, default true: the rotation dflash trains with).
- attention mode: vLLM's `is_causal`, `dflash_config.causal`, `dflash_config.use_swa`,
  `dflash_config.swa_window_size`; both read `layer_types` and need `sliding_window` for sliding
  layers; mixed sliding/full layers need vLLM's V2 model runner.
- vLLM: `target_hidden_size` (the fc input width), `dflash_config.use_aux_hidden_state` (default true),
  `eagle_aux_hidden_state_layer_ids`; SGLang: `dflash_config.{conv_kernel_size, conv_group_size,
  selector_rank, selector_top_k, output_multiplier, final_logit_softcapping, attention_sink_bias,
  attention_value_scale, projector_type}` — variants dflash does not train: present, the engine builds
  another model than the one trained.
"""

from __future__ import annotations

from typing import Any

from dflash.check.findings import Finding

ENGINE_FIELDS = {  # top-level fields the loaders (or transformers' Qwen3Config under them) read
    "architectures", "model_type", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
    "head_dim", "intermediate_size", "hidden_act", "rms_norm_eps", "rope_theta", "rope_scaling", "rope_parameters",
    "attention_bias", "attention_dropout", "vocab_size", "max_position_embeddings", "initializer_range",
    "tie_word_embeddings", "use_cache", "layer_types", "use_sliding_window", "sliding_window", "max_window_layers",
    "num_target_layers", "block_size", "dflash_config", "dtype", "torch_dtype", "transformers_version",
}
DFLASH_READ = {"mask_token_id", "mask_token", "target_layer_ids", "block_size", "num_target_layers"}
VARIANT_FIELDS = {  # dflash_config keys that make the engines build a different drafter than dflash trains
    "conv_kernel_size": "SGLang", "conv_group_size": "SGLang", "selector_rank": "SGLang", "selector_top_k": "SGLang",
    "output_multiplier": "SGLang", "final_logit_softcapping": "SGLang", "attention_sink_bias": "SGLang and vLLM",
    "attention_value_scale": "SGLang", "projector_type": "SGLang", "causal": "vLLM", "use_swa": "vLLM",
    "swa_window_size": "vLLM", "use_aux_hidden_state": "vLLM",
}
TOP_VARIANTS = {"is_causal": "vLLM", "target_hidden_size": "vLLM", "eagle_aux_hidden_state_layer_ids": "vLLM",
                "has_embed_tokens": "SGLang", "has_lm_head": "SGLang", "mask_token_id": "SGLang (top level)",
                "target_layer_ids": "SGLang (top level)"}
OWN_KEYS = {"dflash_training"}  # dflash's record: both engines ignore it


def default_taps(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """The taps both engines derive when config.json names none."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    span = num_target_layers - 4
    return [int(round(1 + i * span / (num_draft_layers - 1))) for i in range(num_draft_layers)]


def check_serving(cfg: dict[str, Any], trained: dict[str, Any] | None, mask_token: str) -> list[Finding]:
    """Findings for what the engines would read differently from how the drafter was trained
    (`trained`: the record's trained fields, or config.json's own when there is no record)."""
    out: list[Finding] = []
    d = cfg.get("dflash_config") if isinstance(cfg.get("dflash_config"), dict) else {}
    arch = cfg.get("architectures") or []
    if "DFlashDraftModel" not in arch:
        out.append(Finding("fail", "serving: architectures", f"architectures is {arch!r}",
                           'set "architectures": ["DFlashDraftModel"]: SGLang and vLLM pick the draft model by it'))
    mid = d.get("mask_token_id")
    if mid is None:
        out.append(Finding("fail", "serving: mask token id", "dflash_config has no mask_token_id",
                           f"SGLang would look up {d.get('mask_token', '<|MASK|>')!r} in the target tokenizer; "
                           "write the trained id into dflash_config.mask_token_id"))
    elif isinstance(mid, bool) or not isinstance(mid, int) or mid < 0:
        out.append(Finding("fail", "serving: mask token id", f"dflash_config.mask_token_id is {mid!r}",
                           "SGLang rejects anything but an integer >= 0"))
    if "mask_token" in d and d["mask_token"] != mask_token:
        out.append(Finding("warn", "serving: mask token", f"dflash_config.mask_token is {d['mask_token']!r}, "
                           f"training used {mask_token!r}", "SGLang reads it when mask_token_id is missing"))
    n_draft, n_target = cfg.get("num_hidden_layers"), d.get("num_target_layers", cfg.get("num_target_layers"))
    taps = d.get("target_layer_ids")
    if taps is None and isinstance(n_target, int) and isinstance(n_draft, int) and n_draft >= 1:
        derived = default_taps(n_target, n_draft)
        want = (trained or {}).get("target_layer_ids")
        lvl = "fail" if want is not None and list(want) != derived else "warn"
        out.append(Finding(lvl, "serving: taps", f"dflash_config has no target_layer_ids: the engines derive {derived}"
                           + (f", the drafter was trained on {list(want)}" if want is not None else ""),
                           "write the trained taps into dflash_config.target_layer_ids"))
    for key in ("block_size", "num_target_layers"):
        if key in d and key in cfg and d[key] != cfg[key]:
            out.append(Finding("fail", f"serving: {key}", f"dflash_config.{key} = {d[key]!r}, top-level {key} = "
                               f"{cfg[key]!r}", f"SGLang reads dflash_config.{key} first; make them one value"))
        elif key not in d and key not in cfg:
            out.append(Finding("fail", f"serving: {key}", f"config.json has no {key}",
                               f"SGLang reads {key} (top level or dflash_config); write the trained value"))
    theta = cfg.get("rope_theta")
    rp = cfg.get("rope_parameters") if isinstance(cfg.get("rope_parameters"), dict) else None
    if theta is None and (rp is None or "rope_theta" not in rp):
        out.append(Finding("fail", "serving: RoPE theta", "config.json has no rope_theta",
                           "vLLM would default it to 1000000 and transformers to 10000: write the trained value"))
    elif rp is not None and theta is not None and rp.get("rope_theta", theta) != theta:
        out.append(Finding("fail", "serving: RoPE theta", f"rope_theta {theta} but rope_parameters.rope_theta "
                           f"{rp.get('rope_theta')}", "SGLang reads rope_theta, vLLM rope_parameters: make them agree"))
    rs = cfg.get("rope_scaling") if isinstance(cfg.get("rope_scaling"), dict) else None
    if rp is not None:
        rp_type = rp.get("rope_type", rp.get("type", "default"))
        rs_type = (rs or {}).get("rope_type", (rs or {}).get("type", "default"))
        rp_rest = {k: v for k, v in rp.items() if k not in ("rope_theta", "type")}
        rs_rest = {k: v for k, v in (rs or {}).items() if k != "type"}
        if rp_type != rs_type or (rs is not None and {**rp_rest, "rope_type": rp_type} != {**rs_rest, "rope_type": rs_type}):
            out.append(Finding("fail", "serving: RoPE scaling", f"rope_scaling {rs!r} vs rope_parameters {rp!r}",
                               "SGLang reads rope_scaling, vLLM rope_parameters: make them say the same scaling"))
    if cfg.get("is_neox_style") is False:
        out.append(Finding("fail", "serving: RoPE layout", "is_neox_style is false",
                           "vLLM would rotate interleaved pairs; dflash trains the neox (rotate-half) layout: drop it"))
    lt = cfg.get("layer_types")
    if isinstance(lt, list) and "sliding_attention" in lt:
        if cfg.get("sliding_window") is None:
            out.append(Finding("fail", "serving: sliding window", "sliding layers without sliding_window",
                               "both engines reject it: write the trained window"))
        if len(set(lt)) > 1:
            out.append(Finding("warn", "serving: layer types", "mixed sliding and full attention layers",
                               "vLLM needs its V2 model runner for them (VLLM_USE_V2_MODEL_RUNNER=1)"))
    for key, who in VARIANT_FIELDS.items():
        if key in d:
            out.append(Finding("fail", f"serving: dflash_config.{key}", f"dflash_config.{key} = {d[key]!r}",
                               f"{who} would build another drafter than the one trained: remove it"))
    for key, who in TOP_VARIANTS.items():
        if key in cfg:
            out.append(Finding("fail", f"serving: {key}", f"{key} = {str(cfg[key])[:60]}",
                               f"{who} reads it and would build or feed the drafter otherwise: remove it"))
    ignored = sorted(k for k in cfg if k not in ENGINE_FIELDS and k not in TOP_VARIANTS and k not in OWN_KEYS
                     and k != "is_neox_style")
    if ignored:
        out.append(Finding("warn", "serving: ignored fields", f"{', '.join(ignored[:8])} "
                           f"{'is' if len(ignored) == 1 else 'are'} read by neither SGLang nor vLLM",
                           "if the drafter depends on them, the engines will not know"))
    unknown = sorted(k for k in d if k not in DFLASH_READ and k not in VARIANT_FIELDS)
    if unknown:
        out.append(Finding("warn", "serving: ignored dflash_config fields", ", ".join(unknown[:8]),
                           "neither SGLang nor vLLM reads them"))
    if not any(f.check.startswith("serving") for f in out):
        out.append(Finding("ok", "serving fields", "config.json has every field SGLang's and vLLM's DFlash "
                           "loaders read, none they would ignore, reject or read with another default", ""))
    return out
