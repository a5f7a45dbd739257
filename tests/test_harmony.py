"""gpt-oss's harmony format (`--reasoning-parser openai_gptoss`, `--tool-call-parser openai`):
the channels split into reasoning, answer and tool calls, the same whole and streamed in any
chunking, and through the app (a fake engine) in chat completions, the Responses API and the
Messages API."""

from __future__ import annotations

import json

import pytest

from server.reasoning_parsers import REASONING_PARSERS, ReasoningDelta, split
from server.tool_parsers import TOOL_PARSERS, Extracted, assemble, extract
from tests.test_protocol_structured import (  # noqa: F401 (fixtures)
    TOOLS,
    calls_of,
    chat,
    post,
    reassemble,
    serve,
    stream_events,
    tokenizer,
)
from tests.test_tool_parsers import chunkings, streamed

THINK = "<|channel|>analysis<|message|>The user wants the weather. Call the tool.<|end|>"
CALL = (
    "<|start|>assistant<|channel|>commentary to=functions.weather <|constrain|>json"
    '<|message|>{"city": "Paris"}'
)
ANSWER = "<|start|>assistant<|channel|>final<|message|>It is sunny in Paris."

# output -> (reasoning, answer as the reasoning parser leaves it)
REASONING_CASES = [
    (THINK + ANSWER, ("The user wants the weather. Call the tool.", "It is sunny in Paris.")),
    # The answer alone (reasoning effort low, or a template that skipped it).
    ("<|channel|>final<|message|>4", ("", "4")),
    # Cut short by max_tokens inside the reasoning, and inside a header.
    ("<|channel|>analysis<|message|>Hmm, so", ("Hmm, so", "")),
    (THINK + "<|start|>assistant<|chan", ("The user wants the weather. Call the tool.", "")),
    # A preamble to the user on the commentary channel is the answer too.
    (
        THINK + "<|start|>assistant<|channel|>commentary<|message|>Checking.<|end|>" + ANSWER,
        ("The user wants the weather. Call the tool.", "Checking.It is sunny in Paris."),
    ),
    # A call goes to the answer as written, for the tool call parser.
    (THINK + CALL + "<|call|>", ("The user wants the weather. Call the tool.", CALL + "<|call|>")),
    # No harmony at all (a model that writes plain text): all answer.
    ("Just text <b>", ("", "Just text <b>")),
    ("", ("", "")),
]


def _streamed_reasoning(text: str, ends: list[int]) -> ReasoningDelta:
    stream = REASONING_PARSERS["openai_gptoss"]()
    total = ReasoningDelta()
    for end in ends:
        d = stream.update(text[:end], final=False)
        total.reasoning, total.content = total.reasoning + d.reasoning, total.content + d.content
    d = stream.update(text, final=True)
    return ReasoningDelta(total.reasoning + d.reasoning, total.content + d.content)


@pytest.mark.parametrize(("text", "want"), REASONING_CASES)
def test_reasoning_split_whole_and_in_any_chunking(text, want):
    whole = split(REASONING_PARSERS["openai_gptoss"](), text)
    assert (whole.reasoning, whole.content) == want
    for ends in chunkings(text):
        got = _streamed_reasoning(text, ends)
        assert (got.reasoning, got.content) == want, ends


# the reasoning parser's answer (or a raw output) -> (content, calls)
TOOL_CASES = [
    (CALL + "<|call|>", "", [("weather", '{"city": "Paris"}')]),
    (CALL, "", [("weather", '{"city": "Paris"}')]),  # <|call|> stops generation: not in text
    # The recipient in the header's role part, as the model may also write it.
    (
        "<|start|>assistant to=functions.now<|channel|>commentary json<|message|>{}<|call|>",
        "",
        [("now", "{}")],
    ),
    # Two calls, text between them, a call to a built-in tool (not the client's): content.
    (
        "Looking.<|start|>assistant<|channel|>commentary to=functions.now<|message|>{}<|call|>"
        "<|start|>assistant<|channel|>commentary to=browser.search<|message|>q<|call|>" + CALL,
        "Looking.q",
        [("now", "{}"), ("weather", '{"city": "Paris"}')],
    ),
    ("It is sunny.", "It is sunny.", []),
    # Without the reasoning parser: every body that is not a call is content.
    (THINK + ANSWER, "The user wants the weather. Call the tool.It is sunny in Paris.", []),
]


@pytest.mark.parametrize(("text", "content", "calls"), TOOL_CASES)
def test_tool_calls_whole_and_in_any_chunking(text, content, calls):
    new = TOOL_PARSERS["openai"]
    whole = extract(new(), text)
    assert (whole.content, [(c.name, c.arguments) for c in whole.tool_calls]) == (content, calls)
    for ends in chunkings(text):
        got = assemble(streamed(new, text, ends))
        assert got.content == content, ends
        assert [(c.name, c.arguments) for c in got.tool_calls] == calls, ends


def test_a_call_streams_its_arguments_as_they_come():
    stream = TOOL_PARSERS["openai"]()
    head = "<|channel|>commentary to=functions.weather<|message|>"
    first = stream.update(head + '{"ci', final=False)
    assert [(d.index, d.name, d.arguments) for d in first.tool_calls] == [(0, "weather", '{"ci')]
    more = stream.update(head + '{"city": 1}', final=False)
    assert [(d.index, d.name, d.arguments) for d in more.tool_calls] == [(0, None, 'ty": 1}')]


def test_both_parsers_in_a_row():
    """The reasoning parser's answer through the tool call parser, as the server runs them."""
    text = THINK + CALL + "<|call|>"
    split_ = split(REASONING_PARSERS["openai_gptoss"](), text)
    tools = extract(TOOL_PARSERS["openai"](), split_.content)
    assert split_.reasoning == "The user wants the weather. Call the tool."
    assert tools == Extracted("", tools.tool_calls)
    assert [(c.name, c.arguments) for c in tools.tool_calls] == [("weather", '{"city": "Paris"}')]


def test_the_end_of_reasoning_is_the_final_header(tokenizer):  # noqa: F811
    stream = REASONING_PARSERS["openai_gptoss"]
    ids = stream.end_token_ids(tokenizer)
    assert tokenizer.decode(ids) == "<|channel|>final<|message|>"


def test_harmony_through_the_apis(serve):  # noqa: F811
    """Chat completions (whole and streamed alike), with the special tokens kept; the
    Responses API's reasoning item and function call; the Messages API's thinking and
    tool_use blocks."""
    client, engine = serve(
        [THINK + CALL],
        reasoning_parser="openai_gptoss",
        enable_auto_tool_choice=True,
        tool_call_parser="openai",
    )
    body = chat(tools=TOOLS)
    response = post(client, body)
    message = response["choices"][0]["message"]
    assert message["reasoning_content"] == "The user wants the weather. Call the tool."
    assert calls_of(message) == [{"name": "weather", "arguments": '{"city": "Paris"}'}]
    assert response["choices"][0]["finish_reason"] == "tool_calls"
    assert not message["content"]
    assert engine.params[0].skip_special_tokens is False
    assert engine.params[0].reasoning_end_token_ids is None  # nothing is constrained
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    fmt = {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}
    post(client, chat(response_format=fmt))
    final = engine.tokenizer.encode("<|channel|>final<|message|>", add_special_tokens=False)
    assert engine.params[-1].reasoning_end_token_ids == final  # the answer is constrained
    events = stream_events(client, body)
    streamed_ = reassemble(events)
    assert streamed_["content"] == "" and streamed_["finish_reason"] == "tool_calls"
    assert streamed_["tool_calls"] == [{"name": "weather", "arguments": '{"city": "Paris"}'}]
    thinking = "".join(
        c["delta"].get("reasoning_content") or "" for e in events for c in e["choices"]
    )
    assert thinking == "The user wants the weather. Call the tool."

    r = client.post(
        "/v1/responses",
        json={"model": "m", "input": "Weather?", "tools": [
            {"type": "function", "name": "weather", "parameters": TOOLS[0]["function"]["parameters"]}
        ]},
    ).json()  # fmt: skip
    assert [i["type"] for i in r["output"]] == ["reasoning", "function_call"]
    assert r["output"][1]["name"] == "weather"
    assert json.loads(r["output"][1]["arguments"]) == {"city": "Paris"}

    m = client.post(
        "/v1/messages",
        json={
            "model": "m", "max_tokens": 50, "messages": [{"role": "user", "content": "Hi"}],
            "tools": [{"name": "weather", "input_schema": TOOLS[0]["function"]["parameters"]}],
        },
    ).json()  # fmt: skip
    assert [b["type"] for b in m["content"]] == ["thinking", "tool_use"]
    assert m["content"][1]["input"] == {"city": "Paris"}


def test_structured_outputs_wait_for_an_end_sequence():
    """`reasoning_end_token_ids` of several tokens (harmony's final header): the grammar takes
    only what follows the sequence's first appearance, whether it arrives in one step (a
    speculative step's tokens) or across steps, and never a partial one."""
    from types import SimpleNamespace

    from jaxllm.engine.scheduler import Scheduler

    class Grammar:
        def __init__(self):
            self.fed: list[int] = []

        def accept(self, tokens):
            self.fed += tokens
            return True

    def run(steps: list[list[int]]) -> list[int]:
        params = SimpleNamespace(reasoning_end_token_ids=[7, 8, 9])
        req = SimpleNamespace(
            grammar_live=False, sampling_params=params, output_token_ids=[], grammar=Grammar()
        )
        for tokens in steps:
            req.output_token_ids += tokens
            assert Scheduler._advance_grammar(req, tokens)
        return req.grammar.fed if req.grammar_live else None

    assert run([[1, 7, 8, 9, 4, 5]]) == [4, 5]
    assert run([[1, 7], [8], [9], [4], [7, 8, 9]]) == [4, 7, 8, 9]
    assert run([[7, 8], [1, 9], [2]]) is None  # interrupted: not the sequence
    assert run([[8, 9], [7, 8], [9, 3]]) == [3]


def test_reasoning_effort_reaches_the_template():
    """OpenAI's `reasoning_effort` (chat) and `reasoning.effort` (Responses) become the
    template's `reasoning_effort` (gpt-oss's harmony system message), chat_template_kwargs
    winning; a bad value is a 400 naming the field."""
    from server.protocol import APIError, ChatCompletionRequest, parse_request
    from server.responses_api import ResponsesRequest, to_chat_request

    req = parse_request(ChatCompletionRequest, chat(reasoning_effort="high"))
    assert req.template_kwargs()["reasoning_effort"] == "high"
    both = chat(reasoning_effort="high", chat_template_kwargs={"reasoning_effort": "low"})
    assert parse_request(ChatCompletionRequest, both).template_kwargs()["reasoning_effort"] == "low"
    assert "reasoning_effort" not in parse_request(ChatCompletionRequest, chat()).template_kwargs()
    with pytest.raises(APIError) as e:
        parse_request(ChatCompletionRequest, chat(reasoning_effort="max"))
    assert e.value.param == "reasoning_effort"

    responses = ResponsesRequest(model="m", input="Hi", reasoning={"effort": "low"})
    assert to_chat_request(responses, [])[0].reasoning_effort == "low"
    with pytest.raises(APIError) as e:
        to_chat_request(ResponsesRequest(model="m", input="Hi", reasoning={"effort": 3}), [])
    assert e.value.param == "reasoning.effort"


def test_marker_soup_streams_as_it_parses_whole():
    """300 random outputs made of harmony's markers, headers, recipients and text, cut
    anywhere: no parser raises, and the streamed deltas add up to the whole output's split
    (reasoning, answer, calls), for the two parsers alone and in a row."""
    import random

    pieces = [
        "<|start|>", "assistant", "<|channel|>", "analysis", "final", "commentary",
        " to=functions.f", " to=browser.search", " json", "<|constrain|>", "<|message|>",
        "<|end|>", "<|call|>", "<|return|>", '{"a": 1}', "text ", "<|", "|>", "<", " ",
    ]  # fmt: skip
    rng = random.Random(0)
    for _ in range(300):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 14)))
        whole = split(REASONING_PARSERS["openai_gptoss"](), text)
        calls = extract(TOOL_PARSERS["openai"](), whole.content)
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, 4)))
        got = _streamed_reasoning(text, cuts)
        assert (got.reasoning, got.content) == (whole.reasoning, whole.content), text
        again = assemble(streamed(TOOL_PARSERS["openai"], whole.content, cuts))
        assert again.content == calls.content, text
        assert [(c.name, c.arguments) for c in again.tool_calls] == [
            (c.name, c.arguments) for c in calls.tool_calls
        ], text


def test_the_official_client_reads_harmony(serve):  # noqa: F811
    """The openai package over the app (its transport the test client): a reasoning split and
    a tool call round trip, whole and streamed, and the Responses API's items."""
    openai = pytest.importorskip("openai")
    client, _ = serve(
        [THINK + CALL, THINK + ANSWER],
        reasoning_parser="openai_gptoss",
        enable_auto_tool_choice=True,
        tool_call_parser="openai",
    )
    api = openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=client)
    ask = [{"role": "user", "content": "Weather in Paris?"}]
    first = api.chat.completions.create(model="m", messages=ask, tools=TOOLS)
    message = first.choices[0].message
    assert message.model_extra["reasoning_content"].startswith("The user wants")
    (call,) = message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == (
        "weather",
        {"city": "Paris"},
    )
    assert first.choices[0].finish_reason == "tool_calls"
    # The round trip: the call and its result go back in the history.
    history = [*ask, message.model_dump(exclude_none=True), {
        "role": "tool", "tool_call_id": call.id, "content": '{"sky": "clear"}'}]  # fmt: skip
    second = api.chat.completions.create(model="m", messages=history, tools=TOOLS)
    assert second.choices[0].finish_reason == "tool_calls"  # (the fake engine says it again)
    chunks = list(api.chat.completions.create(model="m", messages=ask, tools=TOOLS, stream=True))
    names = [c.function.name for k in chunks for c in (k.choices[0].delta.tool_calls or [])]
    assert "weather" in names
    r = api.responses.create(model="m", input="Weather in Paris?")
    assert [item.type for item in r.output][:1] == ["reasoning"]


def test_gpt_oss_reads_harmony_without_flags(tmp_path):
    """A server of a gpt-oss checkpoint splits its reasoning with no --reasoning-parser, as
    vLLM's does; other models get no parser they did not ask for."""
    from types import SimpleNamespace

    from server.api import _built_in_reasoning

    def engine(arch: str):
        path = tmp_path / arch
        path.mkdir()
        (path / "config.json").write_text(json.dumps({"architectures": [arch]}))
        return SimpleNamespace(config=SimpleNamespace(load=SimpleNamespace(model=str(path))))

    assert _built_in_reasoning(engine("GptOssForCausalLM")) is REASONING_PARSERS["openai_gptoss"]
    assert _built_in_reasoning(engine("LlamaForCausalLM")) is None
    assert _built_in_reasoning(SimpleNamespace()) is None  # an engine that names no model
