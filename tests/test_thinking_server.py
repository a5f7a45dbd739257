"""A reasoning model served with `--reasoning-parser qwen3`: a tiny random Qwen3 whose chat
template opens a `<think>` block (Qwen3's way; `enable_thinking: false` closes it in the
prompt), through the real server and the official openai client. The thinking and the answer
split exactly at `</think>` of the raw output (the same tokens by seed through
/v1/completions), whole and streamed; structured outputs apply to the answer (the grammar
waits for `</think>`)."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from jaxllm.testing import write_tiny_tokenizer
from tests.test_server_e2e import running_server

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{% else %}<think>\n{% endif %}{% endif %}"
)
ASK = [{"role": "user", "content": "What is the weather?"}]
WEATHER = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Rome"]}},  # a random model ends it soon
    "required": ["city"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-qwen3-thinking")
    write_tiny_tokenizer(path, chat_template=TEMPLATE)
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    tokenizer.add_tokens(["<think>", "</think>"])
    tokenizer.save_pretrained(path)
    torch.manual_seed(0)
    config = transformers.Qwen3Config(
        vocab_size=len(tokenizer) + 3, hidden_size=32, intermediate_size=64,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        max_position_embeddings=512, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    transformers.Qwen3ForCausalLM(config).save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture(scope="module")
def server(model_dir):
    with running_server(model_dir, "--reasoning-parser", "qwen3", name="thinker") as url:
        yield url


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def end_id(model_dir):
    return transformers.AutoTokenizer.from_pretrained(model_dir).convert_tokens_to_ids("</think>")


def _raw(server, messages, seed, bias, **template) -> str:
    """The same request's tokens as plain text: the rendered prompt through /v1/completions."""
    ids = httpx.post(f"{server}/tokenize", json={"messages": messages, **template}).json()
    body = {"prompt": ids["tokens"], "max_tokens": 40, "seed": seed, "logit_bias": bias,
            "skip_special_tokens": False}  # fmt: skip
    return httpx.post(f"{server}/v1/completions", json=body, timeout=120).json()["choices"][0][
        "text"
    ]


def test_the_split_is_exactly_at_the_end_tag_whole_and_streamed(server, client, end_id):
    bias = {str(end_id): 4.0}  # </think> now and then
    split = 0
    for seed in range(6):
        kw = dict(model="thinker", messages=ASK, max_tokens=40, seed=seed, logit_bias=bias,
                  extra_body={"skip_special_tokens": False})  # fmt: skip
        raw = _raw(server, ASK, seed, bias)
        message = client.chat.completions.create(**kw).choices[0].message
        thought = message.model_extra.get("reasoning_content")
        if "</think>" in raw:
            split += 1
            want_thought, want_answer = raw.split("</think>", 1)
            assert (thought or "", message.content or "") == (want_thought, want_answer)
        else:
            assert (thought, message.content) == (raw or None, None)
        streamed = {"reasoning_content": "", "content": ""}
        for chunk in client.chat.completions.create(**kw, stream=True):
            for c in chunk.choices:
                streamed["content"] += c.delta.content or ""
                streamed["reasoning_content"] += (c.delta.model_extra or {}).get(
                    "reasoning_content"
                ) or ""
        assert streamed == {"reasoning_content": thought or "", "content": message.content or ""}
    assert split >= 2  # the seeds above end their thinking


def test_thinking_off_is_all_answer(server, client):
    raw = _raw(server, ASK, 1, {}, chat_template_kwargs={"enable_thinking": False})
    message = client.chat.completions.create(
        model="thinker", messages=ASK, max_tokens=40, seed=1,
        extra_body={"chat_template_kwargs": {"enable_thinking": False},
                    "skip_special_tokens": False},
    ).choices[0].message  # fmt: skip
    assert message.content == raw and "reasoning_content" not in (message.model_extra or {})


def test_structured_outputs_apply_to_the_answer(client, end_id):
    """The thinking is free; after </think> the constrained answer is JSON of the schema
    (whitespace left out: a random model would fill its budget with it). (Tool calls read
    from the answer: tests/test_reasoning_parsers.py.)"""
    bias = {str(end_id): 4.0}
    for seed in range(3):
        kw = dict(model="thinker", messages=ASK, max_tokens=200, seed=seed, logit_bias=bias)
        answer = client.chat.completions.create(
            **kw,
            extra_body={"structured_outputs": {"json": WEATHER, "disable_any_whitespace": True}},
        ).choices[0]
        assert answer.finish_reason == "stop", answer
        assert answer.message.model_extra.get("reasoning_content") is not None
        jsonschema.validate(json.loads(answer.message.content), WEATHER)


def test_the_responses_and_messages_apis_carry_the_same_split(server, client):
    """Greedy, so the raw tokens are the same: a Responses `reasoning` item and an Anthropic
    `thinking` block hold exactly the raw output's thinking, the answer what follows."""
    anthropic = pytest.importorskip("anthropic")
    ids = httpx.post(f"{server}/tokenize", json={"messages": ASK}).json()["tokens"]
    body = {"prompt": ids, "max_tokens": 24, "temperature": 0.0, "skip_special_tokens": False}
    raw = httpx.post(f"{server}/v1/completions", json=body).json()["choices"][0]["text"]
    thought, _, answer = raw.partition("</think>")
    r = client.responses.create(model="thinker", input=ASK[0]["content"], max_output_tokens=24,
                                temperature=0.0)  # fmt: skip
    assert [i.content[0].text for i in r.output if i.type == "reasoning"] == [thought]
    assert r.output_text == answer
    claude = anthropic.Anthropic(base_url=server, api_key="unused", max_retries=0)
    m = claude.messages.create(model="thinker", max_tokens=24, messages=ASK,
                               extra_body={"temperature": 0.0})  # fmt: skip
    assert [b.thinking for b in m.content if b.type == "thinking"] == [thought]
    assert "".join(b.text for b in m.content if b.type == "text") == answer
