"""`Ops.beside` on the device (CudaOps' side stream): the MoE block with its shared expert beside
the routed experts gives the bits of the sequential order, eagerly and replayed from a graph, at
decode and prefill sizes (the router's one launch; the router GEMM on cuBLASLt beside the shared
expert's, each on its own workspace; the grouped expert GEMMs); a block the side work drops
reaches no main-stream allocation before the join; side work may not upload."""

from __future__ import annotations

import numpy as np
import pytest

from moe_blocks import sequential_forward, shared_expert_block
from sparkd.backend.dtypes import DType, encode

pytestmark = pytest.mark.gpu

HIDDEN = 1024


@pytest.fixture(scope="module")
def block(cuda_ops_factory):
    """64 experts of 256, 8 a token, and a shared expert of 256, in bf16."""
    ops = cuda_ops_factory("bfloat16")
    return shared_expert_block(ops, np.random.default_rng(0), hidden=HIDDEN, num_experts=64, top_k=8,
                               intermediate=256, shared=256)


def block_inputs(ops, rng, tokens):
    """x, residual and the norm weight in bf16: a residual not yet fp32 is not updated in place, so a
    graph replays the same step."""
    x, residual = (ops.upload(rng.standard_normal((tokens, HIDDEN)).astype(np.float32), ops.dtype) for _ in range(2))
    return x, residual, ops.upload((1 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32), ops.dtype)


def downloaded(ops, tensors):
    return [ops.download(t) for t in tensors]


def assert_same_bits(actual, expected):
    for a, e in zip(actual, expected, strict=True):
        np.testing.assert_array_equal(a, e)


@pytest.mark.parametrize("tokens", [1, 8, 256])
def test_the_shared_expert_beside_the_routed_experts_gives_the_sequential_bits(block, tokens):
    ops = block.ops
    x, residual, norm = block_inputs(ops, np.random.default_rng(tokens), tokens)
    expected = downloaded(ops, sequential_forward(block, x, residual, norm))
    assert_same_bits(downloaded(ops, block.forward(x, residual, norm)), expected)


@pytest.mark.parametrize("tokens", [1, 8])
def test_a_graph_of_the_block_replays_its_side_branch_on_new_inputs(block, tokens):
    """The side branch is captured with the rest (both streams leave capture mode at its end) and
    reads the live x at each replay."""
    from sparkd.backend.cuda.graphs import capture
    from sparkd.backend.cuda.memory import MemoryPool

    ops = block.ops
    rng = np.random.default_rng(10 + tokens)
    x, residual, norm = block_inputs(ops, rng, tokens)
    block.forward(x, residual, norm)  # warm-up: plans and kernels, as a decode graph's capture has
    pool = MemoryPool("test graphs")
    with ops.allocator.use_pool(pool):
        graph, outputs = capture(ops.stream, lambda: block.forward(x, residual, norm))
    try:
        assert not ops.stream.is_capturing() and not ops.lanes.side.stream.is_capturing()
        for _ in range(2):
            new_x = rng.standard_normal((tokens, HIDDEN)).astype(np.float32)
            ops.staging.upload([encode(new_x, ops.dtype)], dest=x, dtypes=[ops.dtype])
            graph.replay(ops.stream)
            assert_same_bits(downloaded(ops, outputs), downloaded(ops, sequential_forward(block, x, residual, norm)))
    finally:
        graph.destroy()
        ops.synchronize()
        ops.allocator.release_cached(pool)


def test_a_block_the_side_work_drops_reaches_main_stream_work_only_after_the_join(cuda_ops_factory):
    ops = cuda_ops_factory("float32")
    shape = (4096,)
    with ops.beside(lambda: ops.empty(shape, DType.float32).ptr) as side:  # the tensor dies at once
        beside_it = ops.empty(shape, DType.float32).ptr
    assert beside_it != side.result
    assert ops.empty(shape, DType.float32).ptr in (side.result, beside_it)  # both free again


def test_side_work_may_not_upload(cuda_ops_factory):
    ops = cuda_ops_factory("float32")
    with pytest.raises(RuntimeError, match="an upload inside side work"):
        with ops.beside(lambda: ops.upload(np.zeros(4, np.float32))):
            pass
    assert ops.lanes.current is ops.lanes.main
    np.testing.assert_array_equal(ops.download(ops.upload(np.arange(4, dtype=np.float32))), np.arange(4))
