"""Request bodies -> Structs and SamplingParams, and every rejection as an OpenAI-shaped 400."""

import json

import msgspec
import pytest

from sparkd.api.errors import APIError, decode_json
from sparkd.api.params import chat_sampling_params, completion_sampling_params
from sparkd.api.protocol import ChatCompletionRequest, CompletionRequest, WSClientMessage
from sparkd.api.serving_completions import _prompt_list


def decode(body, body_type):
    return decode_json(body if isinstance(body, bytes) else json.dumps(body).encode(), body_type)


def rejected(body, body_type=ChatCompletionRequest, convert=None) -> APIError:
    with pytest.raises(APIError) as info:
        req = decode(body, body_type)
        if convert is not None:
            convert(req)
    assert info.value.status == 400
    return info.value


CHAT = {"messages": [{"role": "user", "content": "hi"}]}


def test_chat_request_maps_every_sampling_field():
    req = decode({**CHAT, "model": "m", "n": 2, "temperature": 0.5, "top_p": 0.9, "top_k": 5, "min_p": 0.1,
                  "seed": 7, "max_completion_tokens": 9, "max_tokens": 100, "stop": "x", "stop_token_ids": [3],
                  "logprobs": True, "top_logprobs": 4, "presence_penalty": 0.5, "frequency_penalty": -0.5,
                  "repetition_penalty": 1.2, "min_tokens": 2, "ignore_eos": True, "user": "u",
                  "stream": True, "stream_options": {"include_usage": True}}, ChatCompletionRequest)
    p = chat_sampling_params(req)
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p, p.seed) == (2, 0.5, 0.9, 5, 0.1, 7)
    assert p.max_tokens == 9  # max_completion_tokens wins over the deprecated max_tokens
    assert (p.stop, p.stop_token_ids, p.logprobs) == (["x"], [3], 4)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.5, -0.5, 1.2)
    assert (p.min_tokens, p.ignore_eos) == (2, True)
    assert req.stream and req.stream_options.include_usage


def test_defaults_follow_openai_and_vllm():
    chat = chat_sampling_params(decode(CHAT, ChatCompletionRequest))
    assert (chat.temperature, chat.top_p, chat.top_k, chat.max_tokens, chat.logprobs) == (1.0, 1.0, 0, None, None)
    completion = completion_sampling_params(decode({"prompt": "a"}, CompletionRequest))
    assert completion.max_tokens == 16 and completion.logprobs is None
    assert chat_sampling_params(decode({**CHAT, "logprobs": True}, ChatCompletionRequest)).logprobs == 0


def test_message_content_parts_join_into_text():
    req = decode({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                            {"type": "text", "text": "b"}]},
                               {"role": "assistant", "content": None}]}, ChatCompletionRequest)
    assert [m.to_template_dict() for m in req.messages] == [{"role": "user", "content": "a\nb"},
                                                           {"role": "assistant", "content": ""}]


@pytest.mark.parametrize("body, param", [
    ({**CHAT, "temperature": "hot"}, "temperature"),
    ({**CHAT, "n": 1.5}, "n"),
    ({**CHAT, "max_tokens": True}, "max_tokens"),
    ({**CHAT, "stop": [1, 2]}, "stop[0]"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content[0].type"),
    ({"messages": "hello"}, "messages"),
    ({**CHAT, "seed": 2**70}, "seed"),
    ({**CHAT, "stream_options": {"include_usage": 1}}, "stream_options.include_usage"),
    ({**CHAT, "temperature": 1e999}, "temperature"),
])
def test_wrong_types_name_the_field(body, param):
    raw = json.dumps(body).replace("Infinity", "1e999").encode()
    assert rejected(raw).param == param


def test_missing_required_field():
    assert "messages" in rejected({"model": "m"}).message


@pytest.mark.parametrize("body, param", [
    ({**CHAT, "logit_bias": {"1": 5}}, "logit_bias"),
    ({**CHAT, "tools": []}, "tools"),
    ({"messages": [{"role": "user", "content": "x", "mood": "happy"}]}, "messages[0].mood"),
])
def test_unknown_fields_are_rejected_in_openai_words(body, param):
    err = rejected(body)
    assert err.param == param
    assert err.message == f"Unrecognized request argument supplied: {param}"


def test_deep_nesting_is_a_400_not_a_crash():
    assert rejected(b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", CompletionRequest).message == (
        "the request body is nested too deeply")


@pytest.mark.parametrize("raw", [b"{", b"", b"not json", b'{"prompt": "a"}{}', b'{"prompt": "\xff\xfe"}',
                                 b"\xff\xfe{}", b'{"prompt": NaN}'])
def test_bad_json_and_bad_utf8(raw):
    err = rejected(raw, CompletionRequest)
    assert err.message.startswith("the request body is not valid JSON")
    assert err.info().type == "invalid_request_error"


@pytest.mark.parametrize("field, value", [
    ("n", 0), ("n", 10_000), ("temperature", -1), ("top_p", 0), ("top_p", 1.5), ("top_k", -2),
    ("min_p", 2), ("max_tokens", 0), ("max_tokens", -5), ("presence_penalty", 3), ("frequency_penalty", -3),
    ("repetition_penalty", 0), ("min_tokens", -1), ("logprobs", 21), ("stop_token_ids", [-1]),
])
def test_out_of_range_values_name_the_field(field, value):
    err = rejected({"prompt": "a", field: value}, CompletionRequest, completion_sampling_params)
    assert err.param == field and err.message.startswith(f"{field} must be")


def test_chat_errors_use_the_chat_field_names():
    err = rejected({**CHAT, "logprobs": True, "top_logprobs": 50}, convert=chat_sampling_params)
    assert err.param == "top_logprobs" and err.message.startswith("top_logprobs must be")
    err = rejected({**CHAT, "max_completion_tokens": 0}, convert=chat_sampling_params)
    assert err.param == "max_completion_tokens"
    assert rejected({**CHAT, "top_logprobs": 2}, convert=chat_sampling_params).param == "top_logprobs"
    assert rejected({**CHAT, "stop": [""]}, convert=chat_sampling_params).param == "stop"


@pytest.mark.parametrize("prompt, expected", [
    ("abc", ["abc"]),
    (["a", "b"], ["a", "b"]),
    ([1, 2, 3], [[1, 2, 3]]),
    ([[1, 2], [3]], [[1, 2], [3]]),
])
def test_prompt_forms(prompt, expected):
    assert _prompt_list(decode({"prompt": prompt}, CompletionRequest).prompt) == expected


@pytest.mark.parametrize("prompt", [[], [1, "a"], [[1], "a"], [True, 2], [1.5], [{"x": 1}], [[1, [2]]]])
def test_bad_prompt_forms(prompt):
    with pytest.raises(APIError) as info:
        _prompt_list(decode({"prompt": prompt}, CompletionRequest).prompt)
    assert info.value.status == 400 and info.value.param == "prompt"


def test_websocket_frames():
    frame = msgspec.json.decode(b'{"id": "a", "type": "completions", "body": {"prompt": "x"}}', type=WSClientMessage)
    assert decode(bytes(frame.body), CompletionRequest).prompt == "x"
    assert rejected({"id": "a", "type": "explode"}, WSClientMessage).param == "type"
    assert rejected({"type": "cancel"}, WSClientMessage).message.startswith("Object missing required field `id`")
