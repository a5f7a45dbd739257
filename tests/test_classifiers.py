"""Sequence classification models (`*ForSequenceClassification`): BERT cross-encoders on the
encoder's pooling core, Qwen2 and Llama classifiers on the decoder's (chunked under the step
budget), against transformers on torch with tiny random checkpoints written here; `LLM.classify`
and `LLM.score`, and the server's `/classify`, `/score` and `/rerank`."""

from __future__ import annotations

import httpx
import numpy as np
import pytest

from tests.test_server_e2e import _start_server, _stop_server

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

WORDS = "the a man woman child eats drinks plays food water music guitar in park house".split()
SENTENCES = [
    "a man eats food",
    "the woman drinks water in the park",
    "a child plays music",
    "the man plays guitar in a house",
]


def _bert_classifier(tmp_path, num_labels: int):
    """A tiny random BertForSequenceClassification with a WordPiece tokenizer of WORDS."""
    torch.manual_seed(num_labels)
    path = tmp_path / f"bert-cls-{num_labels}"
    path.mkdir()
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS]
    (path / "vocab.txt").write_text("\n".join(vocab) + "\n")
    tokenizer = transformers.BertTokenizerFast(vocab_file=str(path / "vocab.txt"))
    tokenizer.save_pretrained(path)
    config = transformers.BertConfig(
        vocab_size=len(vocab), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=48, max_position_embeddings=64, num_labels=num_labels,
        id2label={i: f"class-{i}" for i in range(num_labels)},
        label2id={f"class-{i}": i for i in range(num_labels)},
    )  # fmt: skip
    model = transformers.BertForSequenceClassification(config).eval()
    model.save_pretrained(path, safe_serialization=True)
    return path, model, tokenizer


def _decoder_classifier(tmp_path, family: str, num_labels: int = 3):
    torch.manual_seed(1)
    common = dict(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        num_labels=num_labels, pad_token_id=0,
    )  # fmt: skip
    if family == "qwen2":
        model = transformers.Qwen2ForSequenceClassification(transformers.Qwen2Config(**common))
    else:
        model = transformers.LlamaForSequenceClassification(transformers.LlamaConfig(**common))
    model.eval()
    path = tmp_path / f"{family}-cls"
    model.save_pretrained(path, safe_serialization=True)
    return path, model


def _logits(model, **inputs) -> np.ndarray:
    with torch.no_grad():
        batch = {k: torch.tensor([v]) for k, v in inputs.items()}
        return model(**batch).logits[0].numpy()


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()


def test_bert_classifier_probabilities_equal_transformers(tmp_path):
    from jaxllm import LLM, PoolingParams

    path, ref, tokenizer = _bert_classifier(tmp_path, num_labels=3)
    llm = LLM(str(path), max_model_len=32, max_num_seqs=4, max_num_batched_tokens=64)
    assert llm.supported_tasks == ["classify"]
    compiled = llm.runner.num_compilations
    outs = llm.classify(SENTENCES, use_tqdm=False)
    alone = llm.classify(SENTENCES[1], use_tqdm=False)[0]
    for text, out in zip(SENTENCES, outs, strict=True):
        want = _softmax(_logits(ref, **tokenizer(text)))
        np.testing.assert_allclose(out.outputs.probs, want, atol=2e-5)
        assert out.outputs.num_classes == 3 and out.prompt == text
    np.testing.assert_allclose(alone.outputs.probs, outs[1].outputs.probs, atol=2e-5)
    raw = llm.classify(SENTENCES[0], PoolingParams(activation=False), use_tqdm=False)[0]
    np.testing.assert_allclose(
        raw.outputs.probs, _logits(ref, **tokenizer(SENTENCES[0])), atol=2e-5
    )
    assert llm.runner.num_compilations == compiled
    with pytest.raises(Exception, match="serves classify, not 'embed'"):
        llm.embed("a man")
    with pytest.raises(Exception, match="not 'score'"):
        llm.score("a man", "a woman")  # three labels: no relevance score
    with pytest.raises(Exception, match="dimensions"):
        llm.classify("a man", PoolingParams(dimensions=2), use_tqdm=False)


def test_cross_encoder_scores_pairs_as_transformers(tmp_path):
    """A one-label BERT cross-encoder reads each pair together ([CLS] a [SEP] b [SEP], b's
    tokens of type 1): its score is the sigmoid of its logit."""
    from jaxllm import LLM

    path, ref, tokenizer = _bert_classifier(tmp_path, num_labels=1)
    llm = LLM(str(path), max_model_len=32, max_num_seqs=4, max_num_batched_tokens=64)
    assert llm.supported_tasks == ["classify", "score"]
    query = "the man plays guitar"
    outs = llm.score(query, SENTENCES, use_tqdm=False)
    for text, out in zip(SENTENCES, outs, strict=True):
        enc = tokenizer(query, text)
        assert enc["token_type_ids"][-1] == 1 and out.prompt_token_ids == enc["input_ids"]
        want = 1 / (1 + np.exp(-_logits(ref, **enc)[0]))
        assert abs(out.outputs.score - want) < 2e-5
    pairwise = llm.score(SENTENCES[:2], SENTENCES[2:], use_tqdm=False)
    for (a, b), out in zip(zip(SENTENCES[:2], SENTENCES[2:], strict=True), pairwise, strict=True):
        want = 1 / (1 + np.exp(-_logits(ref, **tokenizer(a, b))[0]))
        assert abs(out.outputs.score - want) < 2e-5
    with pytest.raises(Exception, match="data_2"):
        llm.score(SENTENCES[:2], SENTENCES[:3])


@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_decoder_classifier_equals_transformers_across_chunks(tmp_path, family):
    """A decoder classifier's `score` head on its last token, the prompt prefilled in chunks
    of a 16-token budget beside other requests: transformers' logits, softmaxed."""
    from jaxllm import LLM

    path, ref = _decoder_classifier(tmp_path, family)
    llm = LLM(str(path), max_model_len=64, max_num_seqs=4, max_num_batched_tokens=16,
              num_pages=32)  # fmt: skip
    assert llm.is_pooling_model and llm.supported_tasks == ["classify"]
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, 96, size=n).tolist() for n in (50, 3, 17, 64)]
    outs = llm.classify([{"prompt_token_ids": p} for p in prompts], use_tqdm=False)
    alone = llm.classify({"prompt_token_ids": prompts[0]}, use_tqdm=False)[0]
    for p, out in zip(prompts, outs, strict=True):
        want = _softmax(_logits(ref, input_ids=p))
        np.testing.assert_allclose(out.outputs.probs, want, atol=3e-5)
    np.testing.assert_allclose(alone.outputs.probs, outs[0].outputs.probs, atol=3e-5)
    with pytest.raises(Exception, match="does not generate"):
        llm.generate({"prompt_token_ids": [1, 2]})
    kv = llm.kv_cache_manager
    assert kv.num_free_blocks == kv.num_pages


def test_server_classify_score_and_rerank_with_a_cross_encoder(tmp_path):
    path, ref, tokenizer = _bert_classifier(tmp_path, num_labels=1)
    proc, url = _start_server(path, "--max-model-len", "32", "--max-num-batched-tokens", "64",
                              name="ce")  # fmt: skip
    try:
        models = httpx.get(f"{url}/v1/models").json()["data"]
        assert models[0]["supported_tasks"] == ["classify", "score"]
        query, docs = "the man plays guitar", SENTENCES
        want = [float(1 / (1 + np.exp(-_logits(ref, **tokenizer(query, d))[0]))) for d in docs]
        r = httpx.post(f"{url}/score", json={"text_1": query, "text_2": docs}, timeout=60)
        assert r.status_code == 200, r.text
        np.testing.assert_allclose([d["score"] for d in r.json()["data"]], want, atol=2e-5)
        r = httpx.post(f"{url}/v2/rerank", json={"query": query, "documents": docs, "top_n": 2})
        order = sorted(range(len(docs)), key=lambda i: -want[i])[:2]
        assert [x["index"] for x in r.json()["results"]] == order
        r = httpx.post(f"{url}/classify", json={"input": docs[:2]}, timeout=60)
        assert r.status_code == 200, r.text
        data = r.json()["data"]
        assert [d["label"] for d in data] == ["class-0", "class-0"] and data[0]["num_classes"] == 1
        logit = _logits(ref, **tokenizer(docs[0]))[0]
        assert abs(data[0]["probs"][0] - 1 / (1 + np.exp(-logit))) < 2e-5
        r = httpx.post(f"{url}/classify", json={"input": docs[0], "use_activation": False})
        assert abs(r.json()["data"][0]["probs"][0] - logit) < 2e-5
        r = httpx.post(f"{url}/v1/embeddings", json={"input": "a man"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "model"
        assert "/v1/embeddings" in r.json()["error"]["message"]
    finally:
        log = _stop_server(proc)
    assert "Traceback" not in log, log[-3000:]
