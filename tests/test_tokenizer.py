"""Tokenizer and chat template against transformers' tokenizer for the same directory."""

from __future__ import annotations

import json
from datetime import datetime

import jinja2
import pytest
import tokenizers
import transformers
from oracle import make_tiny_tokenizer

from sparkd.engine.tokenizer import Tokenizer, load_tokenizer

# Qwen2.5's chat template (tools, tool calls, tool responses), verbatim.
QWEN_TEMPLATE = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

# Mistral/Llama-2 style: bos_token, raise_exception, and no `-` whitespace control,
# so the output depends on trim_blocks and lstrip_blocks.
ALTERNATING_TEMPLATE = """{{ bos_token }}
{% for message in messages %}
    {% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
        {{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}
    {% endif %}
    {% if message['role'] == 'user' %}
        {{ '[INST] ' + message['content'] + ' [/INST]' }}
    {% else %}
        {{ message['content'] + eos_token }}
    {% endif %}
{% endfor %}
"""

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Météo <now>",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
TOOL_CONVERSATION = [
    {"role": "system", "content": "You answer in English & 日本語."},
    {"role": "user", "content": "Weather in Zürich?"},
    {"role": "assistant", "content": None,
     "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Zürich"}}}]},
    {"role": "tool", "content": '{"temp": 21}'},
    {"role": "user", "content": "Thanks 😀"},
]
TEXTS = ["Hello, world!", "日本語のテキスト 😀🚀", "<|im_start|>user\nhi<|im_end|>", " leading  spaces\n\ttabs", ""]


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("qwen_tokenizer")
    make_tiny_tokenizer(directory, chat_template=QWEN_TEMPLATE)
    return directory


@pytest.fixture(scope="module")
def tokenizers_pair(qwen_dir):
    """(sparkd Tokenizer, HF tokenizer) loaded from the same directory."""
    return load_tokenizer(qwen_dir), transformers.AutoTokenizer.from_pretrained(qwen_dir)


@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_encode_matches_transformers(tokenizers_pair, add_special_tokens):
    ours, hf = tokenizers_pair
    for text in TEXTS:
        assert ours.encode(text, add_special_tokens=add_special_tokens) == hf.encode(text, add_special_tokens=add_special_tokens)


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_decode_matches_transformers(tokenizers_pair, skip_special_tokens):
    ours, hf = tokenizers_pair
    for text in TEXTS:
        ids = hf.encode(text)
        assert ours.decode(ids, skip_special_tokens=skip_special_tokens) == hf.decode(ids, skip_special_tokens=skip_special_tokens)


def test_vocab_and_special_tokens_match_transformers(tokenizers_pair):
    ours, hf = tokenizers_pair
    assert ours.vocab_size == len(hf)
    assert ours.eos_token_id == hf.eos_token_id == hf.convert_tokens_to_ids("<|im_end|>")
    assert ours.bos_token_id is None and hf.bos_token_id is None
    # Every token transformers calls special, plus <|im_start|>, which decoding skips too.
    assert set(hf.all_special_ids) <= set(ours.all_special_ids) == {0, 1, 2}
    ids = list(range(ours.vocab_size))
    assert ours.convert_ids_to_tokens(ids) == hf.convert_ids_to_tokens(ids)
    assert ours.id_to_token(2) == "<|im_end|>"


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("tools", [None, TOOLS], ids=["no-tools", "tools"])
def test_qwen_chat_template_matches_transformers(tokenizers_pair, add_generation_prompt, tools):
    ours, hf = tokenizers_pair
    kwargs = dict(add_generation_prompt=add_generation_prompt, tools=tools)
    text = ours.apply_chat_template(TOOL_CONVERSATION, **kwargs)
    assert text == hf.apply_chat_template(TOOL_CONVERSATION, tokenize=False, **kwargs)
    assert text.endswith("<|im_start|>assistant\n") == add_generation_prompt
    expected_ids = hf.apply_chat_template(TOOL_CONVERSATION, tokenize=True, return_dict=False, **kwargs)
    assert ours.apply_chat_template(TOOL_CONVERSATION, tokenize=True, **kwargs) == expected_ids


@pytest.fixture(scope="module")
def alternating_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("alternating_tokenizer")
    make_tiny_tokenizer(directory, chat_template=ALTERNATING_TEMPLATE, bos_token="<|endoftext|>", eos_token="<|im_end|>")
    return directory


def test_whitespace_control_and_bos_match_transformers(alternating_dir):
    ours, hf = load_tokenizer(alternating_dir), transformers.AutoTokenizer.from_pretrained(alternating_dir)
    conversation = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
                    {"role": "user", "content": "Bye"}]
    text = ours.apply_chat_template(conversation)
    assert text == hf.apply_chat_template(conversation, tokenize=False)
    assert text.startswith("<|endoftext|>")


def test_raise_exception_becomes_value_error(alternating_dir):
    ours, hf = load_tokenizer(alternating_dir), transformers.AutoTokenizer.from_pretrained(alternating_dir)
    conversation = [{"role": "assistant", "content": "I speak first"}]
    message = "Conversation roles must alternate user/assistant/user/assistant/..."
    with pytest.raises(jinja2.TemplateError, match=message):
        hf.apply_chat_template(conversation, tokenize=False)
    with pytest.raises(ValueError, match=message):
        ours.apply_chat_template(conversation)


def test_template_from_tokenizer_config_forms(qwen_dir, tmp_path):
    """Older checkpoints keep the template in tokenizer_config.json: a string, or a
    list of named templates of which "default" is used."""
    reference = load_tokenizer(qwen_dir).apply_chat_template(TOOL_CONVERSATION, add_generation_prompt=True)
    config = json.loads((qwen_dir / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer.json").write_bytes((qwen_dir / "tokenizer.json").read_bytes())
    for template in (QWEN_TEMPLATE, [{"name": "rag", "template": "x"}, {"name": "default", "template": QWEN_TEMPLATE}]):
        (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}))
        assert load_tokenizer(tmp_path).apply_chat_template(TOOL_CONVERSATION, add_generation_prompt=True) == reference


def test_strftime_now_and_tojson_render_like_transformers(tmp_path):
    template = "{{ strftime_now('%Y-%m-%d') }}|{{ messages[0] | tojson }}|{{ messages[0] | tojson(indent=2) }}"
    make_tiny_tokenizer(tmp_path, chat_template=template)
    conversation = [{"role": "user", "content": "<b>café</b> & 😀"}]
    text = load_tokenizer(tmp_path).apply_chat_template(conversation)
    assert text == transformers.AutoTokenizer.from_pretrained(tmp_path).apply_chat_template(conversation, tokenize=False)
    assert text.split("|")[0] == datetime.now().strftime("%Y-%m-%d")


def test_post_processor_adds_bos_like_transformers(qwen_dir, tmp_path):
    """tokenizer.json's post-processor decides what encode adds; tokenizer_config's
    add_bos_token / add_eos_token are ignored, as transformers 5 ignores them."""
    backend = tokenizers.Tokenizer.from_file(str(qwen_dir / "tokenizer.json"))
    backend.post_processor = tokenizers.processors.TemplateProcessing(
        single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", 0)]
    )
    backend.save(str(tmp_path / "tokenizer.json"))
    config = json.loads((qwen_dir / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config, "add_bos_token": False, "add_eos_token": True}))
    ours, hf = load_tokenizer(tmp_path), transformers.AutoTokenizer.from_pretrained(tmp_path)
    for text in TEXTS:
        assert ours.encode(text) == hf.encode(text)
        assert ours.encode(text, add_special_tokens=False) == hf.encode(text, add_special_tokens=False)
    assert ours.encode("hello")[0] == 0 and ours.encode("hello")[-1] != 2


def test_template_errors_are_value_errors(qwen_dir):
    tokenizer = load_tokenizer(qwen_dir)
    with pytest.raises(ValueError, match="at least one message"):
        tokenizer.apply_chat_template([])
    without_template = Tokenizer(tokenizer.backend, tokenizer.special_tokens)
    with pytest.raises(ValueError, match="no chat_template"):
        without_template.apply_chat_template([{"role": "user", "content": "hi"}])
    broken = Tokenizer(tokenizer.backend, tokenizer.special_tokens, chat_template="{% for m in messages %}")
    with pytest.raises(ValueError, match="chat template error"):
        broken.apply_chat_template([{"role": "user", "content": "hi"}])
