"""Token ids and the loss mask of one conversation, from ONE rendering through the target's chat template.

The loss mask covers exactly what the target generates at inference for each assistant turn: the text
after the turn's generation prompt (e.g. `<|im_start|>assistant\\n`) up to and including the
end-of-turn token (`<|im_end|>`, `<|eot_id|>`, `<end_of_turn>`, `</s>`), with whatever the template
does to that turn (Qwen3 keeps the `<think>` block of the last turn and drops earlier ones; Llama
and Gemma trim; Mistral moves the system prompt into the last user turn). Rendering each turn's
prefix separately and requiring the renderings to agree (the old way) drops every multi-turn
conversation of such templates, so the whole conversation is rendered once and the turns are found
in it:

1. Templates with a `{% generation %}` block: the template's own assistant mask
   (`apply_chat_template(..., return_assistant_tokens_mask=True)`).
2. Otherwise: walk the messages in order through the rendered text, finding each message's content
   (as given, stripped, or, for assistant turns, the answer after a `</think>`). An assistant
   turn's span starts right after its generation prompt (the text `add_generation_prompt=True`
   appends to the conversation so far), or at its content when there is none before it (an empty
   answer there: at its end-of-turn token, past the previous turn's closing `[/INST]`), and ends
   after the first special token following its content (whitespace only in between). Token i is trained when its
   first character lies in a span (offsets mapping of a fast tokenizer; a slow tokenizer is
   tokenized span by span).

`ChatMaskError` says why a conversation cannot be masked; the data loader counts it as a skip reason.
"""

from __future__ import annotations

import re

GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")


class ChatMaskError(ValueError):
    """A conversation this template cannot mask; `reason` is the short skip reason shown to users."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


def render(tokenizer, messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    except Exception as e:  # noqa: BLE001 - jinja raise_exception(...) and template errors
        raise ChatMaskError("chat template refused the conversation", f"{type(e).__name__}: {e}") from None


def tokenize_conversation(tokenizer, messages: list[dict[str, str]]) -> tuple[list[int], list[int]]:
    """(ids, loss mask) of one conversation; ChatMaskError when it cannot be masked."""
    if GENERATION_TAG.search(str(getattr(tokenizer, "chat_template", None) or "")):  # str: also a dict of templates
        return _template_mask(tokenizer, messages)
    text = render(tokenizer, messages, add_generation_prompt=False)
    spans = assistant_spans(tokenizer, text, messages)
    return _tokenize_spans(tokenizer, text, spans)


def _template_mask(tokenizer, messages) -> tuple[list[int], list[int]]:
    try:
        out = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True,
                                            return_assistant_tokens_mask=True)
    except Exception as e:  # noqa: BLE001
        raise ChatMaskError("chat template refused the conversation", f"{type(e).__name__}: {e}") from None
    ids, mask = list(out["input_ids"]), [int(bool(m)) for m in out["assistant_masks"]]
    if not any(mask):
        raise ChatMaskError("the template's {% generation %} mask is empty")
    return ids, mask


def _content_candidates(message: dict[str, str]) -> list[str]:
    """How a template may render a message's content, most faithful first."""
    c = message["content"]
    out = [c, c.strip()]
    if message["role"] == "assistant" and "</think>" in c:
        answer = c.split("</think>")[-1]
        out += [answer.lstrip("\n"), answer.strip()]
    return [x for i, x in enumerate(out) if x and x not in out[:i]]


def _generation_prompt(tokenizer, messages: list[dict[str, str]]) -> str:
    """The text `add_generation_prompt=True` appends after `messages` ('' when it appends none)."""
    try:
        plain = render(tokenizer, messages, add_generation_prompt=False)
        prompted = render(tokenizer, messages, add_generation_prompt=True)
    except ChatMaskError:  # a template that renders only whole conversations: start at the content
        return ""
    return prompted[len(plain):] if prompted.startswith(plain) else ""


def _special_tokens(tokenizer) -> list[str]:
    toks = set(getattr(tokenizer, "all_special_tokens", []) or [])
    for t in (getattr(tokenizer, "added_tokens_decoder", None) or {}).values():
        if getattr(t, "special", False):
            toks.add(str(t))
    return sorted((t for t in toks if t), key=len, reverse=True)


def _find_content(message: dict[str, str], text: str, start: int) -> tuple[int, int] | None:
    """The first place at or after `start` where the template rendered the message's content."""
    for cand in _content_candidates(message):
        at = text.find(cand, start)
        if at >= 0:
            return at, at + len(cand)
    return None


def assistant_spans(tokenizer, text: str, messages: list[dict[str, str]]) -> list[tuple[int, int]]:
    """Character spans [start, end) of the assistant turns' generated text in `text`."""
    specials = _special_tokens(tokenizer)
    spans, cursor = [], 0
    for i, m in enumerate(messages):
        found = _find_content(m, text, cursor)
        if m["role"] != "assistant":
            if found is not None:  # a user/system content the template dropped or rewrote is not an error
                cursor = found[1]
            continue
        prompt = _generation_prompt(tokenizer, messages[:i]) if i else ""
        header = text.find(prompt, cursor) if prompt else -1
        if header >= 0 and (found is None or found[0] >= header):  # the turn opens with its generation prompt
            body = header + len(prompt)
            found, start = _find_content(m, text, body), body  # (a content that also occurs in the header)
        elif found is not None:  # no generation prompt before it (Mistral's is empty): the turn starts at its content
            start = found[0]
        else:  # ... and no content: the end-of-turn token after the previous turn's closing ones
            start = _empty_answer_start(text, cursor, specials, getattr(tokenizer, "eos_token", None))
        if found is None and m["content"].strip():
            raise ChatMaskError("assistant turn not found in the chat template's rendering", f"turn {i}")
        content_end = found[1] if found is not None else start  # an empty answer: just its end-of-turn token
        openers = {t for t in specials if t in prompt} | {getattr(tokenizer, "bos_token", None)}
        spans.append((start, _turn_end(text, content_end, [t for t in specials if t not in openers])))
        cursor = spans[-1][1]
    if not spans:
        raise ChatMaskError("no assistant turn")
    return spans


def _empty_answer_start(text: str, cursor: int, specials: list[str], eos: str | None) -> int:
    """Where an empty answer without a generation prompt starts: past the special tokens that close
    the turn before it (Mistral's `[/INST]`: never the answer's) to its end-of-turn token `eos`; where
    anything else comes first, there (the turn then trains nothing)."""
    pos = cursor
    while True:
        rest = text[pos:]
        stripped = rest.lstrip()
        pos += len(rest) - len(stripped)
        if eos and stripped.startswith(eos):
            return pos
        tok = next((t for t in specials if stripped.startswith(t)), None)
        if tok is None:
            return pos
        pos += len(tok)


def _turn_end(text: str, content_end: int, specials: list[str]) -> int:
    """The end of a turn: past the special token right after its content (whitespace only between);
    `specials` excludes the tokens that open a turn, so a template without an end-of-turn token
    trains the content alone instead of the next turn's header."""
    rest = text[content_end:]
    stripped = rest.lstrip()
    for tok in specials:
        if stripped.startswith(tok):
            return content_end + (len(rest) - len(stripped)) + len(tok)
    return content_end  # no end-of-turn token (a template that emits none): the content alone


def _tokenize_spans(tokenizer, text: str, spans: list[tuple[int, int]]) -> tuple[list[int], list[int]]:
    if getattr(tokenizer, "is_fast", False):
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        ids = list(enc["input_ids"])
        mask = [int(any(s <= a < e for s, e in spans)) for a, _ in enc["offset_mapping"]]
        return ids, mask
    ids, mask, pos = [], [], 0  # no offsets: tokenize the pieces between span boundaries
    for s, e in spans:
        for piece, m in ((text[pos:s], 0), (text[s:e], 1)):
            if piece:
                part = tokenizer(piece, add_special_tokens=False)["input_ids"]
                ids += part
                mask += [m] * len(part)
        pos = e
    if text[pos:]:
        part = tokenizer(text[pos:], add_special_tokens=False)["input_ids"]
        ids += part
        mask += [0] * len(part)
    return ids, mask
