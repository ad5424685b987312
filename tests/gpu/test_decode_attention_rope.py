"""decode_attention_rope (RoPE, the q/k norm and the KV write fused into decode attention)
against the two launches it replaces, rope_write_kv then decode_attention, on the same
device inputs: the caches must come out bit for bit equal, and the outputs too where both
ways plan the same splits (else within the tolerance). Both outputs are also checked
against numpy: the q/k norm, NumpyOps.rope_write_kv and softmax attention in float64,
with every tensor the op hands on held in the model dtype as the device holds it (see
FusedDecode.numpy_reference), so the bar measures the kernels, not bf16 inputs.

Relative error is max |out - ref| / max |ref| (<= 1e-5 fp32, <= 1e-2 bf16 / fp16).
q, k and v are views of one qkv buffer, as the model passes them. Every cache slot that
holds no key is NaN, the newest key's slot included: a kernel that read the new key
from the cache before writing it, or any slot past a sequence, fails loudly.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import pytest

from sparkd.backend.cpu.ops import NumpyOps
from sparkd.backend.dtypes import DType
from sparkd.models.config import rope_config

from .attention_plans import H200_SHARED_PER_BLOCK, H200_SMS, h200_plan
from .test_attention import dense_attention, make_batch, upload_meta

attention = pytest.importorskip("sparkd.backend.cuda.kernels.attention")
from device_fakes import fake_tensor  # noqa: E402

from sparkd.backend.cuda.attention_metadata import CudaAttentionMetadata  # noqa: E402
from sparkd.backend.cuda.graphs import capture  # noqa: E402
from sparkd.backend.cuda.kernels import rope_kv  # noqa: E402
from sparkd.backend.cuda.kernels.attention_plan import SPLIT_ALIGN, AttentionSizes, DecodePlan, plan_decode  # noqa: E402
from sparkd.backend.cuda.kernels.rope_kv import rope_cos_sin  # noqa: E402
from sparkd.backend.cuda.transfer import copy_to_device  # noqa: E402
from sparkd.backend.dtypes import decode, encode  # noqa: E402

EPS = 1e-6
LLAMA3 = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 1024}


@dataclass
class Shape:
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int = 16
    rope: dict = dataclasses.field(default_factory=lambda: {"rope_theta": 10000.0})


class FusedDecode:
    """One decode step on the device, run both ways over separate copies of the same caches.

    Host side: qkv rows [B, (Hq + 2 Hkv) D] (heads scaled 0.05..20x, so the norm matters),
    positions = seq_lens - 1, the caches with NaN in every slot that holds no key."""

    def __init__(self, gpu, dtype: str, shape: Shape, seq_lens: list[int], with_norm: bool, seed: int,
                 plan_len: int | None = None, padding: tuple[int, ...] = ()):
        """padding: rows whose slot is -1, as a graph's padding rows; their newest slot keeps a stale key."""
        rng = np.random.default_rng(seed)
        self.gpu, self.dtype, self.shape, self.with_norm = gpu, dtype, shape, with_norm
        hq, hkv, d = shape.num_q_heads, shape.num_kv_heads, shape.head_dim
        batch = make_batch(rng, [1] * len(seq_lens), seq_lens, hq, hkv, d, shape.block_size)
        real = np.setdiff1d(np.arange(len(seq_lens)), padding)
        slots = batch.meta.slot_mapping[real]
        for cache in (batch.k_cache, batch.v_cache):  # the new tokens' slots hold no key yet
            cache[slots // shape.block_size, :, slots % shape.block_size] = np.nan
        batch.meta.slot_mapping[list(padding)] = -1
        self.meta_host = batch.meta
        self.caches = [tuple(gpu.upload(c, dtype) for c in (batch.k_cache, batch.v_cache)) for _ in range(2)]
        self.rope = rope_config({"rope_parameters": shape.rope, "max_position_embeddings": 1 << 17}, d)
        self.cos_sin = gpu.upload(rope_cos_sin(self.rope, max(seq_lens)))
        self.positions = gpu.upload(np.asarray(seq_lens, np.int32) - 1)
        self.meta = upload_meta(gpu, batch.meta, plan_len)
        self.qkv = gpu.upload(self.random_rows(rng), dtype)
        self.qk_norm = ((*(gpu.upload((1.0 + 0.5 * rng.standard_normal(d)).astype(np.float32), dtype)
                           for _ in range(2)), EPS) if with_norm else None)
        widths = [hq * d, hkv * d, hkv * d]
        starts = np.cumsum([0, *widths[:-1]])
        self.q, self.k, self.v = (self.qkv.column_slice(int(start), width).split_last(width // d, d)
                                  for start, width in zip(starts, widths))
        self.scale = d ** -0.5
        self.outs = [gpu.empty(self.q.shape, self.q.dtype) for _ in range(2)]
        self.q_rotated = gpu.empty(self.q.shape, self.q.dtype)
        self.workspaces = [self._workspace(fused) for fused in (False, True)]
        self.same_plan = (attention.decode_plan(self.q, self.caches[0][0], self.meta, self.workspaces[0]) ==
                          attention.decode_plan(self.q, self.caches[0][0], self.meta, self.workspaces[1],
                                                fused_rope=True))

    def random_rows(self, rng) -> np.ndarray:
        num_heads = self.shape.num_q_heads + 2 * self.shape.num_kv_heads
        rows = len(self.meta_host.seq_lens)
        scales = rng.uniform(0.05, 20.0, (rows, num_heads, 1)) if self.with_norm else 1.0
        return (rng.standard_normal((rows, num_heads, self.shape.head_dim)) * scales).reshape(rows, -1).astype(
            np.float32)

    def _workspace(self, fused: bool):
        numel = attention.decode_workspace_numel(self.q, self.caches[0][0], self.meta, fused_rope=fused)
        return self.gpu.empty((numel,), "float32") if numel else None

    def launch_two_kernels(self) -> None:
        k_cache, v_cache = self.caches[0]
        rope_kv.rope_write_kv(self.q_rotated, self.q, self.k, self.v, self.positions, self.cos_sin, k_cache, v_cache,
                              self.meta.slot_mapping, self.gpu.stream, self.qk_norm)
        attention.decode_attention(self.outs[0], self.q_rotated, k_cache, v_cache, self.meta, self.scale,
                                   self.gpu.stream, self.workspaces[0])

    def launch_fused(self) -> None:
        k_cache, v_cache = self.caches[1]
        attention.decode_attention_rope(self.outs[1], self.q, self.k, self.v, self.positions, self.cos_sin, k_cache,
                                        v_cache, self.meta, self.scale, self.gpu.stream, self.workspaces[1],
                                        self.qk_norm)

    def check(self, rel_error, tolerance, expected: np.ndarray, context=None) -> None:
        """After a step run both ways: the caches equal bit for bit, the outputs too under one
        plan (else within the tolerance), and each output within the tolerance of `expected`."""
        for two_kernels, fused in zip(*(map(self.gpu.download, pair) for pair in self.caches)):
            np.testing.assert_array_equal(fused, two_kernels)
        out_two, out_fused = (self.gpu.download(o) for o in self.outs)
        if self.same_plan:
            np.testing.assert_array_equal(out_fused, out_two, err_msg=str(context))
        errors = {"fused vs two kernels": rel_error(out_fused, out_two),
                  "two kernels vs numpy": rel_error(out_two, expected),
                  "fused vs numpy": rel_error(out_fused, expected)}
        assert max(errors.values()) <= tolerance[self.dtype], (context, errors)

    def numpy_reference(self, seq_lens=None) -> np.ndarray:
        """The step in numpy from the device's qkv rows and caches, each tensor the op hands
        on held in the model dtype as the Ops contract has it: rmsnorm(q) and rmsnorm(k) (with
        the norm), rope_write_kv's rotated q and the key it writes to the cache; then dense
        attention in float64. Without those roundings a bf16 case missed 1e-2 on the H200 for
        both ways alike (1.23e-2, reproduced on the CPU): they moved the new key's score by
        0.01, and its value, scaled 15x, carried the largest output. seq_lens: the step's, if
        not the first; call it before the launch."""
        ops, shape = NumpyOps(), self.shape
        meta = self.meta_host
        if seq_lens is not None:
            meta = dataclasses.replace(meta, seq_lens=np.asarray(seq_lens, np.int32), max_seq_len=max(seq_lens),
                                       slot_mapping=self.slots_for(seq_lens))
        q, k, v = ops.split_heads(self.gpu.download(self.qkv), shape.num_q_heads, shape.num_kv_heads, shape.head_dim)
        k_cache, v_cache = (self.gpu.download(c) for c in self.caches[0])
        if self.with_norm:
            q_norm, k_norm = (self.gpu.download(w) for w in self.qk_norm[:2])
            q, k = self.stored(ops.rmsnorm(q, q_norm, EPS)), self.stored(ops.rmsnorm(k, k_norm, EPS))
        q = ops.rope_write_kv(q, k, v, meta.seq_lens - 1, self.rope, k_cache, v_cache, ops.prepare_attention(meta))
        return dense_attention(self.stored(q), self.stored(k_cache), v_cache, meta, self.scale)

    def stored(self, x: np.ndarray) -> np.ndarray:
        """x rounded to the model dtype, as float32 host values (NaN stays NaN)."""
        dtype = DType.parse(self.dtype)
        return np.asarray(decode(encode(x, dtype), dtype), np.float32)

    def slots_for(self, seq_lens) -> np.ndarray:
        """The slot of each sequence's newest key, through its block table."""
        last = np.asarray(seq_lens) - 1
        bs = self.shape.block_size
        return (self.meta_host.block_tables[np.arange(len(last)), last // bs] * bs + last % bs).astype(np.int32)


DTYPES = ["float32", "bfloat16", "float16"]
CASES = [  # shape, seq_lens, graph plan length (None: the longest sequence)
    (Shape(32, 8, 128), [128], 8192),  # Llama-3-8B at batch 1, planned as an 8k engine's graph
    (Shape(32, 8, 128), [150], 1024),  # its short-context graph: one cluster, three 64-key splits used
    (Shape(32, 8, 128, rope=LLAMA3), [5000], 131072),  # long context, parts merged through the workspace
    (Shape(32, 4, 128, rope={"rope_theta": 1000000.0}), [3000], 4096),  # Qwen3-30B-A3B heads; bf16: 3 clusters
    (Shape(16, 4, 128, block_size=32), [1, 17, 64, 65, 300, 2500], 8192),  # one token, block edges, mixed
    (Shape(40, 2, 64), [5, 333, 2000], None),  # two head chunks per kv head: only the first writes
    (Shape(8, 2, 256, rope={"rope_theta": 10000.0, "partial_rotary_factor": 0.25}), [3, 700], None),
    (Shape(32, 8, 128), list(range(7, 7 + 40 * 13, 13)), None),  # fills the GPU unsplit
]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_norm", [False, True])
@pytest.mark.parametrize("shape,seq_lens,plan_len", CASES)
def test_fused_equals_rope_write_kv_then_decode(gpu, rel_error, tolerance, dtype, with_norm, shape, seq_lens,
                                                plan_len):
    step = FusedDecode(gpu, dtype, shape, seq_lens, with_norm, seed=len(seq_lens) + shape.head_dim,
                       plan_len=plan_len)
    expected = step.numpy_reference()
    step.launch_two_kernels()
    step.launch_fused()
    step.check(rel_error, tolerance, expected)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_padding_row_writes_nothing(gpu, rel_error, tolerance, dtype):
    """A negative slot (a graph's padding row): no cache write; the block reads its newest
    key from the cache as decode_attention alone would."""
    step = FusedDecode(gpu, dtype, Shape(32, 8, 128), [300, 1, 77], True, seed=3, padding=(1,))
    before = [gpu.download(c) for c in step.caches[1]]
    expected = step.numpy_reference()
    step.launch_two_kernels()
    step.launch_fused()
    block = step.meta_host.block_tables[1, 0]
    for old, new in zip(before, (gpu.download(c) for c in step.caches[1])):
        np.testing.assert_array_equal(new[block], old[block])
    step.check(rel_error, tolerance, expected)


# ---- one graph per way, planned for long contexts, replayed as a sequence grows ----

@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("num_seqs,num_kv_heads,plan_len", [(1, 8, 8192), (1, 4, 131072), (1, 4, 4096),
                                                            (3, 8, 131072), (1, 8, 1024)])
@pytest.mark.parametrize("with_norm", [False, True])
def test_graph_replays_equal_the_two_kernels(gpu, rel_error, tolerance, dtype, num_seqs, num_kv_heads, plan_len,
                                             with_norm):
    """Both ways captured once; every replay gets new seq_lens, positions, slots and qkv rows
    (written into the graphs' input buffers), and must leave equal caches and match numpy."""
    capacity = min(6000, plan_len)
    step = FusedDecode(gpu, dtype, Shape(32, num_kv_heads, 128), [capacity] * num_seqs, with_norm,
                       seed=num_seqs * 7 + num_kv_heads, plan_len=plan_len)
    graphs = []
    try:
        for launch in (step.launch_two_kernels, step.launch_fused):
            launch()  # loads the kernels outside the capture
            graphs.append(capture(gpu.stream, launch)[0])
        rng = np.random.default_rng(plan_len)
        # a sequence growing, a new one, a long one, the longest, a short one again; others offset by 1000
        lengths = [128, 129, 130, 1, capacity // 2 + 1, capacity - 1, 17]
        for seq_lens in ([(n - 1 + s * 1000) % capacity + 1 for s in range(num_seqs)] for n in lengths):
            copy_to_device(step.meta.seq_lens, np.asarray(seq_lens, np.int32), gpu.stream)
            copy_to_device(step.positions, np.asarray(seq_lens, np.int32) - 1, gpu.stream)
            copy_to_device(step.meta.slot_mapping, step.slots_for(seq_lens), gpu.stream)
            copy_to_device(step.qkv, encode(step.random_rows(rng), step.qkv.dtype), gpu.stream)
            gpu.stream.synchronize()
            expected = step.numpy_reference(seq_lens)  # from the caches before this step
            for graph in graphs:
                graph.replay(gpu.stream)
            step.check(rel_error, tolerance, expected, seq_lens)
    finally:
        for graph in graphs:
            graph.destroy()


# ---- host-side rules: no GPU needed ----

def h200_fused_plan(num_seqs: int, num_kv_heads: int, dtype: str, plan_len: int) -> DecodePlan:
    """decode_attention_rope's plan for 32 query heads of 128 on the H200's numbers."""
    sizes = AttentionSizes(num_seqs, 32, num_kv_heads, 128, 16, num_seqs, DType.parse(dtype), fused_rope=True)
    return plan_decode(sizes, plan_len, H200_SMS, H200_SHARED_PER_BLOCK, 1 << 40)


@pytest.mark.parametrize("num_seqs,num_kv_heads,plan_len,cluster", [
    (1, 8, 8192, 1), (1, 4, 131072, 1), (1, 4, 4096, 8), (3, 8, 131072, 8)])
def test_graph_cases_cover_both_bf16_kernels_on_the_h200(num_seqs, num_kv_heads, plan_len, cluster):
    """The graph cases above run the plain kernel and the cluster kernel, with 128 keys in one part."""
    plan = h200_fused_plan(num_seqs, num_kv_heads, "bfloat16", plan_len)
    assert plan.cluster == cluster and plan.num_parts > 1 and plan.parts_used(128) == 1


def test_the_short_graph_case_is_one_cluster_of_64_key_splits():
    """The graph case planned for 1024 keys (a short-context decode graph's bound) is one part,
    so its 129-130-key steps use three splits of the cluster."""
    plan = h200_fused_plan(1, 8, "bfloat16", 1024)
    assert plan == DecodePlan(8, 8, SPLIT_ALIGN) and plan.parts_used(1024) == 1


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("num_seqs,plan_len", [(1, 8192), (1, 131072), (64, 4096)])
def test_fused_plans_equal_the_unfused_ones_for_llama_heads(dtype, num_seqs, plan_len):
    """The scratch the fused kernels add keeps as many blocks on an SM at D 128, so both
    ways split alike (and their outputs agree bit for bit)."""
    assert h200_fused_plan(num_seqs, 8, dtype, plan_len) == h200_plan(num_seqs, 32, 8, 128, dtype, plan_len)


def test_fused_rope_has_a_spec_for_every_decode_kernel():
    names = {spec.name for spec in attention.SPECS}
    for name in list(names):
        if name.startswith("decode_attention_") and "rope" not in name:
            assert name.replace("decode_attention_", "decode_attention_rope_") in names


def _decode_step(num_seqs: int, max_query_len: int = 1, num_kv_heads: int = 8, rotary_dim: int = 128,
                 row_extra: int = 0) -> dict:
    """use_fused_rope's operands for a step of Llama-3-8B heads: q, k, v views of one qkv row
    (row_extra more elements per row), caches, cos_sin and the metadata."""
    row = (32 + 2 * num_kv_heads) * 128 + row_extra
    q, k, v = (fake_tensor((num_seqs, heads, 128), strides=(row, 128, 1))
               for heads in (32, num_kv_heads, num_kv_heads))
    cache = fake_tensor((64, num_kv_heads, 16, 128))
    ints = fake_tensor((num_seqs,), "int32")
    meta = CudaAttentionMetadata(fake_tensor((num_seqs + 1,), "int32"), ints, fake_tensor((num_seqs, 4), "int32"),
                                 ints, max_query_len, 4096)
    return {"q": q, "k": k, "v": v, "cos_sin": fake_tensor((4096, rotary_dim), "float32"), "k_cache": cache,
            "v_cache": cache, "meta": meta}


def test_fused_rope_is_used_for_small_decode_batches_only():
    assert attention.use_fused_rope(**_decode_step(1))
    assert attention.use_fused_rope(**_decode_step(attention.FUSED_ROPE_MAX_BATCH))
    assert not attention.use_fused_rope(**_decode_step(attention.FUSED_ROPE_MAX_BATCH + 1))
    assert not attention.use_fused_rope(**_decode_step(1, max_query_len=7))  # prefill and mixed steps: two kernels
    # The rotation only runs in 16-byte vectors: a rotary half of 12 bf16, or rows 4 elements apart, do not fit.
    assert not attention.use_fused_rope(**_decode_step(1, rotary_dim=24))
    assert not attention.use_fused_rope(**_decode_step(1, row_extra=4))
