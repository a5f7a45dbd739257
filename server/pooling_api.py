"""The pooling endpoints of `jaxllm serve`: `/v1/embeddings`, `/pooling`, `/score` (and
`/v1/score`), `/rerank` (and `/v1/rerank`, `/v2/rerank`) and `/classify`, for a pooling model:
an embedding model (all-MiniLM-L6-v2, a decoder served with `--runner pooling`) or a sequence
classifier (a cross-encoder, a decoder reranker). Their schema is
`server.pooling_protocol`'s.

A request's items (its inputs; a score's or a rerank's pairs) each become one pooling request
of the engine (`AsyncLLM.encode`), admitted against `--max-queued-requests` as a completion is
(a request of more items than the queue holds is a 400 naming its field), run together, and
ended together: a client that leaves aborts the ones not done. A pair's score is a
cross-encoder's relevance (the pair read together, its one label's probability), or for an
embedding model the cosine similarity of the two texts' embeddings (vLLM's rules); `/rerank`
orders the documents by it.

An endpoint the model does not serve (embeddings from a generative model or a classifier,
generation from a pooling model, `/classify` from an embedding model) is a 400 naming it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence

import numpy as np
from fastapi import APIRouter, Request

from jaxllm.engine.async_llm import AsyncLLM
from jaxllm.engine.messages import AddPooling
from jaxllm.errors import EngineDeadError, InputError, RequestFailedError
from jaxllm.pooling_params import PoolingParams
from server import pooling_protocol as protocol
from server.protocol import APIError, UsageInfo, _id
from server.serving import ServerState, until_done_or_gone

router = APIRouter()


def _state(request: Request) -> ServerState:
    return request.app.state.server


class _Pooled:
    """The vectors of a request's items, and the prompt tokens they took."""

    def __init__(self, vectors: list[list[float]], num_tokens: int):
        self.vectors = vectors
        self.num_tokens = num_tokens


def _tokenize(
    eng: AsyncLLM, items: Sequence[protocol.Input], params: PoolingParams, req, field: str
) -> list[list[int]]:
    """Each item's checked token ids (on the tokenizer's thread); a 400 names `field`."""
    out = []
    for i, item in enumerate(items):
        prompt = item if isinstance(item, str) else {"prompt_token_ids": item}
        try:
            _, ids = eng.input_processor.pooling_prompt(
                prompt,
                params.truncate_prompt_tokens,
                add_special_tokens=req.add_special_tokens,
                param=field,
            )
        except InputError as e:
            where = f"{field}[{i}]: " if len(items) > 1 else ""
            raise APIError.bad_request(f"{where}{e}", field) from None
        out.append(ids)
    return out


async def _encode_all(eng: AsyncLLM, requests: list[AddPooling], arrival: float) -> list:
    """Every request's output, in order; on the first failure the rest are cancelled (which
    aborts them) and the response is a 500."""
    tasks = [asyncio.ensure_future(eng.encode(r, arrival_time=arrival)) for r in requests]
    try:
        return await asyncio.gather(*tasks)
    except (EngineDeadError, RequestFailedError):
        raise APIError.internal("the engine failed this request") from None
    finally:
        for t in tasks:
            if not t.done():
                t.cancel()


async def _pool(
    state: ServerState,
    eng: AsyncLLM,
    req,
    items: Sequence[protocol.Input],
    params: PoolingParams,
    field: str,
) -> _Pooled:
    """The pooled vectors of `items`, in their order."""
    arrival = time.monotonic()
    try:
        params.check(eng.ready.hidden_size)
    except ValueError as e:
        raise APIError.bad_request(str(e), "dimensions") from None
    prompts = await state.tokenizing(_tokenize, eng, items, params, req, field)
    rid = _id("pool")()
    requests = [AddPooling(f"{rid}-{i}", ids, params) for i, ids in enumerate(prompts)]
    vectors = await _encode_all(eng, requests, arrival)
    return _Pooled(vectors, sum(len(ids) for ids in prompts))


async def _serve(request: Request, req_cls, task: str, n_items, answer):
    """The shape every pooling route has: parse, check the model serves `task`, admit
    `n_items(req)` engine requests, then `answer(state, eng, req, model)` to its response
    model, cancelled (its requests aborted) if the client leaves."""
    state = _state(request)
    req = await state.parse(request, req_cls)
    eng = state.ready_engine(task, request.url.path)
    model = state.check_model(req.model, adapters=False)
    count, field = n_items(req)
    release = state.admit(count, field, "inputs")
    try:
        return await until_done_or_gone(request, answer(state, eng, req, model))
    finally:
        release()


# ---- embeddings and pooling ------------------------------------------------------------


@router.post("/v1/embeddings")
async def embeddings(request: Request):
    async def answer(state, eng, req, model):
        pooled = await _pool(state, eng, req, req.items(), req.pooling_params(), "input")
        return protocol.EmbeddingResponse(
            model=model,
            data=[
                protocol.EmbeddingData(
                    index=i, embedding=protocol.encode_vector(v, req.encoding_format)
                )
                for i, v in enumerate(pooled.vectors)
            ],
            usage=protocol.PoolingUsage.of(pooled.num_tokens),
        )

    return await _serve(
        request, protocol.EmbeddingRequest, "embed", lambda r: (len(r.items()), "input"), answer
    )


@router.post("/pooling")
async def pooling(request: Request):
    async def answer(state, eng, req, model):
        pooled = await _pool(state, eng, req, req.items(), req.pooling_params(), "input")
        return protocol.PoolingResponse(
            model=model,
            data=[
                protocol.PoolingData(index=i, data=protocol.encode_vector(v, req.encoding_format))
                for i, v in enumerate(pooled.vectors)
            ],
            usage=UsageInfo.of(pooled.num_tokens, 0),
        )

    return await _serve(
        request, protocol.PoolingRequest, "encode", lambda r: (len(r.items()), "input"), answer
    )


@router.post("/classify")
async def classify(request: Request):
    async def answer(state, eng, req, model):
        pooled = await _pool(state, eng, req, req.items(), req.pooling_params(), "input")
        labels = eng.ready.labels
        return protocol.ClassificationResponse(
            model=model,
            data=[
                protocol.ClassificationData(
                    index=i, label=labels[int(np.argmax(p))], probs=p, num_classes=len(p)
                )
                for i, p in enumerate(pooled.vectors)
            ],
            usage=UsageInfo.of(pooled.num_tokens, 0),
        )

    return await _serve(
        request,
        protocol.ClassificationRequest,
        "classify",
        lambda r: (len(r.items()), "input"),
        answer,
    )


# ---- scores: a cross-encoder's, or the cosine similarity of embeddings ------------------


async def _pair_scores(
    state: ServerState, eng: AsyncLLM, req, pairs: list[tuple[str, str]], field: str
) -> tuple[list[float], int]:
    """Each pair's score and the prompt tokens they took: a cross-encoder reads each pair
    together (its one label's probability); an embedding model compares the two texts'
    embeddings (each distinct text encoded once)."""
    if "classify" not in eng.supported_tasks:
        texts = [t for pair in pairs for t in pair]
        vectors, num_tokens = await _embed_texts(state, eng, req, texts, field)
        return [_cosine(vectors[a], vectors[b]) for a, b in pairs], num_tokens
    arrival = time.monotonic()
    params = PoolingParams(truncate_prompt_tokens=req.truncate_prompt_tokens)

    def tokenize():
        try:
            return [
                eng.input_processor.pair_prompt(a, b, params.truncate_prompt_tokens, param=field)
                for a, b in pairs
            ]
        except InputError as e:
            raise APIError.bad_request(str(e), field) from None

    prompts = await state.tokenizing(tokenize)
    rid = _id("score")()
    requests = [
        AddPooling(f"{rid}-{i}", ids, params, types) for i, (ids, types) in enumerate(prompts)
    ]
    outputs = await _encode_all(eng, requests, arrival)
    return [o[0] for o in outputs], sum(len(ids) for ids, _ in prompts)


async def _embed_texts(
    state: ServerState, eng: AsyncLLM, req, texts: list[str], field: str
) -> tuple[dict[str, np.ndarray], int]:
    """Each distinct text's unit-length embedding (a text given twice is encoded once)."""
    distinct = list(dict.fromkeys(texts))
    params = PoolingParams(normalize=True, truncate_prompt_tokens=req.truncate_prompt_tokens)
    pooled = await _pool(state, eng, req, distinct, params, field)
    vectors = {
        t: np.asarray(v, dtype=np.float64) for t, v in zip(distinct, pooled.vectors, strict=True)
    }
    return vectors, pooled.num_tokens


def _cosine(a: np.ndarray, b: np.ndarray) -> float:
    return float(a @ b / max(np.linalg.norm(a) * np.linalg.norm(b), 1e-12))


async def _score(request: Request):
    async def answer(state, eng, req, model):
        scores, num_tokens = await _pair_scores(state, eng, req, req.pairs(), "text_2")
        return protocol.ScoreResponse(
            model=model,
            data=[protocol.ScoreData(index=i, score=s) for i, s in enumerate(scores)],
            usage=UsageInfo.of(num_tokens, 0),
        )

    # At most one engine request per pair (fewer for an embedding model: distinct texts).
    return await _serve(
        request, protocol.ScoreRequest, "score", lambda r: (len(r.pairs()), "text_2"), answer
    )


async def _rerank(request: Request):
    async def answer(state, eng, req, model):
        pairs = [(req.query, d) for d in req.documents]
        scores, num_tokens = await _pair_scores(state, eng, req, pairs, "documents")
        order = sorted(range(len(scores)), key=lambda i: -scores[i])
        if req.top_n:
            order = order[: req.top_n]
        return protocol.RerankResponse(
            model=model,
            usage=protocol.RerankUsage(total_tokens=num_tokens),
            results=[
                protocol.RerankResult(
                    index=i,
                    document=protocol.RerankDocument(text=req.documents[i])
                    if req.return_documents
                    else None,
                    relevance_score=scores[i],
                )
                for i in order
            ],
        )

    return await _serve(
        request,
        protocol.RerankRequest,
        "score",
        lambda r: (len(r.documents), "documents"),
        answer,
    )


for _path in ("/score", "/v1/score"):
    router.add_api_route(_path, _score, methods=["POST"])
for _path in ("/rerank", "/v1/rerank", "/v2/rerank"):
    router.add_api_route(_path, _rerank, methods=["POST"])
