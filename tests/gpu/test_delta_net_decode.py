"""The gated delta net's fused decode tail (cukernels/delta_rule_decode.cu, kernels/delta_net_decode.py:
the gates, the token-by-token delta rule and the gated RMSNorm in one launch, a cluster of blocks a
head) against the numpy reference composition (NumpyOps' gates, gdn.gated_delta_rule, the output
rounded to the model dtype, gdn.gated_rmsnorm) and against the three launches it replaces, on fresh
random inputs; through `CudaOps.gated_delta_net` at decode and prefill; and replayed in a CUDA graph.

Steps (STEPS): batch-1 decode from a cached state and from none, a decode batch of three (one
fresh), a verify-like step of several tokens a sequence with snapshots before the first token,
mid-way and at the end, and a one-token step that takes a snapshot. Head shapes (SHAPES):
Qwen3-Next's (8 blocks of 16 columns a head), dk 96 / dv 40 (3 blocks, the last half past dv;
dk not a power of two) and dk 32 / dv 48 (kMaxDk 32: one block a head, a cluster of 1).

Relative error is max |a - b| / max |b| (`tolerance`: 1e-5 fp32, 1e-2 bf16), the looser of the
model's and the state's dtype where a bf16 state is rounded at every store, as in test_delta_net.py.
Against the three launches the state must match bit for bit (the same gates, the same rule); the
outputs differ only by the order in which the norm adds up its squares.
"""

from __future__ import annotations

import numpy as np
import pytest

from sparkd.backend.base import AttentionMetadata, DeltaNetShape
from sparkd.backend.cpu import gdn
from sparkd.backend.cpu.ops import NumpyOps
from sparkd.backend.dtypes import DType, decode, encode

from .delta_net_cases import device_step, held, pool

delta_net = pytest.importorskip("sparkd.backend.cuda.kernels.delta_net")
delta_net_decode = pytest.importorskip("sparkd.backend.cuda.kernels.delta_net_decode")

DTYPES = ["float32", "bfloat16"]
# (sequences (new tokens, cached tokens, state slot), snapshots (sequence, offset, slot)).
STEPS = {
    "decode-1": ([(1, 9, 0)], []),
    "decode-1-fresh": ([(1, 0, 1)], []),
    "decode-3": ([(1, 5, 2), (1, 0, 0), (1, 30, 3)], []),
    "verify": ([(4, 7, 1), (3, 0, 2), (5, 12, 0)], [(0, 0, 4), (0, 2, 5), (0, 4, 6), (2, 1, 7), (2, 5, 8)]),
    "decode-snapshot": ([(1, 3, 0)], [(0, 1, 2)]),
}
NUM_SLOTS = 9
SHAPES = {"qwen3-next": DeltaNetShape(16, 128, 32, 128), "dv-40": DeltaNetShape(2, 96, 4, 40),
          "dk-32": DeltaNetShape(2, 32, 4, 48)}
EPS = 1e-6


def _column_ranges(shape: DeltaNetShape) -> list[tuple[int, int]]:
    """(start, width) of [q | k | v], z, b and a in an in_proj output row."""
    widths = [shape.conv_dim, shape.num_v_heads * shape.v_dim, shape.num_v_heads, shape.num_v_heads]
    return [(int(lo), w) for lo, w in zip(np.cumsum([0, *widths[:-1]]), widths)]


class Case:
    """A step's operands on the device and as the reference reads them: [q | k | v | z | b | a]
    columns of one in_proj-like output (rows spaced, as the model's split_columns gives them), the
    per-head parameters, the norm weight and a state pool with a random state in every slot."""

    def __init__(self, gpu, shape: DeltaNetShape, dtype: str, state_dtype: str, sequences, snapshots, seed: int):
        rng = np.random.default_rng(seed)
        self.shape, self.dtype, self.state_dtype = shape, dtype, state_dtype
        self.attn, self.segments, tokens = device_step(gpu, sequences, snapshots)
        hv, dv = shape.num_v_heads, shape.v_dim
        ranges = _column_ranges(shape)
        a_start = ranges[-1][0]
        values = rng.standard_normal((tokens, a_start + hv + 8))
        values[:, a_start:a_start + hv] *= 3  # a: softplus(a + dt_bias) on both sides of 0
        values[0, a_start] = 25.0  # and past torch's threshold of 20, where it is linear
        self.projected, self.projected_h = held(gpu, values, dtype)
        self.columns = [self.projected.column_slice(lo, width) for lo, width in ranges]
        self.a_log, self.a_log_h = held(gpu, 0.5 * rng.standard_normal(hv), dtype)
        self.dt_bias, self.dt_bias_h = held(gpu, rng.standard_normal(hv), dtype)
        self.norm_weight, self.norm_weight_h = held(gpu, 1 + 0.1 * rng.standard_normal(dv), dtype)
        self.state, self.initial = held(gpu, 0.3 * rng.standard_normal((NUM_SLOTS, hv, shape.k_dim, dv)), state_dtype)

    @property
    def tokens(self) -> int:
        return self.projected_h.shape[0]

    def fused(self, gpu, state, out=None):
        """The fused launch into `out` (made when None) on `state`; returns out."""
        mixed, z, b, a = self.columns
        shape = self.shape
        out = out if out is not None else gpu.empty((self.tokens, shape.num_v_heads * shape.v_dim), self.dtype)
        delta_net_decode.gated_delta_net_decode(out, mixed, a, b, self.a_log, self.dt_bias, z, self.norm_weight, EPS,
                                                state, self.attn, shape, gpu.stream)
        return out

    def unfused(self, gpu, state):
        """The three launches the fused one replaces, the rule in its token-by-token form."""
        mixed, z, b, a = self.columns
        shape, tokens = self.shape, self.tokens
        g, beta = gpu.empty((tokens, shape.num_v_heads), "float32"), gpu.empty((tokens, shape.num_v_heads), "float32")
        delta_net.delta_net_gates(g, beta, a, b, self.a_log, self.dt_bias, gpu.stream)
        core = gpu.empty((tokens, shape.num_v_heads * shape.v_dim), self.dtype)
        delta_net.gated_delta_rule(core, mixed, g, beta, state, self.attn, shape, gpu.stream, form="recurrent")
        out = gpu.empty(core.shape, self.dtype)
        delta_net.gated_rmsnorm(out, core, z, self.norm_weight, EPS, gpu.stream)
        return out

    def reference(self, initial=None, projected_h=None):
        """(output [T, Hv dv], the state pool after) of the numpy composition, from `initial`
        (float32 [slots, Hv, dk, dv]; default the case's) on the rows `projected_h` (default the
        case's)."""
        rows = self.projected_h if projected_h is None else projected_h
        mixed, z, b, a = (rows[:, lo:lo + width] for lo, width in _column_ranges(self.shape))
        g, beta = NumpyOps().delta_net_gates(a, b, self.a_log_h, self.dt_bias_h)
        expected_state = pool(self.initial if initial is None else initial, self.state_dtype)
        core = gdn.gated_delta_rule(mixed, g, beta, expected_state, self.segments, self.shape)
        model = DType.parse(self.dtype)
        core = decode(encode(core, model), model).astype(np.float32)  # the rule's output as the op returns it
        return gdn.gated_rmsnorm(core, z, self.norm_weight_h, EPS), gdn.read_state(expected_state)

    def bound(self, tolerance) -> float:
        return max(tolerance[self.dtype], tolerance[self.state_dtype])


def _case(gpu, shape_name, dtype, state_dtype, step_name) -> Case:
    sequences, snapshots = STEPS[step_name]
    seed = list(SHAPES).index(shape_name) * 10 + list(STEPS).index(step_name)
    return Case(gpu, SHAPES[shape_name], dtype, state_dtype, sequences, snapshots, seed)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("state_dtype", DTYPES)
@pytest.mark.parametrize("shape_name", SHAPES)
@pytest.mark.parametrize("step_name", STEPS)
def test_fused_tail_matches_the_reference_composition(gpu, rel_error, tolerance, dtype, state_dtype, shape_name,
                                                      step_name):
    case = _case(gpu, shape_name, dtype, state_dtype, step_name)
    out = case.fused(gpu, case.state)
    expected, expected_state = case.reference()
    assert rel_error(gpu.download(out), expected) <= case.bound(tolerance)
    assert rel_error(gpu.download(case.state), expected_state) <= case.bound(tolerance)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("state_dtype", DTYPES)
@pytest.mark.parametrize("shape_name", SHAPES)
@pytest.mark.parametrize("step_name", STEPS)
def test_fused_tail_equals_the_three_launches(gpu, rel_error, tolerance, dtype, state_dtype, shape_name, step_name):
    case = _case(gpu, shape_name, dtype, state_dtype, step_name)
    other_state, _ = held(gpu, case.initial, state_dtype)
    fused = gpu.download(case.fused(gpu, case.state))
    unfused = gpu.download(case.unfused(gpu, other_state))
    np.testing.assert_array_equal(gpu.download(case.state), gpu.download(other_state))
    assert rel_error(fused, unfused) <= tolerance[dtype]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("sequences, fused", [([(1, 9, 0), (1, 0, 2)], True), ([(70, 3, 1), (1, 4, 0)], False)],
                         ids=["decode", "prefill"])
def test_the_op_fuses_decode_steps_and_matches_numpy_ops(cuda_ops_factory, rel_error, tolerance, monkeypatch, dtype,
                                                         sequences, fused):
    """CudaOps.gated_delta_net takes the fused launch at a decode step and the three (the chunked
    rule between them) at a prefill step; both give NumpyOps.gated_delta_net's result (the
    reference composition, in float32) from prepare_attention's metadata."""
    from sparkd.backend.cuda import delta_net_ops

    ops, cpu = cuda_ops_factory(dtype), NumpyOps()
    shape = SHAPES["qwen3-next"]
    calls = []
    launch = delta_net_decode.gated_delta_net_decode
    monkeypatch.setattr(delta_net_ops.delta_net_decode, "gated_delta_net_decode",
                        lambda *args: calls.append(args) or launch(*args))
    rng = np.random.default_rng(5)
    lengths = [n for n, _, _ in sequences]
    query_start = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    tokens = int(query_start[-1])
    meta = AttentionMetadata(query_start, np.array([n + c for n, c, _ in sequences], np.int32),
                             np.zeros((len(sequences), 1), np.int32), np.zeros(tokens, np.int32), max(lengths),
                             max(n + c for n, c, _ in sequences), np.array([s for _, _, s in sequences], np.int32))
    hv, dv = shape.num_v_heads, shape.v_dim
    widths = [width for _, width in _column_ranges(shape)]
    projected = ops.upload(rng.standard_normal((tokens, sum(widths))).astype(np.float32), DType.parse(dtype))
    projected_h = ops.download(projected).astype(np.float32)
    params = [rng.standard_normal(hv) * 0.5, rng.standard_normal(hv), 1 + 0.1 * rng.standard_normal(dv)]
    params = [ops.upload(p.astype(np.float32), DType.parse(dtype)) for p in params]
    params_h = [ops.download(p).astype(np.float32) for p in params]
    initial = (0.3 * rng.standard_normal((3, hv, shape.k_dim, dv))).astype(np.float32)
    state, state_h = ops.upload(initial), initial.copy()
    mixed, z, b, a = ops.split_columns(projected, widths)
    mixed_h, z_h, b_h, a_h = cpu.split_columns(projected_h, widths)
    out = ops.gated_delta_net(mixed, a, b, *params[:2], z, params[2], EPS, state, ops.prepare_attention(meta), shape)
    expected = cpu.gated_delta_net(mixed_h, a_h, b_h, *params_h[:2], z_h, params_h[2], EPS, state_h,
                                   cpu.prepare_attention(meta), shape)
    assert len(calls) == int(fused)
    assert rel_error(ops.download(out), expected) <= tolerance[dtype]
    assert rel_error(ops.download(state), state_h) <= tolerance[dtype]


@pytest.mark.gpu
@pytest.mark.parametrize("shape_name", ["qwen3-next", "dv-40"])
def test_fused_tail_replays_in_a_captured_graph(gpu, rel_error, tolerance, shape_name):
    """A decode graph's use: captured once, replayed on new rows copied into its input buffer, the
    state carrying over from replay to replay (each compared with the reference continuing from
    the last one's state)."""
    from sparkd.backend.cuda.graphs import capture
    from sparkd.backend.cuda.transfer import copy_to_device

    case = _case(gpu, shape_name, "bfloat16", "float32", "decode-3")
    out = gpu.empty((case.tokens, case.shape.num_v_heads * case.shape.v_dim), "bfloat16")
    case.fused(gpu, held(gpu, case.initial, "float32")[0], out)  # loads the kernel, as a graph's warm-up run does
    graph, _ = capture(gpu.stream, lambda: case.fused(gpu, case.state, out))
    rng = np.random.default_rng(11)
    state_h = case.initial
    try:
        for _ in range(3):
            rows = encode(rng.standard_normal(case.projected_h.shape).astype(np.float32), DType.bfloat16)
            copy_to_device(case.projected, rows, gpu.stream)
            graph.replay(gpu.stream)
            expected, state_h = case.reference(state_h, decode(rows, DType.bfloat16))
            assert rel_error(gpu.download(out), expected) <= tolerance["bfloat16"]
            assert rel_error(gpu.download(case.state), state_h) <= tolerance["bfloat16"]
    finally:
        graph.destroy()
