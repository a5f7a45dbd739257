"""Reasoning parsers (`--reasoning-parser qwen3|deepseek_r1`): the thinking split off the answer
exactly at the tags, the same whole and streamed in any chunking, and through the app (with a
fake engine) as `reasoning_content` beside content and tool calls."""

from __future__ import annotations

import json
import random

import pytest

from server.reasoning_parsers import (
    REASONING_PARSERS,
    ReasoningDelta,
    prompt_opens_thinking,
    split,
)
from tests.test_protocol_structured import (  # noqa: F401 (fixtures)
    HERMES_TEXT,
    TOOLS,
    calls_of,
    chat,
    post,
    serve,
    stream_events,
    tokenizer,
)

# (parser, prompt opens a block, output) -> (reasoning, answer)
CASES = [
    ("qwen3", False, "<think>\nSo 2+2.\n</think>\n\nIt is 4.", ("\nSo 2+2.\n", "\n\nIt is 4.")),
    ("qwen3", False, "It is 4.", ("", "It is 4.")),
    ("qwen3", False, "<thin", ("", "<thin")),  # not a tag after all
    ("qwen3", False, "<think>cut short by max_tokens", ("cut short by max_tokens", "")),
    ("qwen3", True, "hmm </think>4", ("hmm ", "4")),
    ("qwen3", False, "4 </think> x", ("", "4 </think> x")),  # thinking was off
    ("deepseek_r1", False, "hmm\n</think>\n\n4", ("hmm\n", "\n\n4")),
    ("deepseek_r1", False, "<think>hmm</think>4", ("hmm", "4")),
    ("deepseek_r1", False, "still thinking </thi", ("still thinking </thi", "")),
    ("deepseek_r1", False, "a</think>b</think>c", ("a", "b</think>c")),
    ("deepseek_r1", False, "", ("", "")),
]


def _streamed(parser: str, opens: bool, text: str, cuts: list[int]) -> ReasoningDelta:
    stream = REASONING_PARSERS[parser](prompt_opens=opens)
    total = ReasoningDelta()
    ends = [*cuts, len(text)]
    for i, end in enumerate(ends):
        d = stream.update(text[:end], final=i == len(ends) - 1)
        total.reasoning += d.reasoning
        total.content += d.content
    return total


@pytest.mark.parametrize(("parser", "opens", "text", "want"), CASES)
def test_split_exactly_at_the_tags_whole_and_in_any_chunking(parser, opens, text, want):
    whole = split(REASONING_PARSERS[parser](prompt_opens=opens), text)
    assert (whole.reasoning, whole.content) == want
    rng = random.Random(0)
    chunkings = [list(range(1, len(text)))] + [
        sorted(rng.sample(range(1, len(text)), k=min(len(text) - 1, rng.randint(0, 5))))
        for _ in range(30)
        if len(text) > 1
    ]
    for cuts in chunkings:
        streamed = _streamed(parser, opens, text, cuts)
        assert (streamed.reasoning, streamed.content) == want, cuts


def test_a_partial_end_tag_is_held_until_the_text_tells():
    stream = REASONING_PARSERS["deepseek_r1"]()
    assert stream.update("abc</th", final=False) == ReasoningDelta("abc", "")
    assert stream.update("abc</think>d", final=False) == ReasoningDelta("", "d")


def test_prompt_opens_thinking():
    assert prompt_opens_thinking("<|im_start|>assistant\n<think>\n")
    assert not prompt_opens_thinking("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not prompt_opens_thinking("<|im_start|>assistant\n")


THINKING = "<think>\nThe user wants weather.\n</think>\n\n"


def _reassembled(events: list[dict]) -> dict:
    out = {"reasoning_content": "", "reasoning": "", "content": ""}
    order = []
    for event in events:
        for c in event["choices"]:
            for key in out:
                if c["delta"].get(key):
                    out[key] += c["delta"][key]
                    order.append(key)
    out["order"] = order
    return out


def test_reasoning_through_the_app_whole_and_streamed(serve):  # noqa: F811
    client, _ = serve([THINKING + "Sunny."], reasoning_parser="qwen3")
    body = chat()
    message = post(client, body)["choices"][0]["message"]
    assert message == {
        "role": "assistant",
        "content": "\n\nSunny.",
        "reasoning_content": "\nThe user wants weather.\n",
        "reasoning": "\nThe user wants weather.\n",
    }
    streamed = _reassembled(stream_events(client, body))
    assert streamed["reasoning_content"] == streamed["reasoning"] == message["reasoning"]
    assert streamed["content"] == message["content"]
    first_content = streamed["order"].index("content")
    assert "reasoning_content" not in streamed["order"][first_content:]  # thinking first
    hidden = post(client, {**body, "include_reasoning": False})["choices"][0]["message"]
    assert hidden == {"role": "assistant", "content": "\n\nSunny."}


def test_tool_calls_are_read_from_the_answer_only(serve):  # noqa: F811
    """A call written inside the thinking is thought, not called."""
    thought = '<think>maybe <tool_call>{"name": "now", "arguments": {}}</tool_call>?</think>'
    client, _ = serve(
        [thought + HERMES_TEXT],
        reasoning_parser="deepseek_r1",
        enable_auto_tool_choice=True,
        tool_call_parser="hermes",
    )
    body = chat(tools=TOOLS)
    response = post(client, body)
    message = response["choices"][0]["message"]
    assert message["reasoning_content"].startswith("maybe <tool_call>")
    assert message["content"] == "Let me look.\n"
    assert [c["name"] for c in calls_of(message)] == ["weather", "now"]
    assert response["choices"][0]["finish_reason"] == "tool_calls"
    events = stream_events(client, body)
    streamed = _reassembled(events)
    assert streamed["reasoning_content"] == message["reasoning_content"]
    names = [
        call["function"]["name"]
        for e in events
        for c in e["choices"]
        for call in c["delta"].get("tool_calls", [])
        if "id" in call
    ]
    assert names == ["weather", "now"]


def test_all_thinking_no_answer_is_null_content(serve):  # noqa: F811
    client, _ = serve(["still thinking"], finish_reason="length", reasoning_parser="deepseek_r1")
    message = post(client, chat())["choices"][0]["message"]
    assert message["content"] is None and message["reasoning_content"] == "still thinking"


def test_unknown_reasoning_parser_is_refused():
    from server.config import ServerConfig

    with pytest.raises(ValueError, match="--reasoning-parser"):
        ServerConfig(reasoning_parser="nope")


def test_structured_outputs_wait_for_the_end_of_thinking(tiny_llm):
    """With `reasoning_end_token_id`, the grammar constrains only what follows that token: a
    forced end of thinking, then one of the choices; without the end token the output stays
    free (and is not failed by the grammar)."""
    from jaxllm import SamplingParams
    from jaxllm.structured_outputs import StructuredOutputsParams

    end = 100  # any token stands in for </think>
    choice = StructuredOutputsParams(choice=["yes", "no"])
    base = dict(temperature=0.0, max_tokens=8, structured_outputs=choice)
    forced = SamplingParams(**base, reasoning_end_token_id=end, logit_bias={end: 100.0})
    (out,) = tiny_llm.generate("Is it?", forced, use_tqdm=False)
    ids = out.outputs[0].token_ids
    assert ids[0] == end and end not in ids[1:]  # the bias pushes it; the grammar refuses it
    assert tiny_llm.tokenizer.decode(ids[1:], skip_special_tokens=True) in ("yes", "no")
    free = SamplingParams(**base, reasoning_end_token_id=end, ignore_eos=True)
    (out,) = tiny_llm.generate("Is it?", free, use_tqdm=False)
    assert out.outputs[0].finish_reason == "length" and end not in out.outputs[0].token_ids
    assert out.outputs[0].text not in ("yes", "no")  # eight free tokens


def _sse_events(text: str) -> list[dict]:
    return [json.loads(line[6:]) for line in text.split("\n") if line.startswith("data: ")]


def test_thinking_in_the_responses_and_messages_apis(serve):  # noqa: F811
    """The reasoning parser's split as a Responses `reasoning` item and an Anthropic
    `thinking` block, whole and streamed alike."""
    client, _ = serve([THINKING + "Sunny."], reasoning_parser="qwen3")
    thought, answer = "\nThe user wants weather.\n", "\n\nSunny."
    r = client.post("/v1/responses", json={"model": "m", "input": "Weather?"}).json()
    assert [i["type"] for i in r["output"]] == ["reasoning", "message"]
    assert r["output"][0]["content"][0]["text"] == thought
    assert r["output"][1]["content"][0]["text"] == answer
    events = _sse_events(
        client.post("/v1/responses", json={"model": "m", "input": "Weather?", "stream": True}).text
    )
    reasoning = "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta")
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert (reasoning, text) == (thought, answer)
    assert events[-1]["response"]["output"][0]["content"][0]["text"] == thought

    body = {"model": "m", "max_tokens": 50, "messages": [{"role": "user", "content": "Hi"}]}
    m = client.post("/v1/messages", json=body).json()
    assert [b["type"] for b in m["content"]] == ["thinking", "text"]
    assert m["content"][0]["thinking"] == thought and m["content"][1]["text"] == answer
    events = _sse_events(client.post("/v1/messages", json={**body, "stream": True}).text)
    deltas = [e["delta"] for e in events if e["type"] == "content_block_delta"]
    assert "".join(d.get("thinking", "") for d in deltas) == thought
    assert "".join(d.get("text", "") for d in deltas) == answer
