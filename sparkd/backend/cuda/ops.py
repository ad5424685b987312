"""`CudaOps`: the `Ops` interface on an NVIDIA GPU, through NVRTC kernels and cuBLASLt.

Every op enqueues on the main stream and returns at once, or on the side stream while `beside`
enqueues side work (`side_stream.py`); only `download`, `sample` and the result of `sample_async`
wait for the device. Outputs come from the caching allocator, so a step's intermediates recycle
the previous step's blocks.

One deviation from the functional rule of `Ops`: `add_rmsnorm` updates `residual`
in place and returns it as residual'. The models never read a residual after
passing it on, and the in-place kernel saves a pass over [T, H] per norm.
"""

from __future__ import annotations

import logging
from typing import Callable, Sequence

import numpy as np
from cuda.bindings import driver

from ..base import (AttentionMetadata, DrawnTokens, RopeConfig, SampledTokens, SamplerOutput, SamplingTensors,
                    pre_norm)
from ..dtypes import DType, decode, encode
from .attention_metadata import CudaAttentionMetadata
from .compiler import KernelSpec, all_kernel_specs, get_kernel, specs_by_source
from .decode_graphs import DecodeGraphRunner
from .delta_net_ops import DeltaNetOps
from .moe_ops import ExpertSum, MoeOps
from .driver import Event, Stream, call, ensure_context, init_device, memory_info
from .gemm import Gemm
from .kernels import (activation, attention, attention_prefill_wgmma, delta_net, elementwise, embedding, fault, gemv,
                      gemv_norm, norm, rope_kv, sampling)
from .memory import DeviceAllocator, KVCachePlan, check_weights_fit, plan_kv_cache
from .side_stream import Lane, Lanes
from .tensor import DeviceTensor, as_dtype
from .transfer import DownloadRing, StagingRing, copy_device, copy_to_host
from .weights import ChunkedUploader

log = logging.getLogger("sparkd.cuda")

_MODEL_DTYPES = (DType.float32, DType.bfloat16, DType.float16)
_SMALL_UPLOAD = 1 << 20  # per-step inputs: one pinned staging copy; larger (weights): chunked
_MIN_ROPE_POSITIONS = 4096
class CudaOps(MoeOps, DeltaNetOps):
    name = "cuda"

    def __init__(self, dtype="bfloat16", device_index: int = 0):
        self.dtype = as_dtype(dtype)
        if self.dtype not in _MODEL_DTYPES:
            raise ValueError(f"dtype must be float32, bfloat16 or float16 on CUDA, got {self.dtype.name}")
        self.device = init_device(device_index)
        stream, side_stream = Stream(), Stream()
        self.allocator = DeviceAllocator()
        self.staging = StagingRing(self.allocator, stream)
        self.downloads = DownloadRing()
        self.uploader = ChunkedUploader(stream)
        gemm = Gemm(self.allocator, stream)
        # `beside`'s side work gets a stream and a cuBLASLt workspace of its own: GEMMs may run on both at once.
        self.lanes = Lanes(self.allocator, Lane(stream, gemm),
                           Lane(side_stream, Gemm(self.allocator, side_stream, gemm.table)))
        self._rope_tables: dict[tuple, DeviceTensor] = {}
        self._inject_fault = fault.fault_requested()
        # True runs a one-row step's pre-norms inside the GEMV after each (_pre_norm_product). Off
        # until it is measured on a GPU: it was written in a session that had none, and
        # `tools/bench_decode.py --fused-norms` against the default is the A/B that decides.
        self.fuse_norms = False
        log.info("CUDA backend on %s (%s, %d SMs, %.1f GiB), dtype %s", self.device.name, self.device.arch,
                 self.device.sm_count, self.device.total_memory / 2**30, self.dtype.name)

    @property
    def stream(self) -> Stream:
        """Where ops enqueue: the main stream, or the side stream while `beside` enqueues side work."""
        return self.lanes.current.stream

    @property
    def gemm(self) -> Gemm:
        """The current lane's GEMM runner (each stream has its own cuBLASLt workspace)."""
        return self.lanes.current.gemm

    def beside(self, work):
        """work() on the side stream, beside the with-block's ops on the main one (side_stream.py)."""
        return self.lanes.beside(work)

    def load_kernels(self, progress: Callable[[str], None] | None = None) -> None:
        """Load every kernel module (one per cukernels/ source), compiling what the disk
        cache lacks: minutes on a cold cache, which must not happen inside a request."""
        for source, names in specs_by_source(all_kernel_specs()).items():
            if progress is not None:
                progress(f"loading kernels: {source}")
            get_kernel(KernelSpec(source, names[0]))

    # ---- memory ----
    def upload(self, array: np.ndarray, dtype=None) -> DeviceTensor:
        """Host array -> device tensor, in `dtype` if given (else the array's own dtype)."""
        self.lanes.require_main("an upload")
        array = np.asarray(array)
        target = as_dtype(dtype if dtype is not None else array.dtype)
        if array.nbytes <= _SMALL_UPLOAD:
            (tensor,) = self.staging.upload([encode(array, target)], dtypes=[target])
            return tensor
        out = self.allocator.empty(array.shape, target)
        self.uploader.upload(out, array)
        return out

    def upload_many(self, arrays: Sequence[np.ndarray]) -> list[DeviceTensor]:
        """Several small per-step arrays (int32/float32 ...) in one H2D copy."""
        self.lanes.require_main("an upload")
        return self.staging.upload(list(arrays))

    def download(self, x: DeviceTensor) -> np.ndarray:
        """Waits for the stream; bf16 comes back as float32."""
        if not x.is_contiguous:
            x = self.contiguous(x)
        raw = np.empty(x.shape, dtype=x.dtype.host)
        copy_to_host(raw, x, self.stream)
        return decode(raw, x.dtype)

    def empty(self, shape: Sequence[int], dtype) -> DeviceTensor:
        return self.allocator.empty(shape, dtype)

    def zeros(self, shape: Sequence[int], dtype) -> DeviceTensor:
        out = self.allocator.empty(shape, dtype)
        call(driver.cuMemsetD8Async, out.ptr, 0, out.nbytes, self.stream.handle)
        return out

    def contiguous(self, x: DeviceTensor) -> DeviceTensor:
        if x.is_contiguous:
            return x
        out = self.allocator.empty(x.shape, x.dtype)
        copy_device(out, x, self.stream)
        return out

    def allocate_kv_cache(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                          head_dim: int) -> list[tuple[DeviceTensor, DeviceTensor]]:
        """Per layer (k_cache, v_cache), each [NB, Hkv, BS, D] in self.dtype, zeroed."""
        shape = (num_blocks, num_kv_heads, block_size, head_dim)
        return [(self.zeros(shape, self.dtype), self.zeros(shape, self.dtype)) for _ in range(num_layers)]

    def check_weights_fit(self, weight_bytes: int, gpu_memory_utilization: float) -> None:
        free, total = memory_info()
        check_weights_fit(weight_bytes, free, total, gpu_memory_utilization)

    def plan_kv_cache(self, block_bytes: int, gpu_memory_utilization: float, reserve_bytes: int) -> KVCachePlan:
        """Size the KV pool from free memory once the weights are loaded; logs it in GiB and blocks."""
        self.stream.synchronize()  # pending uploads still hold the staging buffers, not device memory
        free, total = memory_info()
        plan = plan_kv_cache(free, total, gpu_memory_utilization, block_bytes, reserve_bytes)
        log.info(plan.describe())
        return plan

    def bind_thread(self) -> None:
        ensure_context()

    def decode_graph_runner(self, max_batch_size: int, max_blocks_per_seq: int, max_seq_len: int,
                            padding_state_slot: int | None = None) -> DecodeGraphRunner:
        return DecodeGraphRunner(self, max_batch_size, max_blocks_per_seq, max_seq_len,
                                 padding_state_slot=padding_state_slot)

    def prepare_attention(self, meta: AttentionMetadata) -> CudaAttentionMetadata:
        """One H2D copy for the step's metadata arrays: four, and a hybrid model's state slots and
        snapshot requests (delta_net.snapshot_arrays)."""
        self.lanes.require_main("an upload")
        arrays = [meta.query_start_loc, meta.seq_lens, meta.block_tables, meta.slot_mapping]
        if meta.state_slots is not None:
            arrays += [meta.state_slots, *delta_net.snapshot_arrays(len(meta.seq_lens), meta.state_snapshots)]
        qsl, seq_lens, block_tables, slots, *state = self.staging.upload([np.asarray(a, np.int32) for a in arrays])
        if state:
            state_slots, snapshot_start, offsets, snapshot_slots = state
            empty = offsets.shape[0] == 0
            state = [state_slots, snapshot_start, None if empty else offsets, None if empty else snapshot_slots]
        return CudaAttentionMetadata(qsl, seq_lens, block_tables, slots, meta.max_query_len, meta.max_seq_len, *state)

    def record_event(self) -> Event:
        """An event after all work enqueued so far; await `event.wait()` off the event loop."""
        event = Event()
        event.record(self.stream)
        return event

    def synchronize(self) -> None:
        self.stream.synchronize()

    # ---- compute ----
    def embedding(self, token_ids: DeviceTensor, table: DeviceTensor) -> DeviceTensor:
        out = self.allocator.empty((token_ids.shape[0], table.shape[1]), table.dtype)
        embedding.embedding(out, token_ids, table, self.stream)
        return out

    def rmsnorm(self, x: DeviceTensor, weight: DeviceTensor, eps: float) -> DeviceTensor:
        """x [..., D] (a strided [T, H, D] head view too; float32 or weight's dtype) -> contiguous
        [..., D] in weight's dtype."""
        out = self.allocator.empty(x.shape, weight.dtype)
        norm.rmsnorm(out, x, weight, eps, self.stream)
        return out

    def add_rmsnorm(self, x: DeviceTensor | ExpertSum, residual: DeviceTensor, weight: DeviceTensor,
                    eps: float) -> tuple[DeviceTensor, DeviceTensor]:
        """residual' is float32 whatever the model dtype: the residual stream is kept unrounded
        (updated in place from the second layer on). A MoE block's ExpertSum is combined inside
        the norm where its kernel takes the row (norm.combine_add_rmsnorm), else first."""
        out = self.allocator.empty(x.shape, x.dtype)
        residual_out = self._residual_out(x, residual)
        if isinstance(x, ExpertSum) and norm.combine_unsupported_reason(out, residual_out, residual, x.expert_out,
                                                                        weight) is None:
            norm.combine_add_rmsnorm(out, residual_out, residual, x.expert_out, x.weights, x.row_of_pair, weight, eps,
                                     self.stream)
        else:
            norm.add_rmsnorm(out, residual_out, residual, self.combined(x), weight, eps, self.stream)
        return out, residual_out

    def add_rmsnorm_linear(self, x: DeviceTensor, residual: DeviceTensor | None, norm_weight: DeviceTensor, eps: float,
                           weight: DeviceTensor, bias: DeviceTensor | None = None) -> tuple[DeviceTensor, DeviceTensor]:
        return self._pre_norm_product(x, residual, norm_weight, eps, weight, bias, gated=False)

    def add_rmsnorm_linear_silu_and_mul(self, x: DeviceTensor, residual: DeviceTensor | None,
                                        norm_weight: DeviceTensor, eps: float, weight: DeviceTensor,
                                        bias: DeviceTensor | None = None) -> tuple[DeviceTensor, DeviceTensor]:
        return self._pre_norm_product(x, residual, norm_weight, eps, weight, bias, gated=True)

    def _pre_norm_product(self, x: DeviceTensor, residual: DeviceTensor | None, norm_weight: DeviceTensor,
                          eps: float, weight: DeviceTensor, bias: DeviceTensor | None,
                          gated: bool) -> tuple[DeviceTensor, DeviceTensor]:
        """The norm inside the GEMV, one gemv_norm launch, at one row where the table picks gemv for
        the product (the fused kernel is gemv's loop) and the operands suit it; else `pre_norm`,
        then `linear` (gated: `linear_silu_and_mul`). The fused residual' is a fresh fp32 buffer:
        the kernel's other blocks still read the residual, so it is not updated in place."""
        fuses = (self.fuse_norms and not isinstance(x, ExpertSum) and x.ndim == 2 and x.shape[0] == 1
                 and self.gemm.picks_gemv(x, weight)
                 and gemv_norm.unsupported_reason(x, residual, norm_weight, weight) is None)
        if not fuses:
            y, residual = pre_norm(self, x, residual, norm_weight, eps)
            return (self.linear_silu_and_mul if gated else self.linear)(y, weight, bias), residual
        out = self.allocator.empty((1, weight.shape[0] // 2 if gated else weight.shape[0]), x.dtype)
        residual_out = None if residual is None else self.allocator.empty(x.shape, DType.float32)
        launch = gemv_norm.gemv_norm_silu_and_mul if gated else gemv_norm.gemv_norm
        launch(out, residual_out, x, residual, norm_weight, eps, weight, bias, self.stream)
        return out, x if residual_out is None else residual_out

    def add_rmsnorm_for_router(self, x: DeviceTensor, residual: DeviceTensor, weight: DeviceTensor,
                               eps: float) -> tuple[DeviceTensor, DeviceTensor, DeviceTensor]:
        """In bf16 / fp16 one kernel writes router_input [T, 2H] = [y | y's rounding error], y being
        its first half (a view): the router then runs on the 16-bit tensor cores and still sees the
        rows unrounded to ~2^-16 of their size in bf16 (sparse_moe). An fp32 y is its own router_input."""
        if x.dtype is DType.float32:
            y, residual_out = self.add_rmsnorm(x, residual, weight, eps)
            return y, y, residual_out
        rows, hidden = x.shape
        router_input = self.allocator.empty((rows, 2 * hidden), x.dtype)
        y, y_lo = router_input.column_slice(0, hidden), router_input.column_slice(hidden, hidden)
        residual_out = self._residual_out(x, residual)
        norm.add_rmsnorm(y, residual_out, residual, x, weight, eps, self.stream, y_lo)
        return y, router_input, residual_out

    def _residual_out(self, x: DeviceTensor, residual: DeviceTensor) -> DeviceTensor:
        """Where residual' goes: residual itself once it is the fp32 stream, else a new fp32 buffer."""
        return residual if residual.dtype is DType.float32 else self.allocator.empty(x.shape, DType.float32)

    def linear(self, x: DeviceTensor, weight: DeviceTensor, bias: DeviceTensor | None = None,
               out_dtype=None) -> DeviceTensor:
        """x [T, K] (rows may be spaced), weight [N, K], bias [N] -> [T, N] in x's dtype or out_dtype."""
        out = self.allocator.empty((x.shape[0], weight.shape[0]), as_dtype(out_dtype) if out_dtype else x.dtype)
        self.gemm(out, x, weight, bias)
        return out

    def linear_silu_and_mul(self, x: DeviceTensor, weight: DeviceTensor,
                            bias: DeviceTensor | None = None) -> DeviceTensor:
        """One kernel where the table picks the gemv kernel for this product; else the two ops."""
        if not self.gemm.picks_gemv(x, weight):
            return self.silu_and_mul(self.linear(x, weight, bias))
        out = self.allocator.empty((x.shape[0], weight.shape[0] // 2), x.dtype)
        gemv.gemv_silu_and_mul(out, x, weight, bias, self.stream)
        return out

    def split_heads(self, qkv: DeviceTensor, num_q_heads: int, num_kv_heads: int,
                    head_dim: int) -> tuple[DeviceTensor, DeviceTensor, DeviceTensor]:
        """Views, no copies: q [T, Hq, D], k and v [T, Hkv, D] with qkv's row stride."""
        q_width, kv_width = num_q_heads * head_dim, num_kv_heads * head_dim
        if qkv.shape[1] != q_width + 2 * kv_width:
            raise ValueError(f"qkv width {qkv.shape[1]} != (Hq + 2 Hkv) * D = {q_width + 2 * kv_width}")
        q = qkv.column_slice(0, q_width).split_last(num_q_heads, head_dim)
        k = qkv.column_slice(q_width, kv_width).split_last(num_kv_heads, head_dim)
        v = qkv.column_slice(q_width + kv_width, kv_width).split_last(num_kv_heads, head_dim)
        return q, k, v

    def rope_write_kv(self, q: DeviceTensor, k: DeviceTensor, v: DeviceTensor, positions: DeviceTensor,
                      rope: RopeConfig, k_cache: DeviceTensor, v_cache: DeviceTensor,
                      attn: CudaAttentionMetadata, qk_norm: rope_kv.QKNorm | None = None) -> DeviceTensor:
        """The q/k norm, when given, runs inside the same kernel."""
        q_out = self.allocator.empty(q.shape, q.dtype)
        cos_sin = self._rope_table(rope, attn.max_seq_len)
        rope_kv.rope_write_kv(q_out, q, k, v, positions, cos_sin, k_cache, v_cache, attn.slot_mapping, self.stream,
                              qk_norm)
        return q_out

    def attention(self, q: DeviceTensor, k_cache: DeviceTensor, v_cache: DeviceTensor,
                  attn: CudaAttentionMetadata, scale: float) -> DeviceTensor:
        out = self.allocator.empty(q.shape, q.dtype)
        if not attn.is_decode_only:
            prefill = (attention_prefill_wgmma.prefill_attention_wgmma
                       if attention_prefill_wgmma.use_wgmma_prefill(self.device.arch, q.dtype, q.shape[2],
                                                                     attn.max_query_len)
                       else attention.prefill_attention)
            prefill(out, q, k_cache, v_cache, attn, scale, self.stream)
            return out
        # Split-K partials; freed when this returns, so every layer reuses the same block.
        numel = attention.decode_workspace_numel(q, k_cache, attn)
        workspace = self.allocator.empty((numel,), DType.float32) if numel else None
        attention.decode_attention(out, q, k_cache, v_cache, attn, scale, self.stream, workspace)
        return out

    def rope_attention(self, q: DeviceTensor, k: DeviceTensor, v: DeviceTensor, positions: DeviceTensor,
                       rope: RopeConfig, k_cache: DeviceTensor, v_cache: DeviceTensor,
                       attn: CudaAttentionMetadata, scale: float,
                       qk_norm: rope_kv.QKNorm | None = None) -> DeviceTensor:
        """One decode_attention_rope launch where attention.use_fused_rope says it pays (decode-only
        steps of small batches); otherwise rope_write_kv then attention. A decode graph captures
        the choice of its bucket's batch size."""
        cos_sin = self._rope_table(rope, attn.max_seq_len)
        if not attention.use_fused_rope(q, k, v, cos_sin, k_cache, v_cache, attn, qk_norm):
            q = self.rope_write_kv(q, k, v, positions, rope, k_cache, v_cache, attn, qk_norm)
            return self.attention(q, k_cache, v_cache, attn, scale)
        out = self.allocator.empty(q.shape, q.dtype)
        numel = attention.decode_workspace_numel(q, k_cache, attn, fused_rope=True)
        workspace = self.allocator.empty((numel,), DType.float32) if numel else None
        attention.decode_attention_rope(out, q, k, v, positions, cos_sin, k_cache, v_cache, attn, scale,
                                        self.stream, workspace, qk_norm)
        return out

    def silu_and_mul(self, x: DeviceTensor) -> DeviceTensor:
        out = self.allocator.empty((x.shape[0], x.shape[1] // 2), x.dtype)
        activation.silu_and_mul(out, x, self.stream)
        return out

    def add(self, x: DeviceTensor | ExpertSum, y: DeviceTensor) -> DeviceTensor:
        out = self.allocator.empty(x.shape, y.dtype)
        elementwise.add(out, self.combined(x), y, self.stream)
        return out

    def reshape(self, x: DeviceTensor, shape: Sequence[int]) -> DeviceTensor:
        return x.view(shape)

    def logits(self, hidden: DeviceTensor, indices: DeviceTensor, norm_weight: DeviceTensor, eps: float,
               lm_head: DeviceTensor) -> DeviceTensor:
        """Gather the rows, norm them, and run lm_head with fp32 output straight from cuBLASLt."""
        rows = self.allocator.empty((indices.shape[0], hidden.shape[1]), hidden.dtype)  # fp32: the residual stream
        embedding.gather_rows(rows, hidden, indices, self.stream)
        normed = self.rmsnorm(rows, norm_weight, eps)
        out = self.allocator.empty((indices.shape[0], lm_head.shape[0]), DType.float32)
        self.gemm(out, normed, lm_head)
        return out

    def sample(self, logits: DeviceTensor, params: SamplingTensors) -> SamplerOutput:
        return self.sample_async(logits, params).result()

    def sample_async(self, logits: DeviceTensor, params: SamplingTensors) -> SampledTokens:
        self.lanes.require_main("sampling")
        if self._inject_fault:
            self._inject_fault = False
            log.warning("%s is set: launching a trapping kernel (test-only)", fault.DEVICE_FAULT_ENV)
            fault.launch_trap(self.stream)
        return sampling.sample_async(logits, params, self.staging, self.downloads, self.allocator, self.stream)

    def copy_drawn_tokens_(self, token_ids: DeviceTensor, drawn: DrawnTokens) -> None:
        pairs = self.upload(np.stack([drawn.rows, drawn.drawn_rows]).astype(np.int32))
        embedding.copy_drawn_tokens(token_ids, drawn.ids, pairs, self.stream)

    # ---- helpers ----
    def _rope_table(self, rope: RopeConfig, max_seq_len: int) -> DeviceTensor:
        """cos | sin [positions, rotary_dim] float32, attention scaling folded in.

        Grown (by powers of two) only on the host's say-so, before a step is enqueued.
        A bucket's decode graphs are captured after a warm-up run at max_model_len (its
        short-context graph after that one), so no later step grows the table a graph
        captured: growing frees the old table under it."""
        key = (rope.rotary_dim, rope.attention_scaling, rope.inv_freq.tobytes())
        table = self._rope_tables.get(key)
        if table is None or table.shape[0] < max_seq_len:
            num_positions = max(_MIN_ROPE_POSITIONS, 1 << max(max_seq_len - 1, 1).bit_length())
            table = self.upload(rope_kv.rope_cos_sin(rope, num_positions))
            self._rope_tables[key] = table
        return table
