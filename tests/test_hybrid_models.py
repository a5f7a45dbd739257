"""The hybrid linear-attention families (Qwen3.5 dense and MoE, Qwen3-Next) against Hugging
Face transformers (torch, float32), on tiny random checkpoints written by transformers itself:
the Gated DeltaNet recurrence over ragged batches, prefill logits, and greedy tokens through the
engine (chunked, batched, preempted, served again), with the recurrent state in the engine's
memory plan and no state or page left behind."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels
from jaxllm import LLM, SamplingParams
from jaxllm.config import EngineConfig
from jaxllm.loaders import load_model
from jaxllm.loaders.hf import load_hf_config
from jaxllm.models.layers import AttentionMetadata
from jaxllm.models.linear_attention import gated_delta_rule, state_bytes_per_slot
from jaxllm.worker.kv_sizing import DeviceMemory
from jaxllm.worker.plan import plan_engine

from helpers import (
    HYBRIDS,
    VOCAB,
    bfloat16_errors,
    greedy_reference,
    prefill_logits,
    tensor_parallel_report,
    write_family_checkpoint,
)

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module", params=list(HYBRIDS))
def hybrid(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    return request.param, path, write_family_checkpoint(request.param, path)


@pytest.mark.parametrize("backend", pallas_kernels.GDN_BACKENDS)
def test_delta_rule_matches_transformers_over_a_ragged_batch(backend):
    """Requests of 5, 1 (a decode row), 9 and 150 tokens (three chunks of the chunked forms,
    the last one partial) in one batch, two carrying a state from earlier steps and two
    fresh, and padding after them: each request's outputs and final state equal
    transformers' recurrence run on it alone, in every form of the recurrence (the GPU
    kernel interpreted here)."""
    from transformers.models.qwen3_5 import modeling_qwen3_5 as ref

    rng = np.random.default_rng(0)
    lens, carried = [5, 1, 9, 150], [True, True, False, False]
    heads, dk, dv, pad = 4, 16, 8, 4
    t = sum(lens) + pad
    q, k = (rng.normal(size=(t, heads, dk)).astype(np.float32) for _ in range(2))
    v = rng.normal(size=(t, heads, dv)).astype(np.float32)
    decay = -np.abs(rng.normal(size=(t, heads))).astype(np.float32)
    beta = (1 / (1 + np.exp(-rng.normal(size=(t, heads))))).astype(np.float32)
    initial = rng.normal(size=(len(lens) + 1, heads, dk, dv)).astype(np.float32)
    cu = np.concatenate([[0], np.cumsum(lens), [sum(lens)]]).astype(np.int32)  # + a padding row
    seq_lens = np.array([n + 7 * c for n, c in zip(lens, carried, strict=True)] + [0], np.int32)
    meta = AttentionMetadata(
        slot_mapping=jnp.zeros((1, t), jnp.int32),
        seq_lens=jnp.asarray(seq_lens),
        block_tables=jnp.zeros((1, len(lens) + 1, 1), jnp.int32),
        cu_q_lens=jnp.asarray(cu),
        num_seqs=jnp.array([len(lens)], jnp.int32),
    )
    out, final = gated_delta_rule(
        *(jnp.asarray(x) for x in (q, k, v, decay, beta, initial)), meta, backend=backend
    )
    out, final = np.asarray(out), np.asarray(final)
    for r, c in enumerate(carried):
        span = slice(cu[r], cu[r + 1])
        expected, state = ref.torch_recurrent_gated_delta_rule(
            *(torch.from_numpy(x[span][None]) for x in (q, k, v, decay, beta)),
            initial_state=torch.from_numpy(initial[r][None]) if c else None,
            output_final_state=True,
            use_qk_l2norm_in_kernel=True,
        )
        np.testing.assert_allclose(out[span], expected[0].numpy(), atol=2e-5)
        np.testing.assert_allclose(final[r], state[0].numpy(), atol=2e-5)
    assert not out[sum(lens) :].any()  # padding tokens give nothing


def test_logits_match_transformers(hybrid):
    case, path, hf_model = hybrid
    loaded = load_model(path, dtype=jnp.float32, load_tokenizer=False)
    assert loaded.config.architecture == HYBRIDS[case][1]
    ids = np.random.default_rng(0).integers(3, VOCAB, size=45).tolist()
    ours = prefill_logits(loaded.model, loaded.config, ids)
    with torch.no_grad():
        ref = hf_model(torch.tensor([ids])).logits[0].float().numpy()
    diff = np.abs(ours - ref).max()
    print(f"{case}: max abs logit diff {diff:.2e} (logit scale {np.abs(ref).max():.2f})")
    assert diff < 1e-4, diff


def test_bfloat16_error_is_no_worse_than_transformers(hybrid):
    """In bfloat16 (the convolution's state too) our logits stray from the float32 truth no
    more than transformers' own bfloat16 run does (twice its error, plus slack)."""
    case, path, hf_model = hybrid
    ids = np.random.default_rng(2).integers(3, VOCAB, size=53).tolist()
    ours_err, theirs_err = bfloat16_errors(path, hf_model, ids)
    print(f"{case} bfloat16: max abs error ours {ours_err:.3g}, transformers {theirs_err:.3g}")
    assert ours_err <= 2 * theirs_err + 1e-2, (ours_err, theirs_err)


def _assert_idle(llm: LLM) -> None:
    """No request or page is held, and a state slot (a batch row) only by a request that
    finished in the last step: the runner drops those rows at the next step that runs, before
    it adds that step's new ones."""
    kv = llm.kv_cache_manager
    kv.check_invariants()
    assert not llm.engine.has_unfinished_requests()
    assert kv.num_free_blocks == kv.num_pages
    assert set(llm.runner.input_batch.row_of) <= set(llm.engine.scheduler._finished_ids)


def test_greedy_tokens_match_transformers(hybrid):
    """24 greedy tokens each for prompts shorter and longer than a step's 16-token budget
    (chunked: the state carried across chunks), batched and alone with an empty prefix cache,
    then again from the prefix cache: the attention pages and the linear layers' state saved
    at the prompts' page boundaries."""
    case, path, hf_model = hybrid
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, VOCAB, size=n).tolist() for n in (7, 40, 29)]
    expected = greedy_reference(hf_model, prompts, 24)
    llm = LLM(
        path,
        dtype="float32",
        page_size=8,
        num_pages=64,
        max_num_seqs=4,
        max_num_batched_tokens=16,
        max_model_len=256,
        num_state_snapshots=12,  # room for every prompt's saves beside the decodes'
    )
    kv = llm.kv_cache_manager
    assert llm.config.cache.enable_prefix_caching and kv.snapshots.num_slots == 12
    compiled = llm.runner.num_compilations
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    inputs = [{"prompt_token_ids": ids} for ids in prompts]
    alone = []
    for i in inputs:
        assert llm.reset_prefix_cache()
        alone.append(llm.generate(i, params, use_tqdm=False)[0].outputs[0].token_ids)
    assert llm.reset_prefix_cache()
    batched = [o.outputs[0].token_ids for o in llm.generate(inputs, params, use_tqdm=False)]
    assert kv.prefix_cache_hits == 0
    hits, saved_hits = kv.prefix_cache_hits, kv.snapshots.num_hits
    again = [o.outputs[0].token_ids for o in llm.generate(inputs, params, use_tqdm=False)]
    assert batched == expected, case
    assert alone == expected, case
    assert again == expected, case
    # Served from saved states: the 40-token prompt from 32 tokens, the 29-token one from 24.
    assert kv.prefix_cache_hits - hits == 32 + 24
    assert kv.snapshots.num_hits - saved_hits == 2
    assert llm.runner.num_compilations == compiled  # warmup compiled every program
    _assert_idle(llm)


def test_a_returning_conversation_starts_from_its_saved_state(tmp_path):
    """A conversation returns with its answer and a new turn: it starts from the state saved
    where its decode last reached a page boundary (each such save replacing the one before),
    and its tokens are transformers'. A prefix whose state was evicted is recomputed."""
    hf_model = write_family_checkpoint("qwen3.5", tmp_path)
    rng = np.random.default_rng(4)
    first = rng.integers(3, VOCAB, size=21).tolist()
    llm = LLM(
        tmp_path,
        dtype="float32",
        page_size=8,
        num_pages=64,
        max_num_seqs=2,
        max_num_batched_tokens=16,
        max_model_len=128,
        num_state_snapshots=3,
        skip_warmup=True,
    )
    kv = llm.kv_cache_manager
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    answer = llm.generate({"prompt_token_ids": first}, params, use_tqdm=False)
    answer = answer[0].outputs[0].token_ids
    # Its 41 tokens computed up to 40: saved at 16 (the prompt's first chunk ends there) and
    # 40 (its last decode boundary: the saves at 24 and 32 were replaced).
    assert not kv.snapshots.pending and len(kv.snapshots.cached) == 2
    turn = first + answer + rng.integers(3, VOCAB, size=6).tolist()
    expected = greedy_reference(hf_model, [turn], 12)
    hits = kv.prefix_cache_hits
    out = llm.generate({"prompt_token_ids": turn}, params, use_tqdm=False)
    assert kv.prefix_cache_hits - hits == 40
    assert out[0].outputs[0].token_ids[:12] == expected[0]
    # Evicted: three other prompts' saves take the slots; the conversation is recomputed.
    for n in (17, 18, 19):
        other = {"prompt_token_ids": rng.integers(3, VOCAB, size=n).tolist()}
        llm.generate(other, params, use_tqdm=False)
    hits = kv.prefix_cache_hits
    out = llm.generate({"prompt_token_ids": turn}, params, use_tqdm=False)
    assert kv.prefix_cache_hits == hits
    assert out[0].outputs[0].token_ids[:12] == expected[0]
    _assert_idle(llm)


def test_the_tpu_kernels_serve_a_hybrid(tmp_path):
    """The TPU's programs, interpreted on this CPU: the Mosaic kernels of attention and of the
    delta rule (`attention_backend="pallas"` is the TPU's kernels here) give transformers'
    greedy tokens, for prompts chunked across steps and batched."""
    from jaxllm.config.kernels import CompilationConfig, using_kernels
    from jaxllm.models.linear_attention import delta_rule_backend

    with using_kernels(CompilationConfig(attention_backend="pallas")):
        assert delta_rule_backend() == "pallas_tpu"
    hf_model = write_family_checkpoint("qwen3.5", tmp_path)
    rng = np.random.default_rng(5)
    prompts = [rng.integers(3, VOCAB, size=n).tolist() for n in (40, 7)]
    expected = greedy_reference(hf_model, prompts, 8)
    llm = LLM(
        tmp_path,
        dtype="float32",
        page_size=8,
        num_pages=32,
        max_num_seqs=2,
        max_num_batched_tokens=32,
        max_model_len=64,
        attention_backend="pallas",
        enable_prefix_caching=False,
        skip_warmup=True,
    )
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in out] == expected
    _assert_idle(llm)


def test_preempted_requests_recompute_their_state(tmp_path):
    """Pages too few for four growing requests: the newest are preempted, their rows (and
    state slots) handed to others, and recomputed from a zero state: the tokens are
    unchanged."""
    hf_model = write_family_checkpoint("qwen3.5", tmp_path)
    rng = np.random.default_rng(2)
    prompts = [rng.integers(3, VOCAB, size=n).tolist() for n in (30, 25, 33, 20)]
    expected = greedy_reference(hf_model, prompts, 32)
    llm = LLM(
        tmp_path,
        dtype="float32",
        page_size=8,
        num_pages=16,
        max_num_seqs=4,
        max_num_batched_tokens=16,
        max_model_len=128,
        skip_warmup=True,
    )
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in out] == expected
    _assert_idle(llm)


def test_an_8bit_kv_cache_holds_the_attention_layers(tmp_path):
    """`kv_cache_dtype` int8: the attention layers' pages are 8-bit with their scales, the
    linear layers' state stays float32; a mixed batch gives each request the tokens it gets
    alone, with the prefix cache's saved states too, and those tokens are transformers' (the
    8-bit error is far below the tiny model's logit gaps for these prompts)."""
    hf_model = write_family_checkpoint("qwen3.5", tmp_path)
    rng = np.random.default_rng(5)
    prompts = [rng.integers(3, VOCAB, size=n).tolist() for n in (9, 37, 24)]
    expected = greedy_reference(hf_model, prompts, 8)
    llm = LLM(
        tmp_path,
        dtype="float32",
        kv_cache_dtype="int8",
        page_size=8,
        num_pages=48,
        max_num_seqs=4,
        max_num_batched_tokens=16,
        max_model_len=128,
        skip_warmup=True,
    )
    assert llm.runner.kv_cache.scales is not None
    assert llm.runner.device.cache.linear.recurrent.dtype == jnp.float32
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    batched = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    batched = [o.outputs[0].token_ids for o in batched]
    alone = [
        llm.generate({"prompt_token_ids": p}, params, use_tqdm=False)[0].outputs[0].token_ids
        for p in prompts
    ]
    assert batched == alone == expected
    _assert_idle(llm)


def test_the_plan_counts_the_state_and_refuses_what_it_cannot_serve(tmp_path):
    """The recurrent state (a slot per request) and the prefix cache's saved states are
    entries of the memory plan, taken out of the KV pool; only the attention layers have KV
    pages; without saved states prefix caching is off; the host tier and speculative decoding
    are refused by name."""
    write_family_checkpoint("qwen3-next", tmp_path)
    model_config = load_hf_config(tmp_path)
    gib = 2**-8
    config = EngineConfig.create(
        str(tmp_path), max_num_seqs=8, max_num_batched_tokens=64, cpu_kv_cache_gib=gib
    )

    def plan(config):
        return plan_engine(config, model_config, DeviceMemory(None), dtype=jnp.float32)

    la = model_config.linear_attention
    per_layer = 4 * ((la.conv_kernel - 1) * la.conv_dim + 4 * 16 * 8)
    slot = 3 * per_layer
    assert state_bytes_per_slot(model_config, jnp.float32) == slot
    full = plan(config)
    assert full.memory["recurrent state"] == 8 * slot
    assert full.memory["saved states"] == 8 * slot  # max_num_seqs of them: they fit
    assert full.kv_groups.layers == ((3,),)  # the one attention layer
    assert full.num_pages == (int(gib * 2**30) - 16 * slot) // full.page_bytes
    assert full.config.cache.enable_prefix_caching and full.num_state_snapshots == 8
    # A quarter of what is left after the running state, when that holds fewer.
    small = plan(config.replace(cpu_kv_cache_gib=(8 * slot + 4 * 5 * slot) / 2**30))
    assert small.num_state_snapshots == 5
    for off in ({"mamba_cache_mode": "none"}, {"num_state_snapshots": 0}):
        p = plan(config.replace(**off))
        assert not p.config.cache.enable_prefix_caching, off
        assert p.memory["saved states"] == 0 and p.num_state_snapshots == 0
    with pytest.raises(ValueError, match="kv_offloading_size.*linear-attention"):
        plan(config.replace(kv_offloading_size=1.0))
    spec = config.replace(speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="speculative_config.*linear-attention"):
        plan(spec)


def test_tensor_parallel_splits_the_linear_heads(tmp_path):
    """1 and 2 fake CPU devices: each device runs the recurrence of its own key heads (and
    holds their state); the same greedy tokens, nothing compiled after warmup, half the
    weights per device. A size that does not divide the linear key heads is refused by
    name."""
    from jaxllm.sharding import shard_config

    write_family_checkpoint("qwen3-next", tmp_path / "ckpt")
    rows = tensor_parallel_report(tmp_path / "ckpt", "1,2", tmp_path)
    assert [r["same_tokens_as_first"] for r in rows] == [True, True]
    assert [r["compiled_after_warmup"] for r in rows] == [0, 0]
    assert rows[1]["param_bytes_per_device"] < 0.51 * rows[0]["param_bytes"]
    config = load_hf_config(tmp_path / "ckpt")  # 2 linear key heads, 2 kv heads
    with pytest.raises(ValueError, match="linear_num_key_heads"):
        shard_config(config, 4)


def test_image_text_checkpoint_serves_its_text_decoder(tmp_path):
    """A Qwen3_5ForConditionalGeneration checkpoint (as Qwen3.5 is published: the decoder
    under `model.language_model.`, a vision tower, and `mtp.*` layers) serves its text
    decoder, skipping the rest: the greedy tokens of transformers' model."""
    from safetensors.numpy import load_file, save_file

    from helpers import FAMILY_COMMON, write_tiny_tokenizer

    text = {**FAMILY_COMMON, **HYBRIDS["qwen3.5"][2]}
    vision = dict(
        depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
        patch_size=8, spatial_merge_size=2, temporal_patch_size=2,
    )  # fmt: skip
    torch.manual_seed(0)
    config = transformers.Qwen3_5Config(text_config=text, vision_config=vision)
    hf_model = transformers.Qwen3_5ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for p in hf_model.parameters():
            p.add_(torch.randn_like(p) * (0.3 if p.ndim == 1 else 0.02))
    hf_model.save_pretrained(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    tensors["mtp.fc.weight"] = np.zeros((64, 128), np.float32)  # a speculative head
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    write_tiny_tokenizer(tmp_path, vocab_size=VOCAB)
    prompt = np.random.default_rng(3).integers(3, VOCAB, 21).tolist()
    expected = greedy_reference(hf_model, [prompt], 12)[0]
    llm = LLM(tmp_path, dtype="float32", max_model_len=128, max_num_seqs=2, skip_warmup=True)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    out = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)
    assert out[0].outputs[0].token_ids == expected
