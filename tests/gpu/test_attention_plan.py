"""Host-side rules of the paged attention launchers (sparkd/backend/cuda/kernels/attention.py
and attention_plan.py): the decode plan on the H200's numbers, the parts a plan uses, and
the operand checks. No GPU: the tensors here are never launched on."""

from __future__ import annotations

import pytest

from sparkd.backend.dtypes import DType

attention = pytest.importorskip("sparkd.backend.cuda.kernels.attention")
from device_fakes import fake_tensor

from sparkd.backend.cuda.attention_metadata import CudaAttentionMetadata
from sparkd.backend.cuda.kernels import attention_plan

from .attention_plans import H200_SHARED_PER_BLOCK, h200_plan


def test_num_splits_fill_the_gpu_only_when_the_batch_does_not():
    assert attention_plan.choose_num_splits(64 * 8, 1024, 132) == 1  # batch 64, 8 kv heads: 2 full waves of 2 per SM
    assert attention_plan.choose_num_splits(8, 100, 132) == 1  # one split of >= MIN_SPLIT_KEYS holds it all
    splits = attention_plan.choose_num_splits(8, 32768, 132)  # batch 1: split until most of a wave is busy
    assert 0.85 * 132 * 2 <= 8 * splits <= 132 * 2
    assert attention_plan.choose_num_splits(8, 1024, 132) <= 1024 // attention_plan.MIN_SPLIT_KEYS


def test_num_splits_even_out_a_ragged_last_wave():
    # 512 blocks at 3 per SM are 1.29 waves: 8 splits make 10.3 waves of short blocks.
    assert attention_plan.choose_num_splits(64 * 8, 1024, 132, blocks_per_sm=3, step=8) == 8
    assert attention_plan.choose_num_splits(132 * 3, 1024, 132, blocks_per_sm=3, step=8) == 1  # exactly one wave
    assert attention_plan.choose_num_splits(8, 32768, 132, blocks_per_sm=3, step=8) % 8 == 0


def test_bf16_decode_blocks_fit_three_per_h200_sm():
    sizes = attention_plan.AttentionSizes(1, 32, 8, 128, 16, 1, DType.bfloat16)
    assert attention_plan.blocks_per_sm(attention_plan.decode_smem_bytes(sizes), H200_SHARED_PER_BLOCK) == 3


def test_llama_decode_plans_on_the_h200():
    # The rules follow the H200 measurements quoted in plan_decode's docstring.
    # Batch 1 at 1k: one cluster of 8 splits per kv head merges on chip; no workspace, no combine
    # kernel; splits of as few as 64 keys, as one part holds any context the plan serves.
    assert h200_plan(1, 32, 8, 128, "bfloat16", 1024) == attention_plan.DecodePlan(8, 8, attention_plan.SPLIT_ALIGN)
    # Batch 1 at 4k: four clusters, merged through the workspace by the last to finish.
    assert h200_plan(1, 32, 8, 128, "bfloat16", 4096) == attention_plan.DecodePlan(32, 8)
    # Batch 1 at 32k: past MAX_CLUSTER_PARTS clusters, plain splits merged the same way.
    long = h200_plan(1, 32, 8, 128, "bfloat16", 32768)
    assert long.cluster == 1 and long.num_splits > attention_plan.MAX_CLUSTER_PARTS * attention_plan.DECODE_CLUSTER
    # Batch 32's 256 blocks fill the GPU in one wave (3 an SM): unsplit, at any context.
    assert h200_plan(32, 32, 8, 128, "bfloat16", 1024) == attention_plan.DecodePlan(1, 1)
    assert h200_plan(32, 32, 8, 128, "bfloat16", 32768) == attention_plan.DecodePlan(1, 1)
    # Batch 64's 512 blocks are 1.29 waves: 2 splits make 2.59, at any context (each split of
    # a 1k context still holds 512 keys).
    assert h200_plan(64, 32, 8, 128, "bfloat16", 1024) == attention_plan.DecodePlan(2, 1)
    assert h200_plan(64, 32, 8, 128, "bfloat16", 32768) == attention_plan.DecodePlan(2, 1)
    # Batch 128's 1024 blocks are 2.59 waves already: unsplit.
    assert h200_plan(128, 32, 8, 128, "bfloat16", 8192) == attention_plan.DecodePlan(1, 1)
    # Never more than FULL_BATCH_MAX_SPLITS once the batch fills the GPU.
    for batch in range(17, 513):
        plan = h200_plan(batch, 32, 8, 128, "bfloat16", 131072)
        assert plan.cluster == 1 and plan.num_splits <= attention_plan.FULL_BATCH_MAX_SPLITS
    # fp32 splits one by one, as many as the workspace holds.
    fp32 = h200_plan(1, 32, 8, 128, "float32", 32768)
    assert fp32.cluster == 1 and fp32.num_parts == fp32.num_splits > 1
    part_numel = 32 * 129
    assert h200_plan(1, 32, 8, 128, "float32", 32768, workspace_numel=3 * part_numel) == attention_plan.DecodePlan(3, 1)


def test_decode_without_workspace_still_splits_in_one_cluster():
    assert h200_plan(1, 32, 8, 128, "bfloat16", 32768, workspace_numel=0) == attention_plan.DecodePlan(
        8, 8, attention_plan.SPLIT_ALIGN)
    assert h200_plan(1, 32, 8, 128, "float32", 32768, workspace_numel=0) == attention_plan.DecodePlan(1, 1)


def test_parts_used_follow_the_kernels_split_rule():
    plain = attention_plan.DecodePlan(42, 1)
    # Splits are multiples of 64 keys and at least MIN_SPLIT_KEYS long.
    assert [plain.parts_used(n) for n in (1, 128, 129, 256, 257, 8192)] == [1, 1, 2, 2, 3, 32]
    clustered = attention_plan.DecodePlan(32, 8)
    assert [clustered.parts_used(n) for n in (1, 1024, 1025, 4096, 8192)] == [1, 1, 2, 4, 4]


@pytest.mark.parametrize("num_kv_heads", [8, 4])
@pytest.mark.parametrize("plan_len", [8192, 131072])
def test_a_graph_planned_for_long_contexts_writes_128_keys_in_one_part(num_kv_heads, plan_len):
    """The batch-1 decode graph of an engine with max_model_len plan_len: at 128 keys one
    block per kv head writes out, so the call costs about one short launch."""
    plan = h200_plan(1, 32, num_kv_heads, 128, "bfloat16", plan_len)
    assert plan.num_parts > 1 and plan.num_splits <= attention_plan.MAX_SPLITS
    assert plan.parts_used(128) == 1
    assert 1 < plan.parts_used(plan_len) <= plan.num_parts


def test_batches_beyond_the_arrival_counters_are_not_split():
    """Even where more SMs than the kernels' arrival counters would ask for splits."""
    num_seqs = attention_plan.DECODE_COUNTERS // 8  # one counter per (sequence, kv head)
    sizes = attention_plan.AttentionSizes(num_seqs, 32, 8, 128, 16, num_seqs, DType.bfloat16)
    plan = attention_plan.plan_decode(sizes, 32768, 2 * attention_plan.DECODE_COUNTERS, H200_SHARED_PER_BLOCK, 1 << 40)
    assert plan == attention_plan.DecodePlan(1, 1)

def _meta(num_seqs, max_query_len=1):
    return CudaAttentionMetadata(fake_tensor((num_seqs + 1,), "int32"), fake_tensor((num_seqs,), "int32"),
                                 fake_tensor((num_seqs, 4), "int32"), fake_tensor((num_seqs,), "int32"),
                                 max_query_len, 64)


@pytest.mark.parametrize("q_shape,cache_shape,message", [
    ((4, 8, 96), (10, 2, 16, 96), "head_dim 96"),
    ((4, 8, 128), (10, 3, 16, 128), "multiple of num_kv_heads"),
    ((4, 8, 128), (10, 2, 16, 64), "cache head_dim"),
])
def test_launchers_name_the_bad_parameter(q_shape, cache_shape, message):
    q, cache = fake_tensor(q_shape), fake_tensor(cache_shape)
    with pytest.raises(ValueError, match=message):
        attention.prefill_attention(fake_tensor(q_shape), q, cache, cache, _meta(4, 1), 0.1, None)


def test_decode_refuses_a_prefill_step():
    q, cache = fake_tensor((4, 8, 128)), fake_tensor((10, 2, 16, 128))
    with pytest.raises(ValueError, match="max_query_len == 1"):
        attention.decode_attention(fake_tensor((4, 8, 128)), q, cache, cache, _meta(2, 3), 0.1, None)
