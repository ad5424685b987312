"""The one interface between models/engine and a compute backend.

Models are written once against `Ops`; `backend/cpu` (numpy, float32, the
reference) and `backend/cuda` (NVRTC kernels + cuBLASLt) implement it.

Tensors are opaque to callers: `np.ndarray` on the CPU backend, a device tensor
on CUDA. Callers only read `.shape` and `.dtype` and pass tensors back to ops.
Shapes use these letters:
  T  tokens in the step (all sequences, flattened)      B  sequences in the step
  H  hidden size     V  vocab    I  intermediate size   D  head dim
  Hq query heads     Hkv kv heads
  NB kv blocks       BS block size (tokens per block)
  E  experts (MoE)   k  experts per token (top-k)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, Sequence

import numpy as np

from .linear_attention import DeltaNetShape, LinearAttention  # noqa: F401 (DeltaNetShape: part of the interface)
from .side_branch import Branching

Tensor = Any


class DeviceLostError(RuntimeError):
    """A sticky device error: the backend is unusable until the process restarts."""


@dataclass
class AttentionMetadata:
    """Where each sequence of a flattened step lives, in host numpy arrays.

    The backend uploads what it needs (`Ops.prepare_attention`).
    query_start_loc: [B+1] int32, row offsets of each sequence's new tokens in T.
    seq_lens:        [B] int32, context length after this step (cached + new).
    block_tables:    [B, max_blocks] int32, padded with 0 past a sequence's blocks.
    slot_mapping:    [T] int32, flat cache slot (block_id * BS + offset) for each new token.
    state_slots:     [B] int32, each sequence's slot in the linear-attention state pool (hybrid
                     models only; None otherwise).
    state_snapshots: [S, 3] int32 rows (sequence b, n, slot): after sequence b's first n new
                     tokens, copy its state to `slot` too (hybrid prefix caching, rollback
                     points); None for none.
    """

    query_start_loc: np.ndarray
    seq_lens: np.ndarray
    block_tables: np.ndarray
    slot_mapping: np.ndarray
    max_query_len: int
    max_seq_len: int
    state_slots: np.ndarray | None = None
    state_snapshots: np.ndarray | None = None

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)

    @property
    def is_decode_only(self) -> bool:
        return self.max_query_len == 1


@dataclass
class RopeConfig:
    """Rotary embedding, neox style (rotate halves), over the first `rotary_dim` dims.

    inv_freq: [rotary_dim // 2] float64, already scaled (e.g. llama3 scaling).
    attention_scaling: multiplier applied to cos/sin (1.0 for default rope).
    """

    rotary_dim: int
    inv_freq: np.ndarray
    attention_scaling: float = 1.0


@dataclass
class SamplingTensors:
    """Per-row sampling parameters for one step, host numpy arrays.

    Order of processing (matches vLLM / HF logits processors):
      penalties -> min-tokens ban -> temperature -> top-k -> top-p -> min-p -> draw.
    temperature:  [B] float32; 0 means greedy (argmax of the penalised logits).
    top_k:        [B] int32; 0 or >= V disables.
    top_p:        [B] float32 in (0, 1]; 1 disables.
    min_p:        [B] float32 in [0, 1]; 0 disables.
    repetition_penalty, presence_penalty, frequency_penalty: [B] float32 (1, 0, 0 disable).
    prompt_token_ids: [B, P] int32 padded with -1 (for the repetition penalty).
    output_token_ids: [B, L] int32 padded with -1 (all three penalties).
    banned_token_ids: [B, S] int32 padded with -1: set to -inf (min_tokens not yet reached).
    seeds:        [B] uint64 Philox keys, one per request.
    steps:        [B] int64 Philox counters: the index of the token being drawn.
    num_logprobs: max over rows of top logprobs wanted, -1 when no row wants logprobs.
    """

    temperature: np.ndarray
    top_k: np.ndarray
    top_p: np.ndarray
    min_p: np.ndarray
    repetition_penalty: np.ndarray
    presence_penalty: np.ndarray
    frequency_penalty: np.ndarray
    prompt_token_ids: np.ndarray
    output_token_ids: np.ndarray
    banned_token_ids: np.ndarray
    seeds: np.ndarray
    steps: np.ndarray
    num_logprobs: int = -1


@dataclass
class SamplerOutput:
    """Host results of `Ops.sample`.

    token_ids:      [B] int64 sampled ids.
    logprobs:       [B] float32 logprob of each sampled id under the raw model
                    distribution (log_softmax of the unprocessed logits), or None.
    ranks:          [B] int64 rank of each sampled id (1 = most likely), or None.
    top_ids:        [B, K] int64 most likely ids, descending, or None.
    top_logprobs:   [B, K] float32 their logprobs, or None.
    """

    token_ids: np.ndarray
    logprobs: np.ndarray | None = None
    ranks: np.ndarray | None = None
    top_ids: np.ndarray | None = None
    top_logprobs: np.ndarray | None = None


@dataclass
class SampledTokens:
    """What `Ops.sample_async` returns as soon as the draw is enqueued.

    token_ids: [B] int32 backend tensor of the drawn ids; the next step may read it
               (`copy_drawn_tokens_`) before the host knows them.
    result:    waits for the draw and returns the host results."""

    token_ids: Tensor
    result: Callable[[], SamplerOutput]


@dataclass(frozen=True)
class DrawnTokens:
    """A step's input ids that a step still in flight draws on the device:
    token_ids[rows[i]] = ids[drawn_rows[i]].

    rows, drawn_rows: [P] int32 host arrays; ids: [B'] int32 backend tensor (`SampledTokens.token_ids`)."""

    rows: np.ndarray
    ids: Tensor
    drawn_rows: np.ndarray


def column_ranges(width: int, widths: Sequence[int]) -> list[tuple[int, int]]:
    """`Ops.split_columns`' (start, stop) ranges of consecutive `widths` over `width` columns,
    or a ValueError when they do not add up to it."""
    if sum(widths) != width:
        raise ValueError(f"column widths {list(widths)} do not add up to x's {width}")
    bounds = np.cumsum([0, *widths]).tolist()
    return list(zip(bounds[:-1], bounds[1:]))


def pre_norm(ops: "Ops", x: Tensor, residual: Tensor | None, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """A decoder sublayer's input norm: (y, residual') as `Ops.add_rmsnorm`, or with no
    residual (the first layer's) (rmsnorm(x), x)."""
    if residual is None:
        return ops.rmsnorm(x, weight, eps), x
    return ops.add_rmsnorm(x, residual, weight, eps)


class Ops(Branching, LinearAttention, Protocol):
    """Compute backend. Every op is functional unless its name ends in `_`
    or it says it writes a cache; `beside` (side_branch.py) runs work concurrently; the hybrid
    models' state pool and gated delta net ops are LinearAttention's (linear_attention.py)."""

    name: str
    dtype: np.dtype  # activation/weight dtype of this backend instance

    # ---- memory ----
    def upload(self, array: np.ndarray, dtype: np.dtype | None = None) -> Tensor:
        """Host array -> backend tensor (cast to `dtype` if given)."""

    def download(self, x: Tensor) -> np.ndarray:
        """Backend tensor -> host numpy array (same shape; bf16 comes back as float32)."""

    def empty(self, shape: Sequence[int], dtype: np.dtype) -> Tensor: ...

    def allocate_kv_cache(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                          head_dim: int) -> list[tuple[Tensor, Tensor]]:
        """Per layer (k_cache, v_cache), each [NB, Hkv, BS, D] in `self.dtype`, zeroed."""

    def check_weights_fit(self, weight_bytes: int, gpu_memory_utilization: float) -> None:
        """ValueError naming both sizes when `weight_bytes` of weights cannot fit in device
        memory (before any is uploaded). CPU: nothing to check."""

    def load_kernels(self, progress: Callable[[str], None] | None = None) -> None:
        """Compile (or read from the cache) and load every kernel now, so that no step
        waits for a compiler. progress: gets a line per kernel source. CPU: nothing to do."""

    def bind_thread(self) -> None:
        """Make the backend usable from the calling thread (CUDA: make its context current)."""

    def decode_graph_runner(self, max_batch_size: int, max_blocks_per_seq: int, max_seq_len: int,
                            padding_state_slot: int | None = None) -> Any:
        """Something with `run(forward, token_ids, positions, meta) -> logits` that replays
        decode steps from captured graphs, or None where the backend has no graphs.
        padding_state_slot: a hybrid model's spare state slot, for a graph's padding rows."""

    def prepare_attention(self, meta: AttentionMetadata) -> Any:
        """Upload/plan a step's attention metadata once; the result is passed to
        every layer's `rope_write_kv`, `attention` and `rope_attention` call of that step."""

    # ---- compute ----
    def embedding(self, token_ids: Tensor, table: Tensor) -> Tensor:
        """token_ids [T] int32, table [V, H] -> [T, H]."""

    def rmsnorm(self, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        """RMSNorm over the last dim in fp32. x [..., D] (in weight's dtype or float32),
        weight [D] -> [..., D] in weight's dtype."""

    def add_rmsnorm(self, x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
        """residual' = x + residual; y = rmsnorm(residual'). Returns (y, residual').
        A backend may update `residual` in place and return it as residual'. residual' is
        float32 whatever x's dtype (a bf16 model's residual stream is not rounded between
        layers; `residual` may be x's dtype, the first layer's); y is in x's dtype."""

    def add_rmsnorm_linear(self, x: Tensor, residual: Tensor | None, norm_weight: Tensor, eps: float, weight: Tensor,
                           bias: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """A pre-norm and the projection after it: (linear(y, weight, bias), residual') with
        (y, residual') = `add_rmsnorm(x, residual, norm_weight, eps)`, or, with no residual (the
        first layer), y = rmsnorm(x) and residual' = x. x [T, K], weight [N, K] -> [T, N]. A GPU
        runs the norm inside the GEMV at one row (`pre_norm` then `linear` is the reference)."""

    def add_rmsnorm_linear_silu_and_mul(self, x: Tensor, residual: Tensor | None, norm_weight: Tensor, eps: float,
                                        weight: Tensor, bias: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """`add_rmsnorm_linear` with `linear_silu_and_mul` in place of `linear`:
        weight [gate | up] [2I, K] -> ([T, I], residual')."""

    def add_rmsnorm_for_router(self, x: Tensor, residual: Tensor, weight: Tensor,
                               eps: float) -> tuple[Tensor, Tensor, Tensor]:
        """`add_rmsnorm` that also returns y unrounded: (y, router_input, residual'), for a
        MoE router, whose top-k choice flips between near-tied experts on a rounding.
        router_input is y before its rounding in the form `sparse_moe`'s router GEMM takes
        with `router_weight`'s weight: float32 [T, H] (the reference), or in a bf16 / fp16
        model [T, 2H] = [y | what rounding y lost], in the model dtype, whose product with
        [W | W] is the unrounded rows' on 16-bit tensor cores (CUDA; y is a view of its first half)."""

    def router_weight(self, router: Tensor, shared_gate: Tensor | None = None) -> Tensor:
        """A MoE router's weight [E, H] as loaded (model dtype) -> the weight `sparse_moe`'s router
        GEMM takes beside `add_rmsnorm_for_router`'s router_input: float32 [E, H], or [E, 2H] =
        [W | W] in the model dtype where router_input is split. shared_gate [1, H]: a shared
        expert's gate, appended as row E (for `sparse_moe`'s shared_expert)."""

    def linear(self, x: Tensor, weight: Tensor, bias: Tensor | None = None, out_dtype: np.dtype | None = None) -> Tensor:
        """x [T, K], weight [N, K] (HF layout), bias [N] -> [T, N] in x's dtype, or in
        `out_dtype` float32 (accumulated and kept in fp32, e.g. router logits)."""

    def linear_silu_and_mul(self, x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
        """The gated MLP's first GEMM and its activation: `silu_and_mul(linear(x, weight, bias))`.
        x [T, K], weight [gate | up] [2I, K], bias [2I] -> [T, I]; a GPU fuses them at
        decode sizes, so the [T, 2I] product is never written."""

    def split_heads(self, qkv: Tensor, num_q_heads: int, num_kv_heads: int, head_dim: int) -> tuple[Tensor, Tensor, Tensor]:
        """qkv [T, (Hq + 2 Hkv) D] -> q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, D]."""

    def rope_write_kv(
        self, q: Tensor, k: Tensor, v: Tensor, positions: Tensor, rope: RopeConfig,
        k_cache: Tensor, v_cache: Tensor, attn: Any, qk_norm: tuple[Tensor, Tensor, float] | None = None,
    ) -> Tensor:
        """Rotate q and k at `positions` [T] int32, write rotated k and v into the
        caches at the step's slot mapping, return rotated q [T, Hq, D].

        qk_norm: (q_norm [D], k_norm [D], eps) to RMS-normalise every q and k head
        first (Qwen3), exactly `rmsnorm(q, q_norm, eps)` and `rmsnorm(k, k_norm, eps)`
        in the model dtype; one fused kernel on a GPU."""

    def attention(self, q: Tensor, k_cache: Tensor, v_cache: Tensor, attn: Any, scale: float) -> Tensor:
        """Causal paged attention with GQA. q [T, Hq, D] -> [T, Hq, D].

        Token t of sequence s at position p attends to cache slots 0..p of s,
        read through the block table."""

    def rope_attention(
        self, q: Tensor, k: Tensor, v: Tensor, positions: Tensor, rope: RopeConfig, k_cache: Tensor,
        v_cache: Tensor, attn: Any, scale: float, qk_norm: tuple[Tensor, Tensor, float] | None = None,
    ) -> Tensor:
        """`rope_write_kv` then `attention`: un-rotated q [T, Hq, D], k, v [T, Hkv, D] -> [T, Hq, D].
        The caches end as rope_write_kv leaves them; the rotated q is not returned, so a
        backend may fuse the two (CUDA does at decode-only steps of small batches)."""

    def silu_and_mul(self, x: Tensor) -> Tensor:
        """x [T, 2I] = [gate | up] -> silu(gate) * up, [T, I]."""

    def split_columns(self, x: Tensor, widths: Sequence[int]) -> list[Tensor]:
        """x [T, sum(widths)] -> views [T, w] of consecutive column ranges (rows strided), no copies."""

    def mul_sigmoid(self, x: Tensor, gate: Tensor, add_to: Tensor | None = None) -> Tensor:
        """x * sigmoid(gate) (+ add_to [T, N] in the same pass), gate [T, N] like x [T, N] or [T, 1]
        (one gate per row), in x's dtype. Qwen3-Next's attention output gate and shared expert's gate."""

    def moe_route(self, router_logits: Tensor, top_k: int, renormalize: bool) -> tuple[Tensor, Tensor]:
        """Pick each token's `top_k` experts: softmax over E in fp32, then top-k.

        router_logits [T, E] (any float dtype) -> (weights [T, k] float32, expert_ids [T, k] int32),
        each row in descending weight, ties going to the lower expert id. With
        `renormalize` the k weights of a row are divided by their sum (Mixtral,
        Qwen3-MoE's norm_topk_prob); without, they stay softmax probabilities over E.
        One fused kernel on a GPU; the pair goes straight into `moe_experts`."""

    def moe_experts(self, x: Tensor, gate_up: Tensor, down: Tensor, weights: Tensor, expert_ids: Tensor) -> Tensor:
        """Routed SiLU-gated expert MLPs, combined by the routing weights.

        x [T, H], gate_up [E, 2I, H] = [gate | up] per expert, down [E, H, I],
        weights [T, k] float32, expert_ids [T, k] int32 (from `moe_route`) ->
        out[t] = sum_j weights[t, j] * down[e] @ silu_and_mul(gate_up[e] @ x[t]), e = expert_ids[t, j],
        [T, H] in x's dtype. Each expert's output row is summed in fp32 and rounded to x's dtype
        (as transformers does), then weighted and summed over j in fp32. Experts no token chose
        are never read. A backend groups the T*k (token, expert) pairs by expert, runs one
        GEMM per expert on its group (a grouped GEMM on a GPU) and scatters the rows
        back to token order for the weighted combine."""

    def sparse_moe(self, x: Tensor, router_input: Tensor, router: Tensor, gate_up: Tensor, down: Tensor, top_k: int,
                   renormalize: bool, shared_expert: bool = False) -> Tensor:
        """The routed MoE block: the router GEMM (fp32 logits of the unrounded rows), `moe_route`,
        then `moe_experts`.

        x [T, H] (model dtype), router_input (the same rows before their rounding, from
        `add_rmsnorm_for_router`), router (from `router_weight`, E experts), gate_up [E, 2I, H],
        down [E, H, I] -> [T, H] in x's dtype. shared_expert: the router's last row is a shared
        expert's gate and the experts' last (expert E - 1 of gate_up's E) the shared expert; the
        routing takes top_k of the others, and every token also takes that one, weighted
        sigmoid(its gate logit) (cpu.moe.route_with_shared_expert).
        That composition is the reference (NumpyOps); a GPU routes and aligns the pairs
        for its grouped GEMMs in one launch. Each expert's output row is rounded to x's
        dtype before the fp32 weighted sum, as in `moe_experts`. A backend may return the sum
        still to be taken, as a value its ops that read a sublayer's output accept
        (`add_rmsnorm` and the pre-norm products, `add`, `mul_sigmoid`'s add_to): CUDA sums the
        rows in the next layer's norm."""

    def shared_expert_among_routed(self, num_tokens: int, top_k: int, num_experts: int) -> bool:
        """Whether a step of T tokens runs a shared expert of the routed experts' shape as one of
        them (`sparse_moe`'s shared_expert; num_experts counts it) rather than beside them, as a
        dense MLP: the same sum either way. The reference always folds it; a GPU folds it at the
        few tokens of a small decode step, where it costs what one more routed expert does, and
        runs it dense at more, where the expert GEMMs would stream it again per few rows."""

    def add(self, x: Tensor, y: Tensor) -> Tensor:
        """x + y in y's dtype; y of x's shape, in x's dtype or float32 (the residual stream,
        which stays float32: the final hidden states reach the last norm unrounded)."""

    def reshape(self, x: Tensor, shape: Sequence[int]) -> Tensor:
        """A view with a new shape (contiguous tensors only)."""

    def logits(self, hidden: Tensor, indices: Tensor, norm_weight: Tensor, eps: float, lm_head: Tensor) -> Tensor:
        """Final norm + lm_head for the rows `indices` [B] int32 only.
        hidden [T, H], lm_head [V, H] -> logits [B, V] float32."""

    def sample(self, logits: Tensor, params: SamplingTensors) -> SamplerOutput:
        """Process and draw one token per row. logits [B, V] float32."""

    def sample_async(self, logits: Tensor, params: SamplingTensors) -> SampledTokens:
        """`sample`, returning once the draw is enqueued."""

    def copy_drawn_tokens_(self, token_ids: Tensor, drawn: DrawnTokens) -> None:
        """Put a step's input ids that an earlier step drew on the device into token_ids [T] int32."""
