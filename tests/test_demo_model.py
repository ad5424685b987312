"""The embedded demo model: shipped files, size budget, Qwen3-Next config, tokenizer, chat template,
and sparkd's numpy backend against transformers on the same weights."""

from __future__ import annotations

import json
from pathlib import Path

import jinja2
import pytest
import safetensors
from tokenizers import Tokenizer

DEMO_DIR = Path(__file__).resolve().parents[1] / "sparkd" / "demo_model"
SHIPPED = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
ROUND_TRIP_TEXTS = (
    'The "with" statement is used to wrap the execution of a block.',
    "def f(x):\n\treturn x ** 2  # squares   \n\n",
    "Unicode: café, naïve, 日本語, emoji 🐍, NUL \x00 and CR\r\n",
    "",
)


def read_json(name: str) -> dict:
    return json.loads((DEMO_DIR / name).read_text())


def test_shipped_files_exist_within_16_mb():
    missing = [name for name in SHIPPED if not (DEMO_DIR / name).is_file()]
    assert not missing, f"run tools/train_demo_model.py: missing {missing} in {DEMO_DIR}"
    total = sum(path.stat().st_size for path in DEMO_DIR.rglob("*") if path.is_file())
    assert total <= 16 * 2**20, f"demo model is {total / 2**20:.1f} MiB, over the 16 MiB budget"


def test_config_is_qwen3_next_and_weights_match_it():
    transformers = pytest.importorskip("transformers")
    config = transformers.AutoConfig.from_pretrained(DEMO_DIR)
    assert config.model_type == "qwen3_next"
    assert config.architectures == ["Qwen3NextForCausalLM"]
    assert config.tie_word_embeddings
    # Every kernel family: gated delta nets and gated attention, experts in every layer.
    assert set(config.layer_types) == {"linear_attention", "full_attention"}
    assert config.num_experts > 1 and config.decoder_sparse_step == 1 and not config.mlp_only_layers
    hidden, head_dim, experts = config.hidden_size, config.head_dim, config.num_experts
    key_width = config.linear_num_key_heads * config.linear_key_head_dim
    value_width = config.linear_num_value_heads * config.linear_value_head_dim
    moe, shared = config.moe_intermediate_size, config.shared_expert_intermediate_size
    expected = {
        "model.embed_tokens.weight": (config.vocab_size, hidden),
        "model.norm.weight": (hidden,),
    }
    for i, kind in enumerate(config.layer_types):
        prefix = f"model.layers.{i}."
        expected |= {
            prefix + "mlp.gate.weight": (experts, hidden),
            prefix + "mlp.experts.gate_up_proj": (experts, 2 * moe, hidden),
            prefix + "mlp.experts.down_proj": (experts, hidden, moe),
            prefix + "mlp.shared_expert.gate_proj.weight": (shared, hidden),
            prefix + "mlp.shared_expert.up_proj.weight": (shared, hidden),
            prefix + "mlp.shared_expert.down_proj.weight": (hidden, shared),
            prefix + "mlp.shared_expert_gate.weight": (1, hidden),
            prefix + "input_layernorm.weight": (hidden,),
            prefix + "post_attention_layernorm.weight": (hidden,),
        }
        if kind == "full_attention":  # q_proj holds each head's query and output gate
            expected |= {
                prefix + "self_attn.q_proj.weight": (2 * config.num_attention_heads * head_dim, hidden),
                prefix + "self_attn.k_proj.weight": (config.num_key_value_heads * head_dim, hidden),
                prefix + "self_attn.v_proj.weight": (config.num_key_value_heads * head_dim, hidden),
                prefix + "self_attn.o_proj.weight": (hidden, config.num_attention_heads * head_dim),
                prefix + "self_attn.q_norm.weight": (head_dim,),
                prefix + "self_attn.k_norm.weight": (head_dim,),
            }
        else:
            value_heads = config.linear_num_value_heads
            expected |= {
                prefix + "linear_attn.in_proj_qkvz.weight": (2 * key_width + 2 * value_width, hidden),
                prefix + "linear_attn.in_proj_ba.weight": (2 * value_heads, hidden),
                prefix + "linear_attn.conv1d.weight": (2 * key_width + value_width, 1, config.linear_conv_kernel_dim),
                prefix + "linear_attn.A_log": (value_heads,),
                prefix + "linear_attn.dt_bias": (value_heads,),
                prefix + "linear_attn.norm.weight": (config.linear_value_head_dim,),
                prefix + "linear_attn.out_proj.weight": (hidden, value_width),
            }
    with safetensors.safe_open(DEMO_DIR / "model.safetensors", framework="numpy") as f:
        # numpy has no bf16: read the header's dtype and shape without materialising tensors.
        header = {name: f.get_slice(name) for name in f.keys()}
        shapes = {name: tuple(s.get_shape()) for name, s in header.items()}
        dtypes = {s.get_dtype() for s in header.values()}
    assert shapes == expected  # lm_head is tied, so it is not stored
    assert dtypes == {"BF16"}
    assert read_json("config.json")["torch_dtype"] == "bfloat16"


def test_tokenizer_round_trips_text_and_knows_special_tokens():
    tokenizer = Tokenizer.from_file(str(DEMO_DIR / "tokenizer.json"))
    assert tokenizer.get_vocab_size() == read_json("config.json")["vocab_size"]
    for text in ROUND_TRIP_TEXTS:
        assert tokenizer.decode(tokenizer.encode(text).ids, skip_special_tokens=False) == text
    for token in SPECIAL_TOKENS:
        assert tokenizer.encode(token).ids == [tokenizer.token_to_id(token)]
    im_end, endoftext = tokenizer.token_to_id("<|im_end|>"), tokenizer.token_to_id("<|endoftext|>")
    assert read_json("generation_config.json")["eos_token_id"] == [im_end, endoftext]
    tokenizer_config = read_json("tokenizer_config.json")
    assert (tokenizer_config["bos_token"], tokenizer_config["eos_token"], tokenizer_config["pad_token"]) == (
        "<|endoftext|>", "<|im_end|>", "<|endoftext|>")


CONVERSATION = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is the `with` statement?"},
    {"role": "assistant", "content": "It wraps a block."},
    {"role": "user", "content": "And `for`?"},
]
CHATML = (
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "<|im_start|>user\nWhat is the `with` statement?<|im_end|>\n"
    "<|im_start|>assistant\nIt wraps a block.<|im_end|>\n"
    "<|im_start|>user\nAnd `for`?<|im_end|>\n"
)


def test_chat_template_renders_chatml_with_transformers():
    transformers = pytest.importorskip("transformers")
    tokenizer = transformers.AutoTokenizer.from_pretrained(DEMO_DIR)
    render = tokenizer.apply_chat_template
    assert render(CONVERSATION, tokenize=False) == CHATML
    assert render(CONVERSATION, tokenize=False, add_generation_prompt=True) == CHATML + "<|im_start|>assistant\n"
    with pytest.raises(Exception, match="system, user and assistant"):
        render([{"role": "tool", "content": "42"}], tokenize=False)


def test_chat_template_renders_with_plain_jinja2():
    # What a server without transformers does: the template alone, raise_exception supplied by it.
    def raise_exception(message):
        raise jinja2.TemplateError(message)

    template = jinja2.Environment().from_string(read_json("tokenizer_config.json")["chat_template"])
    assert template.render(messages=CONVERSATION, add_generation_prompt=False, raise_exception=raise_exception) == CHATML


PROMPT = 'The "for" statement is used to'


def test_sparkd_numpy_backend_loads_the_demo_model():
    try:
        from sparkd.models.registry import load_model
    except ImportError as error:
        pytest.skip(f"sparkd.models.registry is not importable yet: {error}")
    from sparkd.backend import create_backend

    model = load_model(DEMO_DIR, create_backend("cpu"))
    config = read_json("config.json")
    assert (model.config.vocab_size, model.config.num_layers, model.config.num_kv_heads, model.config.head_dim) == (
        config["vocab_size"], config["num_hidden_layers"], config["num_key_value_heads"], config["head_dim"])


def test_sparkd_greedy_matches_transformers_on_the_demo_model():
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    try:
        from sparkd import LLM, SamplingParams
        from sparkd.models.registry import load_model  # noqa: F401  (the part this test waits for)
    except ImportError as error:
        pytest.skip(f"sparkd.models.registry is not importable yet: {error}")
    llm = LLM(device="cpu", max_num_seqs=2, num_gpu_blocks_override=16)  # no model: the demo model
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(DEMO_DIR)
    chat = CONVERSATION[:2]
    assert llm.tokenizer.apply_chat_template(chat, add_generation_prompt=True) == hf_tokenizer.apply_chat_template(
        chat, add_generation_prompt=True, tokenize=False)
    outputs = [llm.generate(PROMPT, params)[0], llm.chat(chat, params)[0]]

    reference = transformers.AutoModelForCausalLM.from_pretrained(DEMO_DIR, dtype=torch.float32).eval()
    for output in outputs:
        prompt_ids = torch.tensor([output.prompt_token_ids])
        with torch.no_grad():
            expected = reference.generate(prompt_ids, max_new_tokens=params.max_tokens, do_sample=False,
                                          eos_token_id=None, pad_token_id=0)[0, prompt_ids.shape[1]:].tolist()
        assert output.outputs[0].token_ids == expected
    assert outputs[0].prompt_token_ids == hf_tokenizer(PROMPT)["input_ids"]
