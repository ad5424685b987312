"""Fuzzing the /v1 routes of a real `sparkd serve`.

schemathesis generates requests from the server's own /openapi.json, both ones
the schema allows and ones it forbids; hypothesis adds what no schema describes:
bytes that are not JSON, huge numbers, NaN, deep nesting, any unicode, wrong
types in every field. Every answer must be a well-formed 2xx or 4xx (an OpenAI
error, a JSON body or a complete event stream), never a 5xx, and afterwards the
server must be alive, idle and still serving. Runs are derandomized: the same
examples every time.
"""

from __future__ import annotations

import itertools
import json

import httpx
import jsonschema
import pytest
import schemathesis
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st
from openapi_spec_validator import validate as validate_openapi
from schemathesis import GenerationMode
from schemathesis.checks import (content_type_conformance, negative_data_rejection, not_a_server_error,
                                 response_headers_conformance, response_schema_conformance,
                                 status_code_conformance)
from websockets.sync.client import connect

from server_fixtures import VOCAB_SIZE, complete_stream_chunks, sse_payloads, start_server
from sparkd.api.openapi import openapi_schema

# Any larger max_tokens (or prompt) is a 400, so what the fuzzer gets generated stays cheap.
FUZZ_MAX_MODEL_LEN = 48
SCHEMA_EXAMPLES = 250  # per operation and mode
GARBAGE_EXAMPLES = 500  # per route (and for the WebSocket)
COMBINATION_EXAMPLES = 250  # per route
FUZZ_SETTINGS = settings(derandomize=True, database=None, deadline=None, print_blob=True,
                         suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much,
                                                HealthCheck.data_too_large])

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
VALID_BODIES = {
    COMPLETIONS: {"prompt": "fuzz", "max_tokens": 3},
    CHAT: {"messages": [{"role": "user", "content": "fuzz"}], "max_tokens": 3},
}
REQUEST_SCHEMAS = {COMPLETIONS: "CompletionRequest", CHAT: "ChatCompletionRequest"}
ERROR_FIELDS = {"message", "type", "param", "code"}
SCHEMA_CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance,
                 response_schema_conformance, response_headers_conformance]


@pytest.fixture(scope="module")
def fuzz_server(served_model_dir, tmp_path_factory):
    proc = start_server(served_model_dir, tmp_path_factory.mktemp("fuzz") / "serve.log",
                        "--max-model-len", str(FUZZ_MAX_MODEL_LEN))
    yield proc
    proc.stop()


@pytest.fixture
def survives(fuzz_server):
    """After the test: the process is up, idle with an empty KV cache, logged no traceback,
    and still answers a normal request."""
    mark = fuzz_server.log_size()
    yield
    assert fuzz_server.process.poll() is None, fuzz_server.log_tail()
    after = fuzz_server.wait_idle(timeout=10)
    assert after["sparkd:kv_cache_usage_perc"] == 0.0
    with fuzz_server.client() as client:
        assert client.get("/health").status_code == 200
        out = client.post(COMPLETIONS, json={"prompt": "x", "max_tokens": 2, "ignore_eos": True})
    assert out.status_code == 200 and out.json()["usage"]["completion_tokens"] == 2
    log = fuzz_server.log_since(mark)
    assert "Traceback" not in log, log[-4000:]


@pytest.fixture(scope="module")
def api_schema(fuzz_server):
    # schemathesis stops reading an event stream after 20 events by default; ours end by themselves
    # (at most n x prompts x FUZZ_MAX_MODEL_LEN tokens), and a cut stream would look truncated.
    config = schemathesis.Config.from_dict({"max-stream-events": 10**6, "request-timeout": 60})
    return schemathesis.openapi.from_url(f"{fuzz_server.base_url}/openapi.json", config=config)


def check_well_formed(status: int, content_type: str, body: bytes) -> None:
    """Shared by every fuzz test: a 2xx or 4xx with a body of the kind its content-type says."""
    assert status < 500, body[:2000]
    assert b"Traceback" not in body
    if content_type.startswith("text/event-stream"):
        assert status == 200
        complete_stream_chunks(sse_payloads(body))
        return
    assert content_type.startswith("application/json"), (status, content_type, body[:500])
    payload = json.loads(body)
    if status >= 400:
        assert list(payload) == ["error"] and set(payload["error"]) == ERROR_FIELDS, payload
        assert isinstance(payload["error"]["message"], str) and payload["error"]["message"]


def test_openapi_document(fuzz_server):
    """Served without the API key, a valid OpenAPI document, and the request schemas agree with
    the server on bodies it accepts."""
    response = httpx.get(f"{fuzz_server.base_url}/openapi.json", timeout=10)
    assert response.status_code == 200
    document = response.json()
    validate_openapi(document)
    assert document == json.loads(json.dumps(openapi_schema()))
    assert set(document["paths"]) == {"/v1/models", COMPLETIONS, CHAT}
    with fuzz_server.client() as client:
        for path, body in VALID_BODIES.items():
            assert client.post(path, json=body).status_code == 200
            request_schema = {"$ref": f"#/components/schemas/{REQUEST_SCHEMAS[path]}",
                              "components": document["components"]}
            jsonschema.Draft202012Validator(request_schema).validate(body)


OPERATIONS = [("/v1/models", "GET"), (COMPLETIONS, "POST"), (CHAT, "POST")]


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE], ids=lambda m: m.value)
@pytest.mark.parametrize("path, method", OPERATIONS, ids=[f"{m} {p}" for p, m in OPERATIONS])
def test_schema_fuzz(fuzz_server, api_schema, survives, path, method, mode):
    """Requests generated from the schema: valid ones (which may still break value ranges the schema
    does not state) and invalid ones, which the server must refuse with a 4xx."""
    strategy = api_schema[path][method].as_strategy(generation_mode=mode)
    checks = SCHEMA_CHECKS + ([negative_data_rejection] if mode is GenerationMode.NEGATIVE else [])

    @settings(FUZZ_SETTINGS, max_examples=SCHEMA_EXAMPLES)
    @given(case=strategy)
    def fuzz(case):
        note(f"{case.method} {case.path} body: {case.body!r}")  # printed when it fails
        response = case.call(base_url=fuzz_server.base_url, headers=fuzz_server.headers)
        case.validate_response(response, checks=checks, headers=fuzz_server.headers)
        # schemathesis keeps every value of a header, under its lower-cased name
        check_well_formed(response.status_code, response.headers.get("content-type", [""])[0], response.content)

    fuzz()


# ---- garbage no schema describes ----
RAW_VALUES = [b"NaN", b"Infinity", b"-Infinity", b"1e999", b"-1e400", b"1" * 400, b"-0", b"0.0e-999",
              b'"\\ud800"', b'"\\u0000"', b'"\xff\xfe"', b"[" * 5000 + b"]" * 5000, b"{" * 3, b"", b"tru",
              b'"' + "\U0001F600\u202e\u0085".encode() * 200 + b'"']
json_leaves = (st.none() | st.booleans() | st.integers(min_value=-(2**200), max_value=2**200)
               | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=40))
json_values = st.recursive(json_leaves, lambda inner: st.lists(inner, max_size=4)
                           | st.dictionaries(st.text(max_size=10), inner, max_size=4), max_leaves=12)
# Values of about the right type and size, so that mixes of fields get past decoding to the engine.
plausible_values = (st.booleans() | st.integers(-2, FUZZ_MAX_MODEL_LEN + 20) | st.floats(-3.0, 3.0)
                    | st.text(max_size=12) | st.lists(st.integers(-1, VOCAB_SIZE + 80), max_size=4)
                    | st.lists(st.text(max_size=6), max_size=3))


def encode(value) -> bytes:
    return json.dumps(value).encode()  # ASCII escapes, so lone surrogates get through as `\udXXX`


@st.composite
def mutated_body(draw, path: str) -> bytes:
    """A valid request with one to three fields (top level, or of its message) set to anything:
    a value of about the right type, a JSON value of any type, or bytes that are not JSON."""
    schema = openapi_schema()["components"]["schemas"]
    fields = list(schema[REQUEST_SCHEMAS[path]]["properties"])
    if path == CHAT:
        fields += [f"messages.{name}" for name in schema["ChatMessage"]["properties"]]
    body = dict(VALID_BODIES[path], stream=draw(st.booleans()))
    if path == CHAT:
        message = body["messages"][0] = dict(body["messages"][0])
    replacements = {}
    for i, field in enumerate(draw(st.lists(st.sampled_from(fields), min_size=1, max_size=3, unique=True))):
        marker = f"\x00MUTATED{i}\x00"
        if field.startswith("messages."):
            message[field.split(".", 1)[1]] = marker  # lost, rightly, if `messages` itself is replaced
        else:
            body[field] = marker
        values = plausible_values.map(encode) | json_values.map(encode) | st.sampled_from(RAW_VALUES)
        replacements[encode(marker)] = draw(values)
    raw = encode(body)
    for marker, value in replacements.items():
        raw = raw.replace(marker, value)
    return raw


def raw_garbage() -> st.SearchStrategy[bytes]:
    """Whole bodies: any JSON document, any bytes, any text (lone surrogates included)."""
    return (json_values.map(encode) | st.binary(max_size=300)
            | st.text(max_size=200).map(lambda t: t.encode("utf-8", "surrogatepass")))


@pytest.mark.parametrize("kind", ["mutated", "raw"])
@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
def test_garbage_fuzz(fuzz_server, survives, path, kind):
    strategy = mutated_body(path) if kind == "mutated" else raw_garbage()
    with fuzz_server.client(timeout=30) as client:

        @settings(FUZZ_SETTINGS, max_examples=GARBAGE_EXAMPLES)
        @given(raw=strategy)
        def fuzz(raw: bytes):
            response = client.post(path, content=raw, headers={"content-type": "application/json"})
            check_well_formed(response.status_code, response.headers.get("content-type", ""), response.content)

        fuzz()


# ---- requests that decode, with every option at once ----
token_ids = st.integers(0, VOCAB_SIZE + 8)  # a few past the vocabulary
short_text = st.text(max_size=24)
SAMPLING_OPTIONS = {
    "n": st.integers(1, 4), "max_tokens": st.none() | st.integers(1, 24), "min_tokens": st.integers(0, 6),
    "temperature": st.sampled_from([0.0, 1e-6, 1.0]) | st.floats(0, 100), "top_p": st.floats(1e-9, 1),
    "top_k": st.sampled_from([-1, 0, 1, VOCAB_SIZE - 1, VOCAB_SIZE, 2**40]), "min_p": st.floats(0, 1),
    "seed": st.integers(-(2**63), 2**63 - 1), "repetition_penalty": st.floats(1e-3, 10),
    "presence_penalty": st.floats(-2, 2), "frequency_penalty": st.floats(-2, 2),
    "stop": st.text(min_size=1, max_size=4) | st.lists(st.text(min_size=1, max_size=4), max_size=4),
    "stop_token_ids": st.lists(token_ids, max_size=4), "ignore_eos": st.booleans(),
    "include_stop_str_in_output": st.booleans(), "skip_special_tokens": st.booleans(), "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
}
message = st.fixed_dictionaries({
    "role": st.sampled_from(["system", "developer", "user", "assistant"]),
    "content": short_text | st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": short_text}), max_size=2),
})
ROUTE_OPTIONS = {
    COMPLETIONS: {"logprobs": st.integers(0, 20)},
    CHAT: {"logprobs": st.booleans(), "top_logprobs": st.integers(0, 20), "add_generation_prompt": st.booleans(),
           "continue_final_message": st.booleans(), "max_completion_tokens": st.integers(1, 24)},
}
REQUIRED = {
    COMPLETIONS: {"prompt": short_text | st.lists(token_ids, min_size=1, max_size=12)
                  | st.lists(st.lists(token_ids, min_size=1, max_size=6), min_size=1, max_size=3)},
    CHAT: {"messages": st.lists(message, min_size=1, max_size=3)},
}


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
def test_option_combinations_fuzz(fuzz_server, survives, path):
    """Bodies of the right types, mostly in range, with any mix of options: the requests that reach
    the engine, where option interactions (min_tokens with stop_token_ids, n with logprobs) live."""
    bodies = st.fixed_dictionaries(REQUIRED[path], optional=SAMPLING_OPTIONS | ROUTE_OPTIONS[path])
    with fuzz_server.client(timeout=60) as client:

        @settings(FUZZ_SETTINGS, max_examples=COMBINATION_EXAMPLES)
        @given(body=bodies)
        def fuzz(body: dict):
            note(f"POST {path} body: {body!r}")
            response = client.post(path, content=encode(body), headers={"content-type": "application/json"})
            check_well_formed(response.status_code, response.headers.get("content-type", ""), response.content)

        fuzz()


@st.composite
def ws_frame(draw) -> tuple[bool, bytes]:
    """(send as text, frame bytes): a request frame whose body is a mutated request, or garbage.
    `{ID}` stands for the id the test gives the frame."""
    if draw(st.booleans()):
        frame_type, path = draw(st.sampled_from([("completions", COMPLETIONS), ("chat.completions", CHAT)]))
        return True, b'{"id": "{ID}", "type": "%s", "body": %s}' % (frame_type.encode(), draw(mutated_body(path)))
    raw = draw(raw_garbage())
    return draw(st.booleans()), raw


def test_websocket_garbage_fuzz(fuzz_server, survives):
    """Every frame gets exactly one last frame (done or a 4xx error), whatever it held, and the
    socket keeps serving: a probe request after each frame completes."""
    with connect(fuzz_server.ws_url, additional_headers=fuzz_server.headers, proxy=None) as sock:
        counter = itertools.count()

        @settings(FUZZ_SETTINGS, max_examples=GARBAGE_EXAMPLES)
        @given(frame=ws_frame())
        def fuzz(frame: tuple[bool, bytes]):
            as_text, raw = frame
            n = next(counter)
            raw = raw.replace(b"{ID}", f"fuzz-{n}".encode())
            sock.send(raw.decode("utf-8", "replace") if as_text else raw)
            probe = f"probe-{n}"
            sock.send(json.dumps({"id": probe, "type": "completions", "body": VALID_BODIES[COMPLETIONS]}))
            frame_done = probe_done = False
            while not (frame_done and probe_done):
                reply = json.loads(sock.recv(timeout=30))
                assert reply["type"] in ("chunk", "done", "error"), reply
                if reply["type"] == "error":
                    assert set(reply["error"]) == ERROR_FIELDS and reply["error"]["type"] != "server_error", reply
                if reply["type"] == "chunk":
                    continue
                if reply["id"] == probe:
                    assert reply["type"] == "done" and not probe_done, reply
                    probe_done = True
                else:
                    assert not frame_done, f"two last frames for one frame: {reply}"
                    frame_done = True

        fuzz()
