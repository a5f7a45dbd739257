"""Prefill/decode disaggregation over the loopback, as deployed: a prefill server (tensor
parallel 2) and a decode server (tensor parallel 1), `jaxllm serve --kv-transfer-config`, and
`scripts/pd_proxy.py` in front, driven by the official openai client. The same greedy output as
the decode server alone; the decoder pulls the prompts' full blocks instead of computing them
(its metrics say so); a prefiller gone costs the decoder the prompt, never a wrong answer."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from tests.test_server_e2e import _free_port, _start_server, _stop_server

ROOT = Path(__file__).resolve().parents[1]
PAGE = 16
PROMPTS = [[(11 * i + 5 * j) % 250 + 4 for j in range(n)] for i, n in enumerate((75, 40, 130))]


def _metric(url: str, name: str) -> float:
    total = 0.0
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith(name) and not line.startswith("#") and "_created" not in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


def _transfer(role: str, port: int) -> str:
    return json.dumps({"kv_connector": "JaxTransferConnector", "kv_role": role, "kv_port": port,
                       "kv_connector_extra_config": {"pull_timeout_s": 5}})  # fmt: skip


@pytest.fixture(scope="module")
def pd(tiny_model_dir):
    """(proxy, prefill server, decode server) URLs, and the prefill server's process."""
    with pytest.MonkeyPatch.context() as mp:  # the prefiller's two CPU devices
        mp.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2")  # fmt: skip
        prefill, prefill_url = _start_server(
            tiny_model_dir, "--tensor-parallel-size", "2",
            "--kv-transfer-config", _transfer("kv_producer", _free_port()),
        )  # fmt: skip
    decode, decode_url = _start_server(tiny_model_dir, "--kv-transfer-config", _transfer("kv_consumer", _free_port()))  # fmt: skip
    port = _free_port()
    proxy = subprocess.Popen(
        [sys.executable, str(ROOT / "scripts" / "pd_proxy.py"), "--prefill", prefill_url,
         "--decode", decode_url, "--port", str(port)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    proxy_url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            if httpx.get(f"{proxy_url}/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            if time.monotonic() > deadline or proxy.poll() is not None:
                raise
        time.sleep(0.2)
    yield proxy_url, prefill_url, decode_url, prefill
    proxy.terminate()
    proxy.wait(10)
    decode_log = _stop_server(decode)
    assert "Traceback" not in decode_log, decode_log[-5000:]
    if prefill.poll() is None:
        _stop_server(prefill)


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)


def test_the_proxy_answers_as_one_server(pd):
    proxy, prefill, decode = pd[:3]
    # The decode server alone: its own answers, under a salt so that it caches nothing the
    # disaggregated requests could hit.
    alone = _client(decode)
    reference = [
        alone.completions.create(model="tiny", prompt=p, max_tokens=12, temperature=0,
                                 extra_body={"cache_salt": "alone", "ignore_eos": True})
        for p in PROMPTS
    ]  # fmt: skip
    compiled = [_metric(u, "jaxllm:num_compilations_total") for u in (prefill, decode)]
    hits = _metric(decode, "vllm:external_prefix_cache_hits_total")
    computed = _metric(decode, "jaxllm:scheduled_tokens_total")
    client = _client(proxy)
    for p, ref in zip(PROMPTS, reference, strict=True):
        got = client.completions.create(model="tiny", prompt=p, max_tokens=12, temperature=0,
                                        extra_body={"ignore_eos": True})  # fmt: skip
        assert got.choices[0].text == ref.choices[0].text
        assert got.usage.prompt_tokens == len(p)
    pulled = sum((len(p) - 1) // PAGE * PAGE for p in PROMPTS)
    # The decoder pulled every full block of the prompts (all but one token's block of a
    # prompt of whole blocks) and computed only the tails and the decodes.
    assert _metric(decode, "vllm:external_prefix_cache_hits_total") - hits == pulled
    assert _metric(decode, "jaxllm:scheduled_tokens_total") - computed == sum(len(p) for p in PROMPTS) - pulled + len(PROMPTS) * 11  # fmt: skip
    assert _metric(decode, "jaxllm:kv_transfer_failures_total") == 0
    assert _metric(prefill, "jaxllm:kv_transfer_sent_blocks_total") >= pulled // PAGE
    assert _metric(prefill, "jaxllm:kv_transfer_held_requests") == 0

    # Streamed, and chat, through the proxy: the same text as the decode server alone.
    messages = [{"role": "user", "content": "Tell me about the sea and the ships on it, " * 4}]
    ref = alone.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0,
                                        extra_body={"cache_salt": "alone"})  # fmt: skip
    before = _metric(decode, "vllm:external_prefix_cache_hits_total")
    got = client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0)  # fmt: skip
    assert got.choices[0].message.content == ref.choices[0].message.content
    assert _metric(decode, "vllm:external_prefix_cache_hits_total") > before
    stream = client.completions.create(model="tiny", prompt=PROMPTS[2][:100], max_tokens=12,
                                       temperature=0, stream=True, extra_body={"ignore_eos": True})  # fmt: skip
    text = "".join(c.choices[0].text for c in stream if c.choices)
    direct = alone.completions.create(model="tiny", prompt=PROMPTS[2][:100], max_tokens=12, temperature=0,
                                      extra_body={"cache_salt": "alone", "ignore_eos": True})  # fmt: skip
    assert text == direct.choices[0].text
    # n > 1 through the proxy: the decode server alone serves it.
    many = client.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=4, n=2, temperature=0)  # fmt: skip
    assert len(many.choices) == 2
    # Nothing compiled after warmup on either server.
    assert [_metric(u, "jaxllm:num_compilations_total") for u in (prefill, decode)] == compiled


def test_the_prefill_response_carries_the_params(pd):
    _, prefill, decode, _ = pd
    body = {"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 1,
            "kv_transfer_params": {"do_remote_decode": True}}  # fmt: skip
    params = httpx.post(f"{prefill}/v1/completions", json=body, timeout=60).json()[
        "kv_transfer_params"
    ]
    assert params["do_remote_prefill"] is True and params["tp_size"] == 2
    assert len(params["remote_block_ids"]) == len(PROMPTS[0]) // PAGE
    assert _metric(prefill, "jaxllm:kv_transfer_held_requests") == 1
    # A plain response has none.
    plain = httpx.post(f"{decode}/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 2}, timeout=60)  # fmt: skip
    assert plain.json()["kv_transfer_params"] is None
    # Bad params: a 400 naming the field; n > 1 refused with them.
    bad = dict(params, remote_port="x")
    r = httpx.post(f"{decode}/v1/completions", json=dict(body, kv_transfer_params=bad), timeout=60)
    assert r.status_code == 400 and "remote_port" in r.json()["error"]["message"], r.text
    r = httpx.post(f"{decode}/v1/completions", json=dict(body, n=2, kv_transfer_params=params), timeout=60)  # fmt: skip
    assert r.status_code == 400 and "n must be 1" in r.json()["error"]["message"], r.text
    two = dict(body, prompt=[PROMPTS[0], PROMPTS[1]])
    r = httpx.post(f"{prefill}/v1/completions", json=two, timeout=60)
    assert r.status_code == 400 and "one prompt per request" in r.json()["error"]["message"], r.text
    # The decoder takes them (releasing the hold).
    r = httpx.post(f"{decode}/v1/completions", json=dict(body, max_tokens=4, kv_transfer_params=params), timeout=60)  # fmt: skip
    assert r.status_code == 200, r.text
    assert _metric(prefill, "jaxllm:kv_transfer_held_requests") == 0


def test_the_proxy_as_a_decode_pods_sidecar(pd):
    """llm-d's way: the proxy in front of one decode server, the prefiller named per request
    by the scheduler's x-prefiller-host-port header (none: the decoder serves alone); every
    other path is the decode server's."""
    import asyncio
    import importlib.util

    _, prefill, decode, _ = pd
    spec = importlib.util.spec_from_file_location("pd_proxy", ROOT / "scripts" / "pd_proxy.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    app = module.build_app([], [decode])
    prompt = [(13 * j) % 240 + 6 for j in range(90)]  # new to the decoder
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True}  # fmt: skip
    ref = httpx.post(f"{decode}/v1/completions", json=dict(body, cache_salt="alone3"), timeout=60).json()  # fmt: skip

    async def run():
        transport = httpx.ASGITransport(app)
        async with httpx.AsyncClient(
            transport=transport, base_url="http://sidecar", timeout=60
        ) as c:
            hits = _metric(decode, "vllm:external_prefix_cache_hits_total")
            named = {"x-prefiller-host-port": prefill.removeprefix("http://")}
            split = (await c.post("/v1/completions", json=body, headers=named)).json()
            pulled = _metric(decode, "vllm:external_prefix_cache_hits_total") - hits
            alone = (await c.post("/v1/completions", json=dict(body, cache_salt="s"))).json()
            metrics = await c.get("/metrics")
            return split, pulled, alone, metrics

    split, pulled, alone, metrics = asyncio.run(run())
    assert split["choices"][0]["text"] == alone["choices"][0]["text"] == ref["choices"][0]["text"]
    assert pulled == (len(prompt) - 1) // PAGE * PAGE
    assert metrics.status_code == 200 and "vllm:external_prefix_cache_hits_total" in metrics.text


# Last: it stops the prefill server.
def test_a_prefiller_gone_costs_the_prompt_not_the_answer(pd):
    proxy, prefill, decode, prefill_proc = pd
    alone = _client(decode)
    prompt = PROMPTS[1] + PROMPTS[0]
    ref = alone.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0,
                                   extra_body={"cache_salt": "alone2", "ignore_eos": True})  # fmt: skip
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}  # fmt: skip
    params = httpx.post(f"{prefill}/v1/completions", json=body, timeout=60).json()[
        "kv_transfer_params"
    ]
    _stop_server(prefill_proc)
    failures = _metric(decode, "jaxllm:kv_transfer_failures_total")
    # The decoder given params of a prefiller that is gone: it computes the prompt itself.
    got = alone.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0,
                                   extra_body={"kv_transfer_params": params, "ignore_eos": True})  # fmt: skip
    assert got.choices[0].text == ref.choices[0].text
    assert _metric(decode, "jaxllm:kv_transfer_failures_total") == failures + 1
    # The proxy with its prefiller down: the decoder is sent the request without params.
    got = _client(proxy).completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0,
                                            extra_body={"ignore_eos": True})  # fmt: skip
    assert got.choices[0].text == ref.choices[0].text
