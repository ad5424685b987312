"""Launchers of the gated delta net's kernels (cukernels/delta_net.cu, delta_rule.cu and
delta_rule_chunked.cu): the causal conv + SiLU, the decay / write gates, the delta rule over
each sequence with its state slot, the gated RMSNorm, and x * sigmoid(gate). Each is the CUDA
form of the `Ops` method of the same name (`backend/cpu/gdn.py` and `NumpyOps` are the twins).

A step's sequences reach the conv and the delta rule through its CudaAttentionMetadata: the
varlen offsets, context lengths, state slots and snapshot requests (`snapshot_arrays`). The
gates, the token-by-token rule and the gated norm in one launch (`Ops.gated_delta_net` at decode)
are delta_net_decode.py's.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ...base import DeltaNetShape
from ...dtypes import DType
from ..attention_metadata import CudaAttentionMetadata
from ..compiler import KernelSpec, get_kernel
from ..driver import Stream
from ..tensor import DeviceTensor
from . import ELEMENT_TYPES, i32, require, require_contiguous, require_dtype, row_stride, vector_width, vector_widths

_SOURCE = "delta_net.cu"
_RULE_SOURCE = "delta_rule.cu"  # the token-by-token form
_CHUNKED_SOURCE = "delta_rule_chunked.cu"
CONV_WIDTHS = (2, 3, 4)  # kWidth instantiations (Qwen3-Next: 4)
_CONV_TILE = 64  # kConvTile: tokens a conv thread walks
_WIDE_NORM_MIN_ROWS = 64  # fewer rows (decode-sized steps) keep the gated norm's warp a group
MAX_DK = (32, 64, 128)  # kMaxDk instantiations: kMaxDk / kDeltaRows threads hold a column of dk state values
_THREADS = 256
# The conv's blocks are smaller: its ~94 registers a thread (8 tokens' loads in flight) fit 5 blocks
# of 128 an SM (20 warps) where 256-thread blocks fit 2 (16 warps).
_CONV_THREADS = 128
_VEC = 4  # kVec of the conv where the shapes allow (`vector_width`); the gated norm's is 16 bytes' worth
_DELTA_THREADS, _DELTA_ROWS = 128, 16  # kDeltaThreads, kDeltaRows


def kernel_name(kernel: str, *params) -> str:
    """kernel<params>: dtypes as their C types."""
    return f"{kernel}<{', '.join(p.c_type if isinstance(p, DType) else str(p) for p in params)}>"


# The linear-attention state (conv windows and recurrent state) is held in one of these (STATE_TYPES,
# the kernels' S) and computed in float32 whatever it is.
STATE_TYPES = ELEMENT_TYPES
SPECS = ([KernelSpec(_SOURCE, kernel_name("causal_conv1d_silu_kernel", t, s, w, v)) for t in ELEMENT_TYPES
          for s in STATE_TYPES for w in CONV_WIDTHS for v in (1, _VEC)]
         + [KernelSpec(_SOURCE, kernel_name("gated_rmsnorm_kernel", t, v)) for t in ELEMENT_TYPES for v in vector_widths(t)]
         + [KernelSpec(_SOURCE, kernel_name(k, t)) for t in ELEMENT_TYPES for k in ("delta_net_gates_kernel", "mul_sigmoid_kernel")]
         + [KernelSpec(_RULE_SOURCE, kernel_name("gated_delta_rule_kernel", t, s, d)) for t in ELEMENT_TYPES
            for s in STATE_TYPES for d in MAX_DK]
         + [KernelSpec(_CHUNKED_SOURCE, kernel_name("delta_chunk_prepare_kernel", t)) for t in ELEMENT_TYPES]
         + [KernelSpec(_CHUNKED_SOURCE, kernel_name("delta_chunk_state_kernel", t, s)) for t in ELEMENT_TYPES
            for s in STATE_TYPES])
# The chunked form: kChunk tokens a chunk, dk and dv up to kChunkD and multiples of 4; the state
# kernel's blocks take kStateCols columns of a head's state each. Shared memory as the kernels
# lay it out.
_CHUNK, _CHUNK_MAX_D, _STATE_COLS = 64, 128, 32
_PREPARE_THREADS, _STATE_THREADS = 2 * _CHUNK_MAX_D, 512
_PREPARE_SMEM_BYTES = 4 * (2 * _CHUNK * (_CHUNK_MAX_D + 4) + _CHUNK * _CHUNK_MAX_D + 3 * _CHUNK)
# The state kernel's rows are padded (kLdS, kLdW, kLdK, kLdP) for conflict-free fragment loads.
_LD_S, _LD_W, _LD_K, _LD_P = _STATE_COLS + 8, _CHUNK_MAX_D + 4, _CHUNK_MAX_D + 8, _CHUNK + 4
_STATE_SMEM_BYTES = 4 * (_CHUNK_MAX_D * _LD_S + _CHUNK * (2 * _LD_W + _LD_K + _LD_P + _LD_S) + 3 * _CHUNK)
FORMS = ("recurrent", "chunked")


def chunked_fits(shape: DeltaNetShape) -> bool:
    """Whether the chunked form takes these head sizes."""
    return all(d <= _CHUNK_MAX_D and d % 4 == 0 for d in (shape.k_dim, shape.v_dim))


def pick_form(attn: CudaAttentionMetadata, shape: DeltaNetShape) -> str:
    """The chunked form for a step with a query longer than one token (prefill) where the head
    sizes allow, else the token-by-token one (decode)."""
    return "chunked" if attn.max_query_len > 1 and chunked_fits(shape) else "recurrent"


def chunk_workspace_floats(tokens: int, shape: DeltaNetShape) -> int:
    """float32 elements of the chunked form's workspace for a step of `tokens` rows: W, U, the
    intra-chunk products, G and the two scales (delta_rule_chunked.cu's ChunkWorkspace)."""
    return tokens * shape.num_v_heads * (shape.k_dim + shape.v_dim + _CHUNK + 3)


@dataclass(frozen=True)
class RecurrentBlocks:
    """The token-by-token kernels' blocks (delta_rule_recurrent.cuh): the kMaxDk instantiation,
    threads a block, and blocks a value head (grid z), each holding threads / kSplit columns of
    its state."""

    max_dk: int
    threads: int
    per_head: int


def recurrent_blocks(shape: DeltaNetShape) -> RecurrentBlocks:
    """The blocks of the token-by-token form for these head sizes (dk at most MAX_DK[-1])."""
    dk, dv = shape.k_dim, shape.v_dim
    max_dk = next((m for m in MAX_DK if m >= dk), None)
    require(max_dk is not None, f"dk must be at most {MAX_DK[-1]}, got {dk}")
    split = max_dk // min(max_dk, _DELTA_ROWS)  # kSplit: threads sharing a state column
    threads = min(_DELTA_THREADS, -(-dv * split // 32) * 32)
    return RecurrentBlocks(max_dk, threads, -(-dv // (threads // split)))


def snapshot_arrays(num_seqs: int, snapshots: np.ndarray | None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """AttentionMetadata.state_snapshots rows (sequence, offset, slot), or None, as the kernels read
    them: (snapshot_start [B + 1], offsets [S], slots [S]) int32, by sequence then offset."""
    rows = np.zeros((0, 3), np.int64) if snapshots is None else np.asarray(snapshots, np.int64).reshape(-1, 3)
    rows = rows[np.lexsort((rows[:, 1], rows[:, 0]))]
    start = np.searchsorted(rows[:, 0], np.arange(num_seqs + 1))
    return start.astype(np.int32), rows[:, 1].astype(np.int32), rows[:, 2].astype(np.int32)


def segment_args(attn: CudaAttentionMetadata) -> list:
    """The six Segments arrays (delta_net_common.cuh) of the conv and delta-rule kernels, from a
    hybrid step's metadata."""
    require(attn.state_slots is not None and attn.snapshot_start is not None,
            "a delta-net layer needs the step's state slots (AttentionMetadata.state_slots)")
    empty = np.uint64(0)  # no snapshots: the kernels never read past snapshot_start
    return [attn.query_start_loc, attn.seq_lens, attn.state_slots, attn.snapshot_start,
            attn.snapshot_offsets if attn.snapshot_offsets is not None else empty,
            attn.snapshot_slots if attn.snapshot_slots is not None else empty]


def require_gate_inputs(a: DeviceTensor, b: DeviceTensor, a_log: DeviceTensor, dt_bias: DeviceTensor) -> None:
    """The gates' inputs: a, b [T, Hv] of one dtype and row stride, a_log and dt_bias [Hv] in it."""
    require(a.shape == b.shape and a.ndim == 2 and row_stride(a) == row_stride(b) and a.dtype is b.dtype,
            f"a and b must be [T, Hv] of one dtype and row stride, got {a} and {b}")
    heads = a.shape[1]
    for name, tensor in (("a_log", a_log), ("dt_bias", dt_bias)):
        require(tensor.shape == (heads,) and tensor.dtype is a.dtype, f"{name} must be [{heads}] {a.dtype.name}")


def require_rule_operands(out: DeviceTensor, mixed_qkv: DeviceTensor, state: DeviceTensor,
                          shape: DeltaNetShape) -> None:
    """The delta rule's operands but its gates: mixed_qkv [T, 2 Hk dk + Hv dv] with contiguous
    columns, out a contiguous [T, Hv dv] in its dtype, state a contiguous [slots, Hv, dk, dv] in
    one of STATE_TYPES, Hv a multiple of Hk."""
    hk, dk, hv, dv = shape.num_k_heads, shape.k_dim, shape.num_v_heads, shape.v_dim
    require(mixed_qkv.ndim == 2 and mixed_qkv.shape[1] == shape.conv_dim and mixed_qkv.strides[1] == 1,
            f"mixed_qkv must be [T, {shape.conv_dim}] with contiguous columns, got {mixed_qkv}")
    require(hv % hk == 0, f"value heads ({hv}) must be a multiple of key heads ({hk})")
    tokens = mixed_qkv.shape[0]
    require(out.shape == (tokens, hv * dv) and out.dtype is mixed_qkv.dtype and out.is_contiguous,
            f"out must be a contiguous [{tokens}, {hv * dv}] {mixed_qkv.dtype.name}")
    require(state.ndim == 4 and state.shape[1:] == (hv, dk, dv) and state.is_contiguous,
            f"state must be a contiguous [slots, {hv}, {dk}, {dv}], got {state}")
    require_dtype("state", state, *STATE_TYPES)


def causal_conv1d_silu(out: DeviceTensor, x: DeviceTensor, weight: DeviceTensor, conv_state: DeviceTensor,
                       attn: CudaAttentionMetadata, stream: Stream) -> None:
    """out [T, C] (contiguous, x's dtype) = silu(causal conv of x [T, C] (rows may be spaced) by
    weight [C, W]) along each of attn's sequences; conv_state [slots, C, W - 1] in one of
    STATE_TYPES, updated."""
    require(x.ndim == 2 and weight.ndim == 2 and weight.shape[0] == x.shape[1],
            f"x must be [T, C] and weight [C, W], got {x.shape} and {weight.shape}")
    tokens, channels = x.shape
    width = weight.shape[1]
    require(width in CONV_WIDTHS, f"the conv width must be one of {CONV_WIDTHS}, got {width}")
    require(x.strides[1] == 1 and weight.dtype is x.dtype and weight.is_contiguous, "x's columns and weight contiguous, one dtype")
    require_dtype("x", x, *ELEMENT_TYPES)
    require(out.shape == x.shape and out.dtype is x.dtype, f"out must be {x.shape} {x.dtype.name}, got {out}")
    require_contiguous("out", out)
    require(conv_state.ndim == 3 and conv_state.shape[1:] == (channels, width - 1),
            f"conv_state must be [slots, {channels}, {width - 1}], got {conv_state.shape}")
    require_dtype("conv_state", conv_state, *STATE_TYPES)
    require_contiguous("conv_state", conv_state)
    segments = segment_args(attn)
    if tokens == 0:
        return
    # A step of short queries (decode) has one tile a sequence: a thread per channel keeps 4x the
    # blocks (Qwen3-Next at batch 1: 64, not 16), which its few bytes need more than wide loads.
    vec = (vector_width(x.dtype, (x, out), (channels, row_stride(x)), elements=_VEC)
           if attn.max_query_len >= _CONV_TILE else 1)
    grid = (-(-channels // (vec * _CONV_THREADS)), -(-attn.max_query_len // _CONV_TILE), attn.num_seqs)
    get_kernel(KernelSpec(_SOURCE, kernel_name("causal_conv1d_silu_kernel", x.dtype, conv_state.dtype, width, vec))).launch(
        grid, _CONV_THREADS, [out, x, np.int64(row_stride(x)), weight, conv_state, *segments, i32(channels)],
        stream=stream)


def delta_net_gates(g: DeviceTensor, beta: DeviceTensor, a: DeviceTensor, b: DeviceTensor, a_log: DeviceTensor,
                    dt_bias: DeviceTensor, stream: Stream) -> None:
    """g = -exp(a_log) * softplus(a + dt_bias), beta = sigmoid(b): a, b [T, Hv] at one row stride
    (columns of one GEMM output), a_log, dt_bias [Hv] -> g, beta [T, Hv] float32, contiguous."""
    require_gate_inputs(a, b, a_log, dt_bias)
    tokens, heads = a.shape
    for name, tensor in (("g", g), ("beta", beta)):
        require(tensor.shape == a.shape and tensor.dtype is DType.float32 and tensor.is_contiguous,
                f"{name} must be a contiguous {a.shape} float32")
    if tokens == 0:
        return
    get_kernel(KernelSpec(_SOURCE, kernel_name("delta_net_gates_kernel", a.dtype))).launch(
        -(-tokens * heads // _THREADS), _THREADS,
        [g, beta, a, b, np.int64(row_stride(a)), a_log, dt_bias, i32(tokens), i32(heads)], stream=stream)


def gated_delta_rule(out: DeviceTensor, mixed_qkv: DeviceTensor, g: DeviceTensor, beta: DeviceTensor,
                     state: DeviceTensor, attn: CudaAttentionMetadata, shape: DeltaNetShape, stream: Stream,
                     form: str = "recurrent", workspace: DeviceTensor | None = None) -> None:
    """out [T, Hv dv] (contiguous, mixed_qkv's dtype) = the delta rule over each of attn's
    sequences: mixed_qkv [T, 2 Hk dk + Hv dv] (rows may be spaced), g, beta [T, Hv] float32,
    state [slots, Hv, dk, dv] in one of STATE_TYPES (updated). form: "recurrent" (token by token) or
    "chunked" (the WY form; `chunked_fits` the head sizes; workspace: chunk_workspace_floats(T,
    shape) float32 elements, contiguous). `pick_form` says which suits a step."""
    hk, dk, hv, dv = shape.num_k_heads, shape.k_dim, shape.num_v_heads, shape.v_dim
    tokens = mixed_qkv.shape[0]
    require_rule_operands(out, mixed_qkv, state, shape)
    for name, tensor in (("g", g), ("beta", beta)):
        require(tensor.shape == (tokens, hv) and tensor.dtype is DType.float32 and tensor.is_contiguous,
                f"{name} must be a contiguous [{tokens}, {hv}] float32")
    require(form in FORMS and (form == "recurrent" or chunked_fits(shape)),
            f"form must be one of {FORMS} (chunked: dk and dv at most {_CHUNK_MAX_D}, multiples of 4), got {form!r}")
    segments = segment_args(attn)
    if form == "chunked":
        require(row_stride(mixed_qkv) % 4 == 0 and mixed_qkv.ptr % 16 == 0,
                "the chunked form reads mixed_qkv 4 elements at a time: its row stride a multiple of 4, 16-byte aligned")
        floats = chunk_workspace_floats(tokens, shape)
        require(workspace is not None and workspace.dtype is DType.float32 and workspace.is_contiguous
                and workspace.numel >= floats, f"the chunked form needs a contiguous float32 workspace of {floats} elements")
    if tokens == 0:
        return
    common = [mixed_qkv, np.int64(row_stride(mixed_qkv))]
    if form == "chunked":
        get_kernel(KernelSpec(_CHUNKED_SOURCE, kernel_name("delta_chunk_prepare_kernel", mixed_qkv.dtype))).launch(
            (-(-attn.max_query_len // _CHUNK), hv, attn.num_seqs), _PREPARE_THREADS,
            [workspace, *common, g, beta, attn.query_start_loc, i32(tokens), i32(hk), i32(hv), i32(dk), i32(dv)],
            shared_mem=_PREPARE_SMEM_BYTES, stream=stream)
        get_kernel(KernelSpec(_CHUNKED_SOURCE, kernel_name("delta_chunk_state_kernel", mixed_qkv.dtype, state.dtype))).launch(
            (hv, attn.num_seqs, -(-dv // _STATE_COLS)), _STATE_THREADS,
            [out, *common, workspace, state, *segments, i32(tokens), i32(hk), i32(hv), i32(dk), i32(dv)],
            shared_mem=_STATE_SMEM_BYTES, stream=stream)
        return
    blocks = recurrent_blocks(shape)
    get_kernel(KernelSpec(_RULE_SOURCE, kernel_name("gated_delta_rule_kernel", mixed_qkv.dtype, state.dtype,
                                                    blocks.max_dk))).launch(
        (hv, attn.num_seqs, blocks.per_head), blocks.threads,
        [out, *common, g, beta, state, *segments, i32(hk), i32(hv), i32(dk), i32(dv)], stream=stream)


def gated_rmsnorm(out: DeviceTensor, x: DeviceTensor, z: DeviceTensor, weight: DeviceTensor, eps: float,
                  stream: Stream) -> None:
    """out = rmsnorm(x) * weight * silu(z) over groups of D = len(weight) columns: x [T, N]
    contiguous, z [T, N] (rows may be spaced), out [T, N] contiguous, one dtype."""
    require(x.ndim == 2 and z.shape == x.shape and z.strides[1] == 1, f"x and z must be [T, N], got {x} and {z}")
    tokens, width = x.shape
    dim = weight.shape[0]
    require(weight.ndim == 1 and width % dim == 0, f"weight must be [D] with D dividing {width}, got {weight.shape}")
    for name, tensor in (("z", z), ("weight", weight), ("out", out)):
        require(tensor.dtype is x.dtype, f"{name} must be {x.dtype.name}, got {tensor.dtype.name}")
    require_contiguous("x", x)
    require_contiguous("out", out)
    require(out.shape == x.shape, f"out must be {x.shape}, got {out.shape}")
    if tokens == 0:
        return
    # Decode-sized steps keep a warp a group: twice the blocks (Qwen3-Next at batch 1: 4, not 2;
    # measured 1.7 against 2.1 us), which their few bytes need more than wide loads.
    vec = vector_width(x.dtype, (x, z, out, weight), (dim, row_stride(z))) if tokens >= _WIDE_NORM_MIN_ROWS else 1
    groups_per_block = _THREADS // (32 if vec == 1 else 16)  # kLanes lanes a group
    get_kernel(KernelSpec(_SOURCE, kernel_name("gated_rmsnorm_kernel", x.dtype, vec))).launch(
        -(-tokens * (width // dim) // groups_per_block), _THREADS,
        [out, x, z, np.int64(row_stride(z)), weight, i32(tokens), i32(width), i32(dim), np.float32(eps)],
        stream=stream)


def mul_sigmoid(out: DeviceTensor, x: DeviceTensor, gate: DeviceTensor, stream: Stream,
                add_to: DeviceTensor | None = None) -> None:
    """out [T, N] (contiguous) = x * sigmoid(gate) (+ add_to [T, N], contiguous; out may be it): x
    [T, N], gate [T, N] or [T, 1], rows of either may be spaced; one dtype."""
    require(x.ndim == 2 and gate.ndim == 2 and gate.shape[0] == x.shape[0] and gate.shape[1] in (1, x.shape[1]),
            f"gate must be [T, N] or [T, 1] beside x [T, N], got {gate.shape} and {x.shape}")
    require(x.strides[1] == 1 and (gate.shape[1] == 1 or gate.strides[1] == 1), "x's and gate's columns contiguous")
    require(gate.dtype is x.dtype and out.dtype is x.dtype and out.shape == x.shape,
            f"out and gate must be in x's dtype {x.dtype.name}, out {x.shape}")
    require_contiguous("out", out)
    if add_to is not None:
        require(add_to.shape == x.shape and add_to.dtype is x.dtype, f"add_to must be [T, N] in x's dtype, got {add_to}")
        require_contiguous("add_to", add_to)
    tokens, width = x.shape
    if tokens == 0 or width == 0:
        return
    ld_gate = gate.row_stride if tokens > 1 else gate.shape[1]
    get_kernel(KernelSpec(_SOURCE, kernel_name("mul_sigmoid_kernel", x.dtype))).launch(
        -(-tokens * width // _THREADS), _THREADS,
        [out, x, np.int64(row_stride(x)), gate, np.int64(ld_gate), add_to if add_to is not None else np.uint64(0),
         i32(gate.shape[1]), i32(tokens), i32(width)],
        stream=stream)
