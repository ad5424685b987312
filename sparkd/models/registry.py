"""Architecture name -> model class, and loading a checkpoint directory into a model.

Supporting a new architecture is one entry in `_MODEL_CLASSES`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from ..backend.base import Ops
from .config import ModelConfig, architecture_of, read_hf_configs
from .dense import DenseForCausalLM
from .load_progress import LoadProgress
from .moe import MoeForCausalLM
from .qwen3_next import Qwen3NextForCausalLM
from .safetensors_reader import iter_checkpoint, stored_nbytes

_MODEL_CLASSES: dict[str, type] = {
    "LlamaForCausalLM": DenseForCausalLM,
    "Qwen2ForCausalLM": DenseForCausalLM,
    "Qwen3ForCausalLM": DenseForCausalLM,
    "Qwen3MoeForCausalLM": MoeForCausalLM,
    "MixtralForCausalLM": MoeForCausalLM,
    "Qwen3NextForCausalLM": Qwen3NextForCausalLM,
}
SUPPORTED_ARCHITECTURES = tuple(_MODEL_CLASSES)

# Buffers some exporters save that the models recompute.
_IGNORED_WEIGHT_SUFFIXES = ("rotary_emb.inv_freq",)


def model_class_for(architecture: str) -> type:
    try:
        return _MODEL_CLASSES[architecture]
    except KeyError:
        raise ValueError(
            f"architecture {architecture!r} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        ) from None


def load_model_config(model_dir: str | Path) -> ModelConfig:
    """The checkpoint's ModelConfig; ValueError for an unsupported architecture."""
    hf_config, generation_config = read_hf_configs(model_dir)
    model_class_for(architecture_of(hf_config))
    return ModelConfig.from_hf(hf_config, generation_config)


def load_model(model_dir: str | Path, ops: Ops, report: Callable[[str], None] | None = None) -> Any:
    """Build the model for `model_dir`, uploading its weights through `ops` in `ops.dtype`.

    Weights stream from the mapped files one tensor at a time and are uploaded at once;
    the host keeps only packed modules still waiting for a part (see `pack_weights`)
    and expert stacks still waiting for an expert (see `stack_experts`).
    A progress bar shows on a terminal; `report` gets progress lines."""
    config = load_model_config(model_dir)
    model_class = model_class_for(config.architecture)
    sizes = stored_nbytes(model_dir)
    progress = LoadProgress(sum(sizes.values()), report)
    stored = progress.track(iter_checkpoint(model_dir), nbytes_of=sizes.__getitem__)
    checkpoint = ((n, a) for n, a in stored if not n.endswith(_IGNORED_WEIGHT_SUFFIXES))
    renamed = rename_modules(checkpoint, model_class.renamed_modules)
    packed = stack_experts(pack_weights(renamed, model_class.packed_modules), config.num_experts)
    if config.folds_shared_expert:
        packed = fold_shared_expert(packed)
    weights = {name: ops.upload(array, ops.dtype) for name, array in model_class.prepare_weights(config, packed)}
    model = model_class(config, ops, weights)
    if weights:
        raise ValueError(f"checkpoint has weights {config.architecture} does not use: {sorted(weights)}")
    return model


def rename_modules(
    weights: Iterable[tuple[str, np.ndarray]], renamed_modules: dict[str, str]
) -> Iterator[tuple[str, np.ndarray]]:
    """Rename whole components of each weight's dotted path: with {"w1": "gate_proj"},
    `...experts.3.w1.weight` becomes `...experts.3.gate_proj.weight`."""
    for name, array in weights:
        yield ".".join(renamed_modules.get(part, part) for part in name.split(".")), array


def pack_weights(
    weights: Iterable[tuple[str, np.ndarray]], packed_modules: dict[str, tuple[str, ...]]
) -> Iterator[tuple[str, np.ndarray]]:
    """Concatenate the parts of each packed module along dim 0, in the listed order.

    With packed_modules {"qkv_proj": ("q_proj", "k_proj", "v_proj")}, the three tensors
    `...self_attn.{q,k,v}_proj.weight` become one `...self_attn.qkv_proj.weight`, yielded
    once its last part has arrived (shards may split a layer's parts). Other weights
    pass through unchanged."""
    part_of = {part: (packed, i) for packed, parts in packed_modules.items() for i, part in enumerate(parts)}
    pending: dict[str, list[np.ndarray | None]] = {}
    for name, array in weights:
        path = name.split(".")
        if len(path) < 2 or path[-2] not in part_of:
            yield name, array
            continue
        packed, index = part_of[path[-2]]
        packed_name = ".".join([*path[:-2], packed, path[-1]])
        parts = pending.setdefault(packed_name, [None] * len(packed_modules[packed]))
        parts[index] = array
        if all(part is not None for part in parts):
            del pending[packed_name]
            yield packed_name, np.concatenate(parts, axis=0)
    if pending:
        raise ValueError(f"checkpoint has only some parts of {sorted(pending)}")


def fold_shared_expert(weights: Iterable[tuple[str, np.ndarray]]) -> Iterator[tuple[str, np.ndarray]]:
    """Append each `<prefix>.shared_expert.<module>.weight` [N, K] to the stacked
    `<prefix>.experts.<module>` [E, N, K] as expert E, yielding `<prefix>.experts.<module>`
    [E + 1, N, K] once both have arrived (ModelConfig.folds_shared_expert). The host holds a
    layer's stacked experts twice while it copies them. Other weights pass through unchanged."""
    pending: dict[str, dict[str, np.ndarray]] = {}
    for name, array in weights:
        path = name.split(".")
        if len(path) >= 3 and path[-3] == "shared_expert" and path[-1] == "weight":
            stacked_name, part = ".".join([*path[:-3], "experts", path[-2]]), "shared"
        elif len(path) >= 2 and path[-2] == "experts" and array.ndim == 3:
            stacked_name, part = name, "experts"
        else:
            yield name, array
            continue
        parts = pending.setdefault(stacked_name, {})
        parts[part] = array
        if len(parts) == 2:
            del pending[stacked_name]
            experts, shared = parts["experts"], parts["shared"]
            if shared.shape != experts.shape[1:]:
                raise ValueError(f"the shared expert of {stacked_name!r} has shape {shared.shape}, the experts "
                                 f"{experts.shape[1:]}")
            yield stacked_name, np.concatenate([experts, shared[None].astype(experts.dtype, copy=False)])
    if pending:
        raise ValueError(f"checkpoint has the experts but not the shared expert (or the reverse) of {sorted(pending)}")


def stack_experts(weights: Iterable[tuple[str, np.ndarray]], num_experts: int) -> Iterator[tuple[str, np.ndarray]]:
    """Stack per-expert weights `<prefix>.experts.{e}.<module>.weight` [N, K], e = 0..E-1,
    into one `<prefix>.experts.<module>` [E, N, K] (transformers 5's name for the fused
    tensor), yielded once its last expert has arrived. The stack is filled in place,
    so the host never holds an expert twice. Other weights pass through unchanged, as
    does everything when num_experts is 0 (a dense model)."""
    pending: dict[str, tuple[np.ndarray, set[int]]] = {}
    for name, array in weights:
        path = name.split(".")
        is_expert = len(path) >= 4 and path[-4] == "experts" and path[-3].isdigit() and path[-1] == "weight"
        if not (num_experts and is_expert):
            yield name, array
            continue
        expert = int(path[-3])
        if expert >= num_experts:
            raise ValueError(f"checkpoint has weight {name!r}, but the config has only {num_experts} experts")
        stacked_name = ".".join([*path[:-3], path[-2]])
        stacked, arrived = pending.setdefault(stacked_name, (np.empty((num_experts, *array.shape), array.dtype), set()))
        if array.shape != stacked.shape[1:]:
            raise ValueError(f"weight {name!r} has shape {array.shape}, other experts {stacked.shape[1:]}")
        stacked[expert] = array
        arrived.add(expert)
        if len(arrived) == num_experts:
            del pending[stacked_name]
            yield stacked_name, stacked
    if pending:
        raise ValueError(f"checkpoint has only some of the {num_experts} experts of {sorted(pending)}")
