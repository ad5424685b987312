"""Read `*.safetensors` checkpoints into numpy without torch.

File layout: an 8-byte little-endian header length, a JSON header
{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}},
then the raw tensor bytes, offsets relative to the end of the header.
Files are memory-mapped, and tensors are yielded one at a time, so only the tensor
being consumed is ever materialised.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from ..backend.dtypes import bf16_bits_to_float32

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"

# safetensors dtype tag -> numpy dtype of the stored bits.
_STORED_DTYPES = {"F32": np.dtype("<f4"), "F16": np.dtype("<f2"), "BF16": np.dtype("<u2")}


def checkpoint_files(model_dir: str | Path) -> list[Path]:
    """The checkpoint's safetensors files: those the index names, else
    `model.safetensors`, else every `*.safetensors` in the directory."""
    model_dir = Path(model_dir)
    index_path = model_dir / INDEX_FILE
    if index_path.is_file():
        weight_map = json.loads(index_path.read_text())["weight_map"]
        return [model_dir / name for name in sorted(set(weight_map.values()))]
    if (model_dir / SINGLE_FILE).is_file():
        return [model_dir / SINGLE_FILE]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{model_dir} has no *.safetensors weights")
    return files


def iter_checkpoint(model_dir: str | Path) -> Iterator[tuple[str, np.ndarray]]:
    """Yield (name, array) for every tensor of a single or sharded checkpoint.

    F32 and F16 come back as read-only views of the mapped file; BF16 is widened to
    float32 (exact) in a fresh array.
    """
    for path in checkpoint_files(model_dir):
        yield from iter_file(path)


def stored_nbytes(model_dir: str | Path) -> dict[str, int]:
    """Tensor name -> bytes its data takes in the checkpoint's files."""
    return {name: info["data_offsets"][1] - info["data_offsets"][0]
            for path in checkpoint_files(model_dir) for name, info in read_header(path)[0].items()}


def checkpoint_numel(model_dir: str | Path) -> int:
    """Elements over all the checkpoint's tensors (what the device holds, times the dtype's size)."""
    return sum((info["data_offsets"][1] - info["data_offsets"][0]) // _STORED_DTYPES[info["dtype"]].itemsize
               for path in checkpoint_files(model_dir) for info in read_header(path)[0].values())


def iter_file(path: str | Path) -> Iterator[tuple[str, np.ndarray]]:
    header, data_start = read_header(path)
    data = np.memmap(path, dtype=np.uint8, mode="r")
    for name, info in header.items():
        begin, end = info["data_offsets"]
        stored = _STORED_DTYPES[info["dtype"]]
        array = data[data_start + begin : data_start + end].view(stored).reshape(info["shape"])
        yield name, bf16_bits_to_float32(array) if info["dtype"] == "BF16" else array


def read_header(path: str | Path) -> tuple[dict[str, dict], int]:
    """(tensor entries without `__metadata__`, byte offset where tensor data starts).

    Raises ValueError for a malformed header or a dtype other than F32/F16/BF16."""
    with open(path, "rb") as f:
        prefix = f.read(8)
        if len(prefix) != 8:
            raise ValueError(f"{path}: too short to be a safetensors file")
        (header_len,) = struct.unpack("<Q", prefix)
        header = json.loads(f.read(header_len))
    header.pop("__metadata__", None)
    for name, info in header.items():
        stored = _STORED_DTYPES.get(info["dtype"])
        if stored is None:
            raise ValueError(
                f"{path}: tensor {name!r} has dtype {info['dtype']}; supported: {', '.join(_STORED_DTYPES)}"
            )
        begin, end = info["data_offsets"]
        if end - begin != int(np.prod(info["shape"], dtype=np.int64)) * stored.itemsize:
            raise ValueError(f"{path}: tensor {name!r} byte range does not match its shape {info['shape']}")
    return header, 8 + header_len
