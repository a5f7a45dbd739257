"""A prefill/decode proxy: one OpenAI endpoint in front of prefill servers and decode servers
(`jaxllm serve --kv-transfer-config`), driving vLLM's two-step protocol as vLLM's toy proxy and
llm-d's routing sidecar do:

1. the request goes to a prefiller with `max_tokens` 1, not streamed, and `kv_transfer_params`
   `{"do_remote_decode": true}`; its response carries the params a decoder needs;
2. the original request goes to a decoder with those params, and its response (streamed or
   not) is the client's.

The prefiller is the one the `x-prefiller-host-port` header names (llm-d's inference scheduler
sets it), else the next of `--prefill` in turn; with neither, the decoder serves the request
alone (llm-d's single-node path). Decoders are taken in turn. A prefiller that fails (down,
5xx, 429, past --prefill-timeout) costs the decode server the prompt, not the request: the
decoder is sent the request without params and computes it. A prefiller's refusal of the
request itself (400, 401, 403, 413, 422) is the client's answer. A request for n > 1
completions goes to the decoder alone (one prefill serves one decode).
Every other path (/health, /metrics, /v1/models, ...) is the first decoder's, so the proxy can
stand in front of a decode pod's server as llm-d's routing sidecar does. Works with any server
that speaks the protocol (vLLM with NixlConnector too).

    python scripts/pd_proxy.py --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200
    python scripts/pd_proxy.py --decode http://127.0.0.1:8200 --port 8000   # a decode pod's sidecar
"""

from __future__ import annotations

import argparse
import itertools
import logging
import uuid
from contextlib import asynccontextmanager

import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

logger = logging.getLogger("pd_proxy")

# The prefill step's request: one token, not streamed; what a prefiller cannot use dropped.
_PREFILL_PARAMS = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


def build_app(
    prefill: list[str],
    decode: list[str],
    *,
    prefill_timeout: float = 300.0,
    allowed_prefillers: list[str] | None = None,
) -> FastAPI:
    """The proxy over prefill servers `prefill` (none: only those the header names) and decode
    servers `decode` (base URLs). `allowed_prefillers`: the host:port values the header may
    name (None: any; the header comes from whoever reaches the proxy)."""
    if not decode:
        raise ValueError("the proxy needs at least one decode server")
    clients: dict[str, httpx.AsyncClient] = {}

    def client(base: str) -> httpx.AsyncClient:
        if base not in clients:
            limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
            # Decodes stream for as long as they take; a prefill gets `prefill_timeout`.
            clients[base] = httpx.AsyncClient(base_url=base, timeout=None, limits=limits)
        return clients[base]

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        for c in clients.values():
            await c.aclose()

    app = FastAPI(lifespan=lifespan)
    prefillers, decoders = itertools.cycle(prefill or [None]), itertools.cycle(decode)

    def headers(request: Request, request_id: str) -> dict[str, str]:
        out = {"X-Request-Id": request_id}
        if "authorization" in request.headers:
            out["Authorization"] = request.headers["authorization"]
        return out

    async def two_steps(path: str, request: Request) -> Response:
        try:
            body = await request.json()
        except ValueError:
            return JSONResponse({"error": {"message": "the body is not JSON", "type": "BadRequestError", "code": 400}}, 400)  # fmt: skip
        if not isinstance(body, dict):
            return JSONResponse({"error": {"message": "the body must be a JSON object", "type": "BadRequestError", "code": 400}}, 400)  # fmt: skip
        request_id = request.headers.get("x-request-id") or str(uuid.uuid4())
        named = request.headers.get("x-prefiller-host-port")
        if named and allowed_prefillers is not None and named not in allowed_prefillers:
            logger.warning("x-prefiller-host-port %s is not an allowed prefiller: ignored", named)
            named = None
        prefiller = f"http://{named}" if named else next(prefillers)
        decoder = client(next(decoders))
        if prefiller is None or (body.get("n") or 1) != 1:  # one prefill serves one decode
            return await _forward(decoder, decoder.build_request("POST", path, json=body, headers=headers(request, request_id)))  # fmt: skip
        step = dict(body, kv_transfer_params=dict(_PREFILL_PARAMS), stream=False, max_tokens=1)
        if "max_completion_tokens" in step:
            step["max_completion_tokens"] = 1
        for name in ("stream_options", "min_tokens", "min_completion_tokens"):
            step.pop(name, None)
        params = None
        try:
            answer = await client(prefiller).post(path, json=step, headers=headers(request, request_id), timeout=prefill_timeout)  # fmt: skip
            if answer.status_code in (400, 401, 403, 413, 422):  # the request's fault: its answer
                return Response(answer.content, answer.status_code, media_type="application/json")  # fmt: skip
            answer.raise_for_status()
            params = answer.json().get("kv_transfer_params")
        except (httpx.HTTPError, ValueError) as e:
            logger.warning("prefill on %s failed (%s): the decoder computes the prompt", prefiller, e)  # fmt: skip
        if params:
            body = dict(body, kv_transfer_params=params)
        return await _forward(decoder, decoder.build_request("POST", path, json=body, headers=headers(request, request_id)))  # fmt: skip

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await two_steps("/v1/completions", request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await two_steps("/v1/chat/completions", request)

    @app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "DELETE"])
    async def other(path: str, request: Request):
        """Anything else is the first decoder's (its health, metrics, models, tokenizer)."""
        decoder = client(decode[0])
        kept = {k: v for k, v in request.headers.items() if k.lower() in ("authorization", "content-type", "accept")}  # fmt: skip
        sent = decoder.build_request(request.method, f"/{path}", params=request.query_params,
                                     content=await request.body(), headers=kept)  # fmt: skip
        return await _forward(decoder, sent)

    return app


async def _forward(client: httpx.AsyncClient, sent: httpx.Request) -> Response:
    """The answer to `sent`, streamed back as it comes."""
    try:
        reply = await client.send(sent, stream=True)
    except httpx.HTTPError as e:
        return JSONResponse({"error": {"message": f"the decode server failed: {e}", "type": "InternalServerError", "code": 502}}, 502)  # fmt: skip
    return StreamingResponse(
        reply.aiter_bytes(),  # decoded: the content-encoding is not passed on
        status_code=reply.status_code,
        media_type=reply.headers.get("content-type"),
        background=BackgroundTask(reply.aclose),
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prefill", action="append", default=[], help="a prefill server's base URL (repeat for more); none: only the one a request's x-prefiller-host-port header names")  # fmt: skip
    parser.add_argument("--decode", action="append", required=True, help="a decode server's base URL (repeat for more)")  # fmt: skip
    parser.add_argument("--prefill-timeout", type=float, default=300.0, help="seconds a prefill may take before the decoder computes the prompt itself")  # fmt: skip
    parser.add_argument("--allowed-prefillers", nargs="+", default=None, help="the host:port values x-prefiller-host-port may name (default: any)")  # fmt: skip
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    app = build_app(args.prefill, args.decode, prefill_timeout=args.prefill_timeout,
                    allowed_prefillers=args.allowed_prefillers)  # fmt: skip
    uvicorn.run(app, host=args.host, port=args.port)


if __name__ == "__main__":
    main()
