"""Row gathers (cukernels/embedding.cu): the embedding lookup, the last-position
hidden rows picked before the final norm and lm_head, and the input ids an
earlier step drew on the device."""

from __future__ import annotations

from ...dtypes import DType
from ..compiler import KernelSpec, get_kernel
from ..driver import Stream
from ..tensor import DeviceTensor
from . import i32, require, require_contiguous, require_dtype, round_up

_SOURCE = "embedding.cu"
# The copy is dtype-blind: bytes per thread access -> the C type moved.
_WORDS = {16: "uint4", 4: "unsigned int", 2: "unsigned short"}
_COPY_DRAWN = KernelSpec(_SOURCE, "copy_drawn_tokens_kernel")
SPECS = [KernelSpec(_SOURCE, f"gather_rows_kernel<{word}>") for word in _WORDS.values()] + [_COPY_DRAWN]
_MAX_THREADS = 256


def embedding(out: DeviceTensor, token_ids: DeviceTensor, table: DeviceTensor, stream: Stream) -> None:
    """out[t] = table[token_ids[t]]: token_ids [T] int32, table [V, H] -> out [T, H].

    An id outside [0, V) yields a zero row (the device cannot raise)."""
    gather_rows(out, table, token_ids, stream)


def gather_rows(out: DeviceTensor, x: DeviceTensor, indices: DeviceTensor, stream: Stream) -> None:
    """out[i] = x[indices[i]]: x [R, H], indices [N] int32 -> out [N, H]; all contiguous."""
    require(x.ndim == 2, f"x must be [rows, H], got shape {x.shape}")
    require(indices.ndim == 1, f"indices must be [N], got shape {indices.shape}")
    require_dtype("indices", indices, DType.int32)
    require(out.shape == (indices.shape[0], x.shape[1]), f"out must be {(indices.shape[0], x.shape[1])}, got {out.shape}")
    require(out.dtype is x.dtype, f"out dtype {out.dtype.name} differs from x dtype {x.dtype.name}")
    require(x.dtype.itemsize >= 2, f"x must have 2- to 8-byte elements, got {x.dtype.name}")
    for name, tensor in (("out", out), ("x", x), ("indices", indices)):
        require_contiguous(name, tensor)
    if out.numel == 0:
        return
    row_bytes = x.shape[1] * x.dtype.itemsize
    word_bytes = next(size for size in _WORDS if row_bytes % size == 0 and out.ptr % size == 0 and x.ptr % size == 0)
    row_words = row_bytes // word_bytes
    kernel = get_kernel(KernelSpec(_SOURCE, f"gather_rows_kernel<{_WORDS[word_bytes]}>"))
    threads = min(_MAX_THREADS, round_up(row_words, 32))
    kernel.launch(indices.shape[0], threads, [out, x, indices, i32(row_words), i32(x.shape[0])], stream=stream)


def copy_drawn_tokens(token_ids: DeviceTensor, drawn: DeviceTensor, pairs: DeviceTensor, stream: Stream) -> None:
    """token_ids[pairs[0, i]] = drawn[pairs[1, i]]: token_ids [T], drawn [B'], pairs [2, P], all int32."""
    for name, tensor in (("token_ids", token_ids), ("drawn", drawn), ("pairs", pairs)):
        require_dtype(name, tensor, DType.int32)
        require_contiguous(name, tensor)
    require(pairs.ndim == 2 and pairs.shape[0] == 2, f"pairs must be [2, P], got shape {pairs.shape}")
    num_pairs = pairs.shape[1]
    if num_pairs:
        get_kernel(_COPY_DRAWN).launch(-(-num_pairs // _MAX_THREADS), _MAX_THREADS,
                                       [token_ids, drawn, pairs, i32(num_pairs)], stream=stream)
