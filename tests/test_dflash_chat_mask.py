"""dflash.data.chat_mask on the REAL chat templates of Qwen3, Qwen2.5, Llama 3.x, Mistral and Gemma.

The templates are fixtures (tests/fixtures/chat_templates, sources in its README). The tokenizer is a
byte-level one with the template's special tokens (no download): every character is one token, so
"the trained tokens decode to exactly the expected strings, in order, and nothing else is trained"
checks the mask token by token.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from dflash.data.chat_mask import ChatMaskError, tokenize_conversation
from dflash.config import DataConfig
from dflash.data.dataset import build_dataset

TEMPLATES = Path(__file__).parent / "fixtures" / "chat_templates"
SPECIALS = {  # template -> (special tokens, bos, eos)
    "qwen3": (["<|im_start|>", "<|im_end|>", "<|endoftext|>"], None, "<|im_end|>"),
    "qwen2.5": (["<|im_start|>", "<|im_end|>", "<|endoftext|>"], None, "<|im_end|>"),
    "llama3.2": (["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
                 "<|begin_of_text|>", "<|eot_id|>"),
    "mistral_nemo": (["<s>", "</s>", "[INST]", "[/INST]"], "<s>", "</s>"),
    "gemma2": (["<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>"], "<bos>", "<eos>"),
}


def byte_tokenizer(name: str):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tk = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(sorted(alphabet))}, merges=[]))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    specials, bos, eos = SPECIALS[name]
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token=bos, eos_token=eos,
                                  additional_special_tokens=[t for t in specials if t not in (bos, eos)])
    tok.chat_template = (TEMPLATES / f"{name}.jinja").read_text()
    return tok


def trained_runs(tok, ids, mask) -> list[str]:
    """The decoded text of each maximal run of trained tokens."""
    runs, cur = [], []
    for i, m in zip(ids, mask):
        if m:
            cur.append(i)
        elif cur:
            runs.append(cur)
            cur = []
    if cur:
        runs.append(cur)
    return [tok.decode(r) for r in runs]


THINK = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "<think>\nadd them\n</think>\n\nIt is 4."},
    {"role": "user", "content": "And 3+3?"},
    {"role": "assistant", "content": "<think>\nagain\n</think>\n\nIt is 6."},
]
PLAIN = [
    {"role": "user", "content": "Hello there"},
    {"role": "assistant", "content": "Hi! How can I help?"},
    {"role": "user", "content": "Name a colour."},
    {"role": "assistant", "content": "Blue."},
    {"role": "user", "content": "Another?"},
    {"role": "assistant", "content": "  Green.  "},
]


def check(name: str, messages, expected: list[str]) -> None:
    tok = byte_tokenizer(name)
    ids, mask = tokenize_conversation(tok, messages)
    full = tok.apply_chat_template(messages, tokenize=False)
    assert tok.decode(ids) == full  # one rendering, tokenized once, nothing lost
    assert trained_runs(tok, ids, mask) == expected


def test_qwen3_keeps_the_last_think_block_and_trains_what_it_renders():
    # earlier turns lose their think block, the last keeps it: the old prefix check dropped this
    check("qwen3", THINK, ["It is 4.<|im_end|>", "<think>\nagain\n</think>\n\nIt is 6.<|im_end|>"])
    # no think in the data: the last turn gets the template's empty think block, as rendered
    check("qwen3", PLAIN, ["Hi! How can I help?<|im_end|>", "Blue.<|im_end|>",
                           "<think>\n\n</think>\n\n  Green.  <|im_end|>"])


def test_qwen25_default_system_prompt():
    check("qwen2.5", PLAIN, ["Hi! How can I help?<|im_end|>", "Blue.<|im_end|>", "  Green.  <|im_end|>"])
    check("qwen2.5", THINK, ["<think>\nadd them\n</think>\n\nIt is 4.<|im_end|>",
                             "<think>\nagain\n</think>\n\nIt is 6.<|im_end|>"])


def test_llama3_trims_and_ends_with_eot():
    check("llama3.2", PLAIN, ["Hi! How can I help?<|eot_id|>", "Blue.<|eot_id|>", "Green.<|eot_id|>"])
    check("llama3.2", THINK, ["<think>\nadd them\n</think>\n\nIt is 4.<|eot_id|>",
                              "<think>\nagain\n</think>\n\nIt is 6.<|eot_id|>"])


def test_mistral_moves_the_system_prompt_and_ends_with_eos():
    check("mistral_nemo", PLAIN, ["Hi! How can I help?</s>", "Blue.</s>", "  Green.  </s>"])
    check("mistral_nemo", THINK, ["<think>\nadd them\n</think>\n\nIt is 4.</s>",
                                  "<think>\nagain\n</think>\n\nIt is 6.</s>"])


def test_gemma_model_role_and_end_of_turn():
    check("gemma2", PLAIN, ["Hi! How can I help?<end_of_turn>", "Blue.<end_of_turn>", "Green.<end_of_turn>"])


def test_gemma_refuses_a_system_turn_with_a_reason():
    with pytest.raises(ChatMaskError) as e:
        tokenize_conversation(byte_tokenizer("gemma2"), THINK)
    assert e.value.reason == "chat template refused the conversation"


def test_a_user_turn_quoting_the_answer_does_not_move_the_span():
    msgs = [{"role": "user", "content": "Say: Blue."}, {"role": "assistant", "content": "Blue."}]
    check("qwen2.5", msgs, ["Blue.<|im_end|>"])


def test_generation_tag_uses_the_templates_own_mask():
    tok = byte_tokenizer("qwen2.5")
    tok.chat_template = ("{% for m in messages %}<|im_start|>{{ m.role }}\n"
                         "{% if m.role == 'assistant' %}{% generation %}{{ m.content }}<|im_end|>{% endgeneration %}"
                         "{% else %}{{ m.content }}<|im_end|>{% endif %}\n{% endfor %}")
    ids, mask = tokenize_conversation(tok, PLAIN)
    assert trained_runs(tok, ids, mask) == ["Hi! How can I help?<|im_end|>", "Blue.<|im_end|>", "  Green.  <|im_end|>"]


@pytest.mark.parametrize("name", sorted(SPECIALS))
def test_multi_turn_datasets_drop_nothing(name):
    convs = [PLAIN] * 6 + ([] if name == "gemma2" else [THINK] * 6)
    ds = build_dataset(convs, byte_tokenizer(name), DataConfig(path="x.jsonl", max_length=4096, strict=True), 4, 0)
    assert ds.stats.dropped == {} and ds.stats.kept == len(convs)


def test_an_answer_that_also_occurs_in_the_header_or_is_empty():
    msgs = [{"role": "user", "content": "Say the role."}, {"role": "assistant", "content": "assistant"},
            {"role": "user", "content": "Now nothing."}, {"role": "assistant", "content": ""}]
    check("qwen2.5", msgs, ["assistant<|im_end|>", "<|im_end|>"])
    check("llama3.2", msgs, ["assistant<|eot_id|>", "<|eot_id|>"])


def test_a_template_without_an_end_of_turn_token_trains_the_content_only():
    tok = byte_tokenizer("qwen2.5")
    tok.chat_template = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}\n{% endfor %}"
                         "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    ids, mask = tokenize_conversation(tok, PLAIN)
    assert trained_runs(tok, ids, mask) == ["Hi! How can I help?", "Blue.", "  Green.  "]
