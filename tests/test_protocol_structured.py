"""Structured outputs and tools in the server: every request form of a constraint and the
SamplingParams.structured_outputs it becomes, the 400s (each naming the field the client used),
tools and tool_choice, tool call history through a chat template, and the chat endpoint's tool
calls, streamed and not, through the app with a fake engine that returns canned text (no
model)."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import time
from types import SimpleNamespace

import pytest
from test_server_protocol import chat, completion

from jaxllm.config import CacheConfig
from jaxllm.engine.core_outputs import Stats
from jaxllm.engine.input_processor import InputProcessor
from jaxllm.outputs import CompletionOutput, RequestOutput
from jaxllm.structured_outputs import StructuredOutputsParams
from server.protocol import APIError, ChatCompletionRequest, CompletionRequest, parse_request
from server.tool_parsers import required_tool_calls_schema

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city"],
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "weather", "description": "The forecast.", "parameters": WEATHER},
    },
    {"type": "function", "function": {"name": "now"}},
]
# The tools as they reach the template and the required schema: every key, nothing else.
NORMALIZED_TOOLS = [
    {
        "type": "function",
        "function": {"name": "weather", "description": "The forecast.", "parameters": WEATHER},
    },
    {"type": "function", "function": {"name": "now", "description": None, "parameters": None}},
]
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}}
LARK = 'start: "yes" | "no"'
GBNF = 'root ::= "yes" | "no"'


def named(name):
    return {"type": "function", "function": {"name": name}}


def constraint(cls, body):
    req = parse_request(cls, body)
    params = req.to_sampling_params(default_max_tokens=100, generation_defaults={})
    return params.structured_outputs


SOP = StructuredOutputsParams
FORMS = [
    (CompletionRequest, completion(), None),
    (CompletionRequest, completion(response_format={"type": "text"}), None),
    (CompletionRequest, completion(response_format={"type": "json_object"}), SOP(json_object=True)),
    (
        ChatCompletionRequest,
        chat(
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": SCHEMA, "strict": True},
            }
        ),
        SOP(json=SCHEMA),
    ),  # fmt: skip
    (ChatCompletionRequest, chat(response_format={"type": "json_object"}), SOP(json_object=True)),
    (
        CompletionRequest,
        completion(structured_outputs={"json": SCHEMA, "disable_any_whitespace": True}),
        SOP(json=SCHEMA, disable_any_whitespace=True),
    ),
    (CompletionRequest, completion(structured_outputs={"regex": "[ab]+"}), SOP(regex="[ab]+")),
    (
        ChatCompletionRequest,
        chat(structured_outputs={"choice": ["x", "y"]}),
        SOP(choice=["x", "y"]),
    ),
    (ChatCompletionRequest, chat(structured_outputs={"grammar": LARK}), SOP(grammar=LARK)),
    (
        ChatCompletionRequest,
        chat(structured_outputs={"json_object": True, "whitespace_pattern": " ?"}),
        SOP(json_object=True, whitespace_pattern=" ?"),
    ),
    (CompletionRequest, completion(structured_outputs=None), None),
    (CompletionRequest, completion(guided_json=SCHEMA), SOP(json=SCHEMA)),
    (CompletionRequest, completion(guided_json=json.dumps(SCHEMA)), SOP(json=json.dumps(SCHEMA))),
    (ChatCompletionRequest, chat(guided_regex=r"\d+"), SOP(regex=r"\d+")),
    (ChatCompletionRequest, chat(guided_choice=["a", "b"]), SOP(choice=["a", "b"])),
    (CompletionRequest, completion(guided_grammar=GBNF), SOP(grammar=GBNF)),
    (
        CompletionRequest,
        completion(guided_json=SCHEMA, guided_whitespace_pattern=" ", guided_decoding_backend="x"),
        SOP(json=SCHEMA, whitespace_pattern=" "),
    ),
    (
        ChatCompletionRequest,
        chat(structured_outputs={"json": SCHEMA}, guided_whitespace_pattern=" "),
        SOP(json=SCHEMA, whitespace_pattern=" "),
    ),
    # tools: a named function's parameters, or any object; required's array
    (ChatCompletionRequest, chat(tools=TOOLS, tool_choice=named("weather")), SOP(json=WEATHER)),
    (
        ChatCompletionRequest,
        chat(tools=TOOLS, tool_choice=named("now")),
        SOP(json={"type": "object"}),
    ),
    (
        ChatCompletionRequest,
        chat(tools=TOOLS, tool_choice="required"),
        SOP(json=required_tool_calls_schema(NORMALIZED_TOOLS, parallel=True)),
    ),
    (
        ChatCompletionRequest,
        chat(tools=TOOLS, tool_choice="required", parallel_tool_calls=False),
        SOP(json=required_tool_calls_schema(NORMALIZED_TOOLS, parallel=False)),
    ),
    (ChatCompletionRequest, chat(tools=TOOLS, tool_choice="auto"), None),
    (ChatCompletionRequest, chat(tools=TOOLS, tool_choice="none"), None),
    (ChatCompletionRequest, chat(tools=TOOLS), None),
    (ChatCompletionRequest, chat(tools=[], tool_choice="required"), None),
    (
        ChatCompletionRequest,
        chat(tools=TOOLS, tool_choice="none", response_format={"type": "json_object"}),
        SOP(json_object=True),
    ),
]


@pytest.mark.parametrize("cls, body, expected", FORMS)
def test_request_forms_become_structured_outputs(cls, body, expected):
    assert constraint(cls, body) == expected


def test_constraint_fields_are_known_fields():
    req = parse_request(CompletionRequest, completion(guided_decoding_backend="xgrammar", foo=1))
    assert req.ignored_fields() == ["foo"]


BAD = [
    # response_format
    (CompletionRequest, completion(response_format="json"), "response_format"),
    (CompletionRequest, completion(response_format={"type": "xml"}), "response_format"),
    (CompletionRequest, completion(response_format={}), "response_format"),
    (ChatCompletionRequest, chat(response_format={"type": "json_schema"}), "response_format"),
    (
        ChatCompletionRequest,
        chat(response_format={"type": "json_schema", "json_schema": {"name": "x"}}),
        "response_format",
    ),
    (
        ChatCompletionRequest,
        chat(
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "nope"}},
            }
        ),
        "response_format",
    ),  # fmt: skip
    (
        ChatCompletionRequest,
        chat(response_format={"type": "json_schema", "json_schema": {"schema": 3}}),
        "response_format",
    ),
    # structured_outputs
    (CompletionRequest, completion(structured_outputs={}), "structured_outputs"),
    (CompletionRequest, completion(structured_outputs="json"), "structured_outputs"),
    (CompletionRequest, completion(structured_outputs={"regex": "a("}), "structured_outputs"),
    (CompletionRequest, completion(structured_outputs={"bogus": 1}), "structured_outputs"),
    (
        CompletionRequest,
        completion(structured_outputs={"regex": "a", "choice": ["b"]}),
        "structured_outputs",
    ),
    (CompletionRequest, completion(structured_outputs={"choice": []}), "structured_outputs"),
    (
        ChatCompletionRequest,
        chat(structured_outputs={"grammar": "start: ???"}),
        "structured_outputs",
    ),
    # the older guided_* fields
    (CompletionRequest, completion(guided_json={"type": "wat"}), "guided_json"),
    (CompletionRequest, completion(guided_json="{not json"), "guided_json"),
    (CompletionRequest, completion(guided_json=3), "guided_json"),
    (CompletionRequest, completion(guided_regex="a("), "guided_regex"),
    (CompletionRequest, completion(guided_regex=5), "guided_regex"),
    (ChatCompletionRequest, chat(guided_choice=[]), "guided_choice"),
    (ChatCompletionRequest, chat(guided_choice="a"), "guided_choice"),
    (ChatCompletionRequest, chat(guided_grammar="start: ???"), "guided_grammar"),
    (CompletionRequest, completion(guided_whitespace_pattern=5), "guided_whitespace_pattern"),
    # two constraints: the second is named
    (CompletionRequest, completion(guided_regex="a", guided_choice=["b"]), "guided_choice"),
    (
        ChatCompletionRequest,
        chat(response_format={"type": "json_object"}, structured_outputs={"regex": "a"}),
        "structured_outputs",
    ),
    (
        ChatCompletionRequest,
        chat(tools=TOOLS, tool_choice="required", guided_json=SCHEMA),
        "tool_choice",
    ),
    # tools
    (ChatCompletionRequest, chat(tools="weather"), "tools"),
    (ChatCompletionRequest, chat(tools=[1]), "tools"),
    (ChatCompletionRequest, chat(tools=[{"type": "function"}]), "tools"),
    (
        ChatCompletionRequest,
        chat(tools=[{"type": "retrieval", "function": {"name": "f"}}]),
        "tools",
    ),
    (ChatCompletionRequest, chat(tools=[{"type": "function", "function": {"name": ""}}]), "tools"),
    (ChatCompletionRequest, chat(tools=[{"type": "function", "function": {}}]), "tools"),
    (ChatCompletionRequest, chat(tools=[*TOOLS, TOOLS[1]]), "tools"),
    (
        ChatCompletionRequest,
        chat(tools=[{"type": "function", "function": {"name": "f", "parameters": 5}}]),
        "tools",
    ),
    (
        ChatCompletionRequest,
        chat(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "x"}}}]),
        "tools",
    ),
    (
        ChatCompletionRequest,
        chat(tools=[{"type": "function", "function": {"name": "f", "description": 5}}]),
        "tools",
    ),
    (
        ChatCompletionRequest,
        chat(
            tools=[
                {
                    "type": "function",
                    "function": {
                        "name": "a",
                        "parameters": {"type": "object", "$defs": {"D": {"type": "string"}}},
                    },
                },
                {
                    "type": "function",
                    "function": {
                        "name": "b",
                        "parameters": {"type": "object", "$defs": {"D": {"type": "integer"}}},
                    },
                },
            ],
            tool_choice="required",
        ),
        "tools",
    ),  # fmt: skip
    # tool_choice
    (ChatCompletionRequest, chat(tool_choice="auto"), "tool_choice"),
    (ChatCompletionRequest, chat(tool_choice="required"), "tool_choice"),
    (ChatCompletionRequest, chat(tool_choice=named("weather")), "tool_choice"),
    (ChatCompletionRequest, chat(tools=TOOLS, tool_choice="sometimes"), "tool_choice"),
    (ChatCompletionRequest, chat(tools=TOOLS, tool_choice={"type": "function"}), "tool_choice"),
    (ChatCompletionRequest, chat(tools=TOOLS, tool_choice=named("")), "tool_choice"),
    (ChatCompletionRequest, chat(tools=TOOLS, tool_choice=named("rain")), "tool_choice"),
    (ChatCompletionRequest, chat(tools=[], tool_choice=named("weather")), "tool_choice"),
    (ChatCompletionRequest, chat(tools=TOOLS, parallel_tool_calls="x"), "parallel_tool_calls"),
    # the legacy functions API
    (ChatCompletionRequest, chat(functions=[{"name": "f"}]), "functions"),
    (ChatCompletionRequest, chat(function_call="auto"), "function_call"),
    # tool calls in the history
    (
        ChatCompletionRequest,
        chat(
            messages=[
                {
                    "role": "assistant",
                    "tool_calls": [
                        {
                            "id": "c",
                            "type": "function",
                            "function": {"name": "f", "arguments": "{bad"},
                        }
                    ],
                }
            ]
        ),
        "messages.0.tool_calls.0.function.arguments",
    ),  # fmt: skip
    (
        ChatCompletionRequest,
        chat(messages=[{"role": "assistant", "tool_calls": [{"id": "c"}]}]),
        "messages.0.tool_calls.0.function",
    ),
    (
        ChatCompletionRequest,
        chat(messages=[{"role": "tool", "content": "x", "tool_call_id": 5}]),
        "messages.0.tool_call_id",
    ),
]


@pytest.mark.parametrize(
    "cls, body, param", BAD, ids=[f"{i}-{p}" for i, (_, _, p) in enumerate(BAD)]
)
def test_bad_constraint_or_tool_is_400_naming_param(cls, body, param):
    with pytest.raises(APIError) as info:
        parse_request(cls, body)
    err = info.value
    assert (err.status, err.param) == (400, param), err.message
    assert param.split(".")[0] in err.message, err.message  # the message says which field
    assert len(err.message) < 500


def test_messages_say_what_is_wrong():
    def message(body):
        with pytest.raises(APIError) as info:
            parse_request(ChatCompletionRequest, body)
        return info.value.message

    assert message(chat(guided_json={"type": "wat"})).startswith("guided_json: ")
    assert "tools.2.function.name" in message(chat(tools=[*TOOLS, TOOLS[1]]))
    assert "tools.0.function.parameters" in message(
        chat(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "x"}}}])
    )
    assert "'rain'" in message(chat(tools=TOOLS, tool_choice=named("rain")))
    assert "response_format and guided_regex" in message(
        chat(response_format={"type": "json_object"}, guided_regex="a")
    )
    assert "unknown key 'bogus'" in message(chat(structured_outputs={"bogus": 1}))


def test_tool_choice_normalized():
    def tool_choice(**fields):
        return parse_request(ChatCompletionRequest, chat(**fields)).tool_choice

    assert tool_choice() == "none"
    assert tool_choice(tools=TOOLS) == "auto"  # vLLM: unset with tools is auto
    assert tool_choice(tools=TOOLS, tool_choice=None) == "auto"
    assert tool_choice(tools=[], tool_choice="required") == "none"
    assert tool_choice(tools=[], tool_choice="auto") == "none"
    assert tool_choice(tool_choice="none") == "none"
    extra = {"type": "function", "function": {"name": "now", "x": 1}}
    req = parse_request(ChatCompletionRequest, chat(tools=TOOLS, tool_choice=extra))
    assert req.tool_choice == named("now") and req.named_tool == "now"
    assert parse_request(ChatCompletionRequest, chat(parallel_tool_calls=None)).parallel_tool_calls


def test_auto_tool_choice_needs_the_server_flag():
    req = parse_request(ChatCompletionRequest, chat(tools=TOOLS))
    req.check_tool_choice(auto_tool_choice=True)
    with pytest.raises(APIError) as info:
        req.check_tool_choice(auto_tool_choice=False)
    assert (info.value.status, info.value.param) == (400, "tool_choice")
    assert info.value.message == (
        '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'
    )
    for body in (chat(tools=TOOLS, tool_choice="required"), chat(tools=TOOLS, tool_choice="none"),
                 chat()):  # fmt: skip
        parse_request(ChatCompletionRequest, body).check_tool_choice(auto_tool_choice=False)


HISTORY = [
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "weather", "arguments": '{"city": "Paris"}'}},
            {"id": "call_2", "type": "function", "function": {"name": "now", "arguments": ""}},
            {"type": "function", "function": {"name": "weather", "arguments": {"city": "Rome"}}},
        ],
    },
    {"role": "tool", "content": "sunny", "tool_call_id": "call_1"},
    {"role": "tool", "content": [{"type": "text", "text": "noon"}], "tool_call_id": "call_2"},
]  # fmt: skip


def test_tool_history_reaches_the_template_as_transformers_expects():
    req = parse_request(ChatCompletionRequest, chat(messages=HISTORY, tools=TOOLS))
    assert req.conversation() == [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": "call_1", "type": "function",
                 "function": {"name": "weather", "arguments": {"city": "Paris"}}},
                {"id": "call_2", "type": "function", "function": {"name": "now", "arguments": {}}},
                {"type": "function", "function": {"name": "weather", "arguments": {"city": "Rome"}}},
            ],
        },
        {"role": "tool", "content": "sunny", "tool_call_id": "call_1"},
        {"role": "tool", "content": "noon", "tool_call_id": "call_2"},
    ]  # fmt: skip
    assert req.template_kwargs()["tools"] == NORMALIZED_TOOLS
    none = parse_request(ChatCompletionRequest, chat(tools=TOOLS, tool_choice="none"))
    assert "tools" not in none.template_kwargs()
    assert "tools" not in parse_request(ChatCompletionRequest, chat()).template_kwargs()


TOOLS_TEMPLATE = (
    "{% if tools %}TOOLS:{% for t in tools %} {{ t.function.name }} "
    "{{ t.function.parameters | tojson }};{% endfor %}|{% endif %}"
    "{% for m in messages %}<{{ m.role }}>{{ m.content }}"
    "{% for c in m.tool_calls or [] %}[{{ c.id }} {{ c.function.name }} "
    "{{ c.function.arguments | tojson }}]{% endfor %}"
    "{% if m.tool_call_id %}(for {{ m.tool_call_id }}){% endif %}|{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_dir)


def test_tools_and_history_render_through_a_chat_template(tokenizer):
    from server.generation import render_chat

    tok = copy.deepcopy(tokenizer)
    tok.chat_template = TOOLS_TEMPLATE
    req = parse_request(ChatCompletionRequest, chat(messages=HISTORY, tools=TOOLS))
    text = tok.decode(
        render_chat(SimpleNamespace(tokenizer=tok, input_processor=_inputs(tok)), req)
    )
    assert text == (
        'TOOLS: weather {"type": "object", "properties": {"city": {"type": "string"}, '
        '"days": {"type": "integer"}}, "required": ["city"]}; now null;|'
        "<user>Weather in Paris?|"
        '<assistant>[call_1 weather {"city": "Paris"}][call_2 now {}]'
        '[ weather {"city": "Rome"}]|'
        "<tool>sunny(for call_1)|"
        "<tool>noon(for call_2)|"
        "<assistant>"
    )


# ------------------------------------------------------------------ the app, with a fake engine


def _inputs(tokenizer) -> InputProcessor:
    return InputProcessor(
        tokenizer, eos_token_ids=(), vocab_size=len(tokenizer), max_model_len=4096
    )


class FakeEngine:
    """What the app uses of AsyncLLM; each choice's output is `texts[index]`, three
    characters per snapshot, the last with `finish_reason`."""

    def __init__(self, tokenizer, texts: list[str], finish_reason: str = "stop"):
        self.tokenizer = tokenizer
        self.texts, self.finish_reason = texts, finish_reason
        self.max_model_len = 4096
        self.input_processor = _inputs(tokenizer)
        self.generation_config: dict = {}
        self.dead = False
        self.on_step = None
        self.is_pooling_model = False
        self.supported_tasks = ["generate"]
        self.sleep_level = 0
        self.ready = SimpleNamespace(max_model_len=4096, num_pages=1, page_size=16, num_programs=0)
        self.config = SimpleNamespace(cache=CacheConfig())  # for the metrics
        self.stats = Stats()
        self.params: list = []  # the SamplingParams of each request

    async def generate(self, request, *, index=0, arrival_time=None):
        request_id, ids, params = (
            request.request_id,
            request.prompt_token_ids,
            request.sampling_params,
        )
        self.params.append(params)
        text = self.texts[index]
        ends = [*range(3, len(text), 3), len(text)]
        for k, end in enumerate(ends):
            done = k == len(ends) - 1
            out = CompletionOutput(
                index=index, text=text[:end], token_ids=list(range(k + 1)),
                cumulative_logprob=None, logprobs=None,
                finish_reason=self.finish_reason if done else None,
            )  # fmt: skip
            yield RequestOutput(request_id, None, ids, [out], done)
            await asyncio.sleep(0)

    async def shutdown(self) -> None:
        pass


@pytest.fixture
def serve(tokenizer):
    """serve(texts, **build_app kwargs) -> (a TestClient of the app, its FakeEngine)."""
    from fastapi.testclient import TestClient

    from server.api import build_app
    from server.config import ServerConfig

    with contextlib.ExitStack() as stack:

        def start(texts, finish_reason="stop", **kwargs):
            engine = FakeEngine(tokenizer, texts, finish_reason)

            async def start_engine():
                return engine

            app = build_app(start_engine, ServerConfig(served_model_name=("m",), **kwargs))
            client = stack.enter_context(TestClient(app))
            deadline = time.monotonic() + 10
            while client.get("/health").status_code != 200:
                assert time.monotonic() < deadline, "the app did not start"
                time.sleep(0.01)
            return client, engine

        yield start


def post(client, body):
    response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def stream_events(client, body) -> list[dict]:
    response = client.post("/v1/chat/completions", json={**body, "stream": True})
    assert response.status_code == 200, response.text
    lines = [line for line in response.text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]


def reassemble(events: list[dict], choice: int = 0) -> dict:
    """The message and finish reason a stream's deltas add up to, as a client builds them."""
    content, calls, finish = "", [], None
    for event in events:
        for c in event["choices"]:
            if c["index"] != choice:
                continue
            delta = c["delta"]
            content += delta.get("content") or ""
            for call in delta.get("tool_calls", []):
                if "id" in call:
                    assert set(call) == {"index", "id", "type", "function"}, call
                    assert call["index"] == len(calls) and call["type"] == "function"
                    assert call["id"].startswith("chatcmpl-tool-")
                    calls.append({"name": call["function"]["name"], "arguments": ""})
                else:
                    assert set(call) == {"index", "function"}, call
                    assert set(call["function"]) == {"arguments"}, call
                calls[call["index"]]["arguments"] += call["function"]["arguments"]
            finish = c["finish_reason"] or finish
    return {"content": content, "tool_calls": calls, "finish_reason": finish}


def calls_of(message: dict) -> list[dict]:
    for call in message.get("tool_calls", []):
        assert call["id"].startswith("chatcmpl-tool-") and call["type"] == "function"
    return [c["function"] for c in message.get("tool_calls", [])]


def check_stream_matches(client, body, response):
    """The stream of `body` adds up to the same content, calls and finish reason as
    `response` (a content of null or "" streams as no content)."""
    choice = response["choices"][0]
    streamed = reassemble(stream_events(client, body))
    assert streamed == {
        "content": choice["message"]["content"] or "",
        "tool_calls": calls_of(choice["message"]),
        "finish_reason": choice["finish_reason"],
    }


def test_named_tool_call(serve):
    arguments = '{"city": "Paris", "days": 3}'
    client, engine = serve([arguments])
    body = chat(tools=TOOLS, tool_choice=named("weather"))
    response = post(client, body)
    message = response["choices"][0]["message"]
    assert message["content"] == ""  # vLLM's, for a forced call
    assert calls_of(message) == [{"name": "weather", "arguments": arguments}]
    assert response["choices"][0]["finish_reason"] == "stop"  # vLLM keeps the engine's
    assert engine.params[0].structured_outputs == SOP(json=WEATHER)
    assert engine.params[0].skip_special_tokens is True
    check_stream_matches(client, body, response)


def test_required_tool_calls(serve):
    text = (
        '[{"name": "weather", "parameters": {"city": "Paris"}}, {"name": "now", "parameters": {}}]'
    )
    client, engine = serve([text])
    body = chat(tools=TOOLS, tool_choice="required")
    response = post(client, body)
    message = response["choices"][0]["message"]
    assert message["content"] == ""
    assert calls_of(message) == [
        {"name": "weather", "arguments": '{"city": "Paris"}'},
        {"name": "now", "arguments": "{}"},
    ]
    assert response["choices"][0]["finish_reason"] == "tool_calls"
    assert engine.params[0].structured_outputs.json["type"] == "array"
    check_stream_matches(client, body, response)
    events = stream_events(client, body)
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert [e["choices"][0]["finish_reason"] for e in events[1:]].count("tool_calls") == 1


def test_required_cut_short_keeps_length(serve):
    client, _ = serve(['[{"name": "weather", "parameters": {"ci'], finish_reason="length")
    body = chat(tools=TOOLS, tool_choice="required")
    response = post(client, body)
    assert calls_of(response["choices"][0]["message"]) == [{"name": "weather", "arguments": '{"ci'}]
    assert response["choices"][0]["finish_reason"] == "length"
    check_stream_matches(client, body, response)


def test_required_with_two_choices(serve):
    texts = [
        '[{"name": "now", "parameters": {}}]',
        '[{"name": "weather", "parameters": {"city": "Rome"}}]',
    ]
    client, _ = serve(texts)
    body = chat(tools=TOOLS, tool_choice="required", n=2)
    response = post(client, body)
    events = stream_events(client, body)
    for i, choice in enumerate(response["choices"]):
        assert choice["index"] == i
        assert reassemble(events, i)["tool_calls"] == calls_of(choice["message"])
    assert calls_of(response["choices"][1]["message"]) == [
        {"name": "weather", "arguments": '{"city": "Rome"}'}
    ]


HERMES_TEXT = (
    'Let me look.\n<tool_call>\n{"name": "weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>'
)


def test_auto_tool_calls_with_the_hermes_parser(serve):
    client, engine = serve([HERMES_TEXT], enable_auto_tool_choice=True, tool_call_parser="hermes")
    body = chat(tools=TOOLS)
    response = post(client, body)
    message = response["choices"][0]["message"]
    assert message["content"] == "Let me look.\n"
    assert calls_of(message) == [
        {"name": "weather", "arguments": '{"city": "Paris"}'},
        {"name": "now", "arguments": "{}"},
    ]
    assert response["choices"][0]["finish_reason"] == "tool_calls"
    params = engine.params[0]
    assert params.structured_outputs is None and params.skip_special_tokens is False
    check_stream_matches(client, body, response)

    response = post(client, {**body, "parallel_tool_calls": False})  # the first call only
    assert [c["name"] for c in calls_of(response["choices"][0]["message"])] == ["weather"]
    check_stream_matches(client, {**body, "parallel_tool_calls": False}, response)


def test_auto_tool_calls_typed_by_the_request_tools_with_qwen3_coder(serve):
    text = (
        "<tool_call>\n<function=weather>\n<parameter=city>\nParis\n</parameter>\n"
        "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>"
    )
    client, _ = serve([text], enable_auto_tool_choice=True, tool_call_parser="qwen3_coder")
    body = chat(tools=TOOLS)
    response = post(client, body)
    message = response["choices"][0]["message"]
    assert calls_of(message) == [{"name": "weather", "arguments": '{"city": "Paris", "days": 3}'}]
    check_stream_matches(client, body, response)


def test_auto_tool_calls_with_the_pythonic_parser(serve):
    client, _ = serve(['[weather(city="Oslo"), now()]'], enable_auto_tool_choice=True,
                      tool_call_parser="pythonic")  # fmt: skip
    body = chat(tools=TOOLS)
    response = post(client, body)
    assert calls_of(response["choices"][0]["message"]) == [
        {"name": "weather", "arguments": '{"city": "Oslo"}'},
        {"name": "now", "arguments": "{}"},
    ]
    assert response["choices"][0]["finish_reason"] == "tool_calls"
    check_stream_matches(client, body, response)


def test_mistral_calls_have_ids_its_templates_take_back(serve):
    text = 'Sure.[TOOL_CALLS]weather[ARGS]{"city": "Rome"}'
    client, engine = serve([text], enable_auto_tool_choice=True, tool_call_parser="mistral")
    body = chat(tools=TOOLS)
    message = post(client, body)["choices"][0]["message"]
    assert message["content"] == "Sure."
    (call,) = message["tool_calls"]
    assert len(call["id"]) == 9 and call["id"].isalnum()
    assert call["function"] == {"name": "weather", "arguments": '{"city": "Rome"}'}
    assert engine.params[0].skip_special_tokens is False
    events = stream_events(client, body)
    ids = [
        c["id"] for e in events for ch in e["choices"] for c in ch["delta"].get("tool_calls", [])
    ]
    assert len(ids) == 1 and len(ids[0]) == 9 and ids[0].isalnum()


def test_auto_without_calls_is_plain_content(serve):
    client, _ = serve(
        ["Just text, <b>no</b> calls."],
        enable_auto_tool_choice=True,
        tool_call_parser="llama3_json",
    )
    body = chat(tools=TOOLS)
    response = post(client, body)
    choice = response["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": "Just text, <b>no</b> calls."}
    assert choice["finish_reason"] == "stop"
    check_stream_matches(client, body, response)


def test_auto_with_llama3_json_content_is_null(serve):
    text = '{"name": "weather", "parameters": {"city": "Oslo"}}'
    client, _ = serve([text], enable_auto_tool_choice=True, tool_call_parser="llama3_json")
    response = post(client, chat(tools=TOOLS, tool_choice="auto"))
    message = response["choices"][0]["message"]
    assert message["content"] is None
    assert calls_of(message) == [{"name": "weather", "arguments": '{"city": "Oslo"}'}]


def test_tool_errors_through_the_app(serve):
    client, _ = serve(["x"])
    response = client.post("/v1/chat/completions", json=chat(tools=TOOLS))
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "tool_choice"
    assert "--enable-auto-tool-choice" in response.json()["error"]["message"]
    response = client.post("/v1/chat/completions", json=chat(guided_json={"type": "wat"}))
    assert (response.status_code, response.json()["error"]["param"]) == (400, "guided_json")


def test_no_tools_leaves_responses_as_they_were(serve):
    client, engine = serve(['{"a": 1}'])
    body = chat(response_format={"type": "json_object"})
    response = post(client, body)
    assert response["choices"][0]["message"] == {"role": "assistant", "content": '{"a": 1}'}
    assert engine.params[0].structured_outputs == SOP(json_object=True)
    events = stream_events(client, body)
    assert all("tool_calls" not in c["delta"] for e in events for c in e["choices"])
    response = client.post("/v1/completions", json=completion(guided_regex="[ab]+"))
    assert response.status_code == 200
    assert engine.params[-1].structured_outputs == SOP(regex="[ab]+")


def test_build_app_and_cli_flags(capsys):
    from jaxllm.cli import build_parser, main
    from server.config import ServerConfig

    with pytest.raises(ValueError, match="requires --tool-call-parser"):
        ServerConfig(enable_auto_tool_choice=True)
    with pytest.raises(ValueError, match="unknown parser 'x'"):
        ServerConfig(tool_call_parser="x")
    args = build_parser().parse_args(
        ["serve", "m", "--enable-auto-tool-choice", "--tool-call-parser", "llama3_json"]
    )
    assert (args.enable_auto_tool_choice, args.tool_call_parser) == (True, "llama3_json")
    args = build_parser().parse_args(["serve", "m"])
    assert (args.enable_auto_tool_choice, args.tool_call_parser) == (False, None)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "m", "--tool-call-parser", "nope"])
    assert "invalid choice: 'nope'" in capsys.readouterr().err
    assert main(["serve", "m", "--enable-auto-tool-choice"]) == 2
    assert "--enable-auto-tool-choice requires --tool-call-parser" in capsys.readouterr().err
