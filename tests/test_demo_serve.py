"""Both demo models through the real `jaxllm serve`: a chat completion (through the model's
chat template: SmolLM2's own, the fallback Gemma template for the Gemma 3 base model) and a
streamed completion, with the official `openai` client."""

from __future__ import annotations

import openai
import pytest
from test_server_e2e import _start_server, _stop_server

from jaxllm.model_files import DEMO_MODELS

pytestmark = pytest.mark.demo_model


# Gemma 3 270M is `slow` (3 minutes); its parity with transformers is too. The pooling demo
# (all-MiniLM-L6-v2) is not served yet (issue 36).
GENERATIVE = [name for name, demo in DEMO_MODELS.items() if demo.weights is None]


@pytest.mark.parametrize(
    "name",
    [n if n == "smollm2-135m" else pytest.param(n, marks=pytest.mark.slow) for n in GENERATIVE],
)
def test_demo_model_serves(name):
    proc, url = _start_server(
        name, "--max-model-len", "512", "--max-num-seqs", "4", "--max-num-batched-tokens", "64",
        name=name,
    )  # fmt: skip
    try:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        assert [m.id for m in client.models.list().data] == [name]
        chat = client.chat.completions.create(
            model=name,
            messages=[{"role": "user", "content": "What is the capital of France?"}],
            max_tokens=16,
            temperature=0,
        )
        choice = chat.choices[0]
        assert choice.message.content.strip(), chat
        assert choice.finish_reason in ("stop", "length")
        assert chat.usage.completion_tokens <= 16
        stream = client.completions.create(
            model=name, prompt="The capital of France is", max_tokens=12, temperature=0,
            stream=True,
        )  # fmt: skip
        streamed = "".join(chunk.choices[0].text for chunk in stream if chunk.choices)
        plain = client.completions.create(
            model=name, prompt="The capital of France is", max_tokens=12, temperature=0
        )
        assert streamed == plain.choices[0].text and streamed.strip()
        print(f"{name}: chat {choice.message.content!r}; completion {streamed!r}")
    finally:
        _stop_server(proc)
