"""Anthropic's Messages API (`/v1/messages`) end to end: the official `anthropic` client against
`jaxllm serve` on the demo model, plain, streamed (the same message), a tool round trip, stop
sequences, token counting, and bad requests in Anthropic's error shape."""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.test_fuzz import ANYTHING, FUZZ_SETTINGS, TEXT, _field, body_bytes
from tests.test_server_e2e import running_server

anthropic = pytest.importorskip("anthropic")

pytestmark = pytest.mark.demo_model

MODEL = "smollm2-135m"
KEY = "anthropic-test-key"
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city"],
}
TOOLS = [{"name": "get_weather", "description": "The forecast.", "input_schema": WEATHER}]
HELLO = [{"role": "user", "content": "Write one sentence about the sea."}]


@pytest.fixture(scope="module")
def server():
    with running_server(
        MODEL, "--max-model-len", "1024", "--num-pages", "256", "--max-num-batched-tokens",
        "256", "--api-key", KEY, "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
        name=MODEL,
    ) as url:  # fmt: skip
        yield url


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server, api_key=KEY, max_retries=0, timeout=600)


def _text(message) -> str:
    return "".join(b.text for b in message.content if b.type == "text")


def test_plain_and_streamed_messages_are_the_same(client):
    kw = dict(model=MODEL, max_tokens=24, messages=HELLO, extra_body={"temperature": 0.0},
              system="You are terse.")  # fmt: skip
    whole = client.messages.create(**kw)
    assert whole.type == "message" and whole.role == "assistant" and whole.model == MODEL
    assert whole.id.startswith("msg_") and [b.type for b in whole.content] == ["text"]
    assert whole.stop_reason in ("end_turn", "max_tokens")
    assert whole.usage.input_tokens > 10 and 0 < whole.usage.output_tokens <= 24
    with client.messages.stream(**kw) as stream:
        deltas = [e.delta.text for e in stream if e.type == "content_block_delta"]
        streamed = stream.get_final_message()
    assert _text(streamed) == "".join(deltas) == _text(whole)
    assert streamed.stop_reason == whole.stop_reason
    assert streamed.usage.output_tokens == whole.usage.output_tokens


def test_stop_sequences(client):
    kw = dict(model=MODEL, max_tokens=24, messages=HELLO, extra_body={"temperature": 0.0})
    text = _text(client.messages.create(**kw))
    stop = text[3:5]
    cut = client.messages.create(**kw, stop_sequences=[stop])
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    assert _text(cut) == text[: text.index(stop)]


# (The client of this version has no sampling arguments: they go in extra_body, as the
# Messages API takes them.)


def test_a_tool_round_trip(client):
    """tool_choice any, one call: a tool_use whose input fits the schema (stop_reason
    tool_use), the same streamed; its result sent back gets an answer."""
    ask = [{"role": "user", "content": "What is the weather in Paris for 3 days?"}]
    choice = {"type": "any", "disable_parallel_tool_use": True}  # one call
    kw = dict(model=MODEL, max_tokens=200, messages=ask, tools=TOOLS, tool_choice=choice,
              extra_body={"temperature": 0.0})  # fmt: skip
    first = client.messages.create(**kw)
    calls = [b for b in first.content if b.type == "tool_use"]
    assert len(calls) == 1 and first.stop_reason == "tool_use"
    for call in calls:
        assert call.name == "get_weather"
        jsonschema.validate(call.input, WEATHER)
    with client.messages.stream(**kw) as stream:
        streamed = stream.get_final_message()
    assert [(b.name, b.input) for b in streamed.content if b.type == "tool_use"] == [
        (c.name, c.input) for c in calls
    ]
    results = [
        {"type": "tool_result", "tool_use_id": c.id, "content": "Sunny, 24 C."} for c in calls
    ]
    history = [*ask, {"role": "assistant", "content": first.content},
               {"role": "user", "content": results}]  # fmt: skip
    second = client.messages.create(model=MODEL, max_tokens=16, messages=history, tools=TOOLS)
    assert second.content and second.stop_reason in ("end_turn", "max_tokens", "tool_use")


def test_count_tokens_and_both_key_headers(server, client):
    count = client.messages.count_tokens(model=MODEL, messages=HELLO)
    assert count.input_tokens > 5
    body = {"model": MODEL, "max_tokens": 2, "messages": HELLO}
    r = httpx.post(f"{server}/v1/messages", json=body, timeout=120,
                   headers={"Authorization": f"Bearer {KEY}"})  # fmt: skip
    assert r.status_code == 200 and r.json()["type"] == "message"


@pytest.mark.parametrize(
    ("body", "param_in_message"),
    [
        ({"messages": HELLO}, "max_tokens"),
        ({"max_tokens": 4, "messages": [{"role": "system", "content": "x"}]}, "role"),
        ({"max_tokens": 4, "messages": [{"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "nope", "content": "x"}]}]}, "tool_use"),
        ({"max_tokens": 4, "messages": [{"role": "user", "content": [
            {"type": "image", "source": {}}]}]}, "image"),
        ({"max_tokens": 4, "messages": HELLO, "tool_choice": {"type": "maybe"}}, "tool_choice"),
        ({"max_tokens": 4, "messages": HELLO, "temperature": -1}, "temperature"),
        ({"max_tokens": 0, "messages": HELLO}, "max_tokens"),
        ({"max_tokens": 4, "messages": "hi"}, "messages"),
        ({"max_tokens": 4, "messages": HELLO, "thinking": {"type": "maybe"}}, "thinking"),
    ],
)  # fmt: skip
def test_bad_requests_are_400s_in_anthropics_shape(server, body, param_in_message):
    r = httpx.post(f"{server}/v1/messages", json={"model": MODEL, **body},
                   headers={"x-api-key": KEY}, timeout=60)  # fmt: skip
    assert r.status_code == 400, r.text
    data = r.json()
    assert data["type"] == "error" and data["error"]["type"] == "invalid_request_error"
    assert param_in_message in data["error"]["message"], data


def test_auth_and_unknown_model_errors(server):
    bad = anthropic.Anthropic(base_url=server, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as err:
        bad.messages.create(model=MODEL, max_tokens=2, messages=HELLO)
    assert err.value.body["error"]["type"] == "authentication_error"
    good = anthropic.Anthropic(base_url=server, api_key=KEY, max_retries=0)
    with pytest.raises(anthropic.NotFoundError):
        good.messages.create(model="other", max_tokens=2, messages=HELLO)
    r = httpx.post(f"{server}/v1/messages", content=b"{nope", headers={"x-api-key": KEY})
    assert r.status_code == 400 and json.loads(r.text)["type"] == "error"


# ---- fuzzing --------------------------------------------------------------------------------

BLOCK = st.one_of(
    st.fixed_dictionaries({"type": st.just("text"), "text": TEXT}),
    st.fixed_dictionaries({"type": st.just("tool_use"), "id": TEXT, "name": TEXT,
                           "input": st.dictionaries(st.text(max_size=5), TEXT, max_size=2)}),
    st.fixed_dictionaries({"type": st.just("tool_result"), "tool_use_id": TEXT,
                           "content": st.one_of(TEXT, st.lists(ANYTHING, max_size=2))}),
    st.fixed_dictionaries({"type": st.sampled_from(["thinking", "image", "document", "x"])}),
)  # fmt: skip
MESSAGE = st.fixed_dictionaries(
    {
        "role": st.sampled_from(["user", "assistant", "system"]),
        "content": st.one_of(TEXT, st.lists(BLOCK, max_size=3)),
    }
)
FIELDS = {
    "model": st.sampled_from([MODEL, "other"]),
    "max_tokens": st.integers(-1, 8),
    "messages": st.lists(MESSAGE, min_size=1, max_size=3),
    "system": st.one_of(TEXT, st.lists(BLOCK, max_size=2)),
    "stop_sequences": st.lists(TEXT, max_size=2),
    "stream": st.booleans(),
    "temperature": st.floats(-1, 3),
    "top_k": st.integers(-2, 50),
    "tools": st.lists(st.fixed_dictionaries({"name": TEXT, "input_schema": ANYTHING}), max_size=2),
    "tool_choice": st.fixed_dictionaries(
        {"type": st.sampled_from(["auto", "any", "none", "tool", "x"]), "name": TEXT}
    ),
    "thinking": st.fixed_dictionaries({"type": st.sampled_from(["enabled", "disabled", "x"])}),
}


@st.composite
def bodies(draw):
    names = draw(st.lists(st.sampled_from(sorted(FIELDS)), unique=True, max_size=8))
    body = {name: draw(_field(FIELDS[name])) for name in names}
    for required in ("model", "max_tokens", "messages"):
        if required not in body and draw(st.integers(0, 4)):
            body[required] = draw(FIELDS[required])
    if draw(st.integers(0, 19)) == 0:
        body = draw(ANYTHING)
    return body


@settings(max_examples=100, derandomize=True, **FUZZ_SETTINGS)
@given(body=bodies())
def test_fuzzed_messages_bodies_get_no_5xx(server, body):
    content = body_bytes(body)
    r = httpx.post(f"{server}/v1/messages", content=content, timeout=120,
                   headers={"x-api-key": KEY, "content-type": "application/json"})  # fmt: skip
    assert r.status_code < 500, r.text[:1000]
    if r.status_code >= 400:
        data = r.json()
        assert data["type"] == "error" and set(data["error"]) == {"type", "message"}, data
    elif r.headers["content-type"].startswith("text/event-stream"):
        events = [line for line in r.text.split("\n") if line.startswith("event: ")]
        assert events[0] == "event: message_start", r.text[:500]
        assert events[-1] in ("event: message_stop", "event: error"), r.text[-500:]
        if events[-1] == "event: error":
            assert "api_error" not in r.text, r.text[-500:]
    else:
        assert r.json()["type"] == "message"
