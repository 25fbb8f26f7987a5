"""The evaluation side of `dflash`, red-teamed (periodic eval, shared plain baselines, `dflash eval`, other
architectures as local targets): a sliding-window target's eval was a traceback once the window was reached,
`dflash eval -n 1000000000` made a billion embedded prompts (hours, then the OOM killer) before its memory
check, and why a stored baseline was not used never reached `dflash train`'s output."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from cli.dflash_main import app
from tests.dflash_helpers import write_word_chats
from tests.helpers import invoke

COMMON = ["--set", "data.regenerate=false", "--set", "metrics.tensorboard=false", "--set", "eval.at_end=false"]


@pytest.fixture
def mistral_sliding(tmp_path):
    """A saved 2-layer Mistral whose sliding window (8) is shorter than the decodes below."""
    from transformers import MistralConfig, MistralForCausalLM

    from dflash.model.target import build_tiny_tokenizer

    tok = build_tiny_tokenizer()
    torch.manual_seed(5)
    model = MistralForCausalLM(MistralConfig(
        vocab_size=(len(tok) + 63) // 64 * 64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=256, sliding_window=8,
        tie_word_embeddings=False, eos_token_id=2, pad_token_id=0, bos_token_id=None))
    path = tmp_path / "mistral"
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


class _Proposer:
    """Drafts from a known answer: right where `right(i)`, else a wrong token (rejections crop the cache)."""

    def __init__(self, prompt, answer, right) -> None:
        self.prompt, self.answer, self.right = prompt, answer, right

    def reset(self) -> None:
        pass

    def propose(self, tokens, new_ctx, block_len):
        i = len(tokens) - len(self.prompt)
        return [self.answer[j] if j < len(self.answer) and self.right(j) else 5 for j in range(i, i + block_len - 1)]


def test_a_sliding_window_target_decodes_past_its_window_losslessly(mistral_sliding):
    """The batch-1 loop (a sliding-window target) cropped a sliding-window cache layer once the window was
    reached: RuntimeError `crop` ... does not track past states (a traceback at `dflash train`'s first eval of
    a Mistral with sliding_window). Now every layer keeps its K/V; the window is the mask's."""
    from dflash.config import TargetConfig
    from dflash.eval.reference import plain_generate, speculative_generate
    from dflash.model.target import load_target

    target = load_target(TargetConfig(path=str(mistral_sliding)), 2, torch.device("cpu"))
    prompt = list(range(10, 22))
    plain = plain_generate(target, prompt, 40).tokens
    for right in (lambda j: False, lambda j: j % 3 != 1, lambda j: True):
        got = speculative_generate(_Proposer(prompt, plain, right), target, prompt, 40, 4)
        assert got.tokens == plain


def test_eval_with_a_huge_n_is_refused_before_its_prompts_are_made(tmp_path, monkeypatch):
    """`dflash eval RUN -n 1000000000` generated (embedded data) or gathered a billion prompts and tokenized
    them before the K/V check: hours, then the OOM killer. Now exit 2 before any prompt is made."""
    from dflash.data import dataset

    data = write_word_chats(tmp_path / "chat.jsonl")
    out = tmp_path / "run"
    r = invoke(app, ["train", "--out", str(out), "--data", str(data), *COMMON, "--max-steps", "1"])
    assert r.exit_code == 0, r.stderr

    def made(*a, **k):
        raise AssertionError("prompts made before the memory check")

    monkeypatch.setattr(dataset, "eval_prompts", made)
    r = invoke(app, ["eval", str(out), "-n", "1000000000"])
    assert r.exit_code == 2 and "Traceback" not in r.stderr and "at most 65536 prompts" in r.stderr
    r = invoke(app, ["eval", str(out), "-n", "65536", "--max-new-tokens", "100000000"])
    assert r.exit_code == 2 and "Traceback" not in r.stderr
    assert "65536 prompt(s) of at least 1 tokens" in r.stderr and "K/V slots" in r.stderr


def test_an_eval_note_is_told_as_it_happens_not_only_in_the_result():
    """A stored or shared baseline that did not apply (a symlink to /dev/zero, a damaged file) was noted only in
    the run's result, which `dflash train` does not print: the user never saw why it measured again."""
    from dflash.eval.in_training import _note_once

    events = []
    trainer = SimpleNamespace(notes=[], on_event=lambda kind, d: events.append((kind, d)))
    for _ in range(2):
        _note_once(trainer, "x.json is not a regular file: not read; the plain baseline is measured again")
    assert trainer.notes == ["eval: x.json is not a regular file: not read; the plain baseline is measured again"]
    assert events == [("notes", {"notes": trainer.notes})]  # (rich markup escaped: nothing to escape here)


def test_an_eval_note_with_markup_in_a_path_is_printed_not_a_markup_error(tmp_path, monkeypatch):
    """`dflash train` prints notes as rich markup: a shared baseline directory named like `b[/]x` (or a run
    name from a shared file) made the eval's note a rich MarkupError traceback, exit 1."""
    shared = tmp_path / "b[/]x"  # the folder `]x` in the folder `b[`
    shared.mkdir(parents=True)
    monkeypatch.setenv("DFLASH_EVAL_CACHE", str(shared))
    data = write_word_chats(tmp_path / "chat.jsonl")
    r = invoke(app, ["train", "--out", str(tmp_path / "one"), "--data", str(data), *COMMON, "--max-steps", "2",
                     "--set", "eval.every=1"])
    assert r.exit_code == 0, r.stderr
    (digest,) = shared.glob("*.json")
    digest.unlink()
    digest.symlink_to("/dev/zero")
    r = invoke(app, ["train", "--out", str(tmp_path / "two"), "--data", str(data), *COMMON, "--max-steps", "2",
                     "--set", "eval.every=1"])
    assert r.exit_code == 0 and "Traceback" not in r.stderr, r.stderr
    assert f"note: eval: {digest} is not a regular file" in " ".join(r.stderr.split())
    assert digest.is_file() and not digest.is_symlink()  # measured again, replaced: /dev/zero untouched


def test_check_with_a_huge_max_new_tokens_is_bad_input_not_an_allocation_traceback(tmp_path):
    """`dflash check RUN --max-new-tokens 100000000` decoded through speculative_batch directly (no memory
    check): RuntimeError DefaultCPUAllocator: can't allocate memory, exit 1 (or the OOM killer)."""
    data = write_word_chats(tmp_path / "chat.jsonl")
    out = tmp_path / "run"
    r = invoke(app, ["train", "--out", str(out), "--data", str(data), *COMMON, "--max-steps", "1"])
    assert r.exit_code == 0, r.stderr
    r = invoke(app, ["check", str(out), "--max-new-tokens", "100000000"])
    assert r.exit_code == 2 and "Traceback" not in r.stderr and "GiB of K/V slots" in r.stderr


def test_every_note_is_printed_as_text_not_markup(tmp_path, monkeypatch):
    """A data cache directory named like `b[/]x` made `dflash train`'s "data cache ..." note a rich MarkupError
    (exit 1); notes quote paths and files, so every command prints them with their markup escaped."""
    cache = tmp_path / "b[/]x" / "dc"
    monkeypatch.setenv("DFLASH_DATA_CACHE", str(cache))
    data = write_word_chats(tmp_path / "chat.jsonl")
    for run in ("one", "two"):  # the cache built, then hit
        r = invoke(app, ["train", "--out", str(tmp_path / run), "--data", str(data), *COMMON, "--max-steps", "1"])
        assert r.exit_code == 0 and "Traceback" not in r.stderr, r.stderr
    assert "b[/]x" in " ".join(r.stderr.split())
