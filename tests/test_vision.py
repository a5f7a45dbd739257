"""Image-text models (LLaVA: a CLIP or SigLIP tower, the MLP projector, a Llama decoder;
Gemma 3: a SigLIP tower, the pooled projector, a Gemma 3 decoder whose image tokens attend to
each other; Qwen2.5-VL: images at their own size through a windowed tower, a Qwen2 decoder with
M-RoPE positions; Qwen2-VL, the same without windows) against Hugging Face transformers (torch, float32), on tiny random checkpoints
transformers writes: the vision encoder's output, and greedy tokens through the engine identical to
transformers' `generate` for prompts with no, one and two images, batched and alone, across
chunked prefill, prefix-cache hits and preemption; the encoder cache; the offline chat API
with image parts; refusals; and no compilation after warmup."""

from __future__ import annotations

import base64
import io

import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm import LLM, SamplingParams
from jaxllm.errors import InputError
from jaxllm.loaders.vision import load_vision_encoder, vision_config

from helpers import (
    QWEN_VL_PLACEHOLDER,
    QwenVLProcessor,
    write_gemma3_vl_checkpoint,
    write_llava_checkpoint,
    write_qwen25_vl_checkpoint,
)

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
Image = pytest.importorskip("PIL.Image")

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


def images(seed: int, n: int) -> list:
    """`n` random RGB images of different sizes (LLaVA's and Gemma's processors resize them
    to one; Qwen2.5-VL's keep them, 14 to 24 tokens, one to four windows)."""
    rng = np.random.default_rng(seed)
    return [
        Image.fromarray(rng.integers(0, 256, (60 + 50 * i, 200 - 40 * i, 3), dtype=np.uint8))
        for i in range(n)
    ]


@pytest.fixture(scope="module", params=["clip", "siglip", "gemma3", "qwen2_5_vl", "qwen2_vl"])
def llava(request, tmp_path_factory):
    """(checkpoint, transformers model, processor, the prompt's image placeholder text)."""
    path = tmp_path_factory.mktemp(f"vl-{request.param}")
    if request.param == "gemma3":
        model, placeholder = write_gemma3_vl_checkpoint(path), "<start_of_image>"
    elif request.param in ("qwen2_5_vl", "qwen2_vl"):
        version = "2.5" if request.param == "qwen2_5_vl" else "2"
        model = write_qwen25_vl_checkpoint(path, version)
        return path, model, QwenVLProcessor(path), QWEN_VL_PLACEHOLDER
    else:
        model, placeholder = write_llava_checkpoint(path, tower=request.param), "<image>"
    processor = transformers.AutoProcessor.from_pretrained(path)
    return path, model, processor, placeholder


def is_gemma(llava) -> bool:
    return llava[3] == "<start_of_image>"


def ph(llava, text: str) -> str:
    """`text` with the model's own image placeholder for "<image>"."""
    return text.replace("<image>", llava[3])


def reference(llava, text: str, imgs: list, max_tokens: int = 10) -> list[int]:
    """transformers' greedy tokens for a prompt and its images."""
    _, model, processor, _ = llava
    inputs = processor(text=[text], images=imgs or None, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=max_tokens, do_sample=False)
    return out[0, inputs["input_ids"].shape[1] :].tolist()


def prompt(text: str, imgs: list):
    return {"prompt": text, "multi_modal_data": {"image": imgs}} if imgs else text


CASES = [
    ("Describe <image> briefly.", 1),
    ("Compare <image> with <image> now", 2),
    ("A text-only prompt in the same batch.", 0),
    ("<image><image> both at the start", 2),
]


@pytest.fixture(scope="module")
def cases(llava):
    out = []
    for i, (text, n) in enumerate(CASES):
        imgs = images(10 + i, n)
        out.append((ph(llava, text), imgs, reference(llava, ph(llava, text), imgs)))
    return out


def test_vision_encoder_matches_transformers(llava, monkeypatch):
    path, model, *_ = llava
    config = vision_config(path)
    encoder = load_vision_encoder(path, config, dtype=jnp.float32)
    if config.dynamic:
        return _qwen_encoder_matches(llava, config, encoder, monkeypatch)
    pixels = np.random.default_rng(0).standard_normal((3, *config.pixel_shape))
    pixels = pixels.astype(np.float32)
    with torch.no_grad():
        ref = model.model.get_image_features(pixel_values=torch.tensor(pixels)).pooler_output
    ref = torch.stack(list(ref)).numpy() if isinstance(ref, list | tuple) else ref.numpy()
    ours = np.asarray(encoder(jnp.asarray(pixels)))
    assert ours.shape == ref.shape == (3, config.tokens_per_image, 64)
    np.testing.assert_allclose(ours, ref, atol=2e-5, rtol=1e-4)


def _qwen_encoder_matches(llava, config, encoder, monkeypatch):
    """Qwen2-VL and Qwen2.5-VL: images of several sizes (partial windows among them) packed
    into one launch as the engine packs them, each token written to its row: transformers'
    rows."""
    from jaxllm.models import qwen_vision
    from jaxllm.models.qwen_vision import pack

    _, model, processor, _ = llava
    out = processor.image_processor(images=images(0, 4), return_tensors="np")
    with torch.no_grad():
        ref = model.model.get_image_features(
            pixel_values=torch.tensor(out["pixel_values"]),
            image_grid_thw=torch.tensor(out["image_grid_thw"]),
        ).pooler_output
    ref = torch.cat(list(ref)).numpy() if isinstance(ref, list | tuple) else ref.numpy()
    pixels = config.split_pixels(out)
    assert len({p.shape[:3] for p in pixels}) == 4  # four grids
    if config.window_size:  # Qwen2.5-VL: more than one window
        assert max(p.shape[1] for p in pixels) > config.window_units
    total = sum(int(np.prod(p.shape[:3])) for p in pixels)
    rows = np.cumsum([0] + [int(np.prod(p.shape[:3])) for p in pixels])
    spans = zip(pixels, rows[:-1], rows[1:], strict=True)
    items = [(p, np.arange(a, b, dtype=np.int32)) for p, a, b in spans]
    batch = pack(config, items, 512, total)
    real = batch.rows < total
    assert sorted(batch.rows[real]) == list(range(total))  # each row written once
    # One chunk of queries, then chunks of 32 (windowed layers' keys a band around them).
    for chunk in (qwen_vision.QUERY_CHUNK, 32):
        monkeypatch.setattr(qwen_vision, "QUERY_CHUNK", chunk)
        embeds = np.asarray(encoder(*map(jnp.asarray, batch.args()[1:])))
        ours = np.zeros((total, embeds.shape[1]), np.float32)
        ours[batch.rows[real]] = embeds[real]
        assert ours.shape == ref.shape == (total, 64)
        np.testing.assert_allclose(ours, ref, atol=2e-5, rtol=1e-4)


def test_greedy_matches_transformers_batched_and_alone(llava, cases):
    """The prompts together (text-only among them), then each alone: the same tokens as
    transformers'; the repeated run is served from the prefix cache and the encoder cache,
    and nothing compiles after warmup."""
    path = llava[0]
    llm = LLM(
        path,
        max_model_len=256,
        max_num_seqs=4,
        max_num_batched_tokens=64,
        num_pages=64,
        encoder_cache_size=256,  # every image stays cached
    )
    compiled = llm.runner.num_compilations
    outs = llm.generate([prompt(t, imgs) for t, imgs, _ in cases], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [ref for *_, ref in cases]
    cache = llm.engine.scheduler.encoder_cache
    encoded = cache.misses
    assert encoded == sum(n for _, n in CASES)
    for t, imgs, ref in cases:
        (out,) = llm.generate([prompt(t, imgs)], GREEDY, use_tqdm=False)
        assert out.outputs[0].token_ids == ref, t
    assert cache.misses == encoded  # every image again from the encoder cache
    stats = llm.engine.stats()
    assert stats.prefix_cache_hits > 0
    assert llm.runner.num_compilations == compiled
    assert cache.num_held == 0
    llm.kv_cache_manager.check_invariants()
    cache.check_invariants()


def test_token_id_prompts_with_images(llava, cases):
    """`prompt_token_ids` with `multi_modal_data`: each image's placeholders expanded already,
    or (LLaVA, Qwen2.5-VL) as one image token, the same tokens as the text prompt."""
    path, _, processor, placeholder = llava
    llm = LLM(path, max_model_len=256, max_num_seqs=4, max_num_batched_tokens=64, num_pages=64)
    text, imgs, ref = cases[1]
    expanded = processor(text=[text], images=imgs, return_tensors="np")["input_ids"][0].tolist()
    prompts = [{"prompt_token_ids": expanded, "multi_modal_data": {"image": imgs}}]
    if not is_gemma(llava):  # one image token an image, expanded by the engine
        lone = processor.tokenizer.encode(text, add_special_tokens=True)
        prompts.append({"prompt_token_ids": lone, "multi_modal_data": {"image": imgs}})
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert all(o.prompt_token_ids == expanded for o in outs)
    assert [o.outputs[0].token_ids for o in outs] == [ref] * len(prompts)


def test_chunked_prefill_across_images_and_preemption(llava, cases):
    """Chunks of 24 tokens cut through the 16-placeholder images, and a KV pool so small that
    requests are preempted and recomputed (their images again): the same tokens."""
    path = llava[0]
    llm = LLM(
        path,
        max_model_len=64 if is_gemma(llava) else 128,
        max_num_seqs=4,
        max_num_batched_tokens=24,
        num_pages=8 if is_gemma(llava) else 12,  # Gemma 3: two layer groups share it
        enable_prefix_caching=False,
    )
    compiled = llm.runner.num_compilations
    sp = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    outs = llm.generate([prompt(t, imgs) for t, imgs, _ in cases], sp, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [ref for *_, ref in cases]
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.runner.num_compilations == compiled
    assert llm.engine.scheduler.encoder_cache.num_held == 0


def test_prefix_cache_never_serves_another_images_blocks(llava):
    """The same text with another image after a cached run: its tokens are that image's
    (transformers' for it), and the prefix cache hits only the blocks before the image."""
    path = llava[0]
    text = "The same words before and after " * 2 + ph(
        llava, "<image> and the same words after it."
    )
    first, second = images(1, 1), images(2, 1)
    llm = LLM(path, max_model_len=256, max_num_seqs=2, max_num_batched_tokens=64, num_pages=64)
    (a,) = llm.generate([prompt(text, first)], GREEDY, use_tqdm=False)
    hits = llm.engine.stats().prefix_cache_hits
    (b,) = llm.generate([prompt(text, second)], GREEDY, use_tqdm=False)
    assert a.outputs[0].token_ids == reference(llava, text, first)
    assert b.outputs[0].token_ids == reference(llava, text, second)
    image_at = b.prompt_token_ids.index(llm.input_processor.images.vision.image_token_id)
    page = llm.kv_cache_manager.page_size
    assert llm.engine.stats().prefix_cache_hits - hits == image_at // page * page


def test_same_image_in_one_batch_is_encoded_once(llava):
    path = llava[0]
    img = images(3, 1)
    llm = LLM(path, max_model_len=256, max_num_seqs=4, max_num_batched_tokens=128, num_pages=64)
    prompts = [prompt(ph(llava, f"Request {i}: <image> what?"), img) for i in range(3)]
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert llm.engine.scheduler.encoder_cache.misses == 1
    for p, o in zip(prompts, outs, strict=True):
        assert o.outputs[0].token_ids == reference(llava, p["prompt"], img)


def data_url(image, fmt: str = "PNG") -> str:
    buf = io.BytesIO()
    image.save(buf, format=fmt)
    return f"data:image/{fmt.lower()};base64,{base64.b64encode(buf.getvalue()).decode()}"


def test_chat_with_image_parts(llava, tmp_path):
    """`LLM.chat` with image_url (data: and file:// URLs) and image_pil parts: the tokens of
    the prompt the template renders, with the images, in transformers."""
    path = llava[0]
    imgs = images(4, 3)
    imgs[2].save(tmp_path / "local.png")
    llm = LLM(
        path,
        max_model_len=256,
        max_num_seqs=2,
        max_num_batched_tokens=128,
        num_pages=64,
        allowed_local_media_path=str(tmp_path),
    )
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "What differs between "},
                {"type": "image_url", "image_url": {"url": data_url(imgs[0], "JPEG")}},
                {"type": "image_pil", "image_pil": imgs[1]},
                {"type": "text", "text": " and "},
                {"type": "image_url", "image_url": {"url": f"file://{tmp_path / 'local.png'}"}},
            ],
        }
    ]
    (out,) = llm.chat(messages, GREEDY, use_tqdm=False)
    text = ph(
        llava, "<|im_start|>user\nWhat differs between <image><image> and <image><|im_end|>\n"
    )
    text += "<|im_start|>assistant\n"
    decoded = [Image.open(io.BytesIO(base64.b64decode(data_url(imgs[0], "JPEG")[23:])))]
    expected = reference(llava, text, [decoded[0].convert("RGB"), imgs[1], imgs[2]])
    assert out.outputs[0].token_ids == expected


def test_refusals_name_the_parameter(llava, tmp_path):
    if llava[3] != "<image>":
        pytest.skip("the front end's refusals do not depend on the model: LLaVA's placeholder")
    path = llava[0]
    llm = LLM(
        path,
        max_model_len=256,
        max_num_seqs=2,
        max_num_batched_tokens=64,
        num_pages=32,
        limit_mm_per_prompt={"image": 2},
    )
    img = images(5, 1)[0]

    def refused(p, param: str, *, chat: bool = False):
        with pytest.raises(InputError) as e:
            if chat:
                llm.chat([{"role": "user", "content": p}], GREEDY, use_tqdm=False)
            else:
                llm.generate([p], GREEDY, use_tqdm=False)
        assert e.value.param == param, (e.value.param, str(e.value))
        return str(e.value)

    three = prompt("<image><image><image>", [img] * 3)
    assert "more than the 2" in refused(three, "multi_modal_data")
    # The processor counts placeholders against images (LLaVA's does; ours checks again).
    message = refused(prompt("one <image>", [img, img]), "multi_modal_data")
    assert "1 <image> tokens and 2 images" in message or "1 image(s) but 2" in message
    assert "no image" in refused("a lone <image> token", "prompt")
    assert "must be a dict" in refused(
        {"prompt": "x", "multi_modal_data": {"video": [img]}}, "multi_modal_data"
    )

    def part(url: str):
        return [{"type": "image_url", "image_url": {"url": url}}]

    at = "messages.0.content.0.image_url"
    assert "corrupt" in refused(part("data:image/png;base64,aGVsbG8="), at, chat=True)
    assert "not valid base64" in refused(part("data:image/png;base64,%%%"), at, chat=True)
    buf = io.BytesIO()
    img.save(buf, format="TIFF")
    tiff = "data:image/tiff;base64," + base64.b64encode(buf.getvalue()).decode()
    assert "not supported" in refused(part(tiff), at, chat=True)
    assert "not fetched" in refused(part("https://example.com/cat.png"), at, chat=True)
    assert "not supported" in refused(part("ftp://example.com/cat.png"), at, chat=True)
    img.save(tmp_path / "cat.png")
    assert "not allowed" in refused(part(f"file://{tmp_path / 'cat.png'}"), at, chat=True)
    big = Image.new("RGB", (8000, 6000))
    assert "too large" in refused({"prompt": "<image>", "multi_modal_data": {"image": big}},
                                  "multi_modal_data")  # fmt: skip
    # Nothing of them reached the engine, which still serves.
    (out,) = llm.generate([prompt("fine <image>", [img])], GREEDY, use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 10
    assert llm.engine.scheduler.encoder_cache.num_held == 0


def test_text_model_refuses_images(tiny_llm):
    img = images(6, 1)
    with pytest.raises(InputError) as e:
        tiny_llm.generate([prompt("hi", img)], GREEDY, use_tqdm=False)
    assert e.value.param == "multi_modal_data"
    with pytest.raises(InputError) as e:
        tiny_llm.chat(
            [{"role": "user", "content": [{"type": "image_pil", "image_pil": img[0]}]}],
            GREEDY,
            use_tqdm=False,
        )
    assert e.value.param == "messages.0.content.0.image_pil"


def test_random_workload_compiles_nothing_after_warmup(llava):
    """Random prompts with 0-3 images (some repeated), random lengths and sampling, with a
    small batch budget: every program was compiled at warmup, and nothing is held after."""
    path = llava[0]
    llm = LLM(path, max_model_len=192, max_num_seqs=4, max_num_batched_tokens=32, num_pages=40)
    compiled = llm.runner.num_compilations
    rng = np.random.default_rng(7)
    pool = images(8, 4)
    words = "alpha beta gamma delta epsilon zeta eta theta".split()
    prompts, params = [], []
    for i in range(12):
        n = int(rng.integers(0, 4))
        parts = [" ".join(rng.choice(words, int(rng.integers(1, 12))))]
        for _ in range(n):
            parts += [llava[3], " ".join(rng.choice(words, int(rng.integers(0, 5))))]
        imgs = [pool[int(k)] for k in rng.integers(0, len(pool), n)]
        prompts.append(prompt(" ".join(parts), imgs))
        params.append(
            SamplingParams(temperature=float(rng.choice([0, 0.8])), max_tokens=int(rng.integers(1, 20)), seed=i)
        )  # fmt: skip
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) >= 1 for o in outs)
    assert llm.runner.num_compilations == compiled
    assert llm.engine.scheduler.encoder_cache.num_held == 0
    assert not llm.engine.has_unfinished_requests()
    llm.kv_cache_manager.check_invariants()


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_frees_the_vision_side_and_wakes_the_same(llava, cases, level):
    """Sleep mode frees the encoder's weights and cache with the decoder's (level 2 reloads
    them from the checkpoint); awake, the tokens are the same and nothing compiles."""
    path = llava[0]
    llm = LLM(path, max_model_len=256, max_num_seqs=4, max_num_batched_tokens=64, num_pages=64)
    compiled = llm.runner.num_compilations
    text, imgs, ref = cases[1]
    (out,) = llm.generate([prompt(text, imgs)], GREEDY, use_tqdm=False)
    assert out.outputs[0].token_ids == ref
    encoder = llm.runner.mm
    weights = list(encoder.params)
    llm.sleep(level)
    assert all(w.is_deleted() for w in weights) and encoder.pool is None
    llm.wake_up()
    (out,) = llm.generate([prompt(text, imgs)], GREEDY, use_tqdm=False)
    assert out.outputs[0].token_ids == ref
    assert llm.engine.scheduler.encoder_cache.misses == 2 * len(imgs)  # encoded again
    assert llm.runner.num_compilations == compiled


_TP_SCRIPT = """
import json, sys
sys.path.insert(0, "tests")
import jax
from jaxllm import LLM, SamplingParams
from test_vision import CASES, images, prompt
path, tp, placeholder = sys.argv[1], int(sys.argv[2]), sys.argv[3]
llm = LLM(path, max_model_len=256, max_num_seqs=4, max_num_batched_tokens=64, num_pages=64,
          tensor_parallel_size=tp)
compiled = llm.runner.num_compilations
prompts = [prompt(t.replace("<image>", placeholder), images(10 + i, n))
           for i, (t, n) in enumerate(CASES)]
outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
                    use_tqdm=False)
print(json.dumps({
    "tokens": [o.outputs[0].token_ids for o in outs],
    "compiled_after_warmup": llm.runner.num_compilations - compiled,
    "vision_shards": [len(p.sharding.device_set) for p in llm.runner.mm.params],
    "split": sum(p.sharding.shard_shape(p.shape) != p.shape for p in llm.runner.mm.params),
}))
"""


@pytest.mark.parametrize("tp", [2, 4])
def test_tensor_parallel_same_tokens(llava, cases, tp):
    """Under tensor parallelism (fake CPU devices, in a subprocess) the vision tower's weights
    are split over the devices and the tokens are transformers'."""
    import json
    import os
    import subprocess
    import sys

    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4"}
    proc = subprocess.run(
        [sys.executable, "-c", _TP_SCRIPT, str(llava[0]), str(tp), llava[3]],
        capture_output=True, text=True, timeout=900, env=env,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["tokens"] == [ref for *_, ref in cases]
    assert report["compiled_after_warmup"] == 0
    assert set(report["vision_shards"]) == {tp}
    assert report["split"] > 0  # the attention and MLP weights, split on heads or width


@pytest.fixture
def image_host():
    """A local HTTP server: /cat.png an image, /slow.png the same after 1 s, /moved a
    redirect to it, anything else a 404."""
    import http.server
    import threading
    import time as _time

    buf = io.BytesIO()
    images(9, 1)[0].save(buf, format="PNG")
    body = buf.getvalue()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (the stdlib's name)
            if self.path == "/moved":
                self.send_response(302)
                self.send_header("Location", "/cat.png")
                self.end_headers()
                return
            if self.path not in ("/cat.png", "/slow.png"):
                self.send_error(404)
                return
            if self.path == "/slow.png":
                _time.sleep(1.0)
            try:
                self.send_response(200)
                self.send_header("Content-Type", "image/png")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
            except (BrokenPipeError, ConnectionResetError):
                pass  # the client gave up (the slow and oversized cases)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}", body
    server.shutdown()


def test_http_image_urls_from_allowed_hosts(llava, image_host, monkeypatch):
    """An http URL on an allowed host is fetched (the same tokens as the image itself); other
    hosts, redirects, errors, oversized and slow downloads are refused naming the part."""
    from jaxllm.multimodal import media

    url, body = image_host
    path = llava[0]
    llm = LLM(
        path,
        max_model_len=256,
        max_num_seqs=2,
        max_num_batched_tokens=64,
        num_pages=32,
        allowed_media_domains=("127.0.0.1",),
    )
    img = Image.open(io.BytesIO(body)).convert("RGB")

    def chat(image_url: str):
        parts = [{"type": "image_url", "image_url": {"url": image_url}}]
        return llm.chat([{"role": "user", "content": parts}], GREEDY, use_tqdm=False)

    (out,) = chat(f"{url}/cat.png")
    text = ph(llava, "<|im_start|>user\n<image><|im_end|>\n<|im_start|>assistant\n")
    assert out.outputs[0].token_ids == reference(llava, text, [img])
    at = "messages.0.content.0.image_url"
    monkeypatch.setattr(media, "FETCH_TIMEOUT_S", 0.3)
    for bad, says in [
        ("http://localhost:1/cat.png", "not in --allowed-media-domains"),
        (f"{url}/moved", "HTTP 302"),
        (f"{url}/missing.png", "HTTP 404"),
        (f"{url}/slow.png", "longer than 0.3 s"),
    ]:
        with pytest.raises(InputError) as e:
            chat(bad)
        assert e.value.param == at and says in str(e.value), (bad, str(e.value))
    monkeypatch.setattr(media, "MAX_IMAGE_BYTES", len(body) - 1)
    with pytest.raises(InputError) as e:
        chat(f"{url}/cat.png")
    assert "larger than" in str(e.value)


def test_encoder_cache_is_sized_alike_for_serve_and_compile(tmp_path):
    """`EncoderCache.for_model` (both `serve` and `jaxllm compile` call it): blocks and budget
    from the flags, and a Gemma 3 image that a step cannot hold is refused; Qwen2.5-VL's
    budget and cache hold its largest image."""
    from jaxllm.config import EngineConfig
    from jaxllm.engine.encoder_cache import EncoderCache
    from jaxllm.models.vision import VisionConfig

    vision = {"model_type": "siglip_vision_model", "hidden_size": 32, "intermediate_size": 48,
              "num_hidden_layers": 2, "num_attention_heads": 4, "image_size": 64,
              "patch_size": 8}  # fmt: skip
    gemma = VisionConfig.from_hf_config({
        "architectures": ["Gemma3ForConditionalGeneration"], "mm_tokens_per_image": 16,
        "vision_config": vision, "text_config": {"hidden_size": 64},
    })  # fmt: skip
    assert gemma.bidirectional and gemma.tokens_per_image == 16
    config = EngineConfig.create(tmp_path, max_num_batched_tokens=8, max_num_seqs=2)
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        EncoderCache.for_model(gemma, config)
    config = EngineConfig.create(
        tmp_path, max_num_batched_tokens=40, max_num_seqs=2, encoder_cache_size=64
    )
    cache = EncoderCache.for_model(gemma, config)
    assert (cache.num_blocks, cache.block_tokens, cache.budget, cache.whole) == (4, 16, 40, True)
    qwen = vision_config(write_qwen_config(tmp_path / "qwen"))
    assert qwen.dynamic and qwen.max_tokens_per_image == 1280
    cache = EncoderCache.for_model(qwen, config)  # budget and cache raised to one image
    assert (cache.num_blocks, cache.block_tokens, cache.budget, cache.whole) == (
        80,
        16,
        1280,
        False,
    )
    small = EngineConfig.create(tmp_path, max_num_batched_tokens=2048, encoder_cache_size=4000)
    cache = EncoderCache.for_model(qwen, small)
    assert (cache.num_blocks, cache.budget) == (250, 2048)


def write_qwen_config(path):
    """A Qwen2.5-VL-7B-shaped config.json and preprocessor_config.json (max_pixels as vLLM's
    examples set it, 1280 tokens), no weights."""
    import json

    path.mkdir()
    (path / "config.json").write_text(json.dumps({
        "architectures": ["Qwen2_5_VLForConditionalGeneration"], "model_type": "qwen2_5_vl",
        "hidden_size": 3584, "image_token_id": 151655,
        "vision_config": {"depth": 32, "hidden_size": 1280, "intermediate_size": 3420,
                          "num_heads": 16, "out_hidden_size": 3584},
    }))  # fmt: skip
    (path / "preprocessor_config.json").write_text(
        json.dumps({"min_pixels": 3136, "max_pixels": 28 * 28 * 1280})
    )
    return path


def test_image_embeds_instead_of_images(llava, cases):
    """`{"image": {"image_embeds": ...}}` (with `enable_mm_embeds`; Qwen's with
    `image_grid_thw`): the embeddings transformers' vision side makes of the images give the
    images' tokens, from text and token-id prompts; written to the encoder cache by the store
    programs compiled at warmup, the tower never run. Bad embeddings are refused naming them."""
    path, model, processor, placeholder = llava
    text, imgs, ref = cases[1]  # two images
    out = processor.image_processor(images=imgs, return_tensors="np")
    kwargs = {"pixel_values": torch.tensor(np.asarray(out["pixel_values"]))}
    if "image_grid_thw" in out:
        kwargs["image_grid_thw"] = torch.tensor(out["image_grid_thw"])
    with torch.no_grad():
        features = model.model.get_image_features(**kwargs).pooler_output
    embeds = torch.cat(list(features)) if "image_grid_thw" in out else torch.stack(list(features))
    data = {"image_embeds": embeds.numpy()}
    if "image_grid_thw" in out:
        data["image_grid_thw"] = out["image_grid_thw"].tolist()
    llm = LLM(
        path,
        max_model_len=256,
        max_num_seqs=4,
        max_num_batched_tokens=64,
        num_pages=64,
        enable_mm_embeds=True,
    )
    compiled = llm.runner.num_compilations
    assert {p.name for p in llm.runner.programs} >= {"encode_images", "store_image_embeds"}
    prompts = [{"prompt": text, "multi_modal_data": {"image": data}}]
    if not is_gemma(llava):  # one image token an image, expanded by the engine
        lone = processor.tokenizer.encode(text, add_special_tokens=True)
        prompts.append({"prompt_token_ids": lone, "multi_modal_data": {"image": data}})
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [ref] * len(prompts)
    assert llm.runner.num_compilations == compiled
    assert llm.engine.scheduler.encoder_cache.num_held == 0

    at = "multi_modal_data.image.image_embeds"
    bad = [
        ({"image_embeds": embeds.numpy()[..., :-1]}, at, "shape"),
        ({"image_embeds": np.full_like(embeds.numpy(), np.nan)}, at, "not finite"),
        ({"image_embeds": "abc"}, at, "not an array"),
        ({"image_embeds": embeds.numpy(), "pixel_values": 1}, "multi_modal_data", "unknown"),
    ]
    if "image_grid_thw" in out:
        bad.append(({"image_embeds": embeds.numpy()}, at.replace("embeds", "grid_thw"), "grids"))
    for data, param, says in bad:
        with pytest.raises(InputError) as e:
            llm.generate([{"prompt": text, "multi_modal_data": {"image": data}}], GREEDY)
        assert e.value.param == param and says in str(e.value), (param, str(e.value))
    plain = LLM(path, max_model_len=256, max_num_seqs=2, max_num_batched_tokens=64, num_pages=32)
    assert "store_image_embeds" not in {p.name for p in plain.runner.programs}
    with pytest.raises(InputError, match="enable_mm_embeds"):
        plain.generate([{"prompt": text, "multi_modal_data": {"image": {"image_embeds": [1]}}}])


def test_mm_processor_kwargs_bound_qwen_images(llava):
    """`mm_processor_kwargs={"max_pixels": ...}` shrinks Qwen2.5-VL's images to at most 8
    tokens, in the front end and the engine alike: transformers' tokens with the same
    processor settings, and an encoder budget of 8 tokens a step is enough."""
    path, model, _, placeholder = llava
    if placeholder != QWEN_VL_PLACEHOLDER:
        pytest.skip("max_pixels is Qwen2.5-VL's processor's")
    kwargs = {"max_pixels": 28 * 28 * 8}
    llm = LLM(
        path,
        max_model_len=256,
        max_num_seqs=2,
        max_num_batched_tokens=64,
        num_pages=32,
        mm_processor_kwargs=kwargs,
        max_num_encoder_input_tokens=8,
    )
    assert llm.engine.vision.max_tokens_per_image == 8
    assert llm.engine.scheduler.encoder_cache.budget == 8
    text, imgs = ph(llava, "Two: <image> and <image>."), images(20, 2)
    (out,) = llm.generate([prompt(text, imgs)], GREEDY, use_tqdm=False)
    image_token = llm.input_processor.images.vision.image_token_id
    assert 2 < out.prompt_token_ids.count(image_token) <= 16
    small = (path, model, QwenVLProcessor(path, **kwargs), placeholder)
    assert out.outputs[0].token_ids == reference(small, text, imgs)
    # A thin image's short side rounds up to a token: past the bound, refused by name.
    thin = Image.new("RGB", (19900, 100))
    with pytest.raises(InputError, match="at most 8") as e:
        llm.generate([prompt(ph(llava, "<image>"), [thin])], GREEDY, use_tqdm=False)
    assert e.value.param == "multi_modal_data"


def test_mrope_positions_as_transformers_computes_them():
    """transformers' `get_rope_index` on [a, b, <vision_start>, 6 image tokens (a 1 x 2 x 3
    grid), <vision_end>, c]; and a prompt without images is plain positions."""
    from jaxllm.worker.mrope import mrope_positions

    positions, delta = mrope_positions(11, [(3, 1, 2, 3)])
    assert positions.tolist() == [
        [0, 1, 2, 3, 3, 3, 3, 3, 3, 6, 7],
        [0, 1, 2, 3, 3, 3, 4, 4, 4, 6, 7],
        [0, 1, 2, 3, 4, 5, 3, 4, 5, 6, 7],
    ]
    assert delta == -3
    positions, delta = mrope_positions(5, [])
    assert positions.tolist() == [list(range(5))] * 3 and delta == 0
    # Two adjacent images, the prompt ending in the second (from 3, 2 x 2): the next token
    # at 3 + max(2, 2) = 5, index 7.
    positions, delta = mrope_positions(7, [(1, 1, 1, 2), (3, 1, 2, 2)])
    assert positions[:, -1].tolist() == [3, 4, 4] and 7 + delta == 5


def test_encoder_cache_blocks_for_images_of_any_size():
    """Images of 1 to 5 blocks in a cache of 8: `cut` predicts exactly what `take` can do
    (the same evictions), blocks are never shared or lost, and a step never evicts an image
    it reads or writes."""
    import types

    from jaxllm.engine.encoder_cache import EncoderCache
    from jaxllm.worker import MultiModalItem

    rng = np.random.default_rng(0)
    cache = EncoderCache(8, 4, 40, max_item_tokens=20)
    pool = [
        MultiModalItem.of(np.full((1, 1, n, 8), k, np.float32), 0, n)
        for k, n in enumerate([3, 4, 9, 16, 20, 5, 13])
    ]
    live = {}
    for step in range(300):
        for rid in list(live):
            if rng.random() < 0.3:
                cache.free(live.pop(rid))
        if len(live) < 3:
            picks = rng.choice(len(pool), int(rng.integers(1, 4)), replace=False)
            at, items = 0, []
            for k in picks:
                at += int(rng.integers(0, 3))
                items.append(MultiModalItem(pool[k].hash, at, pool[k].length, pool[k].values))
                at += pool[k].length
            live[f"r{step}"] = types.SimpleNamespace(request_id=f"r{step}", mm_items=items)
        for request in live.values():
            end = request.mm_items[-1].offset + request.mm_items[-1].length
            start = int(rng.integers(0, end))
            n = cache.cut(request, start, end - start)
            spans = cache.take(request, start, n)
            for _, length, blocks in spans:
                assert len(blocks) == -(-length // 4)
        inputs = cache.take_step()
        assert sum(len(i.blocks) for i in inputs) <= 8
        cache.check_invariants()
    for request in live.values():
        cache.free(request)
    assert cache.num_held == 0 and cache.num_held_blocks == 0
