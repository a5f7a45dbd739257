"""server/tool_parsers.py: tool calls read out of chat output text (hermes, llama3_json, the
`required` array, a named function), and the invariant the server's streams rest on: the
deltas of any chunking of a text add up to exactly what the whole text gives at once."""

from __future__ import annotations

import json
import random

import pytest

from server.tool_parsers import (
    TOOL_PARSERS,
    HarmonyToolCalls,
    HermesToolCalls,
    Llama3JsonToolCalls,
    MistralToolCalls,
    NamedToolCall,
    PythonicToolCalls,
    Qwen3CoderToolCalls,
    RequiredToolCalls,
    ToolCall,
    ToolCallDelta,
    assemble,
    extract,
    required_tool_calls_schema,
)


def chunkings(text: str) -> list[list[int]]:
    """Ends of the prefixes to feed: all at once, a character at a time, and random cuts."""
    out = [[len(text)], list(range(len(text) + 1))]
    for seed in range(4):
        rng = random.Random(seed)
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, 1 + len(text) // 4)))
        out.append([*cuts, len(text)])
    return out


def streamed(new_stream, text: str, ends: list[int]):
    """The deltas of feeding `text`'s prefixes ending at `ends`, then the whole text again
    as the final update (the engine's last output often adds no text)."""
    stream = new_stream()
    deltas = [stream.update(text[:end], final=False) for end in ends]
    deltas.append(stream.update(text, final=True))
    return deltas


def check(new_stream, text: str, content: str, calls: list[tuple[str, str]]):
    """`text` gives `content` and `calls` at once, and streamed in every chunking."""
    whole = extract(new_stream(), text)
    assert whole.content == content
    assert [(c.name, c.arguments) for c in whole.tool_calls] == calls
    for ends in chunkings(text):
        got = assemble(streamed(new_stream, text, ends))
        assert got.content == whole.content, ends
        # (ids aside: a format with ids of its own makes fresh ones)
        assert [(c.name, c.arguments) for c in got.tool_calls] == calls, ends


def args(obj) -> str:
    return json.dumps(obj, ensure_ascii=False)


# ---------------------------------------------------------------------------------- hermes

HERMES_CASES = [
    # (text, content, calls)
    ("Hello there, a < b and <tool", "Hello there, a < b and <tool", []),
    ("", "", []),
    (
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
        '</tool_call>\n<tool_call>{"name":"now","arguments":{}}</tool_call>\n',
        "Let me check.\n",
        [("get_weather", args({"city": "Paris"})), ("now", "{}")],
    ),
    # the end tag inside a JSON string still ends the block (as in vLLM): not a call
    (
        '<tool_call>{"name": "say", "arguments": {"t": "</tool_call>"}}</tool_call>',
        '<tool_call>{"name": "say", "arguments": {"t": "</tool_call>"}}</tool_call>',
        [],
    ),
    (
        '<tool_call>{"name": "f", "arguments": {"x": [1, 2]}}</tool_call>\n\nDone.',
        "\n\nDone.",
        [("f", args({"x": [1, 2]}))],
    ),
    # not calls: bad JSON, no name, arguments not an object: the raw block is content
    ("<tool_call>{oops}</tool_call>", "<tool_call>{oops}</tool_call>", []),
    (
        'a<tool_call>{"arguments": {}}</tool_call>b',
        'a<tool_call>{"arguments": {}}</tool_call>b',
        [],
    ),
    (
        '<tool_call>{"name": "f", "arguments": 3}</tool_call>',
        '<tool_call>{"name": "f", "arguments": 3}</tool_call>',
        [],
    ),
    # an unclosed last block counts if its JSON is complete (vLLM's rule)
    ('<tool_call>{"name": "f", "arguments": {"a": 1}}\n', "", [("f", args({"a": 1}))]),
    ('x <tool_call>{"name": "f", "argu', 'x <tool_call>{"name": "f", "argu', []),
]


@pytest.mark.parametrize("text, content, calls", HERMES_CASES)
def test_hermes(text, content, calls):
    check(HermesToolCalls, text, content, calls)


def test_hermes_unicode_arguments_and_whitespace_between_calls():
    text = (
        '<tool_call>{"name": "say", "arguments": {"text": "héllo 日本 🙂"}}</tool_call>\n  \n'
        '<tool_call>{"name": "say", "arguments": {"text": "b"}}</tool_call>  \n'
    )
    check(
        HermesToolCalls,
        text,
        "",
        [("say", '{"text": "héllo 日本 🙂"}'), ("say", '{"text": "b"}')],
    )


def test_hermes_streams_content_at_once_and_a_call_when_its_block_closes():
    stream = HermesToolCalls()
    assert stream.update("Sure", final=False).content == "Sure"
    assert stream.update("Sure, <tool", final=False).content == ", "  # "<tool" may be a tag
    assert stream.update("Sure, <tool_call>{", final=False).content == ""
    delta = stream.update(
        'Sure, <tool_call>{"name": "f", "arguments": {}}</tool_call>', final=False
    )
    assert delta.tool_calls == [ToolCallDelta(0, "f", "{}")]
    assert stream.skip_special_tokens is False  # <tool_call> is a special token in some models


# ----------------------------------------------------------------------------- llama3_json

LLAMA_CASES = [
    (
        '<|python_tag|>{"name": "f", "parameters": {"a": 1}}; {"name": "g", "arguments": {}}',
        "",
        [("f", args({"a": 1})), ("g", "{}")],
    ),
    (
        '{"name": "f", "parameters": {"s": "}{;\\"", "n": null}}',
        "",
        [("f", args({"s": '}{;"', "n": None}))],
    ),
    ("Hello {x}", "Hello {x}", []),
    ("  ", "  ", []),
    ('{"answer": 42}', '{"answer": 42}', []),
    ('\n{"name": "f", "parameters": {"a":', '\n{"name": "f", "parameters": {"a":', []),
    ("<|python_tag|>print(1)", "<|python_tag|>print(1)", []),
    ("<|python", "<|python", []),
    ('{"name": "f", "parameters": {}} and more', " and more", [("f", "{}")]),
    ('{"name": "f", "parameters": {}};{"name": "g"}', ';{"name": "g"}', [("f", "{}")]),
]


@pytest.mark.parametrize("text, content, calls", LLAMA_CASES)
def test_llama3_json(text, content, calls):
    check(Llama3JsonToolCalls, text, content, calls)


def test_llama3_json_streams_each_object_once_complete():
    stream = Llama3JsonToolCalls()
    assert stream.update('{"name": "f", "parameters": {"a"', final=False).tool_calls == []
    delta = stream.update('{"name": "f", "parameters": {"a": 1}}; {"na', final=False)
    assert delta.tool_calls == [ToolCallDelta(0, "f", '{"a": 1}')]
    assert delta.content == ""


def test_parser_registry():
    assert TOOL_PARSERS == {
        "hermes": HermesToolCalls,
        "openai": HarmonyToolCalls,
        "llama3_json": Llama3JsonToolCalls,
        "mistral": MistralToolCalls,
        "pythonic": PythonicToolCalls,
        "qwen3_coder": Qwen3CoderToolCalls,
    }


# -------------------------------------------------------------------------------- mistral

MISTRAL_CASES = [
    (
        'Sure. [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, '
        '{"name": "now", "arguments": "{}"}]',
        "Sure. ",
        [("get_weather", args({"city": "Paris"})), ("now", "{}")],
    ),
    (
        '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]now[ARGS]{}',
        "",
        [("get_weather", args({"city": "Paris"})), ("now", "{}")],
    ),
    ("No calls, [TOOL but text.", "No calls, [TOOL but text.", []),
    ("[TOOL_CALLS] [oops", "[TOOL_CALLS] [oops", []),
    ("a[TOOL_CALLS]f[ARGS]not json", "a[TOOL_CALLS]f[ARGS]not json", []),
]


@pytest.mark.parametrize("text, content, calls", MISTRAL_CASES)
def test_mistral(text, content, calls):
    check(MistralToolCalls, text, content, calls)


def test_mistral_call_ids_are_nine_letters_and_digits():
    calls = extract(MistralToolCalls(), MISTRAL_CASES[1][0]).tool_calls
    assert all(len(c.id) == 9 and c.id.isalnum() for c in calls)


# ------------------------------------------------------------------------------- pythonic

PYTHONIC_CASES = [
    (
        '[get_weather(city="Paris", days=3), now()]',
        "",
        [("get_weather", args({"city": "Paris", "days": 3})), ("now", "{}")],
    ),
    # Llama 4's tags, strings with brackets and quotes, nested literals
    (
        "<|python_start|>[say(text='a ] b \\' c', opts={'x': [1, None, True]})]<|python_end|>",
        "",
        [("say", args({"text": "a ] b ' c", "opts": {"x": [1, None, True]}}))],
    ),
    ("[f()]\n\nThat is all.", "That is all.", [("f", "{}")]),
    # not calls: prose, a list of values, positional or non-literal arguments, cut short
    ("The answer is [1, 2].", "The answer is [1, 2].", []),
    ("[1, 2]", "[1, 2]", []),
    ("[f(1)]", "[f(1)]", []),
    ("[f(x=y)]", "[f(x=y)]", []),
    ('[f(x="a"', '[f(x="a"', []),
    ("", "", []),
    ("  ", "  ", []),
]


@pytest.mark.parametrize("text, content, calls", PYTHONIC_CASES)
def test_pythonic(text, content, calls):
    check(PythonicToolCalls, text, content, calls)


# ---------------------------------------------------------------------------- qwen3_coder

QWEN3_CODER_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "days": {"type": "integer"},
                    "metric": {"type": "boolean"},
                    "hours": {"type": "array"},
                },
            },
        },
    }
]
QWEN3_CODER_CASES = [
    (
        "Checking.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n"
        "</parameter>\n<parameter=days>\n3\n</parameter>\n<parameter=metric>\ntrue\n"
        "</parameter>\n<parameter=hours>\n[9, 12]\n</parameter>\n</function>\n</tool_call>",
        "Checking.\n",
        [("get_weather", args({"city": "Paris", "days": 3, "metric": True, "hours": [9, 12]}))],
    ),
    # text stays text (a string "3", a parameter the schema lacks), null is null
    (
        "<tool_call>\n<function=get_weather>\n<parameter=city>\n3\n</parameter>\n"
        "<parameter=note>\nmulti\nline\n</parameter>\n<parameter=days>\nnull\n</parameter>\n"
        "</function>\n</tool_call>",
        "",
        [("get_weather", args({"city": "3", "note": "multi\nline", "days": None}))],
    ),
    # two calls; a block that is not a call is content
    (
        "<tool_call><function=a></function></tool_call><tool_call><function=b>"
        "<parameter=x>\n1\n</parameter></function></tool_call>",
        "",
        [("a", "{}"), ("b", args({"x": "1"}))],
    ),
    ("<tool_call>oops</tool_call>", "<tool_call>oops</tool_call>", []),
]


@pytest.mark.parametrize("text, content, calls", QWEN3_CODER_CASES)
def test_qwen3_coder(text, content, calls):
    check(lambda: Qwen3CoderToolCalls(QWEN3_CODER_TOOLS), text, content, calls)


# -------------------------------------------------------------------------------- required

REQUIRED_CASES = [
    (
        '[{"name": "f", "parameters": {"x": 1, "s": "a, }]\\" {"}}, {"name":"g","parameters":{}}]',
        [("f", '{"x": 1, "s": "a, }]\\" {"}'), ("g", "{}")],
    ),
    # flexible whitespace: the arguments are the value's text, without the whitespace around
    (
        '[ {\n "name" : "f" ,\n "parameters" : { "x" : [ 1 , 2 ] }\n }\n]',
        [("f", '{ "x" : [ 1 , 2 ] }')],
    ),
    # other orders and other keys (the grammar puts name first, but any order reads)
    ('[{"parameters": {"x": 1}, "name": "f"}]', [("f", '{"x": 1}')]),
    (
        '[{"name": "f", "parameters": {"a": {"b": {}}}, "extra": [1, {"c": 2}]}]',
        [("f", '{"a": {"b": {}}}')],
    ),
    ('[{"na\\u006de": "f", "parameters": {}}]', [("f", "{}")]),  # an escaped key
    # a non-object value (a tool's schema may allow one), and an output cut short
    ('[{"name": "f", "parameters": 12}]', [("f", "12")]),
    ('[{"name": "f", "parameters": {"x": 1', [("f", '{"x": 1')]),
    ('[{"name": "f"', [("f", "")]),
    ('[{"name": "f', []),
    ("", []),
    # under ignore_eos the text may go on past the array: that is no call
    ('[{"name": "f", "parameters": {}}] [{"name": "g", "parameters": {}}]', [("f", "{}")]),
]


@pytest.mark.parametrize("text, calls", REQUIRED_CASES)
def test_required(text, calls):
    check(RequiredToolCalls, text, "", calls)


def test_required_announces_a_call_when_its_name_is_complete_then_streams_arguments():
    stream = RequiredToolCalls()
    steps = [
        ('[{"name": "get_', []),
        ('[{"name": "get_weather"', [ToolCallDelta(0, "get_weather", "")]),
        ('[{"name": "get_weather", "parameters": {"ci', [ToolCallDelta(0, arguments='{"ci')]),
        ('[{"name": "get_weather", "parameters": {"city": 1} ', [ToolCallDelta(0, arguments='ty": 1}')]),
        ('[{"name": "get_weather", "parameters": {"city": 1} }, {"name": "x"', [ToolCallDelta(1, "x", "")]),
    ]  # fmt: skip
    for text, deltas in steps:
        assert stream.update(text, final=False).tool_calls == deltas, text


def test_required_schema_reads_with_the_tracker_and_compiles():
    """The schema of `required` accepts what the tracker reads (checked with llguidance on a
    byte-level tokenizer): the call objects' names first, whitespace allowed between tokens."""
    import llguidance.hf
    from llguidance import LLMatcher
    from transformers import AutoTokenizer

    from jaxllm.structured_outputs import StructuredOutputsParams
    from jaxllm.testing import write_tiny_tokenizer

    tools = [
        {"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}}},
        {"type": "function", "function": {"name": "g", "parameters": None}},
    ]  # fmt: skip
    grammar = StructuredOutputsParams(
        json=required_tool_calls_schema(tools, parallel=True)
    ).compile_grammar()
    import tempfile

    tok = AutoTokenizer.from_pretrained(write_tiny_tokenizer(tempfile.mkdtemp()))
    ll_tokenizer = llguidance.hf.from_tokenizer(tok, n_vocab=len(tok))

    def accepts(text: str) -> bool:
        matcher = LLMatcher(ll_tokenizer, grammar, log_level=0)
        ok = matcher.consume_tokens(tok.encode(text, add_special_tokens=False))
        return ok and matcher.is_accepting()

    text = '[{"name": "f", "parameters": {"x": 1}}, {"name":"g", "parameters": {"y": [2]}}]'
    assert accepts(text)
    assert [(c.name, c.arguments) for c in extract(RequiredToolCalls(), text).tool_calls] == [
        ("f", '{"x": 1}'),
        ("g", '{"y": [2]}'),
    ]
    assert not accepts('[{"name": "h", "parameters": {}}]')  # not a tool
    assert not accepts('[{"name": "f", "parameters": {}}]')  # f needs x
    assert not accepts("[]")


def test_required_tool_calls_schema():
    defs = {"Unit": {"enum": ["C", "F"]}}
    weather = {
        "type": "object",
        "properties": {"unit": {"$ref": "#/$defs/Unit"}},
        "$defs": defs,
    }
    tools = [
        {"type": "function", "function": {"name": "weather", "parameters": weather}},
        {"type": "function", "function": {"name": "now", "parameters": None}},
    ]
    schema = required_tool_calls_schema(tools, parallel=True)
    assert schema == {
        "type": "array",
        "minItems": 1,
        "items": {
            "type": "object",
            "anyOf": [
                {
                    "properties": {
                        "name": {"type": "string", "enum": ["weather"]},
                        "parameters": {
                            "type": "object",
                            "properties": {"unit": {"$ref": "#/$defs/Unit"}},
                        },
                    },
                    "required": ["name", "parameters"],
                },
                {
                    "properties": {
                        "name": {"type": "string", "enum": ["now"]},
                        "parameters": {"type": "object"},
                    },
                    "required": ["name", "parameters"],
                },
            ],
        },
        "$defs": defs,
    }
    assert "$defs" in weather  # the request's tools are left as they were
    assert required_tool_calls_schema(tools, parallel=False)["maxItems"] == 1
    clash = {"type": "object", "$defs": {"Unit": {"type": "string"}}}
    tools.append({"type": "function", "function": {"name": "x", "parameters": clash}})
    with pytest.raises(ValueError, match=r"\$defs/Unit"):
        required_tool_calls_schema(tools, parallel=True)


# ----------------------------------------------------------------------------------- named


def test_named_call_is_the_whole_output():
    text = '{"city": "Paris", "days": [1, 2]}'
    check(lambda: NamedToolCall("weather"), text, "", [("weather", text)])
    stream = NamedToolCall("weather")
    assert stream.update("", final=False).tool_calls == [ToolCallDelta(0, "weather", "")]
    assert stream.update('{"c', final=False).tool_calls == [ToolCallDelta(0, arguments='{"c')]
    assert stream.update('{"c', final=True).tool_calls == []


def test_assemble():
    from server.tool_parsers import Delta

    deltas = [
        Delta("a", [ToolCallDelta(0, "f", "{")]),
        Delta("b", [ToolCallDelta(0, arguments="}"), ToolCallDelta(1, "g", "[]")]),
    ]
    result = assemble(deltas)
    assert result.content == "ab"
    assert result.tool_calls == [ToolCall("f", "{}"), ToolCall("g", "[]")]
