"""Checkpoint loading: safetensors (single, sharded, bf16/fp16/fp32), config parsing,
generation_config, and the errors a user can run into."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch
import transformers
from oracle import hf_state_dict, make_tiny_checkpoint

from sparkd.backend.cpu.ops import NumpyOps
from sparkd.engine.tokenizer import load_tokenizer
from sparkd.models.config import ModelConfig
from sparkd.models.registry import (
    SUPPORTED_ARCHITECTURES,
    load_model,
    load_model_config,
    pack_weights,
)
from sparkd.models.safetensors_reader import iter_checkpoint, read_header

DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}


def read_all(path) -> dict[str, np.ndarray]:
    return dict(iter_checkpoint(path))


@pytest.mark.parametrize("tag", list(DTYPES))
def test_dtypes_read_exactly(tmp_path, tag):
    """Every stored value comes back exactly (bf16 widened to float32 without torch),
    and within the dtype's rounding of the float32 weights it was cast from."""
    path, hf_model = make_tiny_checkpoint(tmp_path / "cast", dtype=DTYPES[tag])
    _, hf_float32 = make_tiny_checkpoint(tmp_path / "f32")  # same seed: the weights before the cast
    (shard,) = path.glob("*.safetensors")
    assert {info["dtype"] for info in read_header(shard)[0].values()} == {tag}
    ours = read_all(path)
    expected = hf_state_dict(hf_model)
    assert ours.keys() == expected.keys()
    relative_step = {"BF16": 2.0**-8, "F16": 2.0**-11, "F32": 0.0}[tag]
    originals = hf_state_dict(hf_float32)
    for name, array in ours.items():
        assert array.dtype == (np.float16 if tag == "F16" else np.float32)
        np.testing.assert_array_equal(array.astype(np.float32), expected[name], err_msg=name)
        np.testing.assert_allclose(array, originals[name], rtol=relative_step, atol=1e-7, err_msg=name)


def test_bf16_loading_never_imports_torch(tmp_path):
    path, _ = make_tiny_checkpoint(tmp_path, "Qwen3ForCausalLM", dtype=torch.bfloat16)
    script = (
        "import sys; from sparkd.backend.cpu.ops import NumpyOps; from sparkd.models.registry import load_model; "
        f"load_model({str(path)!r}, NumpyOps()); assert 'torch' not in sys.modules, 'torch was imported'"
    )
    subprocess.run([sys.executable, "-c", script], check=True)


def test_sharded_checkpoint_with_split_layers(tmp_path):
    path, hf_model = make_tiny_checkpoint(tmp_path / "sharded", "Qwen2ForCausalLM", max_shard_size="20KB")
    weight_map = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(weight_map.values())) > 1
    # Some layer's q and v projections live in different shards, so packing spans files.
    assert any(weight_map[f"model.layers.{i}.self_attn.q_proj.weight"] != weight_map[f"model.layers.{i}.self_attn.v_proj.weight"]
               for i in range(2))
    ours = read_all(path)
    expected = hf_state_dict(hf_model)
    assert ours.keys() == expected.keys() == weight_map.keys()
    for name in expected:
        np.testing.assert_array_equal(ours[name], expected[name])

    model = load_model(path, NumpyOps())
    attention = model.layers[1].self_attn
    np.testing.assert_array_equal(attention.qkv_proj, np.concatenate(
        [expected[f"model.layers.1.self_attn.{p}_proj.weight"] for p in "qkv"]))
    np.testing.assert_array_equal(attention.qkv_bias, np.concatenate(
        [expected[f"model.layers.1.self_attn.{p}_proj.bias"] for p in "qkv"]))
    np.testing.assert_array_equal(model.layers[0].mlp.gate_up_proj, np.concatenate(
        [expected[f"model.layers.0.mlp.{p}_proj.weight"] for p in ("gate", "up")]))


def test_pack_weights_waits_for_every_part():
    weights = [("l.v_proj.weight", np.full((1, 2), 3.0)), ("l.norm.weight", np.ones(2)),
               ("l.q_proj.weight", np.full((2, 2), 1.0)), ("l.k_proj.weight", np.full((1, 2), 2.0))]
    packed = dict(pack_weights(weights, {"qkv_proj": ("q_proj", "k_proj", "v_proj")}))
    assert list(packed) == ["l.norm.weight", "l.qkv_proj.weight"]
    np.testing.assert_array_equal(packed["l.qkv_proj.weight"][:, 0], [1, 1, 2, 3])
    with pytest.raises(ValueError, match="only some parts"):
        list(pack_weights(weights[:2], {"qkv_proj": ("q_proj", "k_proj", "v_proj")}))


def test_generation_config_eos_list_is_merged(tmp_path):
    path, _ = make_tiny_checkpoint(tmp_path, eos_token_id=[7, 2], generation_config={"eos_token_id": [2, 5]})
    config = load_model_config(path)
    assert config.eos_token_ids == [2, 5, 7]
    assert config.bos_token_id == 1
    assert config.dtype == "float32"


def test_config_fields_of_each_variant(tmp_path):
    qwen3 = load_model_config(make_tiny_checkpoint(tmp_path / "q3", "Qwen3ForCausalLM", head_dim=32, num_key_value_heads=1)[0])
    assert (qwen3.head_dim, qwen3.num_heads, qwen3.num_kv_heads, qwen3.hidden_size) == (32, 4, 1, 64)
    assert (qwen3.qk_norm, qwen3.qkv_bias, qwen3.o_proj_bias) == (True, False, False)
    qwen2 = load_model_config(make_tiny_checkpoint(tmp_path / "q2", "Qwen2ForCausalLM", tie_word_embeddings=True)[0])
    assert (qwen2.qk_norm, qwen2.qkv_bias, qwen2.o_proj_bias, qwen2.tie_word_embeddings) == (False, True, False, True)
    llama = load_model_config(make_tiny_checkpoint(tmp_path / "l", attention_bias=True, max_position_embeddings=99)[0])
    assert (llama.qkv_bias, llama.o_proj_bias, llama.mlp_bias, llama.max_position_embeddings) == (True, True, False, 99)


@pytest.mark.parametrize("rope_key", ["rope_type", "type"])
def test_llama3_rope_scaling_in_transformers4_layout(rope_key):
    """Older config.json files keep rope_theta at the top level and the scaling in
    `rope_scaling`, keyed `type` or `rope_type`; transformers 5 converts both."""
    hf_config = dict(
        architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=384, hidden_size=128, intermediate_size=256,
        num_hidden_layers=1, num_attention_heads=2, max_position_embeddings=8192, rope_theta=500000.0,
        rope_scaling={rope_key: "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 256},
    )
    ours = ModelConfig.from_hf(json.loads(json.dumps(hf_config))).rope
    rotary = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(transformers.LlamaConfig(**hf_config))
    assert ours.rotary_dim == 64
    np.testing.assert_allclose(ours.inv_freq, rotary.inv_freq.double().numpy(), rtol=1e-6)
    assert not np.allclose(ours.inv_freq, 1.0 / 500000.0 ** (np.arange(0, 64, 2) / 64))  # scaling did something


def test_unsupported_architecture_names_the_supported_ones(tmp_path):
    path, _ = make_tiny_checkpoint(tmp_path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "architectures": ["GPTNeoXForCausalLM"]}))
    with pytest.raises(ValueError, match="GPTNeoXForCausalLM") as error:
        load_model(path, NumpyOps())
    assert all(name in str(error.value) for name in SUPPORTED_ARCHITECTURES)


@pytest.mark.parametrize("change, message", [
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "rope type 'yarn' is not supported; supported: default, llama3"),
    ({"use_sliding_window": True, "max_window_layers": 0}, "sliding-window"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
])
def test_unsupported_config_features_are_refused(tmp_path, change, message):
    path, _ = make_tiny_checkpoint(tmp_path, "Qwen2ForCausalLM")
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(ValueError, match=message):
        load_model_config(path)


def test_weights_must_match_the_config(tmp_path):
    path, _ = make_tiny_checkpoint(tmp_path, attention_bias=True)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "attention_bias": False}))
    with pytest.raises(ValueError, match=r"does not use: \['model.layers.0.self_attn.o_proj.bias'"):
        load_model(path, NumpyOps())
    (path / "config.json").write_text(json.dumps({**config, "mlp_bias": True}))
    with pytest.raises(ValueError, match="missing weight 'model.layers.0.mlp.gate_up_proj.bias'"):
        load_model(path, NumpyOps())


def test_missing_files(tmp_path):
    path, _ = make_tiny_checkpoint(tmp_path)
    assert load_tokenizer(path) is None  # token-id prompts still work without one
    (path / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors"):
        load_model(path, NumpyOps())
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_model(tmp_path / "nowhere", NumpyOps())
