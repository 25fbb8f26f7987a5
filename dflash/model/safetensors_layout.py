"""Where each tensor's bytes sit in a safetensors file: its header, read and checked without reading the data.

The format (huggingface/safetensors, "Format" in its README): 8 bytes, a little-endian u64 N; N bytes of
JSON, ``{name: {"dtype": str, "shape": [int, ...], "data_offsets": [begin, end]}, "__metadata__": {...}}``;
then the byte buffer, which the offsets index. A file from elsewhere is untrusted, so the checks are those
safetensors' own reader makes (its Rust `Metadata::validate`): a header of at most 100 MB that is a JSON
object, tensors that tile the buffer exactly (sorted by offset, no hole, no overlap, the last one ending
at the file's end), and each tensor's byte count equal to its dtype's size times its shape's product.
A dtype torch has no plain equivalent for here is `Unsupported` (the caller reads the file with
safetensors instead), not an error.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

MAX_HEADER = 100_000_000  # safetensors' MAX_HEADER_SIZE
DTYPES: dict[str, torch.dtype] = {
    "BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16, "I32": torch.int32,
    "I64": torch.int64, "F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}


class Unsupported(Exception):
    """A well-formed file this reader does not handle (a dtype outside DTYPES)."""


@dataclass(frozen=True, slots=True)
class Entry:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int  # byte offsets into the data buffer
    end: int


@dataclass(frozen=True, slots=True)
class Layout:
    path: Path
    data_start: int  # the buffer's offset in the file: 8 + N
    size: int  # the buffer's bytes
    entries: tuple[Entry, ...]  # in buffer order


def _bad(path: Path, what: str) -> ValueError:
    return ValueError(f"{path.name} is not a valid safetensors file: {what}")


def read_layout(path: Path) -> Layout:
    """The checked layout of `path` (module doc). ValueError names what is wrong; Unsupported for a
    dtype outside DTYPES; OSError for a file that cannot be read."""
    path = Path(path)
    with open(path, "rb") as fh:
        file_size = os.fstat(fh.fileno()).st_size
        head = fh.read(8)
        if len(head) < 8:
            raise _bad(path, f"{file_size} bytes, shorter than the 8-byte header length")
        n = int.from_bytes(head, "little")
        if n > MAX_HEADER:
            raise _bad(path, f"a header of {n} bytes (safetensors allows at most {MAX_HEADER})")
        if 8 + n > file_size:
            raise _bad(path, f"a header of {n} bytes in a file of {file_size}")
        raw = fh.read(n)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        raise _bad(path, "its header is not JSON") from None
    if not isinstance(header, dict):
        raise _bad(path, "its header is not a JSON object")
    entries = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        entries.append(_entry(path, name, info))
    entries.sort(key=lambda e: (e.begin, e.end))
    size = file_size - 8 - n
    at = 0
    for e in entries:
        if e.begin != at:
            raise _bad(path, f"tensor {e.name!r} starts at byte {e.begin} of the data, expected {at} (a hole or an overlap)")
        at = e.end
    if at != size:
        raise _bad(path, f"its tensors cover {at} bytes of a {size}-byte data buffer")
    return Layout(path=path, data_start=8 + n, size=size, entries=tuple(entries))


def _entry(path: Path, name: str, info) -> Entry:
    if not isinstance(info, dict):
        raise _bad(path, f"tensor {name!r} is described by {type(info).__name__}, not an object")
    dt, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if not isinstance(dt, str):
        raise _bad(path, f"tensor {name!r} has no dtype")
    if dt not in DTYPES:
        raise Unsupported(f"{path.name}: tensor {name!r} has dtype {dt}")
    if not isinstance(shape, list) or not all(type(s) is int and s >= 0 for s in shape):
        raise _bad(path, f"tensor {name!r} has shape {shape!r}, not a list of non-negative integers")
    if (not isinstance(offsets, list) or len(offsets) != 2 or not all(type(o) is int for o in offsets)
            or not 0 <= offsets[0] <= offsets[1]):
        raise _bad(path, f"tensor {name!r} has data_offsets {offsets!r}")
    dtype = DTYPES[dt]
    numel = 1
    for s in shape:
        numel *= s
    nbytes = numel * dtype.itemsize
    if offsets[1] - offsets[0] != nbytes:
        raise _bad(path, f"tensor {name!r} ({dt} {shape}) needs {nbytes} bytes, its offsets give {offsets[1] - offsets[0]}")
    return Entry(name=name, dtype=dtype, shape=tuple(shape), begin=offsets[0], end=offsets[1])
