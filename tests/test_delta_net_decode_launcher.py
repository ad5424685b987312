"""Host side of the gated delta net's fused decode tail (sparkd/backend/cuda/kernels/delta_net_decode.py)
and of CudaOps' choice between it and the three launches it replaces (DeltaNetOps.gated_delta_net),
no GPU: which launches a step makes, with which grids, blocks and clusters; the preconditions the
launcher checks; the cluster launch configuration. Tensors here point nowhere; a check that let one
through would reach the driver and fail there instead of raising ValueError."""

from __future__ import annotations

import pytest

pytest.importorskip("cuda.bindings.nvrtc")

from device_fakes import FakeAllocator, fake_tensor  # noqa: E402

from sparkd.backend.base import DeltaNetShape  # noqa: E402
from sparkd.backend.cuda.attention_metadata import CudaAttentionMetadata  # noqa: E402
from sparkd.backend.cuda.delta_net_ops import DeltaNetOps  # noqa: E402
from sparkd.backend.cuda.kernels import delta_net, delta_net_decode  # noqa: E402
from sparkd.backend.cuda.launch import cluster_launch_config  # noqa: E402

QWEN3_NEXT = DeltaNetShape(16, 128, 32, 128)


class FakeDeltaNetOps(DeltaNetOps):
    """DeltaNetOps as CudaOps mixes it in, over fake memory and no stream."""

    def __init__(self):
        self.allocator, self.stream = FakeAllocator(), None


@pytest.fixture
def launches(monkeypatch):
    """Every launch the delta-net launchers make: (kernel name, grid, block, cluster)."""
    recorded = []

    class Recorded:
        def __init__(self, spec):
            self.spec = spec

        def launch(self, grid, block, args, shared_mem=0, stream=None, cluster=None):
            recorded.append((self.spec.name, grid, block, cluster))

    for module in (delta_net, delta_net_decode):
        monkeypatch.setattr(module, "get_kernel", Recorded)
    return recorded


def step(num_seqs: int, query_len: int, state_slots: bool = True) -> CudaAttentionMetadata:
    """A step of num_seqs sequences of query_len new tokens each."""
    ids = fake_tensor((num_seqs,), "int32", ptr=0x90000)
    starts = fake_tensor((num_seqs + 1,), "int32", ptr=0x98000)
    slots = (ids, starts) if state_slots else ()
    return CudaAttentionMetadata(starts, ids, fake_tensor((num_seqs, 1), "int32"),
                                 fake_tensor((num_seqs * query_len,), "int32"), query_len, query_len + 40, *slots)


def operands(shape: DeltaNetShape, tokens: int, dtype: str = "bfloat16", **changed) -> dict:
    """gated_delta_net's tensors by name, [q | k | v | z | b | a] column ranges of one in_proj output;
    `changed` replaces any of them."""
    hv, dv = shape.num_v_heads, shape.v_dim
    projected = fake_tensor((tokens, shape.conv_dim + hv * dv + 2 * hv), dtype, ptr=0x200000)
    mixed, z, b, a = (projected.column_slice(lo, width) for lo, width in
                      ((0, shape.conv_dim), (shape.conv_dim, hv * dv), (shape.conv_dim + hv * dv, hv),
                       (shape.conv_dim + hv * dv + hv, hv)))
    tensors = {"mixed_qkv": mixed, "a": a, "b": b, "a_log": fake_tensor((hv,), dtype), "dt_bias": fake_tensor((hv,), dtype),
               "z": z, "norm_weight": fake_tensor((dv,), dtype),
               "state": fake_tensor((4, hv, shape.k_dim, dv), "float32", ptr=0x4000000)}
    return {**tensors, **changed}


def run_op(shape: DeltaNetShape, attn: CudaAttentionMetadata, **changed) -> None:
    t = operands(shape, attn.slot_mapping.shape[0], **changed)
    FakeDeltaNetOps().gated_delta_net(t["mixed_qkv"], t["a"], t["b"], t["a_log"], t["dt_bias"], t["z"],
                                      t["norm_weight"], 1e-6, t["state"], attn, shape)


def launch_fused(shape: DeltaNetShape, attn: CudaAttentionMetadata, **changed) -> None:
    t = operands(shape, attn.slot_mapping.shape[0], **changed)
    out = fake_tensor((t["mixed_qkv"].shape[0], shape.num_v_heads * shape.v_dim), t["mixed_qkv"].dtype.name)
    delta_net_decode.gated_delta_net_decode(out, t["mixed_qkv"], t["a"], t["b"], t["a_log"], t["dt_bias"], t["z"],
                                            t["norm_weight"], 1e-6, t["state"], attn, shape, None)


@pytest.mark.parametrize("shape, num_seqs, query_len, expected", [
    # Qwen3-Next: a head's 128 columns in 8 blocks of 16, one cluster; 256 blocks at batch 1.
    (QWEN3_NEXT, 1, 1, ("<__nv_bfloat16, float, 128>", (32, 1, 8), 128, (1, 1, 8))),
    (QWEN3_NEXT, delta_net_decode.FUSED_MAX_SEQS, 1,
     ("<__nv_bfloat16, float, 128>", (32, delta_net_decode.FUSED_MAX_SEQS, 8), 128, (1, 1, 8))),
    (DeltaNetShape(2, 96, 4, 40), 3, 1, ("<__nv_bfloat16, float, 128>", (4, 3, 3), 128, (1, 1, 3))),  # 16 + 16 + 8
    (DeltaNetShape(2, 64, 4, 64), 2, 1, ("<__nv_bfloat16, float, 64>", (4, 2, 2), 128, (1, 1, 2))),  # 32 columns a block
    (DeltaNetShape(2, 32, 4, 48), 2, 1, ("<__nv_bfloat16, float, 32>", (4, 2, 1), 96, (1, 1, 1))),  # 48 in one block
    # Heads the chunked form does not take (not multiples of 4) run token by token at any length: fused too.
    (DeltaNetShape(1, 102, 2, 102), 2, 70, ("<__nv_bfloat16, float, 128>", (2, 2, 7), 128, (1, 1, 7))),
])
def test_the_steps_the_token_by_token_rule_takes_are_one_clustered_launch(launches, shape, num_seqs, query_len,
                                                                          expected):
    run_op(shape, step(num_seqs, query_len))
    params, grid, block, cluster = expected
    assert launches == [(f"gated_delta_net_decode_kernel{params}", grid, block, cluster)]
    assert launches[0][0] in {spec.name for spec in delta_net_decode.SPECS}


@pytest.mark.parametrize("shape, query_len, norm_dim, kernels", [
    (QWEN3_NEXT, 70, 128, ["delta_net_gates_kernel", "delta_chunk_prepare_kernel", "delta_chunk_state_kernel",
                           "gated_rmsnorm_kernel"]),  # prefill: the chunked rule
    (QWEN3_NEXT, 4, 128, ["delta_net_gates_kernel", "delta_chunk_prepare_kernel", "delta_chunk_state_kernel",
                          "gated_rmsnorm_kernel"]),  # a verify step's 4 tokens take the chunked form too
    (DeltaNetShape(2, 128, 4, 144), 1, 144, ["delta_net_gates_kernel", "gated_delta_rule_kernel",
                                             "gated_rmsnorm_kernel"]),  # 9 blocks a head: past one cluster
    (QWEN3_NEXT, 1, 64, ["delta_net_gates_kernel", "gated_delta_rule_kernel",
                         "gated_rmsnorm_kernel"]),  # the norm's groups are not the heads
], ids=["prefill", "verify", "9-blocks", "groups-not-heads"])
def test_other_steps_take_the_three_launches(launches, shape, query_len, norm_dim, kernels):
    run_op(shape, step(2, query_len), norm_weight=fake_tensor((norm_dim,)))
    assert [name.split("<")[0] for name, *_ in launches] == kernels


def test_decode_batches_past_the_fused_limit_take_the_three_launches(launches):
    run_op(QWEN3_NEXT, step(delta_net_decode.FUSED_MAX_SEQS + 1, 1))
    assert [name.split("<")[0] for name, *_ in launches] == ["delta_net_gates_kernel", "gated_delta_rule_kernel",
                                                             "gated_rmsnorm_kernel"]


def test_heads_neither_path_takes_are_refused_as_before(launches):
    with pytest.raises(ValueError, match="dk must be at most 128"):
        run_op(DeltaNetShape(1, 256, 1, 32), step(1, 1))


def test_an_empty_step_launches_nothing(launches):
    run_op(QWEN3_NEXT, step(0, 1))
    assert launches == []


def _restrided(tensor, extra: int):
    """tensor's view with rows `extra` elements further apart."""
    return fake_tensor(tensor.shape, tensor.dtype.name, ptr=tensor.ptr, strides=(tensor.strides[0] + extra, 1))


@pytest.mark.parametrize("changed, message", [
    ({"z": fake_tensor((1, 4095))}, r"z must be \[1, 4096\] bfloat16"),
    ({"z": fake_tensor((1, 4096), "float32")}, r"z must be \[1, 4096\] bfloat16"),
    ({"norm_weight": fake_tensor((128,), "float32")}, r"norm_weight must be \[128\] bfloat16"),
    ({"a_log": fake_tensor((16,))}, r"a_log must be \[32\] bfloat16"),
    ({"a": fake_tensor((1, 32), "float32")}, "a and b must be"),
    ({"state": fake_tensor((4, 32, 128, 128), "int32")}, "state must be float32 or float16 or bfloat16"),
    ({"state": fake_tensor((4, 32, 128, 64), "float32")}, r"state must be a contiguous \[slots, 32, 128, 128\]"),
    ({"mixed_qkv": fake_tensor((1, 8190))}, r"mixed_qkv must be \[T, 8192\]"),
])
def test_the_fused_launcher_rejects_what_its_kernel_cannot_run(launches, changed, message):
    with pytest.raises(ValueError, match=message):
        launch_fused(QWEN3_NEXT, step(1, 1), **changed)
    assert launches == []


def test_the_fused_launcher_rejects_spaced_gates_and_heads_past_one_cluster(launches):
    t = operands(QWEN3_NEXT, 2)
    with pytest.raises(ValueError, match="a and b must be .* one dtype and row stride"):
        launch_fused(QWEN3_NEXT, step(2, 1), a=_restrided(t["a"], 8))
    wide = DeltaNetShape(2, 128, 4, 144)
    with pytest.raises(ValueError, match="a head's blocks in one cluster of at most 8, got dk 128, dv 144"):
        launch_fused(wide, step(1, 1))
    with pytest.raises(ValueError, match="needs the step's state slots"):
        launch_fused(QWEN3_NEXT, step(1, 1, state_slots=False))
    assert launches == []


def test_a_verify_step_may_launch_the_fused_kernel_directly(launches):
    """The kernel walks several tokens a sequence (with snapshots) as the token-by-token rule does;
    the op leaves such steps to the chunked form (pick_form), the launcher takes them."""
    launch_fused(QWEN3_NEXT, step(3, 4))
    assert launches == [("gated_delta_net_decode_kernel<__nv_bfloat16, float, 128>", (32, 3, 8), 128, (1, 1, 8))]


def test_cluster_launch_config_sets_the_cluster_dims_attribute():
    from cuda.bindings import driver

    config = cluster_launch_config((32, 5, 8), 128, (1, 1, 8), 0, driver.CUstream(0))
    assert (config.gridDimX, config.gridDimY, config.gridDimZ) == (32, 5, 8)
    assert (config.blockDimX, config.blockDimY, config.blockDimZ) == (128, 1, 1)
    assert config.numAttrs == 1
    [attribute] = config.attrs
    assert attribute.id == driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
    assert (attribute.value.clusterDim.x, attribute.value.clusterDim.y, attribute.value.clusterDim.z) == (1, 1, 8)
    with pytest.raises(ValueError, match=r"cluster dims \(1, 1, 3\) must divide the grid's \(32, 5, 8\)"):
        cluster_launch_config((32, 5, 8), 128, (1, 1, 3), 0, driver.CUstream(0))
