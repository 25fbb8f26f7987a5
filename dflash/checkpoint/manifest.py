"""What a checkpoint's files claim, checked: `manifest.json` holds each file's size and xxh3-128 digest.

    record(directory, ["config.json", "model.safetensors", "training_state.pt", ...])  # last write before publishing
    check(directory)              # every file the manifest lists; BadInput names the first that differs
    check(directory, ["config.json", "model.safetensors"])   # only these (each must be listed)

`record` streams each file through xxh3-128 (1 MiB of memory; benchmarks/dflash_manifest.py measures
the rate) and writes the manifest atomically, so a checkpoint directory holds either no
manifest or a complete one. A file over SEGMENT bytes also gets the digest of each SEGMENT-byte piece
("segments"), computed in the same pass: `check` then reads and hashes the pieces in parallel threads
(a resume's 13.7 GB training state at 8B is read at the page cache's rate over several cores, not at one
core's), and every byte is still compared with what was recorded. Manifests without segments (older
checkpoints) are checked by the whole file's digest. `check` compares sizes first (no reading), then digests; a bit flip, a
truncation, a missing file or something that is not a regular file (a directory, a FIFO: never
opened for reading, so never blocks) is BadInput naming that file. A checkpoint without
manifest.json (written before manifests existed) is accepted: `check` returns a note saying that
nothing was verified, for the caller to show; with a manifest it returns None.

A manifest may also hold "data": what the run trained on at that step (path, content digest, record
counts; dflash.checkpoint.data_check compares it at --resume). It is not a file's checksum and is not
checked by `check`; `read_data` returns it type-checked, or None.

The manifest is untrusted input like the files it lists: read capped, every field type-checked, and
the names it lists must be plain file names inside the checkpoint (never a path out of it).
"""

from __future__ import annotations

import io
import os
import re
from pathlib import Path
from typing import Any, Iterable

from compilewatch import BadInput

MANIFEST = "manifest.json"
FORMAT = "dflash-checkpoint-manifest"
VERSION = 1
ALGORITHM = "xxh3_128"
MAX_MANIFEST_BYTES = 1 << 20  # a manifest lists a handful of files: a few hundred bytes
CHUNK = 1 << 20  # bytes hashed per read (one reused buffer)
SEGMENT = 256 << 20  # a large file's pieces, each with its own digest (checked in parallel)
MIN_SEGMENT = 4 << 10  # the smallest piece a manifest may claim (bounds the digests a file can list)
CHECK_THREADS = 8  # at most, for one file's pieces
_HEX128 = re.compile(r"[0-9a-f]{32}")


def open_regular(path: Path, what: str) -> tuple[int, os.stat_result]:
    """An fd for reading `path` and its stat, or BadInput when it is missing or not a regular file
    (compilewatch.open_untrusted: a FIFO is refused at once, never waited on)."""
    from compilewatch import open_untrusted

    return open_untrusted(path, what)


def _digest(fd: int, size: int) -> str:
    """xxh3-128 of the first `size` bytes of `fd` (the size fstat gave: a file that grows while it
    is hashed does not make this read forever). One reused buffer: no allocation per chunk."""
    return _digests(fd, size, 0)[0]


def _digests(fd: int, size: int, segment: int) -> tuple[str, list[str] | None]:
    """(the whole first `size` bytes' xxh3-128, each `segment`-byte piece's, or None for segment 0 or a
    file of one piece), in one pass over the file."""
    import xxhash

    whole = xxhash.xxh3_128()
    pieces: list[str] | None = [] if segment and size > segment else None
    part = xxhash.xxh3_128()
    in_part = 0
    step = max(1, min(CHUNK, segment or CHUNK, size))
    buf = memoryview(bytearray(step))
    left = size
    with io.FileIO(fd, "rb", closefd=False) as f:
        while left > 0:
            n = f.readinto(buf[: min(step, left, (segment - in_part) if pieces is not None else step)])
            if not n:
                break
            whole.update(buf[:n])
            left -= n
            if pieces is not None:
                part.update(buf[:n])
                in_part += n
                if in_part == segment or left == 0:
                    pieces.append(part.hexdigest())
                    part, in_part = xxhash.xxh3_128(), 0
    return whole.hexdigest(), pieces


def _pieces_match(fd: int, size: int, segment: int, digests: list[str]) -> int | None:
    """Hash each `segment`-byte piece of `fd` in parallel threads (pread: no shared file offset) and
    compare with `digests`; the index of the first piece that differs, or None when all match."""
    from concurrent.futures import ThreadPoolExecutor

    import xxhash

    def piece(i: int) -> bool:
        h = xxhash.xxh3_128()
        off, end = i * segment, min(size, (i + 1) * segment)
        while off < end:
            data = os.pread(fd, min(CHUNK, end - off), off)
            if not data:
                return False  # shorter than its size said (it shrank while read)
            h.update(data)
            off += len(data)
        return h.hexdigest() == digests[i]

    workers = max(1, min(CHECK_THREADS, os.cpu_count() or 1, len(digests)))
    with ThreadPoolExecutor(workers, thread_name_prefix="manifest-check") as pool:
        for i, ok in enumerate(pool.map(piece, range(len(digests)))):
            if not ok:
                return i
    return None


def file_entry(path: str | os.PathLike[str]) -> dict[str, Any]:
    """{"bytes": size, "xxh3_128": digest} of one regular file (BadInput if it is not one), and
    "segments": {"bytes": SEGMENT, "xxh3_128": [each piece's digest]} when it is over SEGMENT bytes."""
    p = Path(path)
    fd, st = open_regular(p, "checkpoint file")
    try:
        whole, pieces = _digests(fd, st.st_size, SEGMENT)
    finally:
        os.close(fd)
    entry: dict[str, Any] = {"bytes": st.st_size, ALGORITHM: whole}
    if pieces is not None:
        entry["segments"] = {"bytes": SEGMENT, ALGORITHM: pieces}
    return entry


def _plain_name(name: Any, where: str) -> str:
    if not isinstance(name, str) or not name or name in (".", "..") or "/" in name or "\\" in name or "\0" in name:
        raise BadInput(f"{where}: {name!r} is not a file name inside the checkpoint")
    return name


def record(directory: Path, names: Iterable[str], data: dict[str, Any] | None = None) -> dict[str, Any]:
    """Hash each named file of `directory` and write `directory/manifest.json` atomically; returns
    the manifest. Call it last, once every listed file is written (and before the directory is
    published). `data`: the training data's record (module docstring), kept as "data"."""
    from compilewatch import atomic_write_json

    directory = Path(directory)
    files = {}
    for name in names:
        _plain_name(name, "manifest.record")
        if name == MANIFEST:
            continue
        files[name] = file_entry(directory / name)
    manifest = {"format": FORMAT, "version": VERSION, "algorithm": ALGORITHM, "files": files}
    if data is not None:
        manifest["data"] = data
    atomic_write_json(directory / MANIFEST, manifest)
    return manifest


def keep(directory: Path, names: Iterable[str]) -> dict[str, Any] | None:
    """Rewrite `directory/manifest.json` (atomically) to list only those of `names` it lists now, with
    the sizes and digests recorded at the save: nothing is hashed again, so a file damaged since then
    still fails `check` (hashing it now would vouch for the damage). None, and nothing written, when
    the directory has no manifest (what was never recorded is not vouched for now). BadInput when the
    manifest does not read (`read`)."""
    from compilewatch import atomic_write_json

    directory = Path(directory)
    files = read(directory)
    if files is None:
        return None
    kept = {n: files[n] for n in names if n != MANIFEST and _plain_name(n, "manifest.keep") in files}
    manifest = {"format": FORMAT, "version": VERSION, "algorithm": ALGORITHM, "files": kept}
    data = read_data(directory)
    if data is not None:
        manifest["data"] = data
    atomic_write_json(directory / MANIFEST, manifest)
    return manifest


def _load(directory: Path) -> dict[str, Any] | None:
    """manifest.json as read (format, version and algorithm checked), or None when there is none."""
    from compilewatch import loads_json

    path = Path(directory) / MANIFEST
    where = str(path)
    if not os.path.lexists(path):
        return None
    fd, _st = open_regular(path, "the checkpoint manifest")
    try:
        with os.fdopen(fd, "rb", closefd=False) as fh:
            raw = fh.read(MAX_MANIFEST_BYTES + 1)
    finally:
        os.close(fd)
    if len(raw) > MAX_MANIFEST_BYTES:
        raise BadInput(f"{where}: larger than {MAX_MANIFEST_BYTES} bytes, not a checkpoint manifest")
    man = loads_json(raw, where)
    if not isinstance(man, dict) or man.get("format") != FORMAT:
        raise BadInput(f"{where}: not a {FORMAT} (no matching \"format\")",
                       hint="it was not written by dflash; move it aside to load the checkpoint unverified")
    if man.get("version") != VERSION or man.get("algorithm") != ALGORITHM:
        raise BadInput(f"{where}: version {man.get('version')!r} / algorithm {man.get('algorithm')!r}, "
                       f"this dflash reads version {VERSION} / {ALGORITHM}")
    return man


DATA_FIELDS = {"path": str, "digest": str, "records": int, "kept": int}
MAX_DATA_TEXT = 4096  # a path or digest longer than this is not one a save wrote


def read_data(directory: Path) -> dict[str, Any] | None:
    """The manifest's "data" record ({"path", "digest", "records", "kept"}, each of its type), or None:
    no manifest, none recorded (a checkpoint saved before dflash recorded it), or one that does not
    type-check (then it says nothing either). BadInput when the manifest itself does not read."""
    man = _load(directory)
    data = man.get("data") if man is not None else None
    if not isinstance(data, dict):
        return None
    out = {}
    for key, kind in DATA_FIELDS.items():
        v = data.get(key)
        if not isinstance(v, kind) or isinstance(v, bool) or (kind is int and v < 0) \
                or (kind is str and not 0 < len(v) <= MAX_DATA_TEXT):
            return None
        out[key] = v
    return out


def read(directory: Path) -> dict[str, dict[str, Any]] | None:
    """The files a checkpoint's manifest lists ({name: {"bytes", "xxh3_128"}}), every field checked;
    None when there is no manifest.json."""
    man = _load(directory)
    if man is None:
        return None
    where = str(Path(directory) / MANIFEST)
    files = man.get("files")
    if not isinstance(files, dict):
        raise BadInput(f"{where}: \"files\" is not an object")
    out = {}
    for name, entry in files.items():
        _plain_name(name, where)
        size = entry.get("bytes") if isinstance(entry, dict) else None
        digest = entry.get(ALGORITHM) if isinstance(entry, dict) else None
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise BadInput(f"{where}: {name}: \"bytes\" is not a size ({size!r})")
        if not isinstance(digest, str) or not _HEX128.fullmatch(digest):
            raise BadInput(f"{where}: {name}: {ALGORITHM!r} is not a 32-digit hex digest")
        out[name] = {"bytes": size, ALGORITHM: digest}
        if isinstance(entry, dict) and "segments" in entry:
            out[name]["segments"] = _read_segments(entry["segments"], size, f"{where}: {name}")
    return out


def _read_segments(seg: Any, size: int, where: str) -> dict[str, Any]:
    """A file entry's "segments", every field checked: a piece size of at least MIN_SEGMENT bytes and one
    32-digit hex digest for each piece of the file's size."""
    piece = seg.get("bytes") if isinstance(seg, dict) else None
    digests = seg.get(ALGORITHM) if isinstance(seg, dict) else None
    if isinstance(piece, bool) or not isinstance(piece, int) or piece < MIN_SEGMENT:
        raise BadInput(f"{where}: \"segments\" has no piece size of at least {MIN_SEGMENT} bytes ({piece!r})")
    if not isinstance(digests, list) or len(digests) != -(-size // piece) or len(digests) < 2:
        raise BadInput(f"{where}: \"segments\" must list one digest per {piece}-byte piece of its {size} bytes")
    if not all(isinstance(d, str) and _HEX128.fullmatch(d) for d in digests):
        raise BadInput(f"{where}: \"segments\" holds something that is not a 32-digit hex digest")
    return {"bytes": piece, ALGORITHM: list(digests)}


def check(directory: Path, names: Iterable[str] | None = None) -> str | None:
    """BadInput naming the first file (of `names`, default every file the manifest lists) whose size
    or digest differs from manifest.json, that is missing or not a regular file, or that the manifest
    does not list. Returns None when every file checked out; a note (nothing verified) when the
    checkpoint has no manifest.json (one written before manifests existed)."""
    directory = Path(directory)
    files = read(directory)
    if files is None:
        return f"{str(directory)!r} has no {MANIFEST} (written before checkpoints carried checksums): files not verified"
    wanted = list(files) if names is None else [_plain_name(n, "manifest.check") for n in names]
    hint = ("the checkpoint is damaged (a bad disk or copy, or an edit): evaluate another checkpoint, or resume from "
            "one by writing its name (step_NNNNNN) into the run's checkpoints/latest")
    for name in wanted:
        if name == MANIFEST:
            continue
        path = directory / name
        if name not in files:
            raise BadInput(f"{str(path)!r} is not listed in {MANIFEST}: its contents cannot be verified", hint=hint)
        want = files[name]
        fd, st = open_regular(path, "checkpoint file")
        try:
            if st.st_size != want["bytes"]:
                raise BadInput(f"{str(path)!r} is {st.st_size} bytes, {MANIFEST} says {want['bytes']}", hint=hint)
            seg = want.get("segments")
            if seg is not None:  # every byte, piece by piece, in parallel
                bad = _pieces_match(fd, st.st_size, seg["bytes"], seg[ALGORITHM])
                if bad is not None:
                    raise BadInput(f"{str(path)!r} does not match its {ALGORITHM} checksum in {MANIFEST} at bytes "
                                   f"{bad * seg['bytes']}..{min(st.st_size, (bad + 1) * seg['bytes']) - 1} "
                                   "(its bytes changed after it was written)", hint=hint)
            elif _digest(fd, st.st_size) != want[ALGORITHM]:
                raise BadInput(f"{str(path)!r} does not match its {ALGORITHM} checksum in {MANIFEST} "
                               "(its bytes changed after it was written)", hint=hint)
        finally:
            os.close(fd)
    return None
