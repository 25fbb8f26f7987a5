"""The tokenized-data cache (dflash/data/cache.py) at scale: build time by worker count, warm start,
reader memory, data-path throughput.

Generates N synthetic multi-turn conversations (random words, 2-3 exchanges, Qwen3's real chat
template with `<think>` blocks in the answers) and a byte-level BPE tokenizer trained on them
(tokenizers' BpeTrainer, Qwen3's special tokens: about the token/word ratio of a real BPE), then:

  build_w{W}   a cold build with W worker processes (fresh cache root each)
  warm         prepare() again: a cache hit (content hash of the JSONL + manifest + index map)
  reader       a fresh process that opens the cache (hit) and makes every micro-batch of its share of
               one epoch (rank 0 of `--ranks`, and a single rank reading everything): RSS (anonymous
               vs file-backed), batches/s and tokens/s of the data path (Plan.batch -> make_batch)
  in_memory    the same data held as Python lists of int64 tensors (the old path): its RSS

    python benchmarks/dflash_data.py --conversations 20000 --workers 1,2 --out /tmp/dd
Results: <out>/dflash_data.json (and a table on stdout).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

TEMPLATE = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "chat_templates" / "qwen3.jinja"
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]


def words(n: int = 5000, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    cons, vows = "bcdfghjklmnprstvwz", "aeiou"
    return ["".join(rng.choice(cons) + rng.choice(vows) for _ in range(rng.randint(1, 4))) for _ in range(n)]


def generate(path: Path, n: int, mean_words: int, seed: int = 1) -> None:
    vocab = words()
    rng = random.Random(seed)

    def text(k: int) -> str:
        return " ".join(rng.choice(vocab) for _ in range(max(1, int(rng.gauss(k, k / 4)))))

    with open(path, "w") as fh:
        for _ in range(n):
            turns = rng.randint(2, 3)
            msgs = [{"role": "system", "content": "You are a helpful assistant."}] if rng.random() < 0.3 else []
            for _t in range(turns):
                msgs.append({"role": "user", "content": text(mean_words // (4 * turns))})
                msgs.append({"role": "assistant", "content": f"<think>\n{text(mean_words // (4 * turns))}\n</think>\n\n"
                                                            f"{text(mean_words // (2 * turns))}"})
            fh.write(json.dumps({"messages": msgs}) + "\n")


def tokenizer(train_file: Path, vocab_size: int = 8192):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    lines = []
    with open(train_file) as fh:
        for i, line in enumerate(fh):
            if i >= 2000:
                break
            lines += [m["content"] for m in json.loads(line)["messages"]]
    tk.train_from_iterator(lines, trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                  additional_special_tokens=["<|im_start|>", "<|im_end|>"])
    tok.chat_template = TEMPLATE.read_text()
    tok.add_tokens(["<|MASK|>"], special_tokens=True)
    return tok


def mem() -> dict[str, int]:
    out = {}
    with open("/proc/self/status") as fh:
        for line in fh:
            k, _, v = line.partition(":")
            if k in ("VmRSS", "RssAnon", "RssFile", "VmHWM"):
                out[k] = int(v.split()[0]) * 1024
    return out


def reader(args) -> int:
    """In a fresh process: open the cache, make every micro-batch of this rank's share of epoch 0."""
    import pickle
    import types

    from dflash.config import DataConfig
    from dflash.data.dataset import ChatDataset
    from dflash.data.cache import prepare
    from dflash.engine.program import Plan

    before = mem()
    tok = pickle.loads(Path(args.tokenizer_pickle).read_bytes())
    cfg = DataConfig(path=args.data, max_length=args.max_length, num_anchors=512, batch_size=args.batch_size)
    t0 = time.perf_counter()
    p = prepare(cfg, tok, 16, root=args.root)
    open_s = time.perf_counter() - t0
    ds = ChatDataset(p.samples, cfg, 16, 0, p.stats)
    after_open = mem()
    result = {"hit": p.hit, "open_s": open_s, "samples": len(ds), "before": before, "after_open": after_open}
    if args.in_memory:
        t0 = time.perf_counter()
        held = [(s.input_ids.clone(), s.loss_mask.clone()) for s in p.samples]
        result.update(materialize_s=time.perf_counter() - t0, held=len(held), after=mem())
    else:
        plan = Plan(types.SimpleNamespace(dataset=ds), 1, args.rank, args.world)
        n = plan.steps_per_epoch
        t0 = time.perf_counter()
        tokens = padded = 0
        for i in range(n):
            b = plan.batch(i)
            tokens += b.tokens
            padded += b.input_ids.numel()
        s = time.perf_counter() - t0
        result.update(batches=n, seconds=s, tokens=tokens, padded_tokens=padded, tokens_per_s=tokens / s,
                      batches_per_s=n / s, samples_read=p.samples.reads, after=mem())
    print(json.dumps(result))
    return 0


def run_reader(args, root: Path, tok_pickle: Path, **kw) -> dict:
    cmd = [sys.executable, __file__, "--reader", "--root", str(root), "--data", str(args.data_file),
           "--tokenizer-pickle", str(tok_pickle), "--max-length", str(args.max_length),
           "--batch-size", str(args.batch_size)]
    for k, v in kw.items():
        cmd += [f"--{k.replace('_', '-')}"] + ([] if v is True else [str(v)])
    out = subprocess.run(cmd, check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--conversations", type=int, default=20000)
    ap.add_argument("--words", type=int, default=600, help="mean words per conversation")
    ap.add_argument("--workers", default="1,2")
    ap.add_argument("--max-length", type=int, default=2048)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--out", default="/tmp/dflash_data")
    ap.add_argument("--reader", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--in-memory", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--root", help=argparse.SUPPRESS)
    ap.add_argument("--data", help=argparse.SUPPRESS)
    ap.add_argument("--tokenizer-pickle", help=argparse.SUPPRESS)
    ap.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--world", type=int, default=1, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.reader:
        return reader(args)

    import pickle

    from dflash.data import cache as datacache
    from dflash.config import DataConfig

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    args.data_file = out / f"synthetic-{args.conversations}.jsonl"
    t0 = time.perf_counter()
    if not args.data_file.is_file():
        generate(args.data_file, args.conversations, args.words)
    gen_s = time.perf_counter() - t0
    tok = tokenizer(args.data_file)
    tok_pickle = out / "tokenizer.pkl"
    tok_pickle.write_bytes(pickle.dumps(tok))
    cfg = DataConfig(path=str(args.data_file), max_length=args.max_length, batch_size=args.batch_size)
    res: dict = {"conversations": args.conversations, "jsonl_bytes": args.data_file.stat().st_size,
                 "generate_s": gen_s, "cpu_count": os.cpu_count(), "builds": {}}
    t0 = time.perf_counter()
    datacache.file_digest(args.data_file)
    res["hash_s"] = time.perf_counter() - t0
    last_root = None
    for w in [int(x) for x in args.workers.split(",")]:
        root = out / f"cache-w{w}"
        if root.exists():
            import shutil

            shutil.rmtree(root)  # the benchmark's own cache from an earlier run of this script
        t0 = time.perf_counter()
        p = datacache.prepare(cfg, tok, 16, root=root, workers=w)
        s = time.perf_counter() - t0
        st = p.stats
        res["builds"][w] = {"seconds": s, "workers": p.workers, "shards": p.shards, "bytes": p.bytes,
                            "tokens": st.tokens, "kept": st.kept, "truncated": st.truncated, "skipped": st.skipped,
                            "conversations_per_s": args.conversations / s, "tokens_per_s": st.tokens / s,
                            "peak_rss_parent": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
        print(f"build with {w} worker(s): {s:.1f} s, {st.kept} kept, {st.tokens:,} tokens "
              f"({st.tokens / s:,.0f} tok/s), {p.shards} shards, {p.bytes / 1e6:.1f} MB", flush=True)
        last_root = root
    t0 = time.perf_counter()
    hit = datacache.prepare(cfg, tok, 16, root=last_root)
    res["warm_s"] = time.perf_counter() - t0
    assert hit.hit
    print(f"warm start (cache hit, in process): {res['warm_s']:.3f} s (of which content hash {res['hash_s']:.3f} s)")
    res["reader_rank0"] = run_reader(args, last_root, tok_pickle, rank=0, world=args.ranks)
    res["reader_all"] = run_reader(args, last_root, tok_pickle, rank=0, world=1)
    res["in_memory"] = run_reader(args, last_root, tok_pickle, in_memory=True)
    for name in ("reader_rank0", "reader_all"):
        r = res[name]
        print(f"{name}: open {r['open_s']:.3f} s, {r['batches']} batches, {r['tokens_per_s']:,.0f} tok/s "
              f"({r['batches_per_s']:.0f} batches/s), RssAnon {r['after']['RssAnon'] / 2**20:.0f} MiB "
              f"(after open {r['after_open']['RssAnon'] / 2**20:.0f}), RssFile {r['after']['RssFile'] / 2**20:.0f} MiB")
    m = res["in_memory"]
    print(f"in memory (lists of tensors, old path): RssAnon {m['after']['RssAnon'] / 2**20:.0f} MiB "
          f"(after open {m['after_open']['RssAnon'] / 2**20:.0f})")
    (out / "dflash_data.json").write_text(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
