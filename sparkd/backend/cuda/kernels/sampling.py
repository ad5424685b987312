"""Token sampling on the device, the twin of sparkd/backend/cpu/sampler.py: same
processing order, same Philox draws, so the chosen ids agree whenever no two
candidates tie to within float rounding.

Greedy steps with nothing to process (temperature 0 everywhere, no penalty or
ban: `is_plain_greedy`) take their own kernel (cukernels/sampling_greedy.cu),
which reads no parameters, so none are uploaded. Otherwise two kernels: small
batches spread each row over many blocks (cukernels/sampling_split.cu, planned
by `plan_split`), so that one row still uses the whole GPU; batches that fill it
run one block per row (cukernels/sampling.cu). Both draw top-k / top-p rows from
a short sorted list of candidates (cukernels/sampling_candidates.cuh) when it
fits in shared memory (ROW_CANDIDATES, SPLIT_CANDIDATES), else by radix descents
over the whole row. Logprobs after a split or greedy draw come from a second,
one-block-per-row launch.

For CudaOps:
  sample_async(logits, params, staging, downloads, allocator, stream) -> SampledTokens
      the whole step: one H2D copy of the parameters (none for a plain greedy
      step), the sampling launch(es), which write the ids (and logprobs when
      params.num_logprobs >= 0) into a mapped download slot that the caller
      reads when it wants the results.
The pieces, for callers that keep inputs in static buffers (graphs):
  upload_inputs(params, staging, dest=None) -> SamplingInputs
  SamplerBuffers.allocate(allocator, num_rows, num_top), or .over(storage, ...)
  launch_sample(out, logits, inputs, workspace, stream), or launch_greedy(out, logits, stream)
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, fields

import numpy as np
from cuda.bindings import driver

from ...base import SampledTokens, SamplerOutput, SamplingTensors
from ...dtypes import DType
from ..compiler import KernelSpec, get_kernel
from ..driver import Stream, call, current_device
from ..memory import DeviceAllocator
from ..tensor import DeviceTensor
from ..transfer import DownloadRing, StagingRing
from . import i32, require, require_contiguous, require_dtype, round_up

_ROW_SPEC = KernelSpec("sampling.cu", "sample_kernel")
_LOGPROBS_SPEC = KernelSpec("sampling.cu", "logprobs_kernel")
_SPLIT_SPEC = KernelSpec("sampling_split.cu", "sample_split_kernel")
_GREEDY_SPEC = KernelSpec("sampling_greedy.cu", "sample_greedy_kernel")
SPECS = [_ROW_SPEC, _LOGPROBS_SPEC, _SPLIT_SPEC, _GREEDY_SPEC]
_THREADS = 1024  # kThreads in sampling.cu
_SPLIT_THREADS = 256  # kSplitThreads in sampling_split.cu
MAX_TOP_LOGPROBS = 64  # kMaxTop in sampling.cu
MAX_SPLIT_ROWS = 64  # kMaxSplitRows in sampling_split.cu
ROW_CANDIDATES = 4096  # kRowCandidates in sampling.cu
SPLIT_CANDIDATES = 4096  # kSplitCandidates in sampling_split.cu
MAX_VOCAB = 1 << 20  # fixed-point row masses (kMassScale in sampling_common.cuh) stay below 2^64
# Ids per block of a split row: at least MIN_CHUNK (two per thread, or the barriers
# cost more than the blocks save), at most MAX_CHUNK (the chunk sits in shared memory).
MIN_CHUNK, MAX_CHUNK = 512, 4096
_GREEDY_THREADS = 256  # kGreedyThreads in sampling_greedy.cu
MAX_GREEDY_ROWS = 4096  # kMaxGreedyRows in sampling_greedy.cu
GREEDY_CHUNK = 1024  # ids a greedy block takes at least: four loads a thread


@dataclass(frozen=True)
class SplitPlan:
    """Each row's ids cut into `splits` chunks of `chunk` ids (a multiple of 4), one block each."""

    splits: int
    chunk: int


def plan_split(num_rows: int, vocab_size: int, num_sms: int, resident_blocks: int) -> SplitPlan | None:
    """How sample_split_kernel cuts the rows, or None for one block per row.

    Enough blocks to give every SM one (fewer for short rows: MIN_CHUNK ids each at
    least), no more than MAX_CHUNK ids a block; split only while that takes at least
    two blocks a row and the whole grid is resident at once (`resident_blocks`, the
    device's capacity at the kernel's occupancy), since a row's blocks wait for each other."""
    if not 0 < num_rows <= MAX_SPLIT_ROWS:
        return None
    splits = max(math.ceil(vocab_size / MAX_CHUNK), min(num_sms // num_rows, math.ceil(vocab_size / MIN_CHUNK)))
    chunk = round_up(math.ceil(vocab_size / max(splits, 1)), 4)
    splits = math.ceil(vocab_size / chunk)
    if splits < 2 or num_rows * splits > resident_blocks:
        return None
    return SplitPlan(splits, chunk)


@functools.cache
def _resident_split_blocks() -> int:
    """Blocks of sample_split_kernel the device holds at once, at the largest chunk."""
    kernel, shared = get_kernel(_SPLIT_SPEC), _split_shared_bytes(MAX_CHUNK)
    kernel.allow_dynamic_shared(shared)
    per_sm = call(driver.cuOccupancyMaxActiveBlocksPerMultiprocessor, kernel.function, _SPLIT_THREADS, shared)
    return current_device().sm_count * per_sm


def _split_shared_bytes(chunk: int) -> int:
    """sample_split_kernel's dynamic shared memory: the chunk's values or the row's candidates."""
    return max(4 * chunk, 8 * SPLIT_CANDIDATES)


def _row_shared_bytes(vocab_size: int) -> int:
    """sample_kernel's dynamic shared memory: the candidates and the bitmap of penalised ids."""
    return 8 * ROW_CANDIDATES + 4 * math.ceil(vocab_size / 32)


def device_split_plan(num_rows: int, vocab_size: int) -> SplitPlan | None:
    """`plan_split` for the current device."""
    if not 0 < num_rows <= MAX_SPLIT_ROWS:
        return None
    return plan_split(num_rows, vocab_size, current_device().sm_count, _resident_split_blocks())


@dataclass
class SamplingInputs:
    """`SamplingTensors` on the device, field for field (B rows).

    temperature, top_p, min_p, repetition/presence/frequency_penalty: [B] float32;
    top_k: [B] int32; prompt/output/banned_token_ids: [B, P|L|S] int32 padded
    with -1; seeds: [B] int64 holding the uint64 bits; steps: [B] int64.
    needs_workspace: some row has a penalty or a banned id."""

    temperature: DeviceTensor
    top_k: DeviceTensor
    top_p: DeviceTensor
    min_p: DeviceTensor
    repetition_penalty: DeviceTensor
    presence_penalty: DeviceTensor
    frequency_penalty: DeviceTensor
    prompt_token_ids: DeviceTensor
    output_token_ids: DeviceTensor
    banned_token_ids: DeviceTensor
    seeds: DeviceTensor
    steps: DeviceTensor
    needs_workspace: bool

    @property
    def num_rows(self) -> int:
        return self.temperature.shape[0]


_FLOAT_FIELDS = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")
_ID_FIELDS = ("prompt_token_ids", "output_token_ids", "banned_token_ids")
# SamplingInputs' arrays in field order with their device dtypes, worked out once: this runs every step.
_ARRAY_FIELDS = [f.name for f in fields(SamplingInputs) if f.name != "needs_workspace"]
_ARRAY_DTYPES = [DType.float32 if name in _FLOAT_FIELDS else DType.int64 if name in ("seeds", "steps")
                 else DType.int32 for name in _ARRAY_FIELDS]


def host_inputs(params: SamplingTensors) -> list[np.ndarray]:
    """The arrays of `SamplingInputs`, in field order, in their device representation."""
    arrays = []
    for name, dtype in zip(_ARRAY_FIELDS, _ARRAY_DTYPES):
        value = getattr(params, name)
        if name == "seeds":
            value = np.asarray(value, np.uint64).view(np.int64)  # the kernel reads the uint64 bits as int64
        arrays.append(np.asarray(value, dtype.host))
    return arrays


def _processes_logits(params: SamplingTensors) -> bool:
    """Whether some row has a penalty or a banned id."""
    return bool(np.any(params.repetition_penalty != 1) or np.any(params.presence_penalty != 0)
                or np.any(params.frequency_penalty != 0) or np.any(params.banned_token_ids >= 0))


def is_plain_greedy(params: SamplingTensors) -> bool:
    """Whether every row takes its largest raw logit (temperature 0, nothing processed): then
    `launch_greedy` draws the step, with no parameters on the device."""
    return (len(params.temperature) <= MAX_GREEDY_ROWS and not np.any(params.temperature != 0)
            and not _processes_logits(params))


def upload_inputs(params: SamplingTensors, staging: StagingRing, dest: DeviceTensor | None = None) -> SamplingInputs:
    """One H2D copy of the step's sampling parameters (into `dest` if given, see StagingRing.upload)."""
    needs_workspace = _processes_logits(params)
    arrays = staging.upload(host_inputs(params), dest=dest, dtypes=_ARRAY_DTYPES)
    return SamplingInputs(*arrays, needs_workspace=needs_workspace)


@dataclass
class SamplerBuffers:
    """One launch's device outputs, views of a single int32 allocation so that one
    D2H copy brings them back: token_ids [B] int32, and when num_top >= 0
    logprobs [B] float32, ranks [B] int32, top_ids [B, K] int32, top_logprobs [B, K] float32."""

    storage: DeviceTensor
    token_ids: DeviceTensor
    logprobs: DeviceTensor
    ranks: DeviceTensor
    top_ids: DeviceTensor
    top_logprobs: DeviceTensor
    num_top: int  # K, or -1 for no logprobs

    @classmethod
    def allocate(cls, allocator: DeviceAllocator, num_rows: int, num_top: int) -> SamplerBuffers:
        """Outputs in device memory, brought back by `download_async`."""
        return cls.over(allocator.empty((cls.words(num_rows, num_top),), DType.int32), num_rows, num_top)

    @staticmethod
    def _shapes(num_rows: int, num_top: int) -> list[tuple[tuple[int, ...], DType]]:
        top = max(num_top, 0)
        shapes = [((num_rows,), DType.int32), ((num_rows,), DType.float32), ((num_rows,), DType.int32),
                  ((num_rows, top), DType.int32), ((num_rows, top), DType.float32)]
        return shapes if num_top >= 0 else shapes[:1]

    @classmethod
    def words(cls, num_rows: int, num_top: int) -> int:
        """The int32 words of the storage."""
        return sum(int(np.prod(shape)) for shape, _ in cls._shapes(num_rows, num_top))

    @classmethod
    def over(cls, storage: DeviceTensor, num_rows: int, num_top: int) -> SamplerBuffers:
        """The outputs as views of storage: int32 [words(num_rows, num_top)], anywhere the device
        writes (device memory, or a mapped pinned slot the host reads without a copy)."""
        views, offset = [], 0
        for shape, dtype in cls._shapes(num_rows, num_top):
            views.append(DeviceTensor(storage.ptr + 4 * offset, shape, dtype, None, storage.owner))
            offset += int(np.prod(shape))
        views += [views[0]] * (5 - len(views))  # unused outputs; the kernel never touches them
        return cls(storage, *views, num_top=num_top)

    def download_async(self, downloads: DownloadRing, stream: Stream) -> SampledTokens:
        """Enqueue the D2H copy of device-memory outputs; `.result()` waits for it."""
        return self.results(downloads.copy_async(self.storage, stream))

    def results(self, wait) -> SampledTokens:
        """SampledTokens whose `.result()` parses what wait() -> uint8 host copy of the storage
        returns. Ids come back as int64, as the CPU sampler returns them."""
        return SampledTokens(self.token_ids, lambda: self._parse(wait().view(np.int32)))

    def _parse(self, host: np.ndarray) -> SamplerOutput:
        """host: the storage's int32 words."""
        num_rows = self.token_ids.shape[0]
        token_ids = host[:num_rows].astype(np.int64)
        if self.num_top < 0:
            return SamplerOutput(token_ids=token_ids)
        top_end = 3 * num_rows + num_rows * self.num_top
        return SamplerOutput(
            token_ids=token_ids,
            logprobs=host[num_rows : 2 * num_rows].view(np.float32).copy(),
            ranks=host[2 * num_rows : 3 * num_rows].astype(np.int64),
            top_ids=host[3 * num_rows : top_end].reshape(num_rows, self.num_top).astype(np.int64),
            top_logprobs=host[top_end:].view(np.float32).reshape(num_rows, self.num_top).copy(),
        )


def num_top_logprobs(num_logprobs: int, vocab_size: int) -> int:
    """K for `SamplerBuffers`: -1 (no logprobs) or min(num_logprobs, V)."""
    if num_logprobs < 0:
        return -1
    require(num_logprobs <= MAX_TOP_LOGPROBS, f"num_logprobs must be at most {MAX_TOP_LOGPROBS}, got {num_logprobs}")
    return min(num_logprobs, vocab_size)


def launch_sample(out: SamplerBuffers, logits: DeviceTensor, inputs: SamplingInputs,
                  workspace: DeviceTensor | None, stream: Stream, split: bool = True) -> None:
    """Enqueue the sampling of logits [B, V] float32 (raw): split rows when
    `device_split_plan` says so (and `split`), else one block per row.

    workspace: [B, V] float32 scratch for the penalised ids of the one-block-per-row
    kernel; may be None when `inputs.needs_workspace` is false or the launch splits
    (`needs_row_workspace`). Capturable: no host sync, no allocation."""
    _check_draw(out, logits)
    num_rows, vocab_size = logits.shape
    require(inputs.num_rows == num_rows, f"sampling inputs have {inputs.num_rows} rows, logits {num_rows}")
    for name in _ID_FIELDS:
        ids = getattr(inputs, name)
        require(ids.ndim == 2 and ids.shape[0] == num_rows, f"{name} must be [B={num_rows}, n], got {ids.shape}")
    if num_rows == 0:
        return
    plan = device_split_plan(num_rows, vocab_size) if split else None
    if plan is None:
        _launch_row_per_block(out, logits, inputs, workspace, stream)
        return
    args = [out.token_ids, logits, i32(vocab_size), i32(plan.chunk), *_parameter_args(inputs)]
    get_kernel(_SPLIT_SPEC).launch((plan.splits, num_rows), _SPLIT_THREADS, args,
                                   shared_mem=_split_shared_bytes(plan.chunk), stream=stream)
    _launch_logprobs(out, logits, stream)


def launch_greedy(out: SamplerBuffers, logits: DeviceTensor, stream: Stream) -> None:
    """Enqueue the plain greedy draw (`is_plain_greedy`) of logits [B, V] float32, B <=
    MAX_GREEDY_ROWS: each row's largest logit, the lowest id among ties; logprobs after it
    when out has them. Every row gets blocks of GREEDY_CHUNK ids or more, about two blocks an SM
    in all. Capturable."""
    _check_draw(out, logits)
    num_rows, vocab_size = logits.shape
    require(num_rows <= MAX_GREEDY_ROWS, f"greedy draws take at most {MAX_GREEDY_ROWS} rows, got {num_rows}")
    if num_rows == 0:
        return
    splits = max(1, min(math.ceil(vocab_size / GREEDY_CHUNK), math.ceil(2 * current_device().sm_count / num_rows)))
    chunk = math.ceil(vocab_size / splits)
    get_kernel(_GREEDY_SPEC).launch((math.ceil(vocab_size / chunk), num_rows), _GREEDY_THREADS,
                                    [out.token_ids, logits, i32(vocab_size), i32(chunk)], stream=stream)
    _launch_logprobs(out, logits, stream)


def _check_draw(out: SamplerBuffers, logits: DeviceTensor) -> None:
    """What every draw asks of logits [B, V] float32 (contiguous, V <= MAX_VOCAB) and of out."""
    require(logits.ndim == 2, f"logits must be [B, V], got shape {logits.shape}")
    require_dtype("logits", logits, DType.float32)
    require_contiguous("logits", logits)
    num_rows, vocab_size = logits.shape
    require(vocab_size <= MAX_VOCAB, f"logits must have at most {MAX_VOCAB} columns, got {vocab_size}")
    require(out.token_ids.shape == (num_rows,), f"outputs are for {out.token_ids.shape[0]} rows, logits have {num_rows}")
    require(out.num_top <= min(vocab_size, MAX_TOP_LOGPROBS), f"num_top {out.num_top} exceeds min(V, {MAX_TOP_LOGPROBS})")


def _launch_logprobs(out: SamplerBuffers, logits: DeviceTensor, stream: Stream) -> None:
    """After a launch that drew out.token_ids only: their logprobs (of the raw logits), when out has them."""
    if out.num_top >= 0:
        get_kernel(_LOGPROBS_SPEC).launch(
            logits.shape[0], _THREADS, [out.token_ids, out.logprobs, out.ranks, out.top_ids, out.top_logprobs, logits,
                                        i32(logits.shape[1]), i32(out.num_top)], stream=stream)


def needs_row_workspace(inputs: SamplingInputs, logits: DeviceTensor, split: bool = True) -> bool:
    """Whether `launch_sample` needs its [B, V] float32 workspace for these inputs."""
    return inputs.needs_workspace and not (split and device_split_plan(*logits.shape) is not None)


def _parameter_args(inputs: SamplingInputs) -> list:
    """The per-row parameters and id lists, in the kernels' argument order."""
    return [inputs.temperature, inputs.top_k, inputs.top_p, inputs.min_p, inputs.repetition_penalty,
            inputs.presence_penalty, inputs.frequency_penalty,
            inputs.prompt_token_ids, i32(inputs.prompt_token_ids.shape[1]),
            inputs.output_token_ids, i32(inputs.output_token_ids.shape[1]),
            inputs.banned_token_ids, i32(inputs.banned_token_ids.shape[1]),
            inputs.seeds, inputs.steps]


def _launch_row_per_block(out: SamplerBuffers, logits: DeviceTensor, inputs: SamplingInputs,
                          workspace: DeviceTensor | None, stream: Stream) -> None:
    if inputs.needs_workspace:
        require(workspace is not None and workspace.shape == logits.shape and workspace.dtype is DType.float32,
                f"penalties or banned ids need a float32 workspace of shape {logits.shape}, got {workspace}")
        require_contiguous("workspace", workspace)
    args = [out.token_ids, out.logprobs, out.ranks, out.top_ids, out.top_logprobs,
            workspace if workspace is not None else np.uint64(0), logits, i32(logits.shape[1]),
            *_parameter_args(inputs), i32(out.num_top)]
    get_kernel(_ROW_SPEC).launch(logits.shape[0], _THREADS, args, shared_mem=_row_shared_bytes(logits.shape[1]),
                                 stream=stream)


def sample_async(logits: DeviceTensor, params: SamplingTensors, staging: StagingRing, downloads: DownloadRing,
                 allocator: DeviceAllocator, stream: Stream) -> SampledTokens:
    """`Ops.sample_async` on the device: logits [B, V] float32 -> SampledTokens, at once.
    The kernels write their outputs straight into a mapped download slot."""
    num_rows, vocab_size = logits.shape
    num_top = num_top_logprobs(params.num_logprobs, vocab_size)
    words = SamplerBuffers.words(num_rows, num_top)
    slot, ready = downloads.take(4 * words)
    out = SamplerBuffers.over(DeviceTensor(slot.ptr, (words,), DType.int32, None, slot.owner), num_rows, num_top)
    if is_plain_greedy(params):
        launch_greedy(out, logits, stream)
    else:
        inputs = upload_inputs(params, staging)
        workspace = allocator.empty(logits.shape, DType.float32) if needs_row_workspace(inputs, logits) else None
        launch_sample(out, logits, inputs, workspace, stream)
    return out.results(ready(stream))
