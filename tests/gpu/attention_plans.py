"""The decode plan on an H200's numbers (132 SMs, 227 KB of shared memory a block), for
tests that check which plan a case gets without asking a GPU."""

from __future__ import annotations

from sparkd.backend.cuda.kernels.attention_plan import AttentionSizes, plan_decode
from sparkd.backend.dtypes import DType

H200_SMS, H200_SHARED_PER_BLOCK = 132, 232448


def h200_plan(num_seqs, num_q_heads, num_kv_heads, head_dim, dtype, max_seq_len, workspace_numel=1 << 40):
    sizes = AttentionSizes(num_seqs, num_q_heads, num_kv_heads, head_dim, 16, num_seqs, DType.parse(dtype))
    return plan_decode(sizes, max_seq_len, H200_SMS, H200_SHARED_PER_BLOCK, workspace_numel)
