"""Red team, data a user brings and the tokenized-data cache (dflash/data): each test pins one fixed bug.

- a lone UTF-16 surrogate ("\\ud800" in the JSON) crashed the tokenizer or the cache's manifest write
  (a traceback): now the line is skipped, counted and shown like any other unreadable line;
- an OpenAI assistant turn with `tool_calls` was trained without its call (normalize_record kept role and
  content only): now the conversation is skipped with a reason naming the field;
- a gzip/zstd file was read as text, every line "unreadable" with a UnicodeDecodeError (after the
  target loaded): now BadInput naming the compression and how to decompress it, before the target loads;
  a directory of shards now says how to make it one file;
- an empty answer under a template without a generation prompt (Mistral) trained the user turn's
  closing `[/INST]`: now its end-of-turn `</s>`;
- a cache whose manifest or index was a FIFO hung every start forever, and a shard replaced by a
  symlink was trained on: now both are moved aside and rebuilt;
- a shard holding a token id past the vocabulary raised IndexError (CPU) mid-training: now BadInput;
- a data file rewritten while `prepare` hashed and read it was cached under the old bytes' key;
- `dflash train` never said on the console that conversations were truncated at data.max_length.
"""

from __future__ import annotations

import gzip
import json
import os
import sys
import threading

import numpy as np
import pytest

from compilewatch.errors import BadInput
from dflash.config import DataConfig
from dflash.data import cache as datacache
from dflash.data.chat_mask import tokenize_conversation
from dflash.data.dataset import normalize_record, read_jsonl
from tests.dflash_helpers import write_word_chats
from tests.test_dflash_chat_mask import byte_tokenizer, trained_runs

BS = 4
SURROGATE_LINE = '{"messages": [{"role": "user", "content": "ba \\ud800 be"}, {"role": "assistant", "content": "%s"}]}'


@pytest.fixture(scope="module")
def tok():
    from dflash.model.target import build_tiny_tokenizer

    return build_tiny_tokenizer()


def _cfg(path, **kw) -> DataConfig:
    return DataConfig(path=str(path), max_length=48, num_anchors=4, batch_size=4, **kw)


def _prepare_within(seconds: float, *args, **kwargs):
    """datacache.prepare, failing (not hanging the suite) when it blocks: a FIFO opened for reading waits
    for a writer forever."""
    out: dict = {}

    def run():
        try:
            out["value"] = datacache.prepare(*args, **kwargs)
        except BaseException as e:  # noqa: BLE001 - handed to the test
            out["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), f"prepare blocked for over {seconds} s"
    if "error" in out:
        raise out["error"]
    return out["value"]


# ---------------------------------------------------------------- records
@pytest.mark.parametrize("where", ["first", "last"])  # first: the tokenizer; last: an eval prompt in the manifest
def test_a_lone_surrogate_is_a_counted_unreadable_line_not_a_traceback(tok, tmp_path, where):
    path = write_word_chats(tmp_path / "d.jsonl", n=24)
    lines = path.read_text().splitlines()
    bad = SURROGATE_LINE % " ".join(["ba"] * 20)
    path.write_text("\n".join([bad, *lines] if where == "first" else [*lines, bad]) + "\n")
    convs, warnings = read_jsonl(path)
    assert len(convs) == 24 and len(warnings) == 1 and "lone UTF-16 surrogate" in warnings[0]
    for cache_dir in (None, "off"):  # the cache (its manifest holds the eval prompts) and in memory
        p = datacache.prepare(_cfg(path, cache_dir=cache_dir), tok, BS, n_eval=2, root=tmp_path / "c"
                              if cache_dir is None else None)
        assert p.stats.kept == 22 and p.stats.dropped == {"unreadable JSONL line": 1}


def test_a_turn_with_tool_calls_is_refused_by_name_never_trained_without_its_call():
    call = [{"id": "c1", "type": "function", "function": {"name": "weather", "arguments": "{}"}}]
    user = {"role": "user", "content": "weather?"}
    for turn in ({"role": "assistant", "content": "Let me check.", "tool_calls": call},
                 {"role": "assistant", "content": None, "tool_calls": call},  # the usual shape: no text at all
                 {"role": "assistant", "content": "", "function_call": {"name": "weather", "arguments": "{}"}}):
        with pytest.raises(ValueError, match=r'turn 2: "(tool_calls|function_call)" is not supported'):
            normalize_record({"messages": [user, turn]})
    plain = normalize_record({"messages": [user, {"role": "assistant", "content": "Sunny.", "tool_calls": []}]})
    assert plain[1] == {"role": "assistant", "content": "Sunny."}  # an empty list calls nothing


@pytest.mark.parametrize("kind,magic", [("gzip", None), ("zstd", b"\x28\xb5\x2f\xfd"), ("xz", b"\xfd7zXZ\x00")])
def test_a_compressed_data_file_is_bad_input_naming_the_compression(tmp_path, kind, magic):
    path = tmp_path / "d.jsonl.gz"
    rows = "".join(json.dumps({"messages": [{"role": "user", "content": "ba"}]}) + "\n" for _ in range(3))
    if magic is None:
        with gzip.open(path, "wt") as fh:
            fh.write(rows)
    else:
        path.write_bytes(magic + b"\x00" * 64)
    with pytest.raises(BadInput, match=f"is {kind}-compressed, not JSON Lines") as e:
        read_jsonl(path)
    assert "decompress it first" in e.value.hint


def test_the_cli_refuses_a_gzip_file_or_a_directory_of_shards_with_exit_2_and_a_hint(tmp_path):
    from cli.dflash_main import app
    from tests.helpers import invoke

    path = tmp_path / "d.jsonl.gz"
    with gzip.open(path, "wt") as fh:
        fh.write(json.dumps({"messages": [{"role": "user", "content": "ba"}]}) + "\n")
    r = invoke(app, ["prepare", str(path), "--cache-dir", str(tmp_path / "c")])
    assert r.exit_code == 2 and "gzip-compressed" in r.stderr and "Traceback" not in r.stderr + r.stdout
    out = tmp_path / "run"  # train refuses it before the target loads (check_data_path), writing nothing
    r = invoke(app, ["train", "--out", str(out), "--data", str(path), "--set", "data.regenerate=false"])
    assert r.exit_code == 2 and "gzip-compressed" in r.stderr and not out.exists()
    shards = tmp_path / "shards"
    shards.mkdir()
    r = invoke(app, ["train", "--out", str(out), "--data", str(shards), "--set", "data.regenerate=false"])
    assert r.exit_code == 2 and "cat DIR/*.jsonl > all.jsonl" in " ".join(r.stderr.split()) and not out.exists()


def test_an_empty_answer_without_a_generation_prompt_trains_its_end_of_turn_not_the_inst_closer():
    tok = byte_tokenizer("mistral_nemo")
    for conv, want in (
        ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": ""},
          {"role": "user", "content": "again"}, {"role": "assistant", "content": "Yes."}], ["</s>", "Yes.</s>"]),
        ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": ""}], ["</s>"]),
    ):
        ids, mask = tokenize_conversation(tok, conv)
        assert trained_runs(tok, ids, mask) == want
    qwen = byte_tokenizer("qwen2.5")  # a generation prompt: unchanged, the empty turn trains its <|im_end|>
    ids, mask = tokenize_conversation(qwen, [{"role": "user", "content": "hi"}, {"role": "assistant", "content": ""},
                                             {"role": "user", "content": "x"}, {"role": "assistant", "content": "Yes."}])
    assert trained_runs(qwen, ids, mask) == ["<|im_end|>", "Yes.<|im_end|>"]


# ---------------------------------------------------------------- the cache
@pytest.mark.skipif(sys.platform == "win32", reason="FIFOs and symlinks")
@pytest.mark.parametrize("damage", ["manifest-fifo", "index-fifo", "shard-symlink", "mask-symlink"])
def test_cache_files_that_are_fifos_or_symlinks_are_moved_aside_and_rebuilt(tok, tmp_path, damage):
    path = write_word_chats(tmp_path / "d.jsonl", n=12)
    cfg, root = _cfg(path), tmp_path / "c"
    good = datacache.prepare(cfg, tok, BS, root=root)
    ref = [s.input_ids.tolist() for s in good.samples]
    d = root / good.key
    del good
    name = {"manifest-fifo": datacache.MANIFEST, "index-fifo": datacache.INDEX,
            "shard-symlink": "shard-00000.tokens", "mask-symlink": "shard-00000.mask"}[damage]
    size = (d / name).stat().st_size
    (d / name).unlink()
    if damage.endswith("fifo"):
        os.mkfifo(d / name)
    else:  # same size, other bytes, outside the cache: what a copied-in cache could point at
        elsewhere = tmp_path / "elsewhere.bin"
        elsewhere.write_bytes(b"\x05" * size)
        os.symlink(elsewhere, d / name)
    again = _prepare_within(30, cfg, tok, BS, root=root)
    assert not again.hit and "moved to" in again.notes[0] and name in again.notes[0]
    assert [s.input_ids.tolist() for s in again.samples] == ref
    assert len(list(root.glob(f"{again.key}.corrupt-*"))) == 1  # kept, not deleted


def test_a_token_id_past_the_vocabulary_is_bad_input_when_read_never_embedded(tok, tmp_path):
    path = write_word_chats(tmp_path / "d.jsonl", n=12)
    cfg, root = _cfg(path), tmp_path / "c"
    key = datacache.prepare(cfg, tok, BS, root=root).key
    tokens = np.memmap(root / key / "shard-00000.tokens", dtype=np.uint32, mode="r+")
    tokens[3] = 10 ** 9  # sample 0's fourth token: a flipped high bit
    tokens.flush()
    del tokens
    p = datacache.prepare(cfg, tok, BS, root=root)
    assert p.hit
    with pytest.raises(BadInput, match=r"is damaged: sample 0 holds token id 1000000000, past the tokenizer's"):
        p.samples[0]
    assert p.samples[1].input_ids.max() < len(tok)  # the others read as before


def test_a_data_file_rewritten_while_prepare_reads_it_is_bad_input_not_cached_under_the_old_key(tok, tmp_path,
                                                                                            monkeypatch):
    path = write_word_chats(tmp_path / "d.jsonl", n=12)
    cfg, root = _cfg(path), tmp_path / "c"
    real = datacache.load_conversations

    def read_then_rewrite(c):
        out = real(c)
        write_word_chats(path, n=13, seed=9)  # a writer finishing its rewrite after the hash was taken
        return out

    monkeypatch.setattr(datacache, "load_conversations", read_then_rewrite)
    with pytest.raises(BadInput, match="changed while it was read"):
        datacache.prepare(cfg, tok, BS, root=root)
    assert not [p for p in root.iterdir() if not p.name.startswith(".")]  # nothing cached
    monkeypatch.setattr(datacache, "load_conversations", real)
    p = datacache.prepare(cfg, tok, BS, root=root)
    assert not p.hit and p.stats.records == 13  # the new bytes, under their own key


def test_training_says_how_many_conversations_were_truncated_to_max_length(tmp_path):
    """`dflash train` said nothing on the console of conversations cut at data.max_length (their later
    answer tokens never trained): only metrics.jsonl's start event counted them."""
    import torch

    from dflash.config import tiny
    from dflash.data.prepare import load_training_data
    from dflash.model.target import load_target
    from tests.dflash_helpers import small_config

    path = write_word_chats(tmp_path / "d.jsonl", n=12)
    with open(path, "a") as fh:
        for _ in range(3):
            fh.write(json.dumps({"messages": [{"role": "user", "content": "ba be"},
                                              {"role": "assistant", "content": " ".join(["bo"] * 200)}]}) + "\n")
    cfg = small_config(tmp_path / "run", path, **{"data.cache_dir": "off"})
    target = load_target(tiny().target, cfg.drafter.num_layers, torch.device("cpu"))
    dataset, _, notes = load_training_data(cfg, target, lambda kind, data: None)
    assert dataset.stats.truncated == 3
    assert any(n.startswith(f"3 of {dataset.stats.kept} conversations are longer than data.max_length (96 tokens)")
               for n in notes), notes


def test_messages_roles_are_read_regardless_of_case():
    """"Assistant" / " USER" were roles of their own: a record mixing cases had turns the mask never trained."""
    from dflash.data.dataset import normalize_record

    rec = {"messages": [{"role": "System", "content": "s"}, {"role": " USER", "content": "u"},
                        {"role": "Assistant", "content": "a"}, {"role": "narrator", "content": "n"}]}
    assert [m["role"] for m in normalize_record(rec)] == ["system", "user", "assistant", "narrator"]
