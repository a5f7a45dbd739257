"""A checkpoint's own multi-token-prediction layer as the proposer (`{"method": "mtp"}`), on
tiny random DeepSeek-V3 checkpoints that carry one as DeepSeek's do (`model.layers.{L}.*`).

The drafts equal a reference computed with transformers' own DeepSeek-V3 decoder layer and the
layer's tensors as vLLM's `DeepSeekMTP` computes them; the engine's output with the layer is
the target's alone, token for token, greedy or seeded, batched, chunked, preempted and with
prefix hits, with nothing compiled after warmup."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from jaxllm import LLM, SamplingParams

from helpers import VOCAB, recorded_drafts, token_ids, write_family_checkpoint

torch = pytest.importorskip("torch")

ENGINE = dict(max_model_len=256, num_pages=96, max_num_seqs=8, max_num_batched_tokens=64)


def _spec(k: int = 3, **extra) -> dict:
    return {"method": "mtp", "num_speculative_tokens": k, "adaptive": False, **extra}


def write_mtp_checkpoint(path, *, own_embeddings: bool = True, own_head: bool = True):
    """A tiny DeepSeek-V3 (4 layers) whose checkpoint also holds an MTP layer 4: an MoE
    decoder layer of the target's kind (taken from a 5-layer model transformers makes, in the
    names it saves) with enorm, hnorm, eh_proj, shared_head and (`own_embeddings`,
    `own_head`) embed_tokens and shared_head.head, in a second safetensors file; config.json
    says num_nextn_predict_layers 1. Returns (the target, the 5-layer model whose layer 4 is
    the MTP block), as transformers models."""
    target = write_family_checkpoint("deepseek-v3", path)
    n = target.config.num_hidden_layers
    deeper_dir = path.parent / f"{path.name}-deeper"
    deeper = write_family_checkpoint("deepseek-v3", deeper_dir, tokenizer=False,
                                     num_hidden_layers=n + 1)  # fmt: skip
    prefix = f"model.layers.{n}."
    tensors = {k: v for k, v in load_file(deeper_dir / "model.safetensors").items()
               if k.startswith(prefix)}  # fmt: skip
    shutil.rmtree(deeper_dir)
    rng = np.random.default_rng(7)
    d = target.config.hidden_size
    own = {
        "enorm.weight": 1 + 0.3 * rng.standard_normal(d),
        "hnorm.weight": 1 + 0.3 * rng.standard_normal(d),
        "eh_proj.weight": 0.1 * rng.standard_normal((d, 2 * d)),
        "shared_head.norm.weight": 1 + 0.3 * rng.standard_normal(d),
    }
    if own_head:
        own["shared_head.head.weight"] = 0.1 * rng.standard_normal((VOCAB, d))
    if own_embeddings:
        own["embed_tokens.weight"] = rng.standard_normal((VOCAB, d))
    tensors |= {prefix + k: v.astype(np.float32) for k, v in own.items()}
    save_file(tensors, str(path / "model-mtp.safetensors"))
    config = json.loads((path / "config.json").read_text())
    config["num_nextn_predict_layers"] = 1
    (path / "config.json").write_text(json.dumps(config))
    return target, deeper


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("mtp") / "v3"
    target, deeper = write_mtp_checkpoint(path)
    return path, target, deeper


@pytest.fixture(scope="module")
def plain(checkpoint):
    return LLM(checkpoint[0], dtype="float32", **ENGINE)


def _prompts(seed: int) -> list[dict]:
    rng = np.random.default_rng(seed)
    return [
        {"prompt_token_ids": rng.integers(3, VOCAB, size=int(rng.integers(5, 90))).tolist()}
        for _ in range(8)
    ]


def _reference_drafts(path, target, deeper, prompt: list[int], k: int) -> list[int]:
    """vLLM's `DeepSeekMTP` over the prompt and then its own drafts: the target's
    final states and next token from transformers, the MTP block transformers' own layer
    (causal over the whole sequence again at each draft, which gives the cache's keys)."""
    t = {
        name.split(".", 3)[3]: torch.from_numpy(w)
        for name, w in load_file(path / "model-mtp.safetensors").items()
    }
    embed = t.get("embed_tokens.weight", target.model.embed_tokens.weight)
    head = t.get("shared_head.head.weight", target.lm_head.weight)
    eps = target.config.rms_norm_eps
    n = target.config.num_hidden_layers
    block, rotary = deeper.model.layers[n], deeper.model.rotary_emb

    def rms(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w

    with torch.no_grad():
        states = target.model(torch.tensor([prompt])).last_hidden_state[0]
        tokens = [*prompt[1:], int(target.lm_head(states[-1]).argmax())]
        drafts = []
        for _ in range(k):
            m = len(tokens)
            positions = torch.arange(m)
            e = embed[torch.tensor(tokens)].clone()
            e[positions == 0] = 0  # vLLM's masking
            x = torch.cat([rms(e, t["enorm.weight"]), rms(states, t["hnorm.weight"])], -1)
            x = (x @ t["eh_proj.weight"].T)[None]
            mask = torch.full((m, m), torch.finfo(torch.float32).min)
            mask = torch.triu(mask, 1)[None, None]
            out = block(x, attention_mask=mask, position_ids=positions[None],
                        position_embeddings=rotary(x, positions[None]))  # fmt: skip
            out = (out[0] if isinstance(out, tuple) else out)[0]
            draft = int((rms(out[-1], t["shared_head.norm.weight"]) @ head.T).argmax())
            drafts.append(draft)
            tokens.append(draft)
            states = torch.cat([states, out[-1:]])
    return drafts


@pytest.mark.parametrize("own", [True, False], ids=["own-embeddings-and-head", "targets"])
def test_drafts_equal_the_reference(tmp_path, checkpoint, own):
    """The first step's k = 4 drafts for prompts of 1, 7 and 40 tokens equal the reference's,
    with the layer's own embeddings and head, or the target's where it has none."""
    if own:
        path, target, deeper = checkpoint
    else:
        path = tmp_path / "v3"
        target, deeper = write_mtp_checkpoint(path, own_embeddings=False, own_head=False)
    k = 4
    llm = LLM(path, dtype="float32", speculative_config=_spec(k), **ENGINE)
    proposed = recorded_drafts(llm)
    rng = np.random.default_rng(1)
    for n in (1, 7, 40):
        prompt = rng.integers(3, VOCAB, size=n).tolist()
        proposed.clear()
        llm.generate({"prompt_token_ids": prompt},
                     SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)  # fmt: skip
        (drafts,) = proposed[0].values()
        assert drafts == _reference_drafts(path, target, deeper, prompt, k), n


def test_output_is_the_targets(checkpoint, plain):
    """Greedy and seeded random output with the layer equal the target's alone, batched, and
    again with the prompts' blocks cached (prefix hits), with nothing compiled after warmup;
    the steps drafted k tokens but near a request's end."""
    llm = LLM(checkpoint[0], dtype="float32", speculative_config=_spec(), **ENGINE)
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
    assert stats.num_draft_tokens > 2.5 * stats.num_drafts > 1000


def test_chunked_preempted_and_paused(checkpoint, plain):
    """A 16-token budget chunks every prompt (the layer reads the next chunk's first token at
    each chunk's end); 14 pages cannot hold 8 growing requests, so some are preempted and
    recomputed; the adaptive policy pauses speculation in some steps (the layer's KV-only
    program keeps its cache whole). Output: the target's."""
    small = LLM(checkpoint[0], dtype="float32", max_model_len=128, num_pages=14, max_num_seqs=8,
                max_num_batched_tokens=16,
                speculative_config={"method": "deepseek_mtp", "num_speculative_tokens": 2})  # fmt: skip
    prompts = _prompts(seed=4)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    want = token_ids(plain.generate(prompts, params, use_tqdm=False))
    assert token_ids(small.generate(prompts, params, use_tqdm=False)) == want
    assert small.engine.scheduler.num_preemptions > 0
    small.kv_cache_manager.check_invariants()
    assert small.kv_cache_manager.num_free_blocks == 14


def test_bad_setups_are_named(tmp_path, checkpoint, tiny_model_dir):
    path = checkpoint[0]
    with pytest.raises(ValueError, match="multi-token-prediction layers of DeepseekV3"):
        LLM(tiny_model_dir, speculative_config=_spec(), **ENGINE)
    bare = tmp_path / "bare"
    shutil.copytree(path, bare)
    config = json.loads((bare / "config.json").read_text())
    config.pop("num_nextn_predict_layers")
    (bare / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="num_nextn_predict_layers is 0"):
        LLM(bare, dtype="float32", speculative_config=_spec(), **ENGINE)
    config["num_nextn_predict_layers"] = 1
    (bare / "config.json").write_text(json.dumps(config))
    (bare / "model-mtp.safetensors").unlink()
    with pytest.raises(ValueError, match=r"model.layers.4 lacks enorm.weight"):
        LLM(bare, dtype="float32", speculative_config=_spec(), **ENGINE)


def test_an_fp8_checkpoints_layer(tmp_path, checkpoint):
    """DeepSeek-V3 as it ships, in FP8 blocks (its MTP layer's projections and experts too,
    eh_proj included): the layer's projections and experts kept fp8 as the target's are
    (`quantization` fp8), the output the target's, the drafts those of the layer dequantized."""
    from jaxllm.loaders.mtp import load_mtp_head
    from jaxllm.quantization import FP8Experts, QArray
    from jaxllm.testing import write_fp8_checkpoint

    src = tmp_path / "float"
    shutil.copytree(checkpoint[0], src)
    tensors = load_file(src / "model.safetensors") | load_file(src / "model-mtp.safetensors")
    (src / "model-mtp.safetensors").unlink()
    save_file(tensors, str(src / "model.safetensors"))
    fp8 = write_fp8_checkpoint(src, tmp_path / "fp8", [8, 8])
    engine = dict(ENGINE, dtype="float32", quantization="fp8")
    llm = LLM(fp8, speculative_config=_spec(2), **engine)
    head, _ = load_mtp_head(fp8, llm.model_config, quantization="fp8")
    assert isinstance(head.layers[0].mlp.gate_proj.get_value(), FP8Experts)
    assert isinstance(head.layers[0].self_attn.q_b_proj.get_value(), QArray)
    prompts = _prompts(seed=5)[:4]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    want = token_ids(LLM(fp8, **engine).generate(prompts, params, use_tqdm=False))
    assert token_ids(llm.generate(prompts, params, use_tqdm=False)) == want
    # Its drafts are those of the same layer dequantized at load.
    dequantized = LLM(fp8, speculative_config=_spec(2), **(engine | {"quantization": "float"}))
    drafts = [recorded_drafts(llm), recorded_drafts(dequantized)]
    once = SamplingParams(temperature=0, max_tokens=1)
    for each in (llm, dequantized):
        for prompt in prompts:
            each.generate(prompt, once, use_tqdm=False)
    assert len(drafts[0]) == len(prompts)
    assert [list(d.values()) for d in drafts[0]] == [list(d.values()) for d in drafts[1]]


_TP_SCRIPT = """
import json, sys
from jaxllm import LLM, SamplingParams
spec = {"method": "mtp", "num_speculative_tokens": 3, "adaptive": False}
prompts = [{"prompt_token_ids": list(range(5 + 9 * i, 30 + 9 * i))} for i in range(4)]
params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
out = {}
for tp in (1, 2):
    llm = LLM(sys.argv[1], dtype="float32", max_model_len=128, num_pages=64, max_num_seqs=4,
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


@pytest.mark.slow
def test_tensor_parallel(checkpoint):
    """TP 2 on 2 CPU devices (the layer's heads and experts split as the target's, the
    latent whole on each): TP 1's tokens and drafts, nothing compiled after warmup."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2",
               JAX_PLATFORMS="cpu")  # fmt: skip
    run = subprocess.run(
        [sys.executable, "-c", _TP_SCRIPT, str(checkpoint[0])],
        env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    line = next(x for x in run.stdout.splitlines() if x.startswith("RESULT "))
    out = json.loads(line.removeprefix("RESULT "))
    assert out["1"]["tokens"] == out["2"]["tokens"]
    assert out["1"]["drafts"] == out["2"]["drafts"] and len(out["1"]["drafts"]) > 5
    assert out["1"]["compiled"] == out["2"]["compiled"] == 0
