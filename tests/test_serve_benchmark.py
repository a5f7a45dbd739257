"""benchmarks/serve.py against a fake OpenAI-compatible streaming server (FastAPI + uvicorn
on a free loopback port in a background thread) whose chunks come with known delays."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import socket
import sys
import threading
import time
from pathlib import Path

import pytest

fastapi = pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")
pytest.importorskip("httpx")

from fastapi.responses import JSONResponse, StreamingResponse  # noqa: E402

FIRST_DELAY = 0.15  # seconds before the first content chunk
TOKEN_DELAY = 0.03  # seconds between content chunks
EOS_AFTER = 3  # tokens generated when the request does not set ignore_eos


def _load_bench():
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "serve.py"
    spec = importlib.util.spec_from_file_location("jaxllm_bench_serve", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up here
    spec.loader.exec_module(mod)
    return mod


bench = _load_bench()


def _fake_app(state: dict):
    app = fastapi.FastAPI()

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": "fake-model", "object": "model"}]}

    @app.get("/version")
    async def version():
        return {"version": "fake-1.0"}

    async def generate(request: fastapi.Request, chat: bool):
        body = await request.json()
        state["bodies"].append(body)
        state["auth"].append(request.headers.get("authorization"))
        prompt = body["messages"][-1]["content"] if chat else body["prompt"]
        if "FAIL_HTTP" in prompt:
            return JSONResponse({"error": {"message": "bad prompt"}}, status_code=400)
        n = body["max_tokens"] if body.get("ignore_eos") else min(EOS_AFTER, body["max_tokens"])
        usage = body.get("stream_options", {}).get("include_usage") and body["model"] != "no-usage"
        obj = "chat.completion.chunk" if chat else "text_completion"

        def event(text, finish=None):
            if chat:
                choice = {"index": 0, "delta": {"content": text}, "finish_reason": finish}
            else:
                choice = {"index": 0, "text": text, "finish_reason": finish}
            return f"data: {json.dumps({'object': obj, 'choices': [choice]})}\n\n"

        async def stream():
            state["inflight"] += 1
            state["max_inflight"] = max(state["max_inflight"], state["inflight"])
            try:
                if chat:
                    role = {"index": 0, "delta": {"role": "assistant"}, "finish_reason": None}
                    yield f"data: {json.dumps({'object': obj, 'choices': [role]})}\n\n"
                await asyncio.sleep(FIRST_DELAY)
                if "HANG" in prompt:
                    await asyncio.sleep(30)
                for i in range(n):
                    if i:
                        await asyncio.sleep(TOKEN_DELAY)
                    if "FAIL_EVENT" in prompt and i == 1:
                        yield f"data: {json.dumps({'error': {'message': 'engine died'}})}\n\n"
                        return
                    yield event(f" w{i}", "length" if i == n - 1 else None)
                if usage:
                    u = {"prompt_tokens": len(prompt.split()), "completion_tokens": n}
                    yield f"data: {json.dumps({'object': obj, 'choices': [], 'usage': u})}\n\n"
                yield "data: [DONE]\n\n"
            finally:
                state["inflight"] -= 1

        return StreamingResponse(stream(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: fastapi.Request):
        return await generate(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: fastapi.Request):
        return await generate(request, chat=True)

    return app


@pytest.fixture(scope="module")
def server():
    state = {"bodies": [], "auth": [], "inflight": 0, "max_inflight": 0}
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(
        _fake_app(state), log_level="warning", lifespan="off", timeout_graceful_shutdown=1
    )
    srv = uvicorn.Server(config)
    thread = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not srv.started:
        assert time.monotonic() < deadline, "fake server did not start"
        time.sleep(0.02)
    yield f"http://127.0.0.1:{port}", state
    srv.should_exit = True
    thread.join(timeout=5)
    sock.close()


def _reset(state):
    state["bodies"].clear()
    state["auth"].clear()
    state["max_inflight"] = 0


def test_completions_counts_and_latencies(server, tmp_path, monkeypatch):
    url, state = server
    _reset(state)
    monkeypatch.setenv("OPENAI_API_KEY", "sk-test")
    out_len, n = 6, 6
    path = tmp_path / "res.json"
    res = bench.main(
        [
            *("--base-url", url, "--num-prompts", str(n), "--max-concurrency", "2"),
            *("--input-len", "16", "--output-len", str(out_len), "--ignore-eos"),
            *("--json", str(path)),
        ]
    )
    assert res["completed"] == n and res["failed"] == 0 and res["errors"] == []
    assert res["model"] == "fake-model"  # the first id of /v1/models
    assert res["server_version"] == {"version": "fake-1.0"}
    assert res["total_output_tokens"] == n * out_len and res["output_tokens_from_usage"]
    assert res["total_input_tokens"] == n * 16 and res["input_tokens_from_usage"]
    assert state["max_inflight"] <= 2

    body = state["bodies"][0]
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["ignore_eos"] is True and body["temperature"] == 0.0
    assert body["max_tokens"] == out_len and len(body["prompt"].split()) == 16
    assert state["auth"][0] == "Bearer sk-test"
    assert len({b["prompt"] for b in state["bodies"]}) == n  # distinct synthetic prompts

    # Known delays: TTFT >= FIRST_DELAY, ITL ~ TOKEN_DELAY, E2E >= FIRST + (n-1) * TOKEN.
    slack = 1.0  # generous: shared, noisy machines
    ms = 1e3
    assert 0.9 * FIRST_DELAY * ms <= res["median_ttft_ms"] <= (FIRST_DELAY + slack) * ms
    assert 0.8 * TOKEN_DELAY * ms <= res["mean_itl_ms"] <= (TOKEN_DELAY + slack) * ms
    assert 0.5 * TOKEN_DELAY * ms <= res["median_itl_ms"] <= (TOKEN_DELAY + slack) * ms
    assert 0.8 * TOKEN_DELAY * ms <= res["mean_tpot_ms"] <= (TOKEN_DELAY + slack) * ms
    e2e_min = FIRST_DELAY + (out_len - 1) * TOKEN_DELAY
    assert 0.9 * e2e_min * ms <= res["median_e2el_ms"] <= (e2e_min + slack) * ms
    for key in ("ttft", "tpot", "itl", "e2el"):
        assert res[f"mean_{key}_ms"] <= res[f"p99_{key}_ms"] + 1e-9
    # Six requests, two at a time: three waves.
    assert res["duration_s"] >= 0.9 * 3 * e2e_min
    assert res["output_throughput"] == pytest.approx(n * out_len / res["duration_s"])

    saved = json.loads(path.read_text())
    assert saved["completed"] == n and saved["args"]["api_key"] == "<redacted>"
    assert saved["args"]["request_rate"] == "inf" and len(saved["requests"]) == n
    assert all(r["output_tokens"] == out_len for r in saved["requests"])


def test_chat_poisson_without_usage(server):
    url, state = server
    _reset(state)
    n, rate, seed = 5, 20.0, 3
    res = bench.main(
        [
            *("--base-url", url, "--endpoint", "/v1/chat/completions", "--model", "no-usage"),
            *("--num-prompts", str(n), "--request-rate", str(rate), "--seed", str(seed)),
            *("--input-len", "8", "--output-len", "4"),  # no --ignore-eos: stops at EOS_AFTER
        ]
    )
    assert res["completed"] == n and res["failed"] == 0
    assert res["model"] == "no-usage" and "ignore_eos" not in state["bodies"][0]
    assert state["bodies"][0]["messages"][0]["role"] == "user"
    # No usage chunk: output tokens are counted from content chunks (the role chunk is not one).
    assert not res["output_tokens_from_usage"] and res["total_output_tokens"] == n * EOS_AFTER
    assert not res["input_tokens_from_usage"] and res["total_input_tokens"] == n * 8
    assert res["median_ttft_ms"] >= 0.9 * FIRST_DELAY * 1e3

    offsets = bench.arrival_offsets(n, rate, seed)
    assert offsets == bench.arrival_offsets(n, rate, seed) and offsets[0] == 0.0
    assert offsets != bench.arrival_offsets(n, rate, seed + 1)
    starts = [r["start_s"] for r in res["requests"]]
    assert starts == pytest.approx(offsets)


def test_failures_are_counted_not_fatal(server, tmp_path):
    url, state = server
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("hello there\nFAIL_HTTP please\nFAIL_EVENT now\nHANG forever\n")
    res = bench.main(
        [
            *("--base-url", url, "--prompt-file", str(prompts), "--num-prompts", "4"),
            *("--output-len", "3", "--ignore-eos", "--timeout", "0.8"),
        ]
    )
    assert res["completed"] == 1 and res["failed"] == 3
    errors = " | ".join(res["errors"])
    assert "HTTP 400: bad prompt" in errors
    assert "error event: engine died" in errors
    assert "timeout after 0.8 s" in errors
    assert res["total_output_tokens"] == 3
    assert [r["success"] for r in res["requests"]] == [True, False, False, False]


def test_unreachable_server_reports_failures():
    # Nothing listens on this port (bound, never listening): every request fails, no crash.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}"
        res = bench.main(
            ["--base-url", url, "--model", "m", "--num-prompts", "2", "--input-len", "4"]
        )
    assert res["completed"] == 0 and res["failed"] == 2
    assert all("ConnectError" in e for e in res["errors"])
    assert res["server_version"] is None and res["mean_ttft_ms"] is None
