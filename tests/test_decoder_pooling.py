"""Decoders served for pooling (Qwen3-Embedding's way: the last token's final hidden state,
normalized; or their mean): through the generative engine's scheduler, chunked under the step's
token budget, against transformers on torch with tiny random checkpoints it writes itself."""

from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


def _qwen3_embedder(tmp_path, pooling: str | None = "lasttoken"):
    """A tiny random Qwen3 saved by transformers; with `pooling`, sentence-transformers' files
    say how it pools (a Pooling module, then Normalize), as Qwen3-Embedding's do."""
    torch.manual_seed(0)
    config = transformers.Qwen3Config(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=128,
    )  # fmt: skip
    model = transformers.Qwen3ForCausalLM(config).eval()
    path = tmp_path / "qwen3-embedder"
    model.save_pretrained(path, safe_serialization=True)
    if pooling is not None:
        modules = [
            {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
            {"idx": 1, "name": "1", "path": "1_Pooling",
             "type": "sentence_transformers.models.Pooling"},
            {"idx": 2, "name": "2", "path": "2_Normalize",
             "type": "sentence_transformers.models.Normalize"},
        ]  # fmt: skip
        (path / "modules.json").write_text(json.dumps(modules))
        (path / "1_Pooling").mkdir()
        (path / "1_Pooling" / "config.json").write_text(
            json.dumps({"word_embedding_dimension": 32, f"pooling_mode_{pooling}": True})
        )
    return path, model


def _hidden(model, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return model.model(input_ids=torch.tensor([ids])).last_hidden_state[0].numpy()


def _unit(x: np.ndarray) -> np.ndarray:
    return x / np.linalg.norm(x)


LENGTHS = (1, 40, 7, 64, 16, 23)


def test_last_token_embeddings_equal_transformers_across_chunks(tmp_path):
    """The checkpoint says it pools (no flag): each prompt's vector is its last token's final
    hidden state, normalized, whether it runs in a batch, alone, or in chunks of a 16-token
    budget; nothing compiles after warmup and every KV page is free after."""
    from jaxllm import LLM

    path, ref = _qwen3_embedder(tmp_path)
    llm = LLM(str(path), max_model_len=64, max_num_seqs=4, max_num_batched_tokens=16,
              num_pages=64)  # fmt: skip
    assert llm.is_pooling_model and llm.engine.pooler.pooling_type == "LAST"
    compiled = llm.runner.num_compilations  # at warmup
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 128, size=n).tolist() for n in LENGTHS]
    outs = llm.embed([{"prompt_token_ids": p} for p in prompts], use_tqdm=False)
    alone = [llm.embed({"prompt_token_ids": p}, use_tqdm=False)[0] for p in prompts[:2]]
    for i, (p, out) in enumerate(zip(prompts, outs, strict=True)):
        want = _unit(_hidden(ref, p)[-1])
        np.testing.assert_allclose(out.outputs.embedding, want, atol=2e-5, rtol=2e-5)
        if i < 2:
            np.testing.assert_allclose(alone[i].outputs.embedding, want, atol=2e-5, rtol=2e-5)
    assert llm.runner.num_compilations == compiled
    kv = llm.kv_cache_manager
    assert kv.num_free_blocks == kv.num_pages
    with pytest.raises(Exception, match="does not generate"):
        llm.generate("hi")


def test_mean_pooling_over_chunks_and_preemption(tmp_path):
    """Mean pooling carried over chunks, with a KV pool so small that requests are preempted
    and recomputed: every vector still equals transformers' mean, not normalized when the
    request says so; `dimensions` cuts it first."""
    from jaxllm import LLM
    from jaxllm.pooling_params import PoolingParams

    path, ref = _qwen3_embedder(tmp_path, pooling="mean_tokens")
    llm = LLM(str(path), max_model_len=64, max_num_seqs=4, max_num_batched_tokens=16,
              num_pages=9, page_size=8)  # fmt: skip
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, 128, size=n).tolist() for n in (60, 50, 30, 45, 5)]
    params = PoolingParams(normalize=False)
    outs = llm.embed([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for p, out in zip(prompts, outs, strict=True):
        np.testing.assert_allclose(out.outputs.embedding, _hidden(ref, p).mean(0), atol=3e-5)
    assert llm.engine.scheduler.num_preemptions > 0
    cut = llm.embed({"prompt_token_ids": prompts[0]}, PoolingParams(dimensions=8), use_tqdm=False)
    np.testing.assert_allclose(
        cut[0].outputs.embedding, _unit(_hidden(ref, prompts[0]).mean(0)[:8]), atol=3e-5
    )


def test_runner_and_pooler_config_flags(tmp_path):
    """A decoder without sentence-transformers files generates unless `runner="pooling"`
    (then it pools its last token, normalized, as vLLM's default); `pooler_config` overrides
    the checkpoint; asking a generative model for embeddings says how to serve it."""
    from jaxllm import LLM
    from jaxllm.errors import InputError

    path, ref = _qwen3_embedder(tmp_path, pooling=None)
    args = dict(max_model_len=32, max_num_seqs=2, max_num_batched_tokens=16, num_pages=16)
    llm = LLM(str(path), **args)
    assert not llm.is_pooling_model
    with pytest.raises(InputError, match="generative model"):
        llm.embed("hi")
    ids = [5, 9, 11, 3]
    pooled = LLM(str(path), runner="pooling", **args)
    (out,) = pooled.embed({"prompt_token_ids": ids}, use_tqdm=False)
    np.testing.assert_allclose(out.outputs.embedding, _unit(_hidden(ref, ids)[-1]), atol=2e-5)
    mean = LLM(str(path), runner="pooling", pooler_config='{"pooling_type": "mean"}', **args)
    (out,) = mean.embed({"prompt_token_ids": ids}, use_tqdm=False)
    np.testing.assert_allclose(out.outputs.embedding, _unit(_hidden(ref, ids).mean(0)), atol=2e-5)
    with pytest.raises(ValueError, match="pooler_config"):
        LLM(str(path), pooler_config='{"normalize": false}', **args)


def test_async_llm_encodes_with_a_decoder_in_the_core_process(tmp_path):
    """The server's path: the core (here on a thread) says it pools; `AsyncLLM.encode`
    returns the same vectors concurrently; generation is refused before the core."""
    import asyncio

    from jaxllm.engine.async_llm import AsyncLLM
    from jaxllm.engine.messages import AddPooling
    from jaxllm.pooling_params import PoolingParams

    path, ref = _qwen3_embedder(tmp_path)
    rng = np.random.default_rng(2)
    prompts = [rng.integers(0, 128, size=n).tolist() for n in (33, 3, 20)]

    async def main():
        eng = await AsyncLLM.create(
            str(path), in_process=True, max_model_len=64, max_num_seqs=4,
            max_num_batched_tokens=16, num_pages=32,
        )  # fmt: skip
        try:
            assert eng.is_pooling_model and eng.supported_tasks == ["encode", "embed", "score"]
            assert eng.ready.hidden_size == 32 and eng.ready.num_pages == 32
            requests = [AddPooling(f"r{i}", p, PoolingParams()) for i, p in enumerate(prompts)]
            return await asyncio.gather(*(eng.encode(r) for r in requests))
        finally:
            await eng.shutdown()

    vectors = asyncio.run(main())
    for p, v in zip(prompts, vectors, strict=True):
        np.testing.assert_allclose(v, _unit(_hidden(ref, p)[-1]), atol=2e-5)


def test_a_base_model_checkpoint_is_an_embedder(tmp_path):
    """A checkpoint of a base model (`Qwen3Model`: no LM head, no "model." prefix, as
    e5-mistral's `MistralModel`) is served for pooling with no flag: its last token,
    normalized; asking it to generate says why not."""
    from jaxllm import LLM

    torch.manual_seed(0)
    config = transformers.Qwen3Config(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
        tie_word_embeddings=False,
    )  # fmt: skip
    model = transformers.Qwen3Model(config).eval()
    path = tmp_path / "qwen3-base"
    model.save_pretrained(path, safe_serialization=True)
    args = dict(max_model_len=32, max_num_seqs=2, max_num_batched_tokens=16, num_pages=16)
    llm = LLM(str(path), **args)
    assert llm.is_pooling_model
    ids = [3, 1, 4, 1, 5, 9, 2, 6]
    (out,) = llm.embed({"prompt_token_ids": ids}, use_tqdm=False)
    with torch.no_grad():
        h = model(input_ids=torch.tensor([ids])).last_hidden_state[0, -1].numpy()
    np.testing.assert_allclose(out.outputs.embedding, _unit(h), atol=2e-5)
    with pytest.raises(ValueError, match="without an LM head"):
        LLM(str(path), runner="generate", **args)
