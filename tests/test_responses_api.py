"""OpenAI's Responses API (`/v1/responses`) end to end: the official `openai` client's
`responses.create` against `jaxllm serve` on the demo model: plain, streamed (adding up to the
stored response), a function tool round trip through `previous_response_id`, `text.format`
with a JSON schema, retrieving and deleting, bad requests, and fuzzed bodies."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.test_fuzz import ANYTHING, FUZZ_SETTINGS, TEXT, _field, body_bytes
from tests.test_server_e2e import running_server

pytestmark = pytest.mark.demo_model

MODEL = "smollm2-135m"
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city", "days"],
    "additionalProperties": False,
}
TOOLS = [{"type": "function", "name": "get_weather", "description": "The forecast.",
          "parameters": WEATHER}]  # fmt: skip


@pytest.fixture(scope="module")
def server():
    with running_server(
        MODEL, "--max-model-len", "1024", "--num-pages", "256", "--max-num-batched-tokens",
        "256", "--enable-auto-tool-choice", "--tool-call-parser", "hermes", name=MODEL,
    ) as url:  # fmt: skip
        yield url


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=600)


def test_plain_and_streamed_responses_are_the_same(client):
    kw = dict(model=MODEL, input="Write one sentence about the sea.", max_output_tokens=24,
              temperature=0.0, instructions="You are terse.")  # fmt: skip
    whole = client.responses.create(**kw)
    assert whole.object == "response" and whole.id.startswith("resp_")
    assert whole.status in ("completed", "incomplete") and whole.output_text
    assert [item.type for item in whole.output] == ["message"]
    assert whole.usage.input_tokens > 5 and 0 < whole.usage.output_tokens <= 24
    events = list(client.responses.create(**kw, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert deltas == final.output_text == whole.output_text
    assert final.status == whole.status and final.usage.output_tokens == whole.usage.output_tokens
    stored = client.responses.retrieve(final.id)
    assert stored.output_text == whole.output_text


def test_a_function_call_round_trip_through_previous_response_id(client):
    first = client.responses.create(
        model=MODEL, input="What is the weather in Paris for 3 days?", tools=TOOLS,
        tool_choice="required", parallel_tool_calls=False, temperature=0.0,
        max_output_tokens=200,
    )  # fmt: skip
    calls = [item for item in first.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather"
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER)
    streamed = list(client.responses.create(
        model=MODEL, input="What is the weather in Paris for 3 days?", tools=TOOLS,
        tool_choice="required", parallel_tool_calls=False, temperature=0.0,
        max_output_tokens=200, stream=True,
    ))  # fmt: skip
    arguments = "".join(
        e.delta for e in streamed if e.type == "response.function_call_arguments.delta"
    )
    assert arguments == calls[0].arguments
    second = client.responses.create(
        model=MODEL, previous_response_id=first.id, max_output_tokens=16, tools=TOOLS,
        input=[{"type": "function_call_output", "call_id": calls[0].call_id,
                "output": "Sunny, 24 C."}],
    )  # fmt: skip
    assert second.previous_response_id == first.id and second.output


def test_text_format_json_schema(client):
    r = client.responses.create(
        model=MODEL, input="Give the weather as JSON.", max_output_tokens=200,
        text={"format": {"type": "json_schema", "name": "weather", "schema": WEATHER}},
    )  # fmt: skip
    jsonschema.validate(json.loads(r.output_text), WEATHER)


def test_retrieve_delete_and_unknown_ids(client):
    r = client.responses.create(model=MODEL, input="Hi", max_output_tokens=4)
    assert client.responses.retrieve(r.id).id == r.id
    client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError) as err:
        client.responses.create(model=MODEL, input="Hi", previous_response_id=r.id)
    assert err.value.body["param"] == "previous_response_id"
    unstored = client.responses.create(model=MODEL, input="Hi", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": [{"type": "computer_call"}]}, "input.0.type"),
        ({"input": [{"type": "function_call_output", "call_id": "x", "output": "y"}]},
         "input.0.call_id"),
        ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]},
         "input.0.content.0.type"),
        ({"input": 3}, "input"),
        ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools.0.type"),
        ({"input": "hi", "background": True}, "background"),
        ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
        ({"input": "hi", "text": {"format": {"type": "yaml"}}}, "text.format.type"),
        ({"input": "hi", "temperature": "hot"}, "temperature"),
    ],
)  # fmt: skip
def test_bad_requests_are_400s_naming_the_field(server, body, param):
    r = httpx.post(f"{server}/v1/responses", json={"model": MODEL, **body}, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()


RESPONSE_FIELDS = {
    "model": st.sampled_from([MODEL, "other"]),
    "input": st.one_of(
        TEXT,
        st.lists(
            st.one_of(
                st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "x"]),
                                       "content": st.one_of(TEXT, st.lists(ANYTHING))}),
                st.fixed_dictionaries({"type": st.sampled_from(
                    ["function_call", "function_call_output", "reasoning", "x"]),
                    "call_id": TEXT, "name": TEXT, "arguments": TEXT, "output": TEXT}),
            ),
            max_size=3,
        ),
    ),
    "instructions": TEXT,
    "max_output_tokens": st.integers(-1, 6),
    "temperature": st.floats(-1, 3),
    "stream": st.booleans(),
    "store": st.booleans(),
    "previous_response_id": TEXT,
    "tool_choice": st.sampled_from(["auto", "none", "required", "x"]),
    "tools": st.lists(st.fixed_dictionaries({"type": st.sampled_from(["function", "x"]),
                                             "name": TEXT, "parameters": ANYTHING}), max_size=2),
    "text": st.fixed_dictionaries({"format": st.fixed_dictionaries(
        {"type": st.sampled_from(["text", "json_object", "json_schema", "x"])})}),
}  # fmt: skip


@st.composite
def bodies(draw):
    names = draw(st.lists(st.sampled_from(sorted(RESPONSE_FIELDS)), unique=True, max_size=8))
    body = {name: draw(_field(RESPONSE_FIELDS[name])) for name in names}
    if "input" not in body and draw(st.integers(0, 4)):
        body["input"] = draw(RESPONSE_FIELDS["input"])
    if "max_output_tokens" not in body and draw(st.integers(0, 29)):
        body["max_output_tokens"] = draw(st.integers(1, 6))  # unset: up to the context's end
    if draw(st.integers(0, 19)) == 0:
        body = draw(ANYTHING)
    return body


@settings(max_examples=100, derandomize=True, **FUZZ_SETTINGS)
@given(body=bodies())
def test_fuzzed_responses_bodies_get_no_5xx(server, body):
    content = body_bytes(body)
    r = httpx.post(f"{server}/v1/responses", content=content, timeout=120,
                   headers={"content-type": "application/json"})  # fmt: skip
    assert r.status_code < 500, r.text[:1000]
    if r.status_code >= 400:
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["code"] == r.status_code
    elif r.headers["content-type"].startswith("text/event-stream"):
        kinds = [line for line in r.text.split("\n") if line.startswith("event: ")]
        assert kinds[0] == "event: response.created", r.text[:300]
        assert kinds[-1] in ("event: response.completed", "event: response.incomplete",
                             "event: error"), r.text[-300:]  # fmt: skip
    else:
        assert r.json()["object"] == "response"
