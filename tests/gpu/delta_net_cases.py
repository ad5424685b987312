"""Steps and operands of the delta-net kernel tests (test_delta_net.py, test_delta_net_decode.py):
a step's sequences as the kernels and the numpy twin (backend/cpu/gdn.py) see them, and inputs as
the device holds them.

A step is a list of sequences (new tokens, cached tokens, state slot) and snapshot rows
(sequence, offset, slot): the state after that sequence's first `offset` new tokens, copied to
`slot` too."""

from __future__ import annotations

import numpy as np

from sparkd.backend.cpu import gdn
from sparkd.backend.dtypes import DType, encode


def step_segments(sequences, snapshots):
    """(query_start [B + 1], seq_lens [B], state slots [B], the numpy twin's StateSegments)."""
    lengths = np.array([n for n, _, _ in sequences])
    query_start = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    seq_lens = np.array([n + c for n, c, _ in sequences], np.int32)
    slots = np.array([s for _, _, s in sequences], np.int32)
    segments = [gdn.StateSegment(int(query_start[b]), int(query_start[b + 1]), c, s,
                                 tuple((int(o), int(t)) for q, o, t in snapshots if q == b))
                for b, (_, c, s) in enumerate(sequences)]
    return query_start, seq_lens, slots, segments


def device_step(gpu, sequences, snapshots):
    """(the step's CudaAttentionMetadata, the numpy twin's segments, T)."""
    from sparkd.backend.cuda.attention_metadata import CudaAttentionMetadata
    from sparkd.backend.cuda.kernels import delta_net

    query_start, seq_lens, slots, segments = step_segments(sequences, snapshots)
    start, offsets, snapshot_slots = delta_net.snapshot_arrays(len(seq_lens), np.asarray(snapshots, np.int32))
    unused = gpu.upload(np.zeros((len(seq_lens), 1), np.int32))  # block tables and slots: not read here
    taken = [gpu.upload(a) for a in (offsets, snapshot_slots)] if len(offsets) else [None, None]
    attn = CudaAttentionMetadata(gpu.upload(query_start), gpu.upload(seq_lens), unused, unused,
                                 int(max(n for n, _, _ in sequences)), int(seq_lens.max()), gpu.upload(slots),
                                 gpu.upload(start), *taken)
    return attn, segments, int(query_start[-1])


def held(gpu, array, dtype):
    """(the device copy in dtype, what it holds as float32)."""
    dev = gpu.upload(array.astype(np.float32), dtype)
    return dev, gpu.download(dev).astype(np.float32)


def pool(values, dtype):
    """The numpy twin's state pool holding float32 `values` in dtype (bf16 as its bits)."""
    return encode(values, DType.parse(dtype))
