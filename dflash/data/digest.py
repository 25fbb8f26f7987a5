"""What identifies a dataset's contents: the data cache's key part, and what a checkpoint records of the
data it trained on (dflash.checkpoint.data_check compares them at --resume).

`source_digest(cfg)` is "file:" + the xxh3-128 of the JSONL file's bytes, or "embedded:" + the embedded
conversations' digest; a file is hashed once per process and file state (the resume's check, then the
cache key: one read of a multi-GB file, not two)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Sequence

from dflash.config import EMBEDDED_DATA, DataConfig

HASH_CHUNK = 8 << 20


def _file_state(path: Path) -> tuple[int, ...] | None:
    """What changes when a file is written or replaced (None: gone)."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


def file_digest(path: str | Path) -> str:
    import xxhash

    h = xxhash.xxh3_128()
    with open(path, "rb") as fh:
        while chunk := fh.read(HASH_CHUNK):
            h.update(chunk)
    return h.hexdigest()


_DIGESTS: dict[tuple, str] = {}  # (path, its _file_state) -> file_digest: a file is hashed once a process


def source_digest(cfg: DataConfig) -> tuple[str, tuple[int, ...] | None]:
    """(what identifies `cfg.path`'s contents, the file's state it was read at): "file:" + the xxh3-128 of
    its bytes (the data cache's key part), or for the embedded dataset "embedded:" + its conversations'
    digest. Hashed once per process and file state (a resume's check, then the cache key: one read).
    OSError when the file cannot be read."""
    if cfg.path == EMBEDDED_DATA:
        from dflash.data.dataset import load_conversations

        convs, warnings = load_conversations(cfg)
        return "embedded:" + convs_digest(convs, warnings), None
    path = Path(cfg.path).expanduser().absolute()
    if not path.is_file():  # a FIFO is never opened (it would wait for a writer), a directory never read
        raise FileNotFoundError(f"{path} is not a regular file")
    state = _file_state(path)
    known = _DIGESTS.get((str(path), state)) if state is not None else None
    if known is not None:
        return known, state
    digest = "file:" + file_digest(path)
    if state is not None and _file_state(path) == state:  # not written while it was hashed
        if len(_DIGESTS) > 64:
            _DIGESTS.clear()
        _DIGESTS[(str(path), state)] = digest
    return digest, state


def convs_digest(convs: Sequence[Any], warnings: Sequence[str] = ()) -> str:
    import xxhash

    h = xxhash.xxh3_128()
    for c in convs:
        h.update(json.dumps(c, ensure_ascii=False, sort_keys=True).encode("utf-8"))
        h.update(b"\n")
    h.update(json.dumps(list(warnings)).encode("utf-8"))
    return h.hexdigest()
