"""Tokenized data, built once: flat memory-mapped shards, keyed by everything that changes the tokens.

    prepared = prepare(cfg.data, tokenizer, block_size, n_eval=16, on_event=...)
    ChatDataset(prepared.samples, cfg.data, block_size, seed, prepared.stats)

Layout of one cache (`<root>/<key>/`, nanoGPT-style flat arrays, no new dependency beyond numpy):

    manifest.json          written last: format, key and its parts, shards, stats, eval prompts
    index.npy              (N, 3) int64: shard, start, length of every kept sequence
    shard-00000.tokens     uint32 token ids of the shard's sequences, back to back
    shard-00000.mask       uint8 loss mask, same positions

Why flat arrays and not Arrow (HF `datasets`): numpy is already installed with transformers, random
access by (shard, start, length) is O(1) and reads only that sample's pages, and every rank (and
every restart) maps the same files through the OS page cache: N ranks on a node share one copy in
RAM, a rank touches only the pages of its own share, and a warm start reads a few KB of manifest and
index instead of tokenizing.

The key hashes: the data (xxh3-128 of the JSONL file's bytes, or of the conversations after
regeneration), the tokenizer (its serialized vocabulary/merges/added tokens, chat template and
special tokens), max length, block size (the no-anchor rule), the eval prompts held out, the
transformers/tokenizers versions and DATA_VERSION. A different key is a different directory (so
an edited file or template rebuilds); a matching one is reused.

A build never leaves something a reader would use: shards are written into `<root>/.tmp-<key>-...`,
fsynced, the manifest written last, and the directory renamed onto `<root>/<key>` in one step. A
cache whose manifest or files do not check out (size, index bounds, key; a symlink, FIFO or other
non-regular file in place of one of its files) is moved aside to `<key>.corrupt-<time>` (never
deleted) and rebuilt; a sample read with a token id past the tokenizer's is BadInput (a damaged
shard is never embedded). A data file that changes while it is hashed and read is BadInput. Builds of one key take a file lock, so ranks
that start together build once and the others then read the result.

Tokenizing runs over record shards in worker processes (spawned, each with the pickled tokenizer);
each worker writes its own shard files and returns lengths and stats, merged in shard order so the
counts and examples equal a sequential pass.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import pickle
import shutil
import stat
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import numpy as np
import torch

from compilewatch import BadInput, nearest_existing
from dflash.config import EMBEDDED_DATA, DataConfig
from dflash.data.dataset import (DataStats, Sample, check_usable, held_out_note, hold_out_eval, load_conversations,
                                 normalize_record, stats_with_warnings, tokenize_record)
from dflash.data.digest import _file_state, convs_digest, file_digest, source_digest  # noqa: F401 (file_digest: benchmarks)
from dflash.data.holdout import duplicate_notes, duplicates

DATA_VERSION = 7  # 2: oversized and assistant-first records skipped; 3: a leading UTF-8 BOM read, non-string turns skipped; 4: turns with tool calls or lone surrogates skipped, an empty answer without a generation prompt trains its end-of-turn token; 5: messages roles read regardless of case ("Assistant"); 6: eval prompts held out by content (every conversation that begins with one, dflash.data.holdout); 7: trained tokens that are the tokenizer's unknown token counted (stats.unknown_tokens); bump when dflash/data/dataset.py or dflash/data/chat_mask.py change which records, tokens, masks or stats come out
FORMAT = "dflash-data-cache"
MANIFEST = "manifest.json"
INDEX = "index.npy"
OFF = "off"
MAX_MANIFEST_BYTES = 256 << 20  # stats keep every unreadable line's warning; never read more
SHARD_RECORDS = (256, 8192)  # records per shard: at least, at most
SMALL = 2048  # fewer records than this: tokenize in this process (starting workers costs more)

Event = Callable[[str, dict[str, Any]], None]


class CorruptCache(Exception):
    """A cache directory that does not check out; the message says what."""


# ---------------------------------------------------------------- where and what
def default_root() -> Path:
    env = os.environ.get("DFLASH_DATA_CACHE")
    if env:
        return Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "dflash" / "data"


def cache_root(cfg: DataConfig) -> Path | None:
    """The cache root for `cfg` (None: caching is off)."""
    if cfg.cache_dir == OFF:
        return None
    return Path(cfg.cache_dir).expanduser() if cfg.cache_dir else default_root()


def check_root(root: Path | None) -> None:
    """BadInput now when the cache root cannot be a directory of ours: it, or the nearest of its
    ancestors that exists, is a file (or another non-directory), or that directory is not writable.
    Only stats: nothing is created (checked before the target loads; a dry run writes nothing)."""
    if root is None:
        return
    existing = nearest_existing(root)
    if existing is None:
        return
    if not existing.is_dir():
        why = "it is not a directory" if existing == root else f"{str(existing)!r} is not a directory"
    elif not _writable(existing):
        if existing == root and _holds_a_cache(root):
            return  # prepared by someone else, read-only to us: `prepare` reads it if it holds this data's key
        why = f"{str(existing)!r} is not writable"
    else:
        return
    raise BadInput(f"cannot use the data cache directory {str(root)!r}: {why}", hint=ROOT_HINT)


def _writable(d: Path) -> bool:
    return os.access(d, os.W_OK | os.X_OK)


def _holds_a_cache(root: Path, looked: int = 256) -> bool:
    """Whether `root` holds a cache directory (one with a manifest), among its first `looked` entries."""
    try:
        with os.scandir(root) as it:
            for n, e in enumerate(it):
                if n >= looked:
                    break
                if not e.name.startswith(".") and os.path.isfile(os.path.join(e.path, MANIFEST)):
                    return True
    except OSError:
        return False
    return False


def _closest(root: Path, parts: dict[str, Any], looked: int = 64) -> str:
    """How the cache in `root` nearest to `parts` (the most key parts alike) was made otherwise, or ""."""
    best: tuple[int, list[str]] | None = None
    with contextlib.suppress(OSError), os.scandir(root) as it:
        for n, e in enumerate(it):
            if n >= looked:
                break
            try:
                theirs = _read_manifest(Path(e.path)).get("parts") if not e.name.startswith(".") else None
            except (CorruptCache, OSError):
                continue
            if isinstance(theirs, dict):
                diff = [k for k in parts if theirs.get(k) != parts[k]]
                if best is None or len(diff) < best[0]:
                    best = (len(diff), [f"{_PART_NAMES.get(k, k)}: {_shown(theirs.get(k))} there, {_shown(parts[k])} here"
                                        for k in diff])
    return f"; the closest one there differs in {'; '.join(best[1])[:500]}" if best and best[1] else ""


_PART_NAMES = {"data": "the data's contents", "tokenizer": "the target's tokenizer or chat template",
               "max_length": "data.max_length", "max_record_chars": "data.max_record_chars",
               "block_size": "drafter.block_size", "eval_held_out": "the eval prompts held out (eval.num_prompts "
                                                                      "when eval.at_end)"}


def _shown(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 24 else text[:20] + "...'"


def _read_only(root: Path, key: str, parts: dict[str, Any]) -> tuple[dict[str, Any], MappedSamples]:
    """The cache of `key` in a root this process cannot write (a shared one prepared elsewhere): read as it
    is, never built, locked or moved aside. BadInput when it is not there or does not check out."""
    d = root / key
    if not d.exists():
        raise BadInput(f"the data cache directory {str(root)!r} is read-only here and holds no cache of this data "
                       f"(key {key}): it was prepared for other data, another tokenizer or other settings"
                       + _closest(root, parts),
                       hint=f"run `dflash prepare` with this run's config where that directory is writable, or "
                            f"{ROOT_HINT}")
    try:
        return open_cache(d, key)
    except (CorruptCache, OSError) as e:
        raise BadInput(f"data cache {str(d)!r} is unusable ({e}), and its directory is read-only here: it cannot "
                       "be moved aside and rebuilt", hint=f"ask whoever prepared it to run `dflash prepare` again, or "
                                                          f"{ROOT_HINT}") from None


ROOT_HINT = "--set data.cache_dir=DIR with a writable directory, or --set data.cache_dir=off to tokenize in memory"


def _make_root(root: Path) -> None:
    """mkdir -p the cache root; an OSError (it became a file since the check, a read-only disk) is BadInput."""
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        check_root(root)
        raise BadInput(f"cannot create the data cache directory {str(root)!r}: {e.strerror or e}",
                       hint=ROOT_HINT) from None


def tokenizer_fingerprint(tokenizer) -> str:
    """A hash of everything in the tokenizer that changes ids or masks: the serialized tokenizer
    (vocabulary, merges, normalizer, added tokens incl. the mask token), chat template, special tokens."""
    h = hashlib.sha256()
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        h.update(backend.to_str().encode("utf-8"))
    else:  # a slow tokenizer: its vocabulary and added tokens
        h.update(json.dumps(sorted(tokenizer.get_vocab().items())).encode("utf-8"))
    h.update(type(tokenizer).__name__.encode())
    h.update(json.dumps(getattr(tokenizer, "chat_template", None), sort_keys=True, default=str).encode("utf-8"))
    specials = getattr(tokenizer, "special_tokens_map", {}) or {}
    h.update(json.dumps(specials, sort_keys=True, default=str).encode("utf-8"))
    return h.hexdigest()


def cache_key(data_id: str, tokenizer, cfg: DataConfig, block_size: int, n_eval: int) -> tuple[str, dict[str, Any]]:
    """(key, its parts): the directory name and what it was made from (kept in the manifest)."""
    import tokenizers
    import transformers

    parts = {"data_version": DATA_VERSION, "data": data_id, "tokenizer": tokenizer_fingerprint(tokenizer),
             "max_length": cfg.max_length, "max_record_chars": cfg.record_chars(), "block_size": block_size,
             "eval_held_out": n_eval,
             "transformers": transformers.__version__, "tokenizers": tokenizers.__version__}
    key = hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:32]
    return key, parts


# ---------------------------------------------------------------- reading
class MappedSamples(Sequence[Sample]):
    """The kept sequences of a cache, read through memory maps: `[i]` copies sample i's tokens and
    mask into tensors and touches nothing else; `lengths` comes from the index."""

    def __init__(self, directory: Path, shards: list[dict[str, Any]]) -> None:
        self.directory = directory
        self.index = np.load(directory / INDEX, mmap_mode="r", allow_pickle=False)
        self._tokens = [_map(directory / s["tokens"], np.uint32, s["n_tokens"]) for s in shards]
        self._masks = [_map(directory / s["mask"], np.uint8, s["n_tokens"]) for s in shards]
        self.reads = 0  # samples read (tests check that a rank reads only its share)
        self.vocab: int | None = None  # token ids must be below it (prepare sets the tokenizer's size)

    @property
    def lengths(self) -> np.ndarray:
        return self.index[:, 2]

    def __len__(self) -> int:
        return int(self.index.shape[0])

    def __getitem__(self, i):  # type: ignore[override]
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        if not -len(self) <= int(i) < len(self):
            raise IndexError(i)
        s, a, n = (int(x) for x in self.index[int(i)])
        self.reads += 1
        ids = torch.from_numpy(self._tokens[s][a:a + n].astype(np.int64))
        mask = torch.from_numpy(self._masks[s][a:a + n].astype(np.bool_))
        if self.vocab is not None and n and int(ids.max()) >= self.vocab:  # a damaged shard: never embedded
            raise BadInput(f"data cache {str(self.directory)!r} is damaged: sample {int(i)} holds token id "
                           f"{int(ids.max())}, past the tokenizer's {self.vocab} tokens",
                           hint="delete that directory (or move it aside) and run again: it is tokenized anew")
        return Sample(ids, mask)

    def __iter__(self) -> Iterator[Sample]:
        for i in range(len(self)):
            yield self[i]

    def candidate_counts(self, block_size: int) -> np.ndarray:
        """(n,) each sample's anchor candidates (loss-masked positions in [0, S-B]), read from the mask
        maps without building tensors (the packing plan needs them; dflash.data.packing)."""
        out = np.zeros(len(self), dtype=np.int64)
        for r, (s, a, n) in enumerate(np.asarray(self.index, dtype=np.int64)):
            out[r] = np.count_nonzero(self._masks[s][a:a + max(0, n - block_size + 1)])
        return out


def vocab_bound(tokenizer) -> int:
    """One past the largest id `tokenizer` can produce (its size, or its largest id where ids have gaps)."""
    return max(len(tokenizer), max(tokenizer.get_vocab().values(), default=-1) + 1)


def _map(path: Path, dtype, n: int) -> np.ndarray:
    if n == 0:
        return np.zeros(0, dtype=dtype)  # mmap cannot map an empty file
    return np.memmap(path, dtype=dtype, mode="r", shape=(n,))


def _regular_file(path: Path) -> int:
    """The size of `path` (-1: missing), which must be a regular file of the cache itself: a symlink
    (to tokens made elsewhere), a FIFO (opening it waits for a writer forever) or a directory is
    CorruptCache."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return -1
    if not stat.S_ISREG(st.st_mode):
        kind = "a symlink" if stat.S_ISLNK(st.st_mode) else "not a regular file"
        raise CorruptCache(f"{path.name} is {kind}")
    return st.st_size


def _read_manifest(directory: Path) -> dict[str, Any]:
    path = directory / MANIFEST
    try:
        if _regular_file(path) < 0:
            raise FileNotFoundError(path)
        with open(path, "rb") as fh:
            raw = fh.read(MAX_MANIFEST_BYTES + 1)
    except FileNotFoundError:
        raise CorruptCache(f"no {MANIFEST} (an unfinished build, or a copy that stopped part way)") from None
    if len(raw) > MAX_MANIFEST_BYTES:
        raise CorruptCache(f"{MANIFEST} is larger than {MAX_MANIFEST_BYTES} bytes")
    try:
        man = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise CorruptCache(f"{MANIFEST} is not JSON ({e})") from None
    if not isinstance(man, dict) or man.get("format") != FORMAT:
        raise CorruptCache(f"{MANIFEST} is not a {FORMAT} manifest")
    return man


def open_cache(directory: str | Path, key: str | None = None) -> tuple[dict[str, Any], MappedSamples]:
    """Check a cache directory and map it; CorruptCache says what is wrong. Checks: manifest format,
    version and key, every shard file's size, the index's shape and bounds, the token total."""
    directory = Path(directory)
    man = _read_manifest(directory)
    try:
        if man["data_version"] != DATA_VERSION:
            raise CorruptCache(f"made by data version {man['data_version']}, this code reads {DATA_VERSION}")
        if key is not None and man["key"] != key:
            raise CorruptCache(f"holds key {man['key']!r}, expected {key!r}")
        shards = man["shards"]
        for s in shards:
            for name, width in ((s["tokens"], 4), (s["mask"], 1)):
                if "/" in name or name.startswith("."):
                    raise CorruptCache(f"bad shard file name {name!r}")
                size = _regular_file(directory / name)
                if size != int(s["n_tokens"]) * width:
                    raise CorruptCache(f"{name} is {size} bytes, expected {int(s['n_tokens']) * width}")
        if _regular_file(directory / INDEX) < 0:
            raise CorruptCache(f"no {INDEX}")
        try:
            samples = MappedSamples(directory, shards)
        except (OSError, ValueError) as e:
            raise CorruptCache(f"{INDEX} unreadable ({e})") from None
        idx = samples.index
        if idx.dtype != np.int64 or idx.ndim != 2 or idx.shape[1] != 3 or idx.shape[0] != int(man["samples"]):
            raise CorruptCache(f"{INDEX} has shape {idx.shape} ({idx.dtype}), expected ({man['samples']}, 3) int64")
        if len(idx):
            sizes = np.array([int(s["n_tokens"]) for s in shards] + [0], dtype=np.int64)
            shard, start, n = idx[:, 0], idx[:, 1], idx[:, 2]
            bad = (shard < 0) | (shard >= len(shards)) | (start < 0) | (n < 1)
            if bad.any() or (start + n > sizes[np.clip(shard, 0, len(shards))]).any():
                raise CorruptCache(f"{INDEX} points outside the shard files")
        if int(idx[:, 2].sum()) != int(man["stats"]["tokens"]):
            raise CorruptCache(f"{INDEX} holds {int(idx[:, 2].sum())} tokens, the manifest says {man['stats']['tokens']}")
        stats_from(man)  # the stats a start reports must load too
        _check_eval_prompts(man.get("eval_prompts"))  # and the prompts its evals decode
    except (KeyError, TypeError, ValueError) as e:
        raise CorruptCache(f"{MANIFEST} is missing or has a bad field ({type(e).__name__}: {e})") from None
    return man, samples


def stats_from(man: dict[str, Any]) -> DataStats:
    try:
        stats = DataStats(**man["stats"])
    except TypeError as e:  # unknown or missing fields
        raise CorruptCache(f"{MANIFEST} stats: {e}") from None
    counts = (stats.records, stats.kept, stats.truncated, stats.tokens, stats.loss_tokens, stats.unknown_tokens)
    strings = lambda xs: isinstance(xs, list) and all(isinstance(x, str) for x in xs)  # noqa: E731
    if (not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in counts)
            or not isinstance(stats.dropped, dict)
            or not all(isinstance(k, str) and isinstance(v, int) for k, v in stats.dropped.items())
            or not isinstance(stats.examples, dict) or not all(strings(v) for v in stats.examples.values())
            or not strings(stats.warnings)):
        raise CorruptCache(f"{MANIFEST} stats: a count, skip reason, example or warning of the wrong type")
    return stats


def _check_eval_prompts(prompts: Any) -> None:
    """The held-out eval prompts a manifest keeps: conversations as dflash.data.dataset reads them
    (a list of {"role", "content"} string turns each), else CorruptCache: the end-of-run eval renders them."""
    if prompts is None:
        return
    if not isinstance(prompts, list):
        raise CorruptCache(f"{MANIFEST} eval_prompts is not a list")
    for conv in prompts:
        try:
            if not isinstance(conv, list) or normalize_record({"messages": conv}) != conv:
                raise ValueError("not a list of {\"role\", \"content\"} turns")
        except ValueError as e:
            raise CorruptCache(f"{MANIFEST} eval_prompts holds a prompt that is no conversation ({e})") from None


# ---------------------------------------------------------------- building
_WORKER_TOKENIZER: Any = None


def _init_worker(tokenizer_bytes: bytes) -> None:
    global _WORKER_TOKENIZER
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # one core per worker process
    _WORKER_TOKENIZER = pickle.loads(tokenizer_bytes)  # our own bytes, from the parent process


def _worker_shard(args: tuple) -> tuple[int, np.ndarray, dict[str, Any]]:
    return encode_shard(_WORKER_TOKENIZER, *args)


def encode_shard(tokenizer, shard: int, first_record: int, convs: list, out_dir: str, max_length: int,
                 block_size: int, max_chars: int | None = None) -> tuple[int, np.ndarray, dict[str, Any]]:
    """Tokenize one shard of records (numbered from `first_record`), write its token and mask files
    into `out_dir` (fsynced); return (shard, lengths of the kept sequences, stats as a dict)."""
    stats = DataStats()
    ids_parts, mask_parts, lengths = [], [], []
    for n, conv in enumerate(convs, first_record):
        out = tokenize_record(tokenizer, conv, n, max_length, block_size, stats, max_chars)
        if out is not None:
            ids_parts.append(np.asarray(out[0], dtype=np.uint32))
            mask_parts.append(np.asarray(out[1], dtype=np.uint8))
            lengths.append(len(out[0]))
    for name, parts, dtype in ((shard_name(shard, "tokens"), ids_parts, np.uint32),
                               (shard_name(shard, "mask"), mask_parts, np.uint8)):
        arr = np.concatenate(parts) if parts else np.zeros(0, dtype=dtype)
        _write_synced(Path(out_dir) / name, arr.tobytes())
    return shard, np.asarray(lengths, dtype=np.int64), asdict(stats)


def shard_name(shard: int, kind: str) -> str:
    return f"shard-{shard:05d}.{kind}"


def _write_synced(path: Path, data: bytes) -> None:
    with open(path, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def plan_shards(n_records: int, workers: int) -> list[tuple[int, int]]:
    """[start, end) record ranges: about 4 shards per worker, each within SHARD_RECORDS."""
    lo, hi = SHARD_RECORDS
    size = min(hi, max(lo, -(-n_records // max(1, 4 * workers))))
    return [(a, min(n_records, a + size)) for a in range(0, n_records, size)] or [(0, 0)]


def auto_workers(n_records: int, requested: int | None) -> int:
    if requested is not None:
        return max(1, requested)
    if n_records < SMALL:
        return 1
    return max(1, min(os.cpu_count() or 1, -(-n_records // SHARD_RECORDS[0])))


BUILDS = {"count": 0}  # cache builds in this process (tests: a second call must not build)


def build_cache(root: Path, key: str, parts: dict[str, Any], convs: list, warnings: list[str], eval_convs: list,
                tokenizer, cfg: DataConfig, block_size: int, *, workers: int | None = None,
                on_event: Event | None = None, eval_held_out: int = 0,
                repeats: tuple[int, int, int] = (0, 0, 0), records: int = 0) -> tuple[dict[str, Any], MappedSamples]:
    """Tokenize `convs` into `<root>/<key>` (atomically; see the module docstring) and open it.
    `eval_held_out`: how many of `eval_convs` were held out of `convs`; `repeats`: the conversations held
    out as repeats of an eval prompt, and the repeated conversations of `convs` and their extra copies
    (dflash.data.holdout); `records`: the data's records, read before any was held out (all recorded in the
    manifest)."""
    on_event = on_event or (lambda kind, data: None)
    BUILDS["count"] += 1
    t0 = time.perf_counter()
    n_workers = auto_workers(len(convs), workers)
    ranges = plan_shards(len(convs), n_workers)
    _make_root(root)
    tmp = root / f".tmp-{key}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        stats = stats_with_warnings(warnings)
        jobs = [(i, a + 1, convs[a:b], str(tmp), cfg.max_length, block_size, cfg.record_chars())
                for i, (a, b) in enumerate(ranges)]
        on_event("tokenize", {"done": 0, "total": len(convs), "workers": n_workers})
        results = []
        for shard, lengths, st in _run(jobs, tokenizer, n_workers):
            results.append((shard, lengths, st))
            done = ranges[shard][1]
            on_event("tokenize", {"done": min(done, len(convs)), "total": len(convs), "workers": n_workers})
        results.sort(key=lambda r: r[0])
        shards, index = [], []
        for shard, lengths, st in results:
            stats.merge(DataStats(**st))
            starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]) if len(lengths) else np.zeros(0, np.int64)
            index.append(np.stack([np.full(len(lengths), shard, np.int64), starts.astype(np.int64), lengths], axis=1))
            shards.append({"tokens": shard_name(shard, "tokens"), "mask": shard_name(shard, "mask"),
                           "n_tokens": int(lengths.sum()), "records": ranges[shard][1] - ranges[shard][0]})
        if not stats.kept:  # nothing to cache: the same BadInput as the in-memory path, nothing written
            check_usable(stats, dataclasses.replace(cfg, strict=False))
        idx = np.concatenate(index) if index else np.zeros((0, 3), np.int64)
        with open(tmp / INDEX, "wb") as fh:
            np.save(fh, idx.astype(np.int64), allow_pickle=False)
            fh.flush()
            os.fsync(fh.fileno())
        manifest = {"format": FORMAT, "data_version": DATA_VERSION, "key": key, "parts": parts,
                    "source": cfg.path, "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                    "build_seconds": round(time.perf_counter() - t0, 3), "workers": n_workers,
                    "samples": int(len(idx)), "shards": shards, "stats": asdict(stats), "eval_prompts": eval_convs,
                    "eval_held_out": int(eval_held_out), "repeats": [int(n) for n in repeats],
                    "records": int(records)}
        _write_synced(tmp / MANIFEST, json.dumps(manifest, ensure_ascii=False).encode("utf-8"))  # last
        _fsync_dir(tmp)
        final = root / key
        try:
            os.rename(tmp, final)
        except OSError:
            if not (final / MANIFEST).is_file():  # not another builder's finished cache: a real error
                raise
            shutil.rmtree(tmp, ignore_errors=True)  # another process finished first: use its cache
        else:
            _fsync_dir(root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # our own unfinished build: never anyone's data
        raise
    return open_cache(final, key)


def _run(jobs: list[tuple], tokenizer, workers: int):
    if workers <= 1 or len(jobs) == 1:
        for job in jobs:
            yield encode_shard(tokenizer, *job)
        return
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor, as_completed

    ctx = multiprocessing.get_context("spawn")  # never fork a process holding CUDA, threads and locks
    with ProcessPoolExecutor(max_workers=min(workers, len(jobs)), mp_context=ctx, initializer=_init_worker,
                             initargs=(pickle.dumps(tokenizer),)) as pool:
        futures = [pool.submit(_worker_shard, job) for job in jobs]
        for fut in as_completed(futures):
            yield fut.result()


@contextlib.contextmanager
def _build_lock(root: Path, key: str):
    """One builder per key on this host (and on filesystems whose flock works across hosts)."""
    _make_root(root)
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX: the atomic rename still keeps builds safe
        yield
        return
    with open(root / f".{key}.lock", "a") as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def lookup(root: Path, key: str, notes: list[str]) -> tuple[dict[str, Any], MappedSamples] | None:
    """The cache of `key` under `root` if it checks out; a broken one is moved aside (note added)."""
    d = root / key
    if not d.exists():
        return None
    try:
        return open_cache(d, key)
    except (CorruptCache, OSError) as e:
        aside = root / f"{key}.corrupt-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:4]}"
        os.rename(d, aside)
        notes.append(f"data cache {str(d)!r} was unusable ({e}); moved to {str(aside)!r} and rebuilt")
        return None


# ---------------------------------------------------------------- the entry
@dataclass
class Prepared:
    """Tokenized data ready for ChatDataset, and where it came from."""

    samples: Sequence[Sample]
    stats: DataStats
    eval_convs: list
    cache_dir: str | None  # None: not cached (data.cache_dir = "off")
    key: str | None
    hit: bool  # True: read from an existing cache, nothing tokenized
    workers: int
    shards: int
    bytes: int
    seconds: float
    notes: list[str] = field(default_factory=list)
    eval_held_out: int | None = 0  # eval prompts held out of training (None: a cache that did not record it)
    records: int = 0  # records of the data: read (skipped ones included) and held out


def prepare(cfg: DataConfig, tokenizer, block_size: int, *, n_eval: int = 0,
            regenerate: Callable[[list], list] | None = None, workers: int | None = None,
            root: str | Path | None = None, on_event: Event | None = None) -> Prepared:
    """Tokenized samples of `cfg.path` (after `regenerate`, when given), from the cache when its key
    matches, else tokenized (into the cache unless it is off). BadInput for unusable data (and for
    any skip under data.strict), the same on a cache hit as on a build."""
    on_event = on_event or (lambda kind, data: None)
    t0 = time.perf_counter()
    base = Path(root).expanduser() if root is not None else cache_root(cfg)
    check_root(base)
    workers = workers if workers is not None else cfg.workers
    notes: list[str] = []
    key = parts = None
    convs = warnings = eval_convs = None
    path, state = Path(cfg.path).expanduser(), None
    if regenerate is None and cfg.path != EMBEDDED_DATA and base is not None:
        if path.is_file():  # a missing file: load_conversations says so below
            digest, state = source_digest(cfg)
            key, parts = cache_key(digest, tokenizer, cfg, block_size, n_eval)
    if key is None:
        convs, warnings = load_conversations(cfg)
        total = len(convs) + len(warnings)
        cut = hold_out_eval(cfg, convs, n_eval)
        convs, eval_convs, held = cut.train, cut.prompts, cut.held_out
        repeats = (cut.repeats_held_out, *duplicates(convs))
        if regenerate is not None and convs:
            convs = regenerate(convs)
        if base is None:  # caching off: the in-memory path
            from dflash.data.dataset import tokenize_all

            on_event("phase", {"name": "data", "conversations": len(convs)})
            stats = stats_with_warnings(warnings)
            samples = tokenize_all(tokenizer, convs, cfg, block_size, stats)
            check_usable(stats, cfg)
            note = held_out_note(len(eval_convs), held, len(convs))
            return Prepared(samples, stats, eval_convs, None, None, False, 1, 0, 0, time.perf_counter() - t0,
                            ([note] if note else []) + duplicate_notes(*repeats), eval_held_out=held,
                            records=total)
        key, parts = cache_key("conversations:" + convs_digest(convs, warnings), tokenizer, cfg, block_size, n_eval)
    read_only = base.is_dir() and not _writable(base)  # a shared cache prepared elsewhere: read, never written
    with contextlib.nullcontext() if read_only else _build_lock(base, key):
        found = _read_only(base, key, parts) if read_only else lookup(base, key, notes)
        hit = found is not None
        if found is None:
            if convs is None:
                convs, warnings = load_conversations(cfg)
                if _file_state(path) != state:  # the key is the digest of other bytes than those read
                    raise BadInput(f"the dataset {cfg.path!r} changed while it was read",
                                   hint="run again once whatever writes it has finished (write a new file and "
                                        "rename it into place)")
                total = len(convs) + len(warnings)
                cut = hold_out_eval(cfg, convs, n_eval)
                convs, eval_convs, held = cut.train, cut.prompts, cut.held_out
                repeats = (cut.repeats_held_out, *duplicates(convs))
            on_event("phase", {"name": "data", "conversations": len(convs)})
            found = build_cache(base, key, parts, convs, warnings, eval_convs, tokenizer, cfg, block_size,
                                workers=workers, on_event=on_event, eval_held_out=held, repeats=repeats,
                                records=total)
    man, samples = found
    samples.vocab = vocab_bound(tokenizer)
    stats = stats_from(man)
    check_usable(stats, cfg)
    size = sum((base / key / n).stat().st_size for n in os.listdir(base / key))
    on_event("phase", {"name": "data-cache", "hit": hit, "dir": str(base / key)})
    held = man.get("eval_held_out")  # absent in a cache built before it was recorded: not known
    held = held if isinstance(held, int) and not isinstance(held, bool) and held >= 0 else None
    eval_convs = list(man.get("eval_prompts") or [])
    note = held_out_note(len(eval_convs), held, stats.records + len(stats.warnings))
    repeats = _counts(man.get("repeats"))
    return Prepared(samples, stats, eval_convs, str(base / key), key, hit,
                    int(man.get("workers", 1)), len(man["shards"]), size, time.perf_counter() - t0,
                    notes + ([note] if note else []) + duplicate_notes(*repeats), eval_held_out=held,
                    records=_count(man.get("records"), stats.records + len(stats.warnings)))


def _count(value: Any, otherwise: int) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else otherwise


def _counts(value: Any) -> tuple[int | None, int | None, int | None]:
    """A manifest's "repeats" ([repeats of held-out prompts, repeated conversations, extra copies]), or
    Nones where it has none (a cache built before they were counted) or a bad one."""
    if (isinstance(value, list) and len(value) == 3
            and all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in value)):
        return value[0], value[1], value[2]
    return None, None, None
