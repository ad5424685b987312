"""The gated delta net's kernels (cukernels/delta_net.cu, delta_rule.cu, delta_rule_chunked.cu)
against their numpy twins (backend/cpu/gdn.py, NumpyOps) on fresh random inputs: a step of three
sequences of different lengths, one fresh and two continuing from the state their slots hold,
with snapshots requested before the first token, mid-sequence and at the end.

Relative error is max |a - b| / max |b|: <= 1e-5 in fp32, <= 1e-2 in bf16 (`tolerance`); the
states, held in float32 or bf16 whatever the activations' dtype, to the looser of the two
bounds. The reference reads the inputs as the device holds them. The snapshot arrays' layout
is checked without a GPU.
"""

from __future__ import annotations

import numpy as np
import pytest

from sparkd.backend.base import DeltaNetShape
from sparkd.backend.cpu import gdn
from sparkd.backend.cpu.ops import NumpyOps

from .delta_net_cases import device_step, held, pool

delta_net = pytest.importorskip("sparkd.backend.cuda.kernels.delta_net")

DTYPES = ["float32", "bfloat16"]
# Three sequences: (new tokens, cached tokens, state slot); their snapshots (sequence, offset, slot).
SEQUENCES = [(5, 0, 2), (1, 9, 0), (70, 3, 3)]
SNAPSHOTS = np.array([(0, 5, 4), (2, 0, 5), (2, 33, 6), (2, 70, 7)], np.int32)
NUM_SLOTS = 8
# Tiny (dk != dv), the demo model's heads (dk = dv = 64: kMaxDk 64) and Qwen3-Next's (128).
SHAPES = [DeltaNetShape(2, 16, 4, 24), DeltaNetShape(2, 64, 4, 64), DeltaNetShape(2, 128, 4, 128)]


def _attn(gpu):
    """(the step's CudaAttentionMetadata, the numpy twin's segments, T)."""
    return device_step(gpu, SEQUENCES, SNAPSHOTS)


def test_snapshot_arrays_are_by_sequence_then_offset():
    start, offsets, slots = delta_net.snapshot_arrays(3, SNAPSHOTS[::-1])
    np.testing.assert_array_equal(start, [0, 1, 1, 4])
    np.testing.assert_array_equal(offsets, [5, 0, 33, 70])
    np.testing.assert_array_equal(slots, [4, 5, 6, 7])
    empty_start, empty_offsets, _ = delta_net.snapshot_arrays(2, None)
    np.testing.assert_array_equal(empty_start, [0, 0, 0])
    assert empty_offsets.shape == (0,)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [2, 4])
@pytest.mark.parametrize("state_dtype", DTYPES)
@pytest.mark.parametrize("channels, first", [(96, 16), (90, 3)], ids=["4-wide", "1-wide"])  # the kernel's kVec
def test_causal_conv1d_silu_matches_numpy(gpu, rel_error, tolerance, dtype, width, state_dtype, channels, first):
    rng = np.random.default_rng(width)
    attn, segments, tokens = _attn(gpu)
    wide, wide_h = held(gpu, rng.standard_normal((tokens, channels + 32)), dtype)  # x is a column range of it
    x = wide.column_slice(first, channels)
    weight, weight_h = held(gpu, rng.standard_normal((channels, width)) / width, dtype)
    conv_state, window = held(gpu, rng.standard_normal((NUM_SLOTS, channels, width - 1)), state_dtype)
    out = gpu.empty((tokens, channels), dtype)
    delta_net.causal_conv1d_silu(out, x, weight, conv_state, attn, gpu.stream)
    expected_state = pool(window, state_dtype)
    expected = gdn.causal_conv1d_silu(wide_h[:, first:first + channels], weight_h, expected_state, segments)
    assert rel_error(gpu.download(out), expected) <= tolerance[dtype]
    # Copies of held inputs, rounded alike: exact.
    assert rel_error(gpu.download(conv_state), gdn.read_state(expected_state)) <= 1e-6


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_delta_net_gates_match_numpy(gpu, rel_error, dtype):
    rng = np.random.default_rng(1)
    ab, ab_h = held(gpu, 4 * rng.standard_normal((37, 16)), dtype)
    a, b = ab.column_slice(0, 8), ab.column_slice(8, 8)
    a_log, a_log_h = held(gpu, rng.standard_normal(8), dtype)
    dt_bias, dt_bias_h = held(gpu, rng.standard_normal(8), dtype)
    g, beta = gpu.empty((37, 8), "float32"), gpu.empty((37, 8), "float32")
    delta_net.delta_net_gates(g, beta, a, b, a_log, dt_bias, gpu.stream)
    g_ref, beta_ref = NumpyOps().delta_net_gates(ab_h[:, :8], ab_h[:, 8:], a_log_h, dt_bias_h)
    assert rel_error(gpu.download(g), g_ref) <= 1e-5 and rel_error(gpu.download(beta), beta_ref) <= 1e-5


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=["tiny", "demo", "qwen3-next"])
@pytest.mark.parametrize("form", delta_net.FORMS)
@pytest.mark.parametrize("state_dtype", DTYPES)
def test_gated_delta_rule_matches_numpy(gpu, rel_error, tolerance, dtype, shape, form, state_dtype):
    """Both forms, each on every sequence of the step (the chunked one in 64-token chunks: the
    70-token sequence's snapshot at 33 falls inside its first chunk), with the state held in
    float32 or bf16 (rounded where stored, as the numpy twin rounds it)."""
    rng = np.random.default_rng(shape.k_dim)
    attn, segments, tokens = _attn(gpu)
    mixed, mixed_h = held(gpu, rng.standard_normal((tokens, shape.conv_dim)), dtype)
    g_h = -np.abs(rng.standard_normal((tokens, shape.num_v_heads))).astype(np.float32)
    beta_h = rng.uniform(0, 1, (tokens, shape.num_v_heads)).astype(np.float32)
    state, initial = held(gpu, 0.3 * rng.standard_normal((NUM_SLOTS, shape.num_v_heads, shape.k_dim, shape.v_dim)),
                           state_dtype)
    out = gpu.empty((tokens, shape.num_v_heads * shape.v_dim), dtype)
    workspace = gpu.empty((delta_net.chunk_workspace_floats(tokens, shape),), "float32")
    delta_net.gated_delta_rule(out, mixed, gpu.upload(g_h), gpu.upload(beta_h), state, attn, shape, gpu.stream,
                               form=form, workspace=workspace)
    expected_state = pool(initial, state_dtype)
    expected = gdn.gated_delta_rule(mixed_h, g_h, beta_h, expected_state, segments, shape)
    bound = max(tolerance[dtype], tolerance[state_dtype])  # a bf16 state is rounded at every store
    assert rel_error(gpu.download(out), expected) <= bound
    assert rel_error(gpu.download(state), gdn.read_state(expected_state)) <= bound


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dim, first", [(24, 104), (128, 8), (256, 8), (6, 100), (128, 4)],
                         ids=["16-byte", "16-byte-128", "16-byte-two-passes", "1-wide", "offset-4"])
@pytest.mark.parametrize("rows", [9, 67], ids=["decode-sized", "wide"])
def test_gated_rmsnorm_matches_numpy(gpu, rel_error, tolerance, dtype, dim, first, rows):
    """z's offset `first` decides the access width of 64 rows or more: 16 bytes where every dtype's
    z stays so aligned (first a multiple of 8), else one element; fewer rows take one element.
    67 rows, 201 groups: the last warp of the 16-byte form has a half past the end."""
    rng = np.random.default_rng(2)
    width = 3 * dim
    x, x_h = held(gpu, rng.standard_normal((rows, width)), dtype)
    zz, zz_h = held(gpu, rng.standard_normal((rows, first + width + 8)), dtype)
    z = zz.column_slice(first, width)
    weight, weight_h = held(gpu, 1 + 0.1 * rng.standard_normal(dim), dtype)
    out = gpu.empty((rows, width), dtype)
    delta_net.gated_rmsnorm(out, x, z, weight, 1e-6, gpu.stream)
    expected = gdn.gated_rmsnorm(x_h, zz_h[:, first:first + width], weight_h, 1e-6)
    assert rel_error(gpu.download(out), expected) <= tolerance[dtype]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("gate_cols", [1, 64])
@pytest.mark.parametrize("adds", [False, True])
def test_mul_sigmoid_matches_numpy(gpu, rel_error, tolerance, dtype, gate_cols, adds):
    rng = np.random.default_rng(gate_cols + adds)
    x, x_h = held(gpu, rng.standard_normal((7, 64)), dtype)
    wide, wide_h = held(gpu, rng.standard_normal((7, 128)), dtype)
    add_to, add_to_h = held(gpu, rng.standard_normal((7, 64)), dtype) if adds else (None, None)
    gate = wide.column_slice(64, gate_cols)
    out = gpu.empty((7, 64), dtype)
    delta_net.mul_sigmoid(out, x, gate, gpu.stream, add_to)
    expected = NumpyOps().mul_sigmoid(x_h, wide_h[:, 64:64 + gate_cols], add_to_h)
    assert rel_error(gpu.download(out), expected) <= tolerance[dtype]


# ---- preconditions (no launch, no GPU) ----

def test_launchers_reject_what_the_kernels_cannot_run():
    from device_fakes import fake_tensor

    from sparkd.backend.cuda.attention_metadata import CudaAttentionMetadata

    ids = fake_tensor((3,), "int32", ptr=0x90000)
    attn = CudaAttentionMetadata(fake_tensor((4,), "int32"), ids, fake_tensor((3, 1), "int32"), ids, 70, 80, ids,
                                 fake_tensor((4,), "int32"))
    shape = DeltaNetShape(2, 16, 4, 24)
    mixed = fake_tensor((76, shape.conv_dim))
    g, beta = (fake_tensor((76, 4), "float32", ptr=p) for p in (0x20000, 0x30000))
    state = fake_tensor((8, 4, 16, 24), "float32", ptr=0x40000)
    out = fake_tensor((76, 96), ptr=0x50000)
    with pytest.raises(ValueError, match=r"mixed_qkv must be \[T, 160\]"):
        delta_net.gated_delta_rule(out, fake_tensor((76, 150)), g, beta, state, attn, shape, None)
    with pytest.raises(ValueError, match="form must be one of"):
        delta_net.gated_delta_rule(out, mixed, g, beta, state, attn, shape, None, form="parallel")
    wide = DeltaNetShape(1, 64, 1, 256)  # the recurrent form takes dv 256, the chunked one at most 128
    with pytest.raises(ValueError, match="chunked: dk and dv at most 128"):
        delta_net.gated_delta_rule(fake_tensor((76, 256)), fake_tensor((76, wide.conv_dim)), fake_tensor((76, 1),
                                   "float32"), fake_tensor((76, 1), "float32"),
                                   fake_tensor((8, 1, 64, 256), "float32"), attn, wide, None, form="chunked")
    with pytest.raises(ValueError, match="needs a contiguous float32 workspace of 32528 elements"):
        delta_net.gated_delta_rule(out, mixed, g, beta, state, attn, shape, None, form="chunked")
    with pytest.raises(ValueError, match="dk must be at most 128"):
        delta_net.gated_delta_rule(fake_tensor((76, 32)), fake_tensor((76, 544)), fake_tensor((76, 1), "float32"),
                                   fake_tensor((76, 1), "float32"), fake_tensor((8, 1, 256, 32), "float32"), attn,
                                   DeltaNetShape(1, 256, 1, 32), None)
    with pytest.raises(ValueError, match="conv width must be one of"):
        delta_net.causal_conv1d_silu(fake_tensor((76, 96)), fake_tensor((76, 96)), fake_tensor((96, 5)),
                                     fake_tensor((8, 96, 4), "float32"), attn, None)
    with pytest.raises(ValueError, match=r"gate must be \[T, N\] or \[T, 1\]"):
        delta_net.mul_sigmoid(fake_tensor((7, 64)), fake_tensor((7, 64)), fake_tensor((7, 2)), None)
    no_state = CudaAttentionMetadata(fake_tensor((4,), "int32"), ids, fake_tensor((3, 1), "int32"), ids, 70, 80)
    with pytest.raises(ValueError, match="needs the step's state slots"):
        delta_net.gated_delta_rule(out, mixed, g, beta, state, no_state, shape, None)
