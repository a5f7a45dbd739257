"""The server with an image-text model (a tiny random LLaVA; and Qwen2.5-VL, whose images
keep their size), driven with the official `openai` client: a chat with a base64 image part,
streamed and not, equal to the offline result; bad images refused with a 400 naming the part;
nothing held after."""

from __future__ import annotations

import base64
import io
import time

import httpx
import numpy as np
import openai
import pytest

from jaxllm import LLM, SamplingParams
from tests.test_server_e2e import running_server

from helpers import write_llava_checkpoint, write_qwen25_vl_checkpoint

Image = pytest.importorskip("PIL.Image")
pytest.importorskip("torch")


def data_url(image, fmt: str = "PNG") -> str:
    buf = io.BytesIO()
    image.save(buf, format=fmt)
    return f"data:image/{fmt.lower()};base64,{base64.b64encode(buf.getvalue()).decode()}"


def image(seed: int, size=(37, 29)):
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (*size, 3), dtype=np.uint8))


@pytest.fixture(scope="module")
def llava_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("llava-server")
    write_llava_checkpoint(path)
    return path


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("media")
    image(3).save(path / "local.png")
    return path


@pytest.fixture(scope="module")
def server(llava_dir, media_dir):
    flags = ("--limit-mm-per-prompt", '{"image": 2}', "--allowed-local-media-path", str(media_dir))
    with running_server(llava_dir, *flags, name="llava") as url:
        yield url


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="none", max_retries=0)


def messages(*parts):
    return [{"role": "user", "content": list(parts)}]


def text(t: str):
    return {"type": "text", "text": t}


def image_part(url: str):
    return {"type": "image_url", "image_url": {"url": url}}


def test_chat_with_images_streams_and_equals_offline(server, client, llava_dir, media_dir):
    conversation = messages(
        text("What is in "),
        image_part(data_url(image(1))),
        text(" and in "),
        image_part(f"file://{media_dir / 'local.png'}"),
        text("?"),
    )
    kwargs = dict(model="llava", messages=conversation, max_tokens=12, temperature=0)
    full = client.chat.completions.create(**kwargs)
    stream = client.chat.completions.create(**kwargs, stream=True)
    streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert full.choices[0].message.content == streamed
    assert full.usage.prompt_tokens > 2 * 16  # two images' placeholders
    offline = LLM(
        llava_dir,
        max_model_len=256,
        num_pages=32,
        max_num_batched_tokens=128,
        max_num_seqs=2,
        allowed_local_media_path=str(media_dir),
    )
    (out,) = offline.chat(
        conversation, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False
    )
    assert out.outputs[0].text == streamed
    assert len(out.prompt_token_ids) == full.usage.prompt_tokens


@pytest.mark.parametrize(
    ("content", "param", "says"),
    [
        ([image_part("data:image/png;base64,bm90IGFuIGltYWdl")], "messages.0.content.0.image_url", "corrupt"),
        ([image_part("data:image/png;base64,@@@")], "messages.0.content.0.image_url", "base64"),
        ([image_part("data:text/plain;base64,aGk=")], "messages.0.content.0.image_url", "not an image"),
        ([image_part("http://example.com/a.png")], "messages.0.content.0.image_url", "not fetched"),
        ([image_part("gopher://example.com/a.png")], "messages.0.content.0.image_url", "not supported"),
        ([image_part("file:///etc/passwd")], "messages.0.content.0.image_url", "outside"),
        ([{"type": "image_url", "image_url": {}}], "messages.0.content.0.image_url", "url"),
        ([{"type": "input_audio", "input_audio": {}}], "messages.0.content.0.type", "not supported"),
        ([{"type": "image_embeds", "image_embeds": "UEsDBA=="}], "messages.0.content.0.type", "torch-pickled"),
    ],
)  # fmt: skip
def test_bad_images_are_400s_naming_the_part(server, content, param, says):
    body = {"model": "llava", "messages": [{"role": "user", "content": content}]}
    r = httpx.post(f"{server}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param, error
    assert says in error["message"], error


def test_unsupported_format_too_many_and_too_large(server):
    buf = io.BytesIO()
    image(4).save(buf, format="TIFF")
    tiff = "data:image/tiff;base64," + base64.b64encode(buf.getvalue()).decode()
    big = data_url(Image.new("RGB", (7000, 6000)))
    small = data_url(image(5))
    cases = [
        ([image_part(tiff)], "messages.0.content.0.image_url", "format TIFF"),
        ([image_part(big)], "messages.0.content.0.image_url", "too large"),
        ([image_part(small)] * 3, "messages", "more than the 2"),
    ]
    for content, param, says in cases:
        body = {"model": "llava", "messages": [{"role": "user", "content": content}]}
        r = httpx.post(f"{server}/v1/chat/completions", json=body, timeout=120)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == param and says in error["message"], error


def test_nothing_held_after(server, client):
    """After the requests above (and an aborted stream), no KV page and no encoder cache slot
    is held."""
    stream = client.chat.completions.create(
        model="llava",
        messages=messages(image_part(data_url(image(6))), text("go on")),
        max_tokens=200,
        stream=True,
    )
    next(iter(stream))
    stream.close()
    metrics = {}
    for _ in range(100):
        lines = httpx.get(f"{server}/metrics").text.splitlines()
        metrics = {
            line.split("{")[0]: float(line.rsplit(" ", 1)[1])
            for line in lines
            if line and not line.startswith("#")
        }
        if metrics["vllm:num_requests_running"] == 0:
            break
        time.sleep(0.1)
    assert metrics["vllm:num_requests_running"] == 0
    assert metrics["vllm:kv_cache_usage_perc"] == 0
    assert metrics["jaxllm:encoder_cache_usage_perc"] == 0
    assert metrics["jaxllm:encoder_cache_queries_total"] >= 2


@pytest.fixture(scope="module")
def qwen_server(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen-vl-server")
    write_qwen25_vl_checkpoint(path)
    with running_server(path, name="qwen-vl") as url:
        yield path, url


def test_qwen_vl_images_of_several_sizes(qwen_server):
    """Qwen2.5-VL: images of three sizes in one chat (each its own number of tokens), streamed
    and not, equal to the offline result; an image of an aspect ratio its processor refuses
    is a 400 naming the part; nothing held after."""
    path, url = qwen_server
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
    conversation = messages(
        text("Compare "),
        image_part(data_url(image(1, (60, 200)))),
        image_part(data_url(image(2, (170, 90)), "JPEG")),
        text(" with "),
        image_part(data_url(image(3, (30, 30)), "WEBP")),
    )
    kwargs = dict(model="qwen-vl", messages=conversation, max_tokens=12, temperature=0)
    full = client.chat.completions.create(**kwargs)
    stream = client.chat.completions.create(**kwargs, stream=True)
    streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert full.choices[0].message.content == streamed
    offline = LLM(path, max_model_len=256, num_pages=32, max_num_batched_tokens=128, max_num_seqs=2)
    (out,) = offline.chat(
        conversation, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False
    )
    assert out.outputs[0].text == streamed
    assert len(out.prompt_token_ids) == full.usage.prompt_tokens
    image_token = offline.input_processor.images.vision.image_token_id
    assert out.prompt_token_ids.count(image_token) == 14 + 18 + 4  # 2x7, 6x3, 2x2 tokens

    thin = messages(image_part(data_url(image(4, (2, 600)))))
    r = httpx.post(
        f"{url}/v1/chat/completions", json={"model": "qwen-vl", "messages": thin}, timeout=60
    )
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "messages.0.content.0.image_url", r.text
    lines = httpx.get(f"{url}/metrics").text.splitlines()
    metrics = {
        line.split("{")[0]: float(line.rsplit(" ", 1)[1])
        for line in lines
        if line and not line.startswith("#")
    }
    assert metrics["vllm:kv_cache_usage_perc"] == 0
    assert metrics["jaxllm:encoder_cache_usage_perc"] == 0
    assert metrics["jaxllm:encoder_cache_queries_total"] >= 3  # the first request's three
