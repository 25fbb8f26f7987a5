"""The target's weights into the page cache from the first moment of a start, before torch is imported.

A start reads the target's safetensors onto the GPU once torch and CUDA are up (dflash.model.weights): on
the H200 machine that is ~3 s into the process, `import torch` most of it, and the disk is idle until
then. `prefetch_weights` reads the files at once from a few threads into scratch buffers, in the order the
GPU read takes them. The pages stay in the page cache, where the GPU read finds them (a page still being
read is waited for, not read twice), so the disk starts ~3 s earlier. It imports nothing heavy (no torch),
raises nothing (a file it cannot read is left to the real read, which says what is wrong), stops at the
end of the files or on `stop()`, and is skipped when the files would not fit in the memory available
(their pages would be dropped again before the GPU read came to them).
"""

from __future__ import annotations

import itertools
import json
import os
import threading
from pathlib import Path

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
CHUNK = 32 << 20  # bytes a thread reads at once
READERS = 4  # threads: enough to keep the disk busy beside the imports' own reads


def safetensors_files(path: Path) -> list[Path] | None:
    """The checkpoint's safetensors files (one, or the shards its index names), or None when the
    directory holds no safetensors checkpoint (a .bin one: from_pretrained reads it)."""
    index = path / INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8")).get("weight_map")
        except (OSError, ValueError, AttributeError):
            return None
        if not isinstance(weight_map, dict) or not weight_map:
            return None
        files = [path / f for f in dict.fromkeys(weight_map.values()) if isinstance(f, str)]
        return files if files and all(f.is_file() for f in files) else None
    single = path / SINGLE
    return [single] if single.is_file() else None


class Prefetch:
    """Reader threads over `files`; `bytes_read` grows as they go, `done` is set when all have ended."""

    def __init__(self, files: list[Path], readers: int = READERS, chunk: int = CHUNK) -> None:
        self.files, self.chunk = files, chunk
        self.bytes_read = 0
        self.done = threading.Event()
        self._stop = threading.Event()
        self._jobs = [(f, off) for f in files for off in range(0, _size(f), chunk)]
        self._taken = itertools.count()  # next() on it is atomic: each chunk goes to one thread
        self._lock = threading.Lock()
        self._left = max(1, min(readers, len(self._jobs)))
        self._threads = [threading.Thread(target=self._read, name="dflash-prefetch", daemon=True)
                         for _ in range(self._left)]

    def start(self) -> "Prefetch":
        for t in self._threads:
            t.start()
        return self

    def stop(self) -> None:
        """The threads end after their current chunk (returns at once)."""
        self._stop.set()

    def _read(self) -> None:
        buf = bytearray(self.chunk)
        fds: dict[Path, int] = {}
        try:
            while not self._stop.is_set() and (j := next(self._taken)) < len(self._jobs):
                f, off = self._jobs[j]
                fd = fds.get(f)
                if fd is None:
                    fd = fds[f] = os.open(f, os.O_RDONLY)
                n = os.preadv(fd, [buf], off)
                with self._lock:
                    self.bytes_read += n
        except OSError:
            pass  # the real read reports it
        finally:
            for fd in fds.values():
                os.close(fd)
            with self._lock:
                self._left -= 1
                if self._left == 0:
                    self.done.set()


def _size(f: Path) -> int:
    try:
        return f.stat().st_size
    except OSError:
        return 0


def _available_memory() -> int | None:
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except Exception:  # noqa: BLE001 - no reading: no bound, as before this existed
        return None


def prefetch_weights(target_path: str) -> Prefetch | None:
    """Start reading a directory target's safetensors into the page cache (the module doc); None for an
    embedded target, no safetensors, or files larger than half the memory available."""
    if target_path.startswith("embedded:"):
        return None
    files = safetensors_files(Path(target_path).expanduser())
    if not files:
        return None
    avail = _available_memory()
    if avail is not None and sum(_size(f) for f in files) > avail // 2:
        return None
    return Prefetch(files).start()
