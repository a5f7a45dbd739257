"""Multi-LoRA serving: PEFT adapters made with `peft` on tiny random Llama and Qwen3 models
(ranks 4, 8 and 16, different targets, rsLoRA) against transformers + peft, greedy: each
adapter alone, three adapters and the base model in one batch, chunked prefill, no prefix-cache
hit across adapters, adapters swapped through fewer device slots with nothing compiled after
warmup, and bad adapters refused by name."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxllm import LLM, LoRARequest, SamplingParams
from tests.helpers import VOCAB, write_family_checkpoint
from tests.test_fuzz import ANYTHING, FUZZ_SETTINGS, TEXT, _field, body_bytes

torch = pytest.importorskip("torch")
peft = pytest.importorskip("peft")

MAX_TOKENS = 8
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]
# name: (rank, alpha, targets, rsLoRA)
ADAPTERS = {
    "r4-attn": (4, 8, ATTENTION, False),
    "r8-all": (8, 16, ATTENTION + MLP, False),
    "r16-mlp-rs": (16, 8, MLP + ["q_proj"], True),
}


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, VOCAB, size=int(k)).tolist() for k in rng.integers(5, 40, size=n)]


@pytest.fixture(scope="module", params=["llama3.1-rope", "qwen3"])
def family(request, tmp_path_factory):
    """A tiny base model, three adapters on it, and transformers + peft's greedy tokens for
    each prompt under each adapter and under none."""
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp(request.param)
    base_dir = root / "base"
    write_family_checkpoint(request.param, base_dir)
    prompts = _prompts(6)
    expected: dict[str | None, list[list[int]]] = {}
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()
    expected[None] = _hf_greedy(base, prompts)
    for i, (name, (rank, alpha, targets, rs)) in enumerate(ADAPTERS.items()):
        torch.manual_seed(10 + i)
        config = peft.LoraConfig(
            r=rank,
            lora_alpha=alpha,
            target_modules=targets,
            use_rslora=rs,
            lora_dropout=0.0,
            init_lora_weights=False,  # random A and B: an adapter that changes the tokens
        )
        model = peft.get_peft_model(
            AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32), config
        ).eval()
        with torch.no_grad():
            for n, p in model.named_parameters():
                if "lora_" in n:
                    p.copy_(torch.randn_like(p) * 0.2)
        model.save_pretrained(root / name)
        expected[name] = _hf_greedy(model, prompts)
    loras = {name: LoRARequest(name, i + 1, str(root / name)) for i, name in enumerate(ADAPTERS)}
    assert len({tuple(map(tuple, v)) for v in expected.values()}) == len(expected), (
        "each adapter should change the greedy tokens"
    )
    return base_dir, prompts, loras, expected


def _hf_greedy(model, prompts: list[list[int]]) -> list[list[int]]:
    out = []
    with torch.no_grad():
        for ids in prompts:
            x = torch.tensor([ids])
            gen = model.generate(
                input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=MAX_TOKENS,
                do_sample=False, pad_token_id=0,
            )  # fmt: skip
            out.append(gen[0, len(ids) :].tolist())
    return out


def _llm(base_dir, **kwargs) -> LLM:
    kwargs = dict(max_model_len=128, num_pages=64, max_num_seqs=8, max_num_batched_tokens=64) | (
        kwargs
    )
    return LLM(base_dir, enable_lora=True, max_lora_rank=16, **kwargs)


def _tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def test_each_adapter_alone_and_all_mixed_in_one_batch(family):
    base_dir, prompts, loras, expected = family
    llm = _llm(base_dir, max_loras=3)
    before = llm.runner.num_compilations
    for name, lora in loras.items():
        got = _tokens(llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY,
                                   lora_request=lora, use_tqdm=False))  # fmt: skip
        assert got == expected[name], name
    assert _tokens(llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY,
                                use_tqdm=False)) == expected[None]  # fmt: skip
    # One batch: every prompt under each adapter and under none, interleaved.
    names = [None, *loras]
    batch = [(p, names[(i + j) % 4]) for i, p in enumerate(prompts) for j in range(4)]
    _check_batch(llm, family, batch)
    assert llm.runner.num_compilations == before, "compiled after warmup"


def _check_batch(llm, family, batch: list[tuple[list[int], str | None]]) -> None:
    """One `generate` of (prompt, adapter name or None) pairs: each as transformers + peft."""
    _, prompts, loras, expected = family
    outs = llm.generate(
        [{"prompt_token_ids": p} for p, _ in batch],
        GREEDY,
        lora_request=[None if n is None else loras[n] for _, n in batch],
        use_tqdm=False,
    )
    for (p, name), got in zip(batch, _tokens(outs), strict=True):
        assert got == expected[name][prompts.index(p)], name


def test_chunked_prefill_and_no_prefix_hit_across_adapters(family):
    """Prompts longer than the step's 16 tokens go in chunks; the same prompt under two
    adapters and none is computed three times (a block cached under one serves only it), and
    again under the first adapter it hits."""
    base_dir, prompts, loras, expected = family
    llm = _llm(base_dir, max_loras=2, max_num_batched_tokens=16, page_size=4)
    kv = llm.kv_cache_manager
    longest = max(prompts, key=len)
    i = prompts.index(longest)
    a, b = list(loras)[:2]
    for name in (a, b, None):
        lora = None if name is None else loras[name]
        hits = kv.prefix_cache_hits
        out = llm.generate({"prompt_token_ids": longest}, GREEDY, lora_request=lora,
                           use_tqdm=False)  # fmt: skip
        assert _tokens(out)[0] == expected[name][i], name
        assert kv.prefix_cache_hits == hits, f"{name}: a prefix computed under another adapter"
    hits = kv.prefix_cache_hits
    out = llm.generate({"prompt_token_ids": longest}, GREEDY, lora_request=loras[a],
                       use_tqdm=False)  # fmt: skip
    assert _tokens(out)[0] == expected[a][i] and kv.prefix_cache_hits > hits


@pytest.mark.parametrize("num_pages", [64, 6], ids=["roomy", "preempting"])
def test_more_adapters_than_slots_take_turns(family, num_pages):
    """Three adapters through one device slot: requests of the others wait, each batch holds
    one adapter (and the base model), every answer is right, and swapping compiles nothing;
    with a pool of 6 pages of 16 tokens (96: one longest request), requests are preempted
    and resume with their adapter."""
    base_dir, prompts, loras, _ = family
    llm = _llm(base_dir, max_loras=1, max_cpu_loras=1, num_pages=num_pages, max_model_len=96)
    before = llm.runner.num_compilations
    _check_batch(llm, family, [(p, name) for p in prompts[:3] for name in (*loras, None)])
    assert llm.runner.num_compilations == before
    assert (llm.engine.scheduler.num_preemptions > 0) == (num_pages == 6)


def _write_adapter(path, config: dict, tensors: dict[str, np.ndarray]):
    from safetensors.numpy import save_file

    path.mkdir(parents=True, exist_ok=True)
    (path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", **config}))
    save_file(tensors, str(path / "adapter_model.safetensors"))
    return path


@pytest.mark.parametrize(
    "config,tensors,message",
    [
        ({"r": 32}, {"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight":
                     np.zeros((32, 64), np.float32)}, "rank 32 is over max_lora_rank"),
        ({"r": 4}, {"base_model.model.model.embed_tokens.lora_A.weight":
                    np.zeros((4, VOCAB), np.float32)}, "embeddings or the head"),
        ({"r": 4, "modules_to_save": ["lm_head"]}, {}, "modules_to_save"),
        ({"r": 4}, {"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight":
                    np.zeros((4, 32), np.float32),
                    "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight":
                    np.zeros((96, 4), np.float32)}, "another model"),
        ({"r": 4}, {"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight":
                    np.zeros((4, 64), np.float32)}, "lacks lora_A or lora_B"),
    ],
    ids=["rank", "embeddings", "modules-to-save", "shapes", "half"],
)  # fmt: skip
def test_bad_adapters_fail_their_request_by_name(family, tmp_path, config, tensors, message):
    base_dir, prompts, loras, expected = family
    path = _write_adapter(tmp_path / "bad", config, tensors or {"x": np.zeros(1, np.float32)})
    llm = _llm(base_dir, max_loras=1)
    with pytest.raises(ValueError, match=message):
        llm.engine.add_request(_request(prompts[0], LoRARequest("bad", 9, str(path))))
    out = llm.generate({"prompt_token_ids": prompts[0]}, GREEDY, lora_request=next(
        iter(loras.values())), use_tqdm=False)  # fmt: skip
    assert _tokens(out)[0] == expected[next(iter(loras))][0]


def test_lora_needs_enable_lora(family):
    base_dir, prompts, loras, _ = family
    llm = LLM(base_dir, max_model_len=128, num_pages=32, skip_warmup=True)
    with pytest.raises(ValueError, match="enable_lora"):
        llm.engine.add_request(_request(prompts[0], next(iter(loras.values()))))


def _request(prompt, lora):
    from jaxllm.engine.request import Request

    return Request("r", prompt, GREEDY, eos_token_ids=(), max_tokens=4, seed=0, lora=lora)


@pytest.fixture(scope="module")
def lora_server(family):
    """`jaxllm serve --enable-lora` on the family's base model with its first adapter named
    by --lora-modules and runtime updating on (one family: the server is the same code)."""
    from tests.test_server_e2e import running_server

    base_dir, _, loras, _ = family
    if "qwen3" in str(base_dir):
        pytest.skip("the server is checked on the Llama family")
    first = next(iter(loras))
    with running_server(
        base_dir, "--enable-lora", "--max-loras", "2", "--max-lora-rank", "16",
        "--lora-modules", f"{first}={loras[first].lora_path}", "--allow-runtime-lora-updating",
        name="base",
    ) as url:  # fmt: skip
        yield url


def test_server_serves_adapters_by_model_name_and_swaps_them_while_serving(
    family, lora_server, tmp_path
):
    """With the official openai client: the adapter named by `model` (listed in /v1/models
    with its parent), streamed and not, equal to transformers + peft; another adapter loaded
    and the first unloaded while a request runs: no request fails, the unloaded name answers
    404, nothing compiles after warmup."""
    import httpx
    import openai

    base_dir, prompts, loras, expected = family
    first, second = list(loras)[:2]
    url = lora_server
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=300)
    cards = {m.id: m for m in client.models.list().data}
    assert set(cards) == {"base", first}
    assert cards[first].parent == "base" and cards[first].root == loras[first].lora_path

    def complete(model, i, stream=False):
        kw = dict(model=model, prompt=prompts[i], max_tokens=MAX_TOKENS, temperature=0)
        if not stream:
            return client.completions.create(**kw).choices[0].text
        return "".join(c.choices[0].text for c in client.completions.create(**kw, stream=True))

    def text(ids):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(base_dir).decode(ids)

    compilations = _metric(url, "jaxllm:num_compilations_total")
    assert complete(first, 0) == complete(first, 0, stream=True) == text(expected[first][0])
    assert complete("base", 1) == text(expected[None][1])
    # While a stream of the first adapter runs (its first chunk read, 100 tokens to
    # come), load the second and unload the first: the stream goes on to its end.
    stream = client.completions.create(
        model=first, prompt=prompts[2], max_tokens=100, temperature=0, stream=True
    )
    chunks = iter(stream)
    next(chunks)
    load = {"lora_name": second, "lora_path": loras[second].lora_path}
    assert httpx.post(f"{url}/v1/load_lora_adapter", json=load).status_code == 200
    assert httpx.post(f"{url}/v1/load_lora_adapter", json=load).status_code == 400
    assert complete(second, 3) == text(expected[second][3])
    gone = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": first})
    assert gone.status_code == 200
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    with pytest.raises(openai.NotFoundError):
        complete(first, 0)
    bad = httpx.post(
        f"{url}/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": str(tmp_path)}
    )
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "lora_path"
    assert "vllm:lora_requests_info" in httpx.get(f"{url}/metrics").text
    assert _metric(url, "jaxllm:num_compilations_total") == compilations


LORA_BODIES = {
    "lora_name": st.one_of(TEXT, st.sampled_from(["base", "r4-attn", "r8-all", "new"])),
    "lora_path": st.one_of(TEXT, st.sampled_from(["/", "/nonexistent", "/etc/passwd", "."])),
    "lora_int_id": st.integers(-2, 3),
}


@settings(max_examples=60, derandomize=True, **FUZZ_SETTINGS)
@given(
    path=st.sampled_from(["/v1/load_lora_adapter", "/v1/unload_lora_adapter"]),
    body=st.one_of(
        st.fixed_dictionaries({}, optional={k: _field(v) for k, v in LORA_BODIES.items()}),
        ANYTHING,
    ),
)
def test_fuzzed_adapter_updates_get_no_5xx(lora_server, path, body):
    """Loading and unloading with any body: a 200, or a 4xx in OpenAI's error shape."""
    import httpx

    r = httpx.post(f"{lora_server}{path}", content=body_bytes(body), timeout=60,
                   headers={"content-type": "application/json"})  # fmt: skip
    assert r.status_code < 500, r.text[:1000]
    if r.status_code >= 400:
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["code"] == r.status_code


@settings(max_examples=30, derandomize=True, **FUZZ_SETTINGS)
@given(model=st.one_of(TEXT, st.sampled_from(["base", "r4-attn", "r8-all", "r16-mlp-rs"])))
def test_fuzzed_model_names_get_no_5xx(lora_server, model):
    """Any `model` in a completion: an adapter or the base model answers, anything else (an
    unloaded adapter too) is a 404 naming `model`."""
    import httpx

    body = body_bytes({"model": model, "prompt": [5, 6, 7], "max_tokens": 2})
    r = httpx.post(f"{lora_server}/v1/completions", content=body, timeout=60,
                   headers={"content-type": "application/json"})  # fmt: skip
    assert r.status_code < 500, r.text[:1000]
    if r.status_code >= 400:  # a 404 naming `model`; a body JSON cannot hold is a 400
        assert r.json()["error"]["param"] == ("model" if r.status_code == 404 else None)


def _metric(url: str, name: str) -> float:
    import httpx

    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not exported")


@pytest.mark.parametrize("family", ["llama3.1-rope"], indirect=True)
def test_tensor_parallel_adapters_split_with_their_base_weights(family, tmp_path):
    """An adapter of every target at TP 1, 2 and 4 (4 devices for 2 kv heads: each repeated,
    its B's columns too): the same tokens, every other prompt under the adapter."""
    from tests.helpers import tensor_parallel_report

    base_dir, _, loras, _ = family
    rows = tensor_parallel_report(base_dir, "1,2,4", tmp_path, "--lora", loras["r8-all"].lora_path)
    for row in rows:
        assert row["same_tokens_as_first"], row["tp"]
        assert row["compiled_after_warmup"] == 0, row


def test_the_kv_pool_is_sized_after_the_slots(tiny_model_dir):
    """The slots' device bytes, as the KV budget subtracts them, are what the runner holds."""
    import jax

    from jaxllm.worker import lora_slot_bytes

    llm = LLM(tiny_model_dir, enable_lora=True, max_loras=3, max_lora_rank=8, num_pages=16,
              skip_warmup=True)  # fmt: skip
    arrays = jax.tree.leaves(llm.runner.lora.device)
    held, itemsize = sum(a.nbytes for a in arrays), arrays[0].dtype.itemsize
    assert held == lora_slot_bytes(llm.runner.config, llm.engine.config.lora, itemsize) > 0
