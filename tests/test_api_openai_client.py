"""The official `openai` client against a real `sparkd serve`: chat and completions,
streaming and not, with usage counted against an independent tokenizer."""

from __future__ import annotations

import pytest
from openai import OpenAI

from server_fixtures import MAX_MODEL_LEN

MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a Python module."}]
PROMPT = "The json module encodes"
MAX_TOKENS = 6
EXACT = {"ignore_eos": True}  # random weights may draw EOS early; these tests count tokens


@pytest.fixture(scope="module")
def client(server):
    return OpenAI(base_url=f"{server.base_url}/v1", api_key=server.api_key, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def model(served_model_dir):
    return str(served_model_dir)


@pytest.fixture(scope="module")
def hf_tokenizer(served_model_dir):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(served_model_dir)


def chat_prompt_len(hf_tokenizer) -> int:
    """As transformers (and vLLM) count it: the template writes the one BOS, tokenizing adds none."""
    text = hf_tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    ids = hf_tokenizer(text, add_special_tokens=False)["input_ids"]
    assert ids[0] == hf_tokenizer.bos_token_id != ids[1]
    return len(ids)


def test_models_lists_the_served_model(client, model):
    models = client.models.list().data
    assert [m.id for m in models] == [model]
    assert models[0].max_model_len == MAX_MODEL_LEN


def test_completion(client, model, hf_tokenizer):
    out = client.completions.create(model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, seed=1,
                                    extra_body=EXACT)
    expected_prompt = len(hf_tokenizer(PROMPT)["input_ids"])  # with the BOS the tokenizer adds
    assert out.object == "text_completion" and out.id.startswith("cmpl-")
    assert len(out.choices) == 1 and out.choices[0].finish_reason == "length"
    assert out.usage.prompt_tokens == expected_prompt
    assert out.usage.completion_tokens == MAX_TOKENS
    assert out.usage.total_tokens == expected_prompt + MAX_TOKENS


def test_completion_stream_matches_the_full_response(client, model):
    args = dict(model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, seed=3, temperature=0.9, extra_body=EXACT)
    full = client.completions.create(**args)
    chunks = list(client.completions.create(**args, stream=True, stream_options={"include_usage": True}))
    *token_chunks, usage_chunk = chunks
    assert len(token_chunks) == MAX_TOKENS  # one event per token
    assert "".join(c.choices[0].text for c in token_chunks) == full.choices[0].text
    assert [c.choices[0].finish_reason for c in token_chunks] == [None] * (MAX_TOKENS - 1) + ["length"]
    assert usage_chunk.choices == [] and usage_chunk.usage == full.usage
    assert all(c.usage is None for c in token_chunks)
    assert len({c.id for c in chunks}) == 1


def test_completion_batch_and_n(client, model):
    out = client.completions.create(model=model, prompt=["one", "two three"], n=2, max_tokens=3, extra_body=EXACT)
    assert sorted(c.index for c in out.choices) == [0, 1, 2, 3]
    assert out.usage.completion_tokens == 4 * 3
    single = [client.completions.create(model=model, prompt=p, max_tokens=1).usage.prompt_tokens
              for p in ("one", "two three")]
    assert out.usage.prompt_tokens == sum(single)  # counted once per prompt, not per choice


def test_completion_token_id_prompt_and_logprobs(client, model, hf_tokenizer):
    ids = hf_tokenizer(PROMPT)["input_ids"]
    by_ids = client.completions.create(model=model, prompt=ids, max_tokens=4, seed=5, logprobs=3, extra_body=EXACT)
    by_text = client.completions.create(model=model, prompt=PROMPT, max_tokens=4, seed=5, logprobs=3, extra_body=EXACT)
    assert by_ids.choices[0].text == by_text.choices[0].text
    lp = by_ids.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert "".join(lp.tokens) == by_ids.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(4)]
    assert all(len(top) <= 3 and all(v <= 0 for v in top.values()) for top in lp.top_logprobs)
    assert all(v <= 0 for v in lp.token_logprobs)


def test_chat(client, model, hf_tokenizer):
    out = client.chat.completions.create(messages=MESSAGES, model=model,
                                         max_completion_tokens=MAX_TOKENS, extra_body=EXACT)
    assert out.object == "chat.completion" and out.id.startswith("chatcmpl-")
    choice = out.choices[0]
    assert choice.message.role == "assistant" and choice.finish_reason == "length"
    assert out.usage.prompt_tokens == chat_prompt_len(hf_tokenizer)
    assert out.usage.completion_tokens == MAX_TOKENS


def test_chat_stream_matches_the_full_response(client, model, hf_tokenizer):
    args = dict(model=model, messages=MESSAGES, max_tokens=MAX_TOKENS, seed=11, n=2, extra_body=EXACT)
    full = client.chat.completions.create(**args)
    chunks = list(client.chat.completions.create(**args, stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].usage == full.usage and chunks[-1].choices == []
    assert full.usage.prompt_tokens == chat_prompt_len(hf_tokenizer)
    assert full.usage.completion_tokens == 2 * MAX_TOKENS
    for index in (0, 1):
        mine = [c.choices[0] for c in chunks[:-1] if c.choices[0].index == index]
        assert mine[0].delta.role == "assistant" and mine[0].delta.content == ""
        assert len(mine) == 1 + MAX_TOKENS  # the role chunk, then one per token
        assert "".join(c.delta.content for c in mine) == full.choices[index].message.content
        assert mine[-1].finish_reason == "length"


def test_chat_logprobs_and_stop_string(client, model):
    out = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=5, logprobs=True,
                                         top_logprobs=2, seed=2, extra_body=EXACT)
    content = out.choices[0].logprobs.content
    assert len(content) == 5 and all(len(t.top_logprobs) == 2 for t in content)
    assert all(bytes(t.bytes).decode("utf-8") == t.token for t in content)
    # A stop string taken from the text itself ends the completion right before it.
    text = out.choices[0].message.content
    assert len(text) >= 4
    stop = text[2:4]
    stopped = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=5, seed=2, stop=[stop],
                                             extra_body=EXACT)
    assert stopped.choices[0].finish_reason == "stop" and stopped.choices[0].stop_reason == stop
    assert stopped.choices[0].message.content == text[:text.index(stop)]


def test_continue_final_message_counts_as_transformers_renders_it(client, model, hf_tokenizer):
    messages = [*MESSAGES, {"role": "assistant", "content": "The json"}]
    out = client.chat.completions.create(model=model, messages=messages, max_tokens=2, extra_body={
        "add_generation_prompt": False, "continue_final_message": True, **EXACT})
    text = hf_tokenizer.apply_chat_template(messages, continue_final_message=True, tokenize=False)
    assert text.endswith("The json")
    assert out.usage.prompt_tokens == len(hf_tokenizer(text, add_special_tokens=False)["input_ids"])
