"""The static checks: the export against the target now, the training record against the target's
tokenizer and chat template now, and (dflash.check.serving) what the serving engines read.

Nothing here reads the target's weights: its config.json (or the embedded tiny config) and its
tokenizer are enough, so `dflash train`'s end summary runs these in a second."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from compilewatch import BadInput
from dflash.check.findings import Finding
from dflash.check.record import target_tokenizer, tokenizer_facts
from dflash.config import EMBEDDED_TARGET

SAFETENSORS_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}


@dataclass
class TargetFacts:
    source: str
    hidden_size: int
    num_layers: int
    vocab_rows: int  # embedding rows (config vocab_size)
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    dtype: str | None  # the target config's dtype, when it says one
    tokenizer: Any = field(repr=False)  # as shipped (no mask token added)
    facts: dict[str, Any] = field(default_factory=dict)  # record.tokenizer_facts of it


def target_facts(path: str, mask_token: str) -> TargetFacts:
    """The target's config and tokenizer facts, without its weights (BadInput when unreadable)."""
    tok = target_tokenizer(path)
    facts = tokenizer_facts(tok, mask_token)
    if path == EMBEDDED_TARGET:
        from dflash.model.target import tiny_target_config

        tc = tiny_target_config(len(tok))
    else:
        from dflash.config import TargetConfig
        from dflash.model.target import load_config

        tc = load_config(TargetConfig(path=path))
    text = tc.get_text_config() if hasattr(tc, "get_text_config") else tc
    from dflash.model.build import target_rope_scaling

    rp = dict(getattr(text, "rope_parameters", None) or getattr(text, "rope_scaling", None) or {})
    theta = rp.get("rope_theta") or getattr(text, "rope_theta", None) or 10000.0  # as dflash.model.build reads it
    dt = getattr(text, "dtype", None)
    return TargetFacts(source=path, hidden_size=int(text.hidden_size), num_layers=int(text.num_hidden_layers),
                       vocab_rows=int(text.vocab_size), rope_theta=float(theta), rope_scaling=target_rope_scaling(text),
                       dtype=str(dt).replace("torch.", "") if dt is not None else None, tokenizer=tok, facts=facts)


def weights_dtype(path: Path) -> str | None:
    """The dtype of the export's tensors (header only), as config.json spells dtypes."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        for k in f.keys():
            return SAFETENSORS_DTYPES.get(str(f.get_slice(k).get_dtype()), str(f.get_slice(k).get_dtype()))
    return None


def weights_finding(path: Path) -> Finding:
    """Every floating-point tensor of the export finite (a diverged run's weights are NaN, and decode as a
    drafter that never drafts). Reads the tensors one at a time."""
    from safetensors import safe_open

    from dflash.model.finite import nonfinite_tensors

    with safe_open(str(path), framework="pt") as f:
        keys = list(f.keys())
        bad = nonfinite_tensors((k, f.get_tensor(k)) for k in keys)
    if bad:
        shown = ", ".join(bad[:3]) + (f" and {len(bad) - 3} more" if len(bad) > 3 else "")
        return Finding("fail", "weights", f"{len(bad)} of {len(keys)} tensors hold NaN or infinite values ({shown})",
                       "training diverged before this save: check an earlier checkpoint, or train again with a "
                       "lower optim.lr")
    return Finding("ok", "weights", f"{len(keys)} tensors, every value finite")


def _rope_type(scaling: dict[str, Any] | None) -> str:
    return "default" if not scaling else str(scaling.get("rope_type", scaling.get("type", "default")))


def _same(a, b) -> bool:
    try:
        return a == b or (isinstance(a, (int, float)) and isinstance(b, (int, float))
                          and abs(a - b) <= 1e-9 * max(abs(a), abs(b), 1))
    except OverflowError:  # an int past float's range (an edited config.json's record): not the float beside it
        return False


def check_static(cfg: dict[str, Any], spec, wdtype: str | None, target: TargetFacts,
                 record: dict[str, Any] | None) -> list[Finding]:
    """Every static finding (ok ones included: each check says what it found)."""
    out: list[Finding] = []
    trained = (record or {}).get("trained") if isinstance((record or {}).get("trained"), dict) else None
    fix_target = "serve with the target the drafter was trained for"

    def edited(key: str, now: Any) -> None:
        if trained is not None and key in trained and not _same(trained[key], now):
            out.append(Finding("fail", f"{key} (config.json vs training)", f"config.json says {now!r}, the drafter "
                               f"was trained with {trained[key]!r}", f"restore {key} = {trained[key]!r} in config.json"))

    def pair(check: str, export: Any, tgt: Any, todo: str = fix_target) -> None:
        if _same(export, tgt):
            out.append(Finding("ok", check, f"{export} (export) = {tgt} (target)"))
        else:
            out.append(Finding("fail", check, f"the export has {export}, the target {tgt}", todo))

    pair("hidden size", spec.hidden_size, target.hidden_size)
    edited("hidden_size", spec.hidden_size)
    pair("vocabulary", spec.vocab_size, target.vocab_rows)
    edited("vocab_size", spec.vocab_size)
    pair("target layers", spec.num_target_layers, target.num_layers)
    edited("num_target_layers", spec.num_target_layers)
    taps = list(spec.target_layer_ids)
    bad = [i for i in taps if not 0 <= i < target.num_layers]
    if bad:
        out.append(Finding("fail", "taps", f"target_layer_ids {taps}: {bad} outside the target's "
                           f"{target.num_layers} layers", fix_target))
    elif trained is None or list(trained.get("target_layer_ids", taps)) == taps:
        out.append(Finding("ok", "taps", f"target_layer_ids {taps}, in range for {target.num_layers} layers"
                           + (", as trained" if trained is not None else "")))
    edited("target_layer_ids", taps)
    edited("block_size", spec.block_size)  # the engines draft block_size - 1 tokens a round, as config.json says
    # RoPE: type, theta, scaling
    e_type, t_type = _rope_type(spec.rope_scaling), _rope_type(target.rope_scaling)
    rope_bad = []
    if e_type != t_type:
        rope_bad.append(f"type {e_type} vs the target's {t_type}")
    if not _same(spec.rope_theta, target.rope_theta):
        rope_bad.append(f"theta {spec.rope_theta:g} vs the target's {target.rope_theta:g}")
    if e_type == t_type and (spec.rope_scaling or None) != (target.rope_scaling or None):
        rope_bad.append(f"scaling {spec.rope_scaling} vs the target's {target.rope_scaling}")
    if rope_bad:
        out.append(Finding("fail", "RoPE", "; ".join(rope_bad),
                           "the drafter's positions must rotate as the target's: " + fix_target))
    else:
        out.append(Finding("ok", "RoPE", f"{e_type}, theta {spec.rope_theta:g}"
                           + (f", scaling {spec.rope_scaling}" if spec.rope_scaling else "") + ", as the target's"))
    edited("rope_theta", spec.rope_theta)
    edited("rope_scaling", dict(spec.rope_scaling) if spec.rope_scaling else None)
    # the mask token
    tf = target.facts
    mt, now_id, shipped = tf["mask_token"], tf["mask_token_id"], tf["mask_token_shipped"]
    where = f"in the target's tokenizer as id {now_id}" if shipped else \
        f"not in the target's tokenizer (training adds it: id {now_id})"
    if spec.mask_token_id >= target.vocab_rows:
        out.append(Finding("fail", "mask token", f"mask_token_id {spec.mask_token_id} has no embedding row in the "
                           f"target ({target.vocab_rows} rows): training resized the table, serving does not",
                           "serve a target saved with the resized embedding, or retrain with a mask id < "
                           f"{target.vocab_rows}"))
    elif spec.mask_token_id != now_id:
        out.append(Finding("fail", "mask token", f"config.json's mask_token_id is {spec.mask_token_id}; {mt} is {where}",
                           "the tokenizer changed since training (tokens added or removed): serve the tokenizer the "
                           "drafter was trained with"))
    else:
        out.append(Finding("ok", "mask token", f"{mt} id {spec.mask_token_id}: {where}"))
    edited("mask_token_id", spec.mask_token_id)
    # dtype
    declared = cfg.get("dtype") or cfg.get("torch_dtype")
    if wdtype is not None and declared is not None and declared != wdtype:
        out.append(Finding("fail", "dtype", f"config.json says {declared}, the weights are {wdtype}",
                           f"set \"dtype\": \"{wdtype}\" in config.json"))
    elif target.dtype is not None and wdtype is not None and target.dtype != wdtype:
        out.append(Finding("warn", "dtype", f"weights {wdtype}, the target {target.dtype}",
                           "the engines run the drafter in the serving dtype: acceptance can move a little"))
    else:
        out.append(Finding("ok", "dtype", f"weights {wdtype or '?'}" + (f", target {target.dtype}" if target.dtype else "")))
    out += check_tokenizer(record, tf)
    return out


def check_tokenizer(record: dict[str, Any] | None, now: dict[str, Any]) -> list[Finding]:
    """The training record's tokenizer and chat template against the target's now."""
    if record is None or not isinstance(record.get("tokenizer"), dict):
        why = (record or {}).get("error")
        return [Finding("warn", "tokenizer and chat template",
                        "the export records no tokenizer or template" + (f" ({why})" if why else
                                                                          " (exported before `dflash check` existed)"),
                        "the tokenizer, template, generation prompt and thinking checks were skipped; "
                        "a checkpoint saved by this version records them")]
    then = record["tokenizer"]
    out: list[Finding] = []
    added = sorted(set(now["special_tokens"]) - set(then.get("special_tokens", [])))
    removed = sorted(set(then.get("special_tokens", [])) - set(now["special_tokens"]))
    if then.get("special_digest") != now["special_digest"]:
        out.append(Finding("fail", "special tokens", "changed since training"
                           + (f": added {', '.join(added[:6])}" if added else "")
                           + (f"; removed {', '.join(removed[:6])}" if removed else ""),
                           "serve the tokenizer the drafter was trained with (or retrain on this one)"))
    else:
        out.append(Finding("ok", "special tokens", f"{len(now['special_tokens'])} special tokens, as in training"))
    if then.get("vocab_digest") != now["vocab_digest"]:
        out.append(Finding("fail", "tokenizer vocabulary", f"changed since training ({then.get('size')} -> "
                           f"{now['size']} tokens)", "serve the tokenizer the drafter was trained with"))
    else:
        out.append(Finding("ok", "tokenizer vocabulary", f"{now['size']} tokens, as in training"))
    for k in ("eos_token", "pad_token", "bos_token"):
        if then.get(k) != now.get(k):
            out.append(Finding("warn", k.replace("_", " "), f"{then.get(k)!r} in training, {now.get(k)!r} now",
                               "stop and padding behave differently from training"))
    ct, cn = then.get("chat_template") or {}, now.get("chat_template") or {}
    if ct.get("digest") != cn.get("digest"):
        diff = first_difference(ct.get("sample"), cn.get("sample"))
        out.append(Finding("fail", "chat template", "changed since training"
                           + (f"; the sample conversation renders differently {diff}" if diff else
                              "; the sample conversation renders the same"),
                           "serve the chat template the drafter was trained with (tokenizer_config.json), "
                           "or retrain on data rendered with this one"))
    else:
        out.append(Finding("ok", "chat template", "the same as in training (digest " + str(cn.get("digest"))[:12] + ")"))
    if ct.get("generation_prompt") != cn.get("generation_prompt"):
        out.append(Finding("fail", "generation prompt", f"{ct.get('generation_prompt')!r} in training, "
                           f"{cn.get('generation_prompt')!r} now",
                           "every prompt ends differently from training: serve the trained template"))
    else:
        out.append(Finding("ok", "generation prompt", repr(cn.get("generation_prompt"))))
    tt, tn = ct.get("thinking") or {}, cn.get("thinking") or {}
    if tt.get("switch") != tn.get("switch") or tt.get("default") != tn.get("default"):
        out.append(Finding("fail", "thinking", f"training: {_thinking(tt)}; now: {_thinking(tn)}",
                           "render requests with the thinking setting the drafter was trained on"))
    elif tn.get("switch"):
        other = "off" if tn.get("default") == "on" else "on"
        out.append(Finding("warn", "thinking", f"the template has an enable_thinking switch; training rendered "
                           f"thinking {tn.get('default')} (its default)",
                           f"requests with enable_thinking {other} start answers unlike training: expect lower acceptance"))
    else:
        out.append(Finding("ok", "thinking", "the template has no enable_thinking switch, as in training"))
    return out


def _thinking(t: dict[str, Any]) -> str:
    if not t:
        return "unknown"
    return f"switch, default {t.get('default')}" if t.get("switch") else "no enable_thinking switch"


def first_difference(a: str | None, b: str | None, width: int = 24) -> str:
    """Where two renderings first differ, as `at char N: 'then' vs 'now'` ('' when equal or unknown)."""
    if a is None or b is None or a == b:
        return ""
    i = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return f"at character {i}: {a[i:i + width]!r} in training vs {b[i:i + width]!r} now"
