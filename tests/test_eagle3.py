"""EAGLE-3 heads (`{"method": "eagle3", "model": HEAD, ...}`) in the layout vLLM loads.

The head's drafts equal a reference computed here from the checkpoint's tensors with numpy and
the target's hidden states from transformers (as vLLM's `Eagle3LlamaForCausalLM` computes
them), and the engine's output with the head is the target's alone, token for token, greedy or
seeded, batched, chunked, preempted and with prefix hits, with nothing compiled after warmup."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from jaxllm import LLM, SamplingParams
from jaxllm.models.eagle3 import default_aux_layers
from jaxllm.testing import write_tiny_checkpoint, write_tiny_eagle3_head

from helpers import recorded_drafts, token_ids

ENGINE = dict(max_model_len=256, num_pages=96, max_num_seqs=8, max_num_batched_tokens=64)


def _spec(head, k: int = 3) -> dict:
    return {"method": "eagle3", "model": str(head), "num_speculative_tokens": k, "adaptive": False}


def _prompts(seed: int) -> list[dict]:
    rng = np.random.default_rng(seed)
    return [
        {"prompt_token_ids": rng.integers(3, 300, size=int(rng.integers(5, 90))).tolist()}
        for _ in range(8)
    ]


@pytest.fixture(scope="module")
def head_dir(tmp_path_factory, tiny_model_dir):
    """A random head over the tiny target's layers 0, 1 and its output, with a draft
    vocabulary of 200 of its ids."""
    return write_tiny_eagle3_head(
        tmp_path_factory.mktemp("eagle3"), tiny_model_dir, draft_vocab_size=200,
        aux_layers=[0, 1, 2],
    )  # fmt: skip


@pytest.fixture(scope="module")
def plain(tiny_model_dir):
    return LLM(tiny_model_dir, **ENGINE)


# ---- the head's computation ---------------------------------------------------------------


def _rms(x, w, eps=1e-5):
    return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * w


def _rope(x, positions, theta, h):
    inv = 1.0 / theta ** (np.arange(0, h, 2) / h)
    ang = positions[:, None] * inv[None]
    cos, sin = np.cos(np.concatenate([ang, ang], -1)), np.sin(np.concatenate([ang, ang], -1))
    half = h // 2
    rot = np.concatenate([-x[..., half:], x[..., :half]], -1)
    return x * cos[:, None] + rot * sin[:, None]


class _ReferenceHead:
    """vLLM's EAGLE-3 forward in numpy, from the checkpoint's tensors (float64)."""

    def __init__(self, path, embed):
        cfg = json.loads((path / "config.json").read_text())
        t = {k: v.astype(np.float64) for k, v in load_file(path / "model.safetensors").items()}
        self.t, self.cfg, self.embed = t, cfg, embed
        self.keys, self.values = [], []

    def step(self, tokens, positions, hidden):
        """Appends positions (with their next tokens and states) to the head's cache: (the
        draft after each, its state before the final norm)."""
        t, c, p = self.t, self.cfg, "midlayer."
        n, k, h = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
        x = np.concatenate(
            [_rms(self.embed[tokens], t[p + "input_layernorm.weight"]),
             _rms(hidden, t[p + "hidden_norm.weight"])], -1,
        )  # fmt: skip
        q = (x @ t[p + "self_attn.q_proj.weight"].T).reshape(-1, n, h)
        kk = (x @ t[p + "self_attn.k_proj.weight"].T).reshape(-1, k, h)
        v = (x @ t[p + "self_attn.v_proj.weight"].T).reshape(-1, k, h)
        q, kk = _rope(q, positions, c["rope_theta"], h), _rope(kk, positions, c["rope_theta"], h)
        self.keys.append(kk)
        self.values.append(v)
        keys, values = np.concatenate(self.keys), np.concatenate(self.values)
        start = len(keys) - len(tokens)
        out = np.zeros_like(q)
        for i in range(len(tokens)):
            kv = slice(0, start + i + 1)
            for head in range(n):
                g = head // (n // k)
                s = keys[kv, g] @ q[i, head] / math.sqrt(h)
                a = np.exp(s - s.max())
                out[i, head] = (a / a.sum()) @ values[kv, g]
        attn = out.reshape(len(tokens), -1) @ t[p + "self_attn.o_proj.weight"].T
        res = _rms(hidden, t[p + "hidden_norm.weight"]) if c["norm_before_residual"] else hidden
        hmid = attn + res
        m = _rms(hmid, t[p + "post_attention_layernorm.weight"])
        gate, up = m @ t[p + "mlp.gate_proj.weight"].T, m @ t[p + "mlp.up_proj.weight"].T
        out = (gate / (1 + np.exp(-gate)) * up) @ t[p + "mlp.down_proj.weight"].T + hmid
        logits = _rms(out, t["norm.weight"]) @ t["lm_head.weight"].T
        ids = logits.argmax(-1)
        return ids + t["d2t"][ids].astype(np.int64), out


@pytest.mark.parametrize("norm_before_residual", [False, True])
def test_drafts_equal_the_reference(tmp_path, tokenizer_dir, norm_before_residual):
    """An 8-layer target and a head naming no layers (vLLM's default: 2, 4, 5), with its own
    embeddings or not: the first step's drafts for each prompt equal the reference's."""
    import torch
    from transformers import AutoModelForCausalLM

    target = write_tiny_checkpoint(tmp_path / "t", tokenizer_dir, num_layers=8, seed=3)
    hf = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float64)
    embeddings = not norm_before_residual  # a head of its own width needs its own
    head = write_tiny_eagle3_head(
        tmp_path / "h", target, hidden_size=48 if embeddings else 64, head_dim=12,
        num_heads=4, num_kv_heads=2,
        draft_vocab_size=150, embeddings=embeddings, norm_before_residual=norm_before_residual,
        seed=5,
    )  # fmt: skip
    k = 4
    llm = LLM(target, speculative_config=_spec(head, k), **ENGINE)
    proposed = recorded_drafts(llm)
    rng = np.random.default_rng(1)
    for n in (1, 7, 40):
        prompt = rng.integers(3, 300, size=n).tolist()
        proposed.clear()
        llm.generate({"prompt_token_ids": prompt},
                     SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)  # fmt: skip
        (drafts,) = proposed[0].values()
        with torch.no_grad():
            out = hf(torch.tensor([prompt]), output_hidden_states=True)
        states = [out.hidden_states[i][0].numpy() for i in default_aux_layers(8)]
        nxt = int(out.logits[0, -1].argmax())
        t = load_file(head / "model.safetensors")
        fused = np.concatenate(states, -1) @ t["fc.weight"].astype(np.float64).T
        table = (
            t["embed_tokens.weight"]
            if embeddings
            else hf.model.embed_tokens.weight.detach().numpy()
        )
        ref = _ReferenceHead(head, table.astype(np.float64))
        ids, pre = ref.step(np.array(prompt[1:] + [nxt]), np.arange(n), fused)
        want = [int(ids[-1])]
        for j in range(1, k):
            ids, pre = ref.step(np.array(want[-1:]), np.array([n - 1 + j]), pre[-1:])
            want.append(int(ids[0]))
        assert drafts == want, (n, drafts, want)


# ---- serving with a head --------------------------------------------------------------------


def test_output_is_the_targets(tiny_model_dir, head_dir, plain):
    """Greedy and seeded random output with the head equal the target's alone, batched, and
    again with the prompts' blocks cached (prefix hits: the head's cache of them is reused
    too), with nothing compiled after warmup; the steps drafted k tokens but near a request's
    end."""
    llm = LLM(tiny_model_dir, speculative_config=_spec(head_dir), **ENGINE)
    compiled = llm.runner.num_compilations
    prompts = _prompts(seed=2)
    for params in (
        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
        SamplingParams(temperature=0.8, seed=9, max_tokens=24, ignore_eos=True),
    ):
        want = token_ids(plain.generate(prompts, params, use_tqdm=False))
        hits = llm.engine.stats().prefix_cache_hits
        assert token_ids(llm.generate(prompts, params, use_tqdm=False)) == want
        assert token_ids(llm.generate(prompts, params, use_tqdm=False)) == want
        assert llm.engine.stats().prefix_cache_hits > hits
    assert llm.runner.num_compilations == compiled
    stats = llm.engine.stats().spec_decoding
    assert stats.num_draft_tokens > 2.5 * stats.num_drafts > 1500  # (cut at max_tokens)


def test_a_prefix_hit_gives_the_drafts_of_a_fresh_engine(tiny_model_dir, head_dir):
    """The head's KV at a position is computed with the token after it: a prompt sharing only
    its first blocks with an earlier one must not reuse the last block's (vLLM drops the last
    block of a hit). Its drafts then equal those of an engine that never saw the other."""
    page = LLM(tiny_model_dir, speculative_config=_spec(head_dir), **ENGINE)
    page_size = page.kv_cache_manager.page_size
    rng = np.random.default_rng(8)
    shared = rng.integers(3, 300, size=2 * page_size).tolist()
    first = {"prompt_token_ids": shared + rng.integers(3, 300, size=9).tolist()}
    second = {"prompt_token_ids": shared + rng.integers(3, 300, size=9).tolist()}
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    page.generate([first], params, use_tqdm=False)
    hits = page.engine.stats().prefix_cache_hits
    proposed = recorded_drafts(page)
    page.generate([second], params, use_tqdm=False)
    assert page.engine.stats().prefix_cache_hits - hits == page_size  # the first block only
    fresh = LLM(tiny_model_dir, speculative_config=_spec(head_dir), **ENGINE)
    reference = recorded_drafts(fresh)
    fresh.generate([second], params, use_tqdm=False)
    assert [list(d.values()) for d in proposed] == [list(d.values()) for d in reference]


def _by_length(llm) -> list[tuple[int, list[int]]]:
    """The drafts `llm`'s proposer returns from now on, each with the length of the sequence
    it follows (one request at a time)."""
    proposed: list[tuple[int, list[int]]] = []
    runner = llm.runner
    propose = runner.proposer.propose

    def recording(launched, held):
        drafts = propose(launched, held)
        proposed.extend((int(runner.input_batch.num_tokens[row]), drafts[r]) for r, _, row in held)
        return drafts

    runner.proposer.propose = recording
    return proposed


def test_drafts_after_many_steps_are_a_fresh_prompts(tiny_model_dir, head_dir):
    """The head's cache after steps of accepted and rejected drafts holds what a prefill of the
    same sequence writes: the drafts proposed after n tokens equal those a fresh request whose
    prompt is the first n - 1 gets after its first step (which the reference test checks)."""
    llm = LLM(tiny_model_dir, speculative_config=_spec(head_dir), **ENGINE)
    proposed = _by_length(llm)
    prompt = _prompts(seed=11)[0]["prompt_token_ids"]
    greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": prompt}], greedy, use_tqdm=False)
    sequence = prompt + list(out[0].outputs[0].token_ids)
    fresh = LLM(tiny_model_dir, speculative_config=_spec(head_dir), enable_prefix_caching=False,
                **ENGINE)  # fmt: skip
    first = _by_length(fresh)
    later = [(n, d) for n, d in proposed if len(prompt) + 1 < n < len(sequence)]
    assert len(later) >= 8
    once = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    for n, drafts in later:
        first.clear()
        # Its first step samples token n (greedy: the same), then the head drafts after n.
        fresh.generate([{"prompt_token_ids": sequence[: n - 1]}], once, use_tqdm=False)
        assert first[0] == (n, drafts)


def test_chunked_preempted_and_prefix_hits(tiny_model_dir, head_dir, plain):
    """A 16-token budget chunks every prompt (the head reads the next chunk's first token at
    each chunk's end); 14 pages cannot hold 8 growing requests, so some are preempted and
    recomputed. Output: the target's."""
    small = LLM(tiny_model_dir, max_model_len=128, num_pages=14, max_num_seqs=8,
                max_num_batched_tokens=16, speculative_config=_spec(head_dir, 2))  # fmt: skip
    prompts = _prompts(seed=4)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    want = token_ids(plain.generate(prompts, params, use_tqdm=False))
    assert token_ids(small.generate(prompts, params, use_tqdm=False)) == want
    assert small.engine.scheduler.num_preemptions > 0
    small.kv_cache_manager.check_invariants()
    assert small.kv_cache_manager.num_free_blocks == 14


@pytest.mark.parametrize("n", [2048, pytest.param(20_480, marks=pytest.mark.slow)])
def test_distribution_equals_the_targets(tmp_path, tiny_model_dir, plain, n, request):
    """n seeded samples of three tokens at temperature 1 (top-k 3: 27 outcomes) with a head
    whose draft vocabulary is one likely token, so its drafts are accepted sometimes and
    rejected sometimes: the frequencies match the target's exact probabilities (chi-square at
    p = 0.001)."""
    if n > 2048 and "slow" not in (request.config.getoption("markexpr") or ""):
        pytest.skip("slow: run with -m slow")
    prompt = [17, 99, 240, 61, 5, 133]
    params = dict(temperature=1.0, top_k=3, max_tokens=3, ignore_eos=True)

    def top3(prefix: list[int]) -> dict[int, float]:
        out = plain.generate({"prompt_token_ids": prompt + prefix},
                             SamplingParams(temperature=0, max_tokens=1, logprobs=3),
                             use_tqdm=False)[0].outputs[0]  # fmt: skip
        lps = {t: lp.logprob for t, lp in out.logprobs[0].items()}
        top = sorted(lps, key=lps.get, reverse=True)[:3]
        z = sum(math.exp(lps[t]) for t in top)
        return {t: math.exp(lps[t]) / z for t in top}

    probs: dict[tuple[int, ...], float] = {}
    for a, pa in top3([]).items():
        for b, pb in top3([a]).items():
            for c, pc in top3([a, b]).items():
                probs[a, b, c] = pa * pb * pc
    # A draft vocabulary of one id: the likeliest second token after the likeliest first.
    first = top3([])
    second = top3([max(first, key=first.get)])
    head = write_tiny_eagle3_head(tmp_path / "h", tiny_model_dir,
                                  draft_ids=[max(second, key=second.get)],
                                  aux_layers=[0, 1, 2], seed=11)  # fmt: skip
    llm = LLM(tiny_model_dir, max_model_len=64, num_pages=600, max_num_seqs=256,
              max_num_batched_tokens=1024, speculative_config=_spec(head, 2))  # fmt: skip
    outs = llm.generate([{"prompt_token_ids": prompt}] * n,
                        [SamplingParams(seed=s, **params) for s in range(n)], use_tqdm=False)  # fmt: skip
    counts: dict[tuple[int, ...], int] = {}
    for o in outs:
        key = tuple(o.outputs[0].token_ids)
        assert key in probs, key
        counts[key] = counts.get(key, 0) + 1
    chi2 = sum((counts.get(k, 0) - n * p) ** 2 / (n * p) for k, p in probs.items())
    assert chi2 < 54.05, (chi2, counts)  # the 0.999 quantile of chi-square, 26 dof
    stats = llm.engine.stats().spec_decoding
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens


# ---- loading ---------------------------------------------------------------------------------


def _edit(head, tmp_path, *, config=None, tensors=None):
    """A copy of `head` with config.json keys and tensors changed (None values: removed)."""
    out = tmp_path / "edited"
    out.mkdir()
    cfg = json.loads((head / "config.json").read_text()) | (config or {})
    (out / "config.json").write_text(json.dumps({k: v for k, v in cfg.items() if v is not None}))
    t = load_file(head / "model.safetensors") | (tensors or {})
    save_file({k: v for k, v in t.items() if v is not None}, str(out / "model.safetensors"))
    return out


@pytest.mark.parametrize(
    ("config", "tensors", "message"),
    [
        (dict(vocab_size=999), None, "vocab_size 999 differs from the target's"),
        (dict(target_hidden_size=32), None, "target_hidden_size 32 differs"),
        (dict(hidden_size=48), None, "no embed_tokens of its own"),
        (dict(num_hidden_layers=2), None, "num_hidden_layers 2; heads of 1 layer only"),
        (dict(architectures=["LlamaForCausalLM"]), None, "not an EAGLE-3 head"),
        (dict(eagle_config={"eagle_aux_hidden_state_layer_ids": [0, 1]}), None,
         "must be 3 distinct layer ids"),
        (dict(eagle_config={"eagle_aux_hidden_state_layer_ids": [0, 1, 1]}), None,
         "must be 3 distinct layer ids"),
        (dict(draft_vocab_size=99999), None, "draft_vocab_size 99999 must be in"),
        (None, {"d2t": np.full(200, 1000, np.int64)}, "maps draft ids outside"),
        (None, {"d2t": None}, "has no d2t map"),
        (None, {"extra.weight": np.zeros(3, np.float32)}, "has tensor 'extra.weight'"),
        (None, {"fc.weight": np.zeros((64, 10), np.float32)}, "fc.weight is [64, 10]"),
        (None, {"midlayer.mlp.up_proj.weight": None}, "lacks mlp.up_proj"),
    ],
)  # fmt: skip
def test_bad_heads_are_named(tmp_path, tiny_model_dir, head_dir, config, tensors, message):
    bad = _edit(head_dir, tmp_path, config=config, tensors=tensors)
    with pytest.raises(ValueError, match=message.replace("[", r"\[")):
        LLM(tiny_model_dir, speculative_config=_spec(bad), **ENGINE)


def test_a_head_over_the_whole_vocabulary(tmp_path, tiny_model_dir, plain):
    """No d2t (its ids are the target's), its layers named out of order: loads and serves."""
    head = write_tiny_eagle3_head(tmp_path / "h", tiny_model_dir, aux_layers=[2, 0, 1])
    t = load_file(head / "model.safetensors")
    del t["d2t"], t["t2d"]
    save_file(t, str(head / "model.safetensors"))
    llm = LLM(tiny_model_dir, speculative_config=_spec(head), **ENGINE)
    assert llm.runner.proposer.config.aux_layers == (0, 1, 2)
    prompts, params = _prompts(seed=7)[:3], SamplingParams(temperature=0, max_tokens=12)
    assert token_ids(llm.generate(prompts, params, use_tqdm=False)) == token_ids(
        plain.generate(prompts, params, use_tqdm=False)
    )


def test_names_as_vllm_reads_them(tmp_path, tiny_model_dir, head_dir):
    """The same head with vLLM's other spellings (`layers.0.` for `midlayer.`, a `model.`
    prefix) gives the same drafts; a .bin-only head is refused by name."""
    t = load_file(head_dir / "model.safetensors")
    renamed = tmp_path / "renamed"
    renamed.mkdir()
    (renamed / "config.json").write_bytes((head_dir / "config.json").read_bytes())
    save_file({"model." + k.replace("midlayer.", "layers.0."): v for k, v in t.items()},
              str(renamed / "model.safetensors"))  # fmt: skip
    prompts, params = _prompts(seed=6)[:3], SamplingParams(temperature=0, max_tokens=8)
    drafts = []
    for head in (head_dir, renamed):
        llm = LLM(tiny_model_dir, speculative_config=_spec(head), **ENGINE)
        drafts.append(recorded_drafts(llm))
        llm.generate(prompts, params, use_tqdm=False)
    assert len(drafts[0]) > 3
    assert [sorted(d.values()) for d in drafts[0]] == [sorted(d.values()) for d in drafts[1]]
    binary = tmp_path / "bin"
    binary.mkdir()
    (binary / "config.json").write_bytes((head_dir / "config.json").read_bytes())
    (binary / "pytorch_model.bin").write_bytes(b"\0")
    with pytest.raises(ValueError, match="PyTorch .bin weights only"):
        LLM(tiny_model_dir, speculative_config=_spec(binary), **ENGINE)


_TP_SCRIPT = """
import json, sys
from jaxllm import LLM, SamplingParams
target, head = sys.argv[1], sys.argv[2]
spec = {"method": "eagle3", "model": head, "num_speculative_tokens": 3, "adaptive": False}
prompts = [{"prompt_token_ids": list(range(5 + 9 * i, 30 + 9 * i))} for i in range(4)]
params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
out = {}
for tp in (1, 4):
    llm = LLM(target, max_model_len=128, num_pages=64, max_num_seqs=4,
              max_num_batched_tokens=64, tensor_parallel_size=tp, speculative_config=spec)
    drafts = []
    propose = llm.runner.proposer.propose
    llm.runner.proposer.propose = lambda *a: drafts.append(propose(*a)) or drafts[-1]
    compiled = llm.runner.num_compilations
    tokens = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    out[tp] = dict(tokens=tokens, drafts=[sorted(d.values()) for d in drafts],
                   compiled=llm.runner.num_compilations - compiled)
print("RESULT " + json.dumps(out))
"""


def test_tensor_parallel(tmp_path, tokenizer_dir, tiny_model_dir, head_dir):
    """TP 4 on 4 CPU devices (the target's and the head's 2 kv heads each repeated twice; the
    draft vocabulary split over the devices): TP 1's tokens and drafts, nothing compiled."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4",
               JAX_PLATFORMS="cpu")  # fmt: skip
    run = subprocess.run(
        [sys.executable, "-c", _TP_SCRIPT, str(tiny_model_dir), str(head_dir)],
        env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    line = next(x for x in run.stdout.splitlines() if x.startswith("RESULT "))
    out = json.loads(line.removeprefix("RESULT "))
    assert out["1"]["tokens"] == out["4"]["tokens"]
    assert out["1"]["drafts"] == out["4"]["drafts"] and len(out["1"]["drafts"]) > 5
    assert out["1"]["compiled"] == out["4"]["compiled"] == 0


@pytest.mark.parametrize("family", ["gemma3", "mixtral"])
def test_hybrid_kv_cache(tmp_path, family):
    """Gemma 3 (sliding and full layers: the hybrid KV manager's groups kept, the head on the
    full group's pages) and Mixtral (every layer sliding: one group freeing blocks behind the
    window, the head attending within it), prompts past the window: the target's output,
    nothing compiled after warmup."""
    from helpers import write_family_checkpoint

    target = tmp_path / "t"
    write_family_checkpoint(family, target)
    head = write_tiny_eagle3_head(
        tmp_path / "h", target, draft_vocab_size=100, aux_layers=[0, 2, 4]
    )
    engine = dict(max_model_len=128, num_pages=64, max_num_seqs=4, max_num_batched_tokens=32)
    plain = LLM(target, **engine)
    llm = LLM(target, speculative_config=_spec(head), **engine)
    groups = llm.runner.kv_groups
    assert (groups.num_groups > 1) == (family == "gemma3")
    assert (groups.windows[0] is None) == (family == "gemma3")
    compiled = llm.runner.num_compilations
    prompts = _prompts(seed=8)[:4]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    assert token_ids(llm.generate(prompts, params, use_tqdm=False)) == token_ids(
        plain.generate(prompts, params, use_tqdm=False)
    )
    assert llm.runner.num_compilations == compiled
    assert llm.engine.stats().spec_decoding.num_draft_tokens > 100
    llm.kv_cache_manager.check_invariants()
