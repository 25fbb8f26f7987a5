"""dflash.model.safetensors_layout reads a safetensors header as safetensors does and refuses what it refuses;
dflash.model.weights' direct GPU read gives the same tensors as the mapped read (GPU tests)."""

from __future__ import annotations

import json
import struct
import threading
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from dflash.model import weights
from dflash.model.safetensors_layout import MAX_HEADER, Unsupported, read_layout
from tests.helpers import requires_cuda


def mixed_tensors() -> dict[str, torch.Tensor]:
    """Odd sizes and dtypes: an odd-length uint8 before a bf16 leaves the bf16 misaligned in the buffer
    (safetensors packs tensors by dtype alignment in its writer, so whether it happens depends on order)."""
    g = torch.Generator().manual_seed(0)
    return {
        "a.weight": torch.randn(33, 17, generator=g).to(torch.bfloat16),
        "b.bias": torch.randn(5, generator=g),
        "c.ids": torch.randint(0, 1000, (7, 3), generator=g),
        "d.flag": torch.tensor([True, False, True]),
        "e.bytes": torch.randint(0, 255, (13,), generator=g).to(torch.uint8),
        "f.half": torch.randn(2, 2, generator=g).half(),
        "g.scalar": torch.tensor(3.5),
        "h.empty": torch.zeros(0, 4),
    }


def write_raw(path: Path, header: dict | bytes, data: bytes = b"", length: int | None = None) -> Path:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw) if length is None else length) + raw + data)
    return path


def test_layout_matches_safetensors_own_reader(tmp_path):
    f = tmp_path / "m.safetensors"
    tensors = mixed_tensors()
    save_file(tensors, str(f), metadata={"format": "pt"})
    lay = read_layout(f)
    raw = f.read_bytes()[lay.data_start:]
    assert len(raw) == lay.size
    with safe_open(str(f), framework="pt") as fh:
        assert sorted(e.name for e in lay.entries) == sorted(fh.keys())
        for e in lay.entries:
            want = fh.get_tensor(e.name)
            assert (e.dtype, e.shape) == (want.dtype, tuple(want.shape))
            got = torch.tensor(list(raw[e.begin:e.end]), dtype=torch.uint8)  # frombuffer refuses 0 bytes
            assert torch.equal(got.view(e.dtype).view(e.shape), want)


@pytest.mark.parametrize("header, data, what", [
    (b"[1, 2]", b"", "not a JSON object"),
    (b"{not json", b"", "not JSON"),
    (b"\xff\xfe{}", b"", "not JSON"),
    ({"t": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 4, "cover 8 bytes of a 4-byte"),
    ({"t": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 12, "cover 8 bytes of a 12-byte"),
    ({"t": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}, b"\0" * 4, "needs 8 bytes"),
    ({"t": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}}, b"\0" * 4, "non-negative integers"),
    ({"t": {"dtype": "F32", "shape": [1.0], "data_offsets": [0, 4]}}, b"\0" * 4, "non-negative integers"),
    ({"t": {"dtype": "F32", "shape": [True], "data_offsets": [0, 4]}}, b"\0" * 4, "non-negative integers"),
    ({"t": {"dtype": "F32", "shape": [1], "data_offsets": [4, 0]}}, b"\0" * 4, "data_offsets"),
    ({"t": {"dtype": "F32", "shape": [1], "data_offsets": [0]}}, b"\0" * 4, "data_offsets"),
    ({"t": {"shape": [1], "data_offsets": [0, 4]}}, b"\0" * 4, "no dtype"),
    ({"t": [1, 2]}, b"", "not an object"),
    ({"t": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}, b"\0" * 8, "starts at byte 4"),  # a hole
    ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},  # an overlap
      "b": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}, b"\0" * 8, "starts at byte 4"),
])
def test_damaged_headers_are_refused_with_what_is_wrong(tmp_path, header, data, what):
    f = write_raw(tmp_path / "bad.safetensors", header, data)
    with pytest.raises(ValueError, match="bad.safetensors is not a valid safetensors file") as e:
        read_layout(f)
    assert what in str(e.value)


def test_lengths_that_lie_are_refused_without_reading_them(tmp_path):
    short = tmp_path / "short.safetensors"
    short.write_bytes(b"\x01\x02")
    with pytest.raises(ValueError, match="shorter than the 8-byte header length"):
        read_layout(short)
    huge = write_raw(tmp_path / "huge.safetensors", b"{}", length=MAX_HEADER + 1)
    with pytest.raises(ValueError, match="safetensors allows at most"):
        read_layout(huge)
    past = write_raw(tmp_path / "past.safetensors", b"{}", length=1000)  # within the bound, past the file's end
    with pytest.raises(ValueError, match="a header of 1000 bytes in a file of 10"):
        read_layout(past)


def test_an_unknown_dtype_is_unsupported_not_damaged(tmp_path):
    f = write_raw(tmp_path / "f4.safetensors", {"t": {"dtype": "F4", "shape": [2], "data_offsets": [0, 1]}}, b"\0")
    with pytest.raises(Unsupported, match="dtype F4"):
        read_layout(f)


def test_metadata_only_and_empty_files(tmp_path):
    f = write_raw(tmp_path / "meta.safetensors", {"__metadata__": {"format": "pt"}})
    lay = read_layout(f)
    assert lay.entries == () and lay.size == 0


def test_a_damaged_target_file_is_bad_input_naming_the_target(tmp_path):
    """The loader's own message path (dflash.model.target.read_target_weights) for the direct read's errors."""
    from compilewatch.errors import BadInput
    from dflash.model.target import read_target_weights

    f = write_raw(tmp_path / "model.safetensors", {"t": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, b"\0")
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(BadInput, match="could not load the target from"):
        read_target_weights(tmp_path, [f], dev)


# ---------------------------------------------------------------- the direct read (GPU)
def _shards(tmp_path: Path) -> list[Path]:
    g = torch.Generator().manual_seed(1)
    one = mixed_tensors()
    two = {"big.weight": torch.randn(700, 1000, generator=g).to(torch.bfloat16),  # 1.4 MB: several 64 KiB chunks
           "odd.u8": torch.randint(0, 255, (3,), generator=g).to(torch.uint8),
           "after.f32": torch.randn(11, generator=g)}
    files = [tmp_path / "model-00001-of-00002.safetensors", tmp_path / "model-00002-of-00002.safetensors"]
    save_file(one, str(files[0]))
    save_file(two, str(files[1]))
    return files


@requires_cuda()
def test_direct_read_gives_the_mapped_reads_tensors(tmp_path, monkeypatch):
    files = _shards(tmp_path)
    monkeypatch.setattr(weights, "CHUNK", 64 << 10)  # many chunks, several per reader
    dev = torch.device("cuda")
    want = weights._read_mapped(files, dev, None)
    for readers in (1, 3, 8):
        monkeypatch.setattr(weights, "READERS", readers)
        got = weights.read_weights(files, dev)
        assert set(got) == set(want)
        for k in want:
            assert got[k].device.type == "cuda" and got[k].dtype == want[k].dtype, k
            assert torch.equal(got[k], want[k]), k


@requires_cuda()
def test_direct_read_stops_and_refuses_truncated_data(tmp_path, monkeypatch):
    files = _shards(tmp_path)
    monkeypatch.setattr(weights, "CHUNK", 64 << 10)
    stop = threading.Event()
    stop.set()
    with pytest.raises(weights.Stopped):
        weights.read_weights(files, torch.device("cuda"), stop)
    raw = files[1].read_bytes()
    files[1].write_bytes(raw[:-5])  # the header still promises the cut bytes
    with pytest.raises(ValueError, match="cover"):
        weights.read_weights(files, torch.device("cuda"))


@requires_cuda()
def test_a_duplicate_name_across_shards_is_refused_before_reading(tmp_path):
    a, b = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    save_file({"w": torch.ones(2)}, str(a))
    save_file({"w": torch.zeros(2)}, str(b))
    with pytest.raises(ValueError, match="stored twice"):
        weights.read_weights([a, b], torch.device("cuda"))
