"""A tiny random gpt-oss served by the real `jaxllm serve` with harmony's special tokens in its
tokenizer, a harmony chat template, the reasoning parser it gets without flags and the `openai`
tool call parser: 100 fuzzed bodies (test_fuzz.py's) get no 5xx with the special tokens kept
in the text the parsers read, and a JSON-schema request (whose grammar waits for the final
channel's header) finishes."""

from __future__ import annotations

import httpx
import openai
import pytest
import test_fuzz
from hypothesis import given, settings

from jaxllm.testing import write_tiny_tokenizer
from tests.helpers import write_family_checkpoint
from tests.test_server_e2e import running_server

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

HARMONY = ["<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|call|>", "<|return|>"]
# Harmony's shape: a system line, each message as <|start|>role<|message|>...<|end|>, and the
# assistant's turn opened.
TEMPLATE = (
    "<|start|>system<|message|>Reasoning: {{ reasoning_effort | default('medium') }}<|end|>"
    "{% for m in messages %}<|start|>{{ m.role }}<|message|>{{ m.content or '' }}<|end|>"
    "{% endfor %}{% if add_generation_prompt %}<|start|>assistant{% endif %}"
)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-gpt-oss")
    write_tiny_tokenizer(path, vocab_size=390, chat_template=TEMPLATE)
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    tokenizer.add_special_tokens({"additional_special_tokens": HARMONY})
    tokenizer.save_pretrained(path)
    write_family_checkpoint("gpt-oss", path, tokenizer=False)
    assert len(tokenizer) <= 400  # the checkpoint's vocabulary
    flags = ("--enable-auto-tool-choice", "--tool-call-parser", "openai")
    with running_server(path, *flags, name="tiny") as url:
        yield url


@settings(max_examples=100, derandomize=True, **test_fuzz.FUZZ_SETTINGS)
@given(case=test_fuzz.requests())
def test_fuzzed_bodies_get_no_5xx(server, case):
    with httpx.Client(base_url=server, timeout=120) as client:
        test_fuzz._send(client, *case)


def test_a_schema_answer_waits_for_the_final_header(server):
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0)
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    response = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Give me a."}],
        response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": schema}},
        reasoning_effort="high",
        max_tokens=16,
        seed=0,
    )
    choice = response.choices[0]
    # A random model never writes the final header: its output stays free (reasoning or
    # content as it falls), and the request finishes by length.
    assert choice.finish_reason == "length"
