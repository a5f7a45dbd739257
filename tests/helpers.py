"""Shared test helpers: running a loaded model directly (no engine) for logit comparisons, and
ragged attention cases with a dense numpy ground truth."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm.models import AttentionMetadata, ModelCache, StepExtras
from jaxllm.models.linear_attention import LinearState, StateSlots
from jaxllm.testing import write_tiny_tokenizer
from jaxllm.worker.kv_groups import kv_cache_groups
from pallas_kernels import KVCache, get_kv_cache_shape
from pallas_kernels.kv_cache import quantize_kv_cache


def prefill_logits(model, config, token_ids: list[int], page_size: int = 16) -> np.ndarray:
    """Logits f32[T, V] for every position of one sequence, through the paged-cache path."""
    num_tokens = len(token_ids)
    pages = -(-num_tokens // page_size)
    groups = kv_cache_groups(config, hybrid=False)  # one block table for every layer
    shape = get_kv_cache_shape(
        max(groups.num_slots, 1),
        pages,
        page_size,
        config.cache_kv_heads,
        config.cache_head_dim,
        latent=config.latent_attention is not None,
    )
    cache = jnp.zeros(shape, jnp.float32)
    meta = AttentionMetadata(
        layer_slots=groups.layer_slots,
        slot_mapping=jnp.arange(num_tokens, dtype=jnp.int32)[None],
        seq_lens=jnp.array([num_tokens], jnp.int32),
        block_tables=jnp.arange(pages, dtype=jnp.int32)[None, None],
        cu_q_lens=jnp.array([0, num_tokens], jnp.int32),
        num_seqs=jnp.array([1], jnp.int32),
    )
    ids = jnp.asarray(token_ids, jnp.int32)
    positions = jnp.arange(num_tokens, dtype=jnp.int32)
    linear, extras = None, None
    if config.linear_attention is not None:  # a hybrid: one request's recurrent state
        shapes = LinearState.shapes(config, 1, jnp.float32)
        linear = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
        zero = jnp.zeros((1,), jnp.int32)
        extras = StepExtras(state_slots=StateSlots(read=zero, write=zero))
    hidden, _ = model(ids, positions, ModelCache(kv=cache, linear=linear), meta, extras)
    return np.asarray(model.compute_logits(hidden))


def bfloat16_errors(path, hf_model, ids: list[int]) -> tuple[float, float]:
    """(ours, transformers') largest logit error in bfloat16 against transformers' float32
    logits of `ids`: our loader and forward pass in bfloat16, and `hf_model` cast to it."""
    import copy

    import torch

    from jaxllm.loaders import load_model

    loaded = load_model(path, dtype=jnp.bfloat16, load_tokenizer=False)
    ours = prefill_logits(loaded.model, loaded.config, ids)
    with torch.no_grad():
        truth = hf_model(torch.tensor([ids])).logits[0].float().numpy()
        hf_bf16 = copy.deepcopy(hf_model).to(torch.bfloat16)
        theirs = hf_bf16(torch.tensor([ids])).logits[0].float().numpy()
    return float(np.abs(ours - truth).max()), float(np.abs(theirs - truth).max())


def quantize_case_cache(cache: np.ndarray, dtype) -> KVCache:
    """`make_case`'s NaN-filled float cache as an 8-bit `KVCache` of `dtype`: the written
    tokens quantized as `write_kv` does, every unused slot's scales NaN (and, for fp8, its
    data NaN too), so reading one still poisons the output."""
    unused = np.isnan(cache).any(-1)  # [L, P, K, S]
    data, scales = quantize_kv_cache(jnp.asarray(np.nan_to_num(cache)), dtype)
    if jnp.dtype(dtype) == jnp.float8_e4m3fn:  # stored as bytes; 0x7f is e4m3's NaN
        data = jnp.where(jnp.asarray(unused)[..., None], jnp.uint8(0x7F), data)
    # Scales lanes are (head, K or V, token) per page: NaN where the token's slot is unused.
    num_layers, num_pages, num_kv_heads, page_size, _ = cache.shape
    unused = np.repeat(unused[:, :, :, None, :], 2, axis=3).reshape(scales.shape)
    scales = np.where(unused, np.nan, np.asarray(scales))
    return KVCache(data, jnp.asarray(scales, jnp.float32))


def dense_attention(
    q, k, v, q_len, sm_scale, sliding_window=None, soft_cap=None, sinks=None, chunk=None
):
    """q: [q_len, N, H]; k, v: [kv_len, K, H]; the queries are the last q_len positions.
    `sinks` [N]: a logit per head in every softmax's denominator (gpt-oss, as transformers'
    eager attention: one more column, dropped after the softmax). `chunk`: Llama 4's chunked
    attention, keys of the query's own chunk only."""
    kv_len, num_kv, _ = k.shape
    group = q.shape[1] // num_kv
    k = np.repeat(k, group, axis=1)
    v = np.repeat(v, group, axis=1)
    s = np.einsum("qnh,knh->nqk", q, k) * sm_scale
    if soft_cap is not None:
        s = soft_cap * np.tanh(s / soft_cap)
    pos = np.arange(kv_len - q_len, kv_len)[:, None]
    kpos = np.arange(kv_len)[None, :]
    mask = kpos <= pos
    if sliding_window is not None:
        mask &= kpos > pos - sliding_window
    if chunk is not None:
        mask &= kpos // chunk == pos // chunk
    s = np.where(mask[None], s, -np.inf)
    if sinks is not None:
        column = np.broadcast_to(np.asarray(sinks, s.dtype)[:, None, None], (*s.shape[:2], 1))
        s = np.concatenate([s, column], axis=-1)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    if sinks is not None:
        p = p[..., :-1]
    return np.einsum("nqk,knh->qnh", p, v)


def make_case(rng, seqs, *, num_heads, num_kv_heads, head_dim, page_size, max_reqs, t_pad, dtype):
    """seqs: list of (q_len, kv_len). Builds a NaN-filled cache holding each request's K/V in
    shuffled pages, and the padded metadata arrays."""
    pages_per_seq = max(-(-kv // page_size) for _, kv in seqs) + 1
    num_pages = sum(-(-kv // page_size) for _, kv in seqs) + 3
    # Two layers; the request data lives in layer 1 and everything else is NaN, so reading the
    # wrong layer, a page outside the block table, or a slot past the length poisons the output.
    cache = np.full(
        get_kv_cache_shape(2, num_pages, page_size, num_kv_heads, head_dim), np.nan, np.float32
    )
    perm = rng.permutation(num_pages)
    block_tables = np.zeros((max_reqs, pages_per_seq), np.int32)
    seq_lens = np.zeros(max_reqs, np.int32)
    cu = np.zeros(max_reqs + 1, np.int32)
    qs, ks, vs = [], [], []
    used = 0
    for r, (q_len, kv_len) in enumerate(seqs):
        n = -(-kv_len // page_size)
        pages = perm[used : used + n]
        used += n
        block_tables[r, :n] = pages
        k = rng.standard_normal((kv_len, num_kv_heads, head_dim)).astype(np.float32)
        v = rng.standard_normal((kv_len, num_kv_heads, head_dim)).astype(np.float32)
        for t in range(kv_len):
            page, off = pages[t // page_size], t % page_size
            cache[1, page, :, off, :head_dim] = k[t]
            cache[1, page, :, off, head_dim:] = v[t]
        qs.append(rng.standard_normal((q_len, num_heads, head_dim)).astype(np.float32))
        ks.append(k)
        vs.append(v)
        seq_lens[r] = kv_len
        cu[r + 1] = cu[r] + q_len
    cu[len(seqs) + 1 :] = cu[len(seqs)]
    total = int(cu[len(seqs)])
    q = np.full((t_pad, num_heads, head_dim), 0.5, np.float32)  # padding rows: arbitrary
    q[:total] = np.concatenate(qs)
    # Round inputs to the dtype so the f32 numpy reference sees the same values.
    q = np.asarray(jnp.asarray(q, dtype).astype(jnp.float32))
    cache = np.asarray(jnp.asarray(cache, dtype).astype(jnp.float32))
    ks = [np.asarray(jnp.asarray(k, dtype).astype(jnp.float32)) for k in ks]
    vs = [np.asarray(jnp.asarray(v, dtype).astype(jnp.float32)) for v in vs]
    return q, cache, seq_lens, block_tables, cu, qs, ks, vs, total


MIXES = {
    "decode": [(1, 1), (1, 17), (1, 255), (1, 513), (1, 3)],
    "prefill": [(3, 3), (16, 16), (17, 17), (255, 255)],
    "chunked": [(16, 513), (3, 17), (17, 255)],
    "mixed": [(1, 513), (17, 17), (16, 255), (1, 1), (3, 16)],
}


def shape_matrix(configs: list, ids) -> list:
    """pytest params (config, mix) of every config with every mix in `MIXES`. By default
    (the suite's time) each config runs once, with "mixed", and each mix once, with the
    second config; the rest of the matrix is `slow`."""
    return [
        pytest.param(
            config,
            mix,
            id=f"{ids(config)}-{mix}",
            marks=() if mix == "mixed" or config is configs[1] else pytest.mark.slow,
        )
        for config in configs
        for mix in MIXES
    ]


TENSOR_PARALLEL_CHECK = Path(__file__).parent.parent / "scripts" / "tensor_parallel_check.py"


def tensor_parallel_report(model, tp: str, tmp_path, *extra: str) -> list[dict]:
    """Runs `scripts/tensor_parallel_check.py` on 8 fake CPU devices in a subprocess (the
    device count must be set before JAX starts; the rest of the suite runs on one device) and
    returns its rows, one per tensor-parallel size in `tp` ("1,2,4")."""
    out = tmp_path / "report.json"
    args = ["--tp", tp, "--cpu-devices", "8", "--json", str(out), *extra]
    proc = subprocess.run(
        [sys.executable, str(TENSOR_PARALLEL_CHECK), str(model), *args],
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert out.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    print(proc.stdout)  # the table, for the log
    return json.loads(out.read_text())


VOCAB = 400
WINDOW = 24
FAMILY_COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=24,  # not hidden / heads
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
SLIDING, FULL = "sliding_attention", "full_attention"
MOE = dict(num_experts_per_tok=2, moe_intermediate_size=40)

# Tiny random checkpoints of every family, written by transformers (tests that use them need
# torch): {case: (transformers config class, model class, config overrides)}.
FAMILIES = {
    "gemma3": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        dict(
            sliding_window=WINDOW,
            layer_types=[SLIDING, SLIDING, FULL, SLIDING],
            query_pre_attn_scalar=32,
            rope_parameters={
                FULL: {"rope_type": "linear", "factor": 2.0, "rope_theta": 1_000_000.0},
                SLIDING: {"rope_type": "default", "rope_theta": 10_000.0},
            },
        ),
    ),
    "gemma2-softcap": (
        "Gemma2Config",
        "Gemma2ForCausalLM",
        dict(
            sliding_window=WINDOW,
            query_pre_attn_scalar=32,
            attn_logit_softcapping=5.0,
            final_logit_softcapping=3.0,
        ),
    ),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(tie_word_embeddings=True)),
    "llama3.1-rope": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 500_000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            }
        ),
    ),
    "mixtral": (
        "MixtralConfig",
        "MixtralForCausalLM",
        dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=WINDOW),
    ),
    "qwen3-moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        dict(num_experts=6, norm_topk_prob=True, mlp_only_layers=[1], **MOE),
    ),
    # Sinks, alternating sliding and full layers, YaRN, biased experts with a clamp tight
    # enough to bite at these weights' scale.
    "gpt-oss": (
        "GptOssConfig",
        "GptOssForCausalLM",
        dict(
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=WINDOW,
            swiglu_limit=0.3,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 150_000.0,
                "factor": 8.0,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "truncate": False,
                "original_max_position_embeddings": 64,
            },
        ),
    ),
    # Chunked layers (RoPE on adjacent pairs, L2 q/k norms) and a layer without RoPE whose
    # queries warm up past floor_scale, MoE layers (top-1 by sigmoid, a shared expert)
    # between dense ones.
    "llama4": (
        "Llama4TextConfig",
        "Llama4ForCausalLM",
        dict(
            num_local_experts=4,
            num_experts_per_tok=1,
            interleave_moe_layer_step=2,
            intermediate_size_mlp=128,
            attention_chunk_size=WINDOW,
            no_rope_layer_interval=2,
            floor_scale=8,
            attn_scale=0.5,
        ),
    ),
    # Gemma 4: wider, fewer full-attention heads (48 against 24: two sliding heads share a
    # cache row) whose values are their keys, proportional RoPE, per-layer inputs, the last two
    # layers reading the KV of the last earlier layer of their kind with double-wide MLPs.
    "gemma4": (
        "Gemma4TextConfig",
        "Gemma4ForCausalLM",
        dict(
            num_hidden_layers=6,
            sliding_window=WINDOW,
            layer_types=[SLIDING, SLIDING, FULL, SLIDING, SLIDING, FULL],
            global_head_dim=48,
            num_global_key_value_heads=1,
            attention_k_eq_v=True,
            num_kv_shared_layers=2,
            use_double_wide_mlp=True,
            hidden_size_per_layer_input=8,
            vocab_size_per_layer_input=VOCAB,
            final_logit_softcapping=30.0,
        ),
    ),
    # Gemma 4's MoE block beside every dense MLP; sliding layers with 4 kv heads (two cache
    # rows) and full ones with 4 of 48 (four rows: two slots each).
    "gemma4-moe": (
        "Gemma4TextConfig",
        "Gemma4ForCausalLM",
        dict(
            num_key_value_heads=4,
            sliding_window=WINDOW,
            layer_types=[SLIDING, FULL, SLIDING, FULL],
            global_head_dim=48,
            enable_moe_block=True,
            num_experts=4,
            top_k_experts=2,
            moe_intermediate_size=40,
            hidden_size_per_layer_input=0,
        ),
    ),
    # DeepSeek-V3: latent attention (q through its own low rank, values narrower than the
    # keys' no-RoPE part is wide), YaRN with its softmax mscale, RoPE on adjacent pairs; a dense
    # first layer, then 8 experts in 4 groups (2 kept) chosen by sigmoid with a correction
    # bias, renormalised and scaled, beside a shared expert.
    "deepseek-v3": (
        "DeepseekV3Config",
        "DeepseekV3ForCausalLM",
        dict(
            num_key_value_heads=4,
            q_lora_rank=32,
            kv_lora_rank=40,
            qk_nope_head_dim=16,
            qk_rope_head_dim=8,
            head_dim=8,  # transformers' RoPE width (FAMILY_COMMON's would win over its own)
            v_head_dim=24,
            n_routed_experts=8,
            n_shared_experts=1,
            moe_intermediate_size=32,
            n_group=4,
            topk_group=2,
            num_experts_per_tok=2,
            first_k_dense_replace=1,
            routed_scaling_factor=2.5,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 10_000.0,
                "factor": 8.0,
                "original_max_position_embeddings": 64,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "mscale": 1.0,
                "mscale_all_dim": 1.0,
            },
        ),
    ),
    # DeepSeek-V2(-Lite): a plain q projection, softmax routing within the groups whose best
    # expert is best, unnormalised, two shared experts.
    "deepseek-v2": (
        "DeepseekV2Config",
        "DeepseekV2ForCausalLM",
        dict(
            num_key_value_heads=4,
            q_lora_rank=None,
            kv_lora_rank=24,
            qk_nope_head_dim=16,
            qk_rope_head_dim=8,
            head_dim=8,
            v_head_dim=16,
            n_routed_experts=8,
            n_shared_experts=2,
            moe_intermediate_size=32,
            topk_method="group_limited_greedy",
            n_group=4,
            topk_group=2,
            num_experts_per_tok=3,
            first_k_dense_replace=1,
            routed_scaling_factor=1.5,
        ),
    ),
    "qwen3-moe-sparse-step": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        dict(num_experts=4, norm_topk_prob=False, decoder_sparse_step=2, **MOE),
    ),
}


# The hybrid linear-attention families (Gated DeltaNet layers between gated attention ones):
# tests/test_hybrid_models.py. Two key heads of 16 and four value heads of 8 (each key head
# serves two value heads), a convolution of 4, partial RoPE (a quarter of head_dim 32).
LINEAR = "linear_attention"
_HYBRID_COMMON = dict(
    head_dim=32,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=8,
    linear_conv_kernel_dim=4,
    layer_types=[LINEAR, FULL, LINEAR, FULL],
)
_HYBRID_MOE = dict(
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=40,
    shared_expert_intermediate_size=48,
)
HYBRIDS = {
    "qwen3.5": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM", _HYBRID_COMMON),
    "qwen3.5-moe": (
        "Qwen3_5MoeTextConfig",
        "Qwen3_5MoeForCausalLM",
        dict(_HYBRID_COMMON, **_HYBRID_MOE),
    ),
    "qwen3-next": (
        "Qwen3NextConfig",
        "Qwen3NextForCausalLM",
        # A dense layer among the MoE ones, and three linear layers in a row.
        dict(
            _HYBRID_COMMON,
            **_HYBRID_MOE,
            mlp_only_layers=[2],
            norm_topk_prob=False,
            layer_types=[LINEAR, LINEAR, LINEAR, FULL],
        ),
    ),
}


def greedy_reference(hf_model, prompts, n):
    """transformers' n greedy tokens per prompt, end-of-sequence included (as `ignore_eos`
    samples it: `generate`'s `min_new_tokens` would mask it instead), each from a full
    forward pass."""
    import torch

    out = []
    for ids in prompts:
        ids = list(ids)
        with torch.no_grad():
            for _ in range(n):
                ids.append(int(hf_model(torch.tensor([ids])).logits[0, -1].argmax()))
        out.append(ids[-n:])
    return out


def write_family_checkpoint(case: str, path, *, tokenizer: bool = True, **overrides) -> object:
    """Writes a tiny random checkpoint of `FAMILIES[case]` (and, with `tokenizer`, a tokenizer)
    to `path`; returns the transformers model."""
    import torch
    import transformers

    config_name, model_name, extra = FAMILIES.get(case) or HYBRIDS[case]
    torch.manual_seed(0)
    config = getattr(transformers, config_name)(**{**FAMILY_COMMON, **extra, **overrides})
    model = getattr(transformers, model_name)(config).eval()
    with torch.no_grad():  # norms start at 0 or 1 and biases at 0: make every weight count
        for p in model.parameters():
            p.add_(torch.randn_like(p) * (0.3 if p.ndim == 1 else 0.02))
        for name, b in model.named_buffers():  # DeepSeek-V3's routing bias is a buffer
            if name.endswith("e_score_correction_bias"):
                b.add_(torch.randn_like(b) * 0.05)
    model.save_pretrained(path, safe_serialization=True)
    if tokenizer:
        write_tiny_tokenizer(path, vocab_size=VOCAB)
    return model


# An image-text chat template for the tiny checkpoints: ChatML, with an image part written as
# the image token (as LLaVA's templates write it).
IMAGE_CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}{% if part['type'] == 'image' %}{{ '<image>' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
    "{{ '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
IMAGE_SIZE, PATCH = 32, 8  # 16 patches: 16 placeholder tokens per image


def save_image_text_model(model_class, config, path):
    """A random image-text model of `config`, every weight counting (norms start at 0 or 1 and
    biases at 0), saved as transformers saves it; returns it."""
    import torch

    torch.manual_seed(0)
    model = model_class(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * (0.3 if p.ndim == 1 else 0.05))
    model.save_pretrained(path, safe_serialization=True)
    return model


def write_llava_checkpoint(path, tower: str = "clip"):
    """A tiny random LLaVA (a CLIP or SigLIP tower, the MLP projector, a Llama decoder) with
    its processor (tokenizer with an `<image>` token, image processor, chat template), as
    transformers writes them; returns the transformers model."""
    import transformers

    path = Path(path)
    write_tiny_tokenizer(path, vocab_size=VOCAB, chat_template=IMAGE_CHATML)
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<image>"]})
    image_token = tokenizer.convert_tokens_to_ids("<image>")
    common = dict(
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=3,
        num_attention_heads=4,
        image_size=IMAGE_SIZE,
        patch_size=PATCH,
    )
    if tower == "clip":
        vision = transformers.CLIPVisionConfig(**common, projection_dim=32)
        images = transformers.CLIPImageProcessor(
            size={"shortest_edge": IMAGE_SIZE},
            crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE},
        )
        extra, strategy, layer = 1, "default", -2
    else:
        vision = transformers.SiglipVisionConfig(**common)
        images = transformers.SiglipImageProcessor(size={"height": IMAGE_SIZE, "width": IMAGE_SIZE})
        extra, strategy, layer = 0, "full", -1
    text = transformers.LlamaConfig(
        vocab_size=VOCAB + 16,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        bos_token_id=1,
        eos_token_id=2,
    )
    config = transformers.LlavaConfig(
        vision_config=vision,
        text_config=text,
        image_token_id=image_token,
        image_seq_length=(IMAGE_SIZE // PATCH) ** 2,
        vision_feature_select_strategy=strategy,
        vision_feature_layer=layer,
    )
    model = save_image_text_model(transformers.LlavaForConditionalGeneration, config, path)
    processor = transformers.LlavaProcessor(
        image_processor=images,
        tokenizer=tokenizer,
        patch_size=PATCH,
        vision_feature_select_strategy=strategy,
        image_token="<image>",
        num_additional_image_tokens=extra,
        chat_template=IMAGE_CHATML,
    )
    processor.save_pretrained(path)
    return model


def write_gemma3_vl_checkpoint(path):
    """A tiny random Gemma 3 image-text model (SigLIP tower, pooled projector to 4 tokens an
    image, a Gemma 3 decoder with a sliding and a global layer) with its processor (the
    `<start_of_image>` placeholder, expanded to begin/4 image tokens/end); returns the
    transformers model."""
    import transformers

    path = Path(path)
    template = IMAGE_CHATML.replace("'<image>'", "'<start_of_image>'")
    write_tiny_tokenizer(path, vocab_size=VOCAB, chat_template=template)
    # Gemma's processor reads its three tokens off the tokenizer (saved with it).
    specials = {"boi_token": "<start_of_image>", "image_token": "<image_soft_token>",
                "eoi_token": "<end_of_image>"}  # fmt: skip
    tokenizer = transformers.AutoTokenizer.from_pretrained(path, extra_special_tokens=specials)
    vision = transformers.SiglipVisionConfig(
        hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        image_size=IMAGE_SIZE, patch_size=PATCH,
    )  # fmt: skip
    text = transformers.Gemma3TextConfig(
        vocab_size=VOCAB + 16, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=6,
        layer_types=["sliding_attention", "full_attention"], query_pre_attn_scalar=16,
        max_position_embeddings=1024, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )  # fmt: skip
    config = transformers.Gemma3Config(
        vision_config=vision,
        text_config=text,
        mm_tokens_per_image=4,
        image_token_index=tokenizer.image_token_id,
        boi_token_index=tokenizer.boi_token_id,
        eoi_token_index=tokenizer.eoi_token_id,
    )
    model = save_image_text_model(transformers.Gemma3ForConditionalGeneration, config, path)
    images = transformers.Gemma3ImageProcessor(size={"height": IMAGE_SIZE, "width": IMAGE_SIZE})
    processor = transformers.Gemma3Processor(
        image_processor=images, tokenizer=tokenizer, image_seq_length=4, chat_template=template
    )
    processor.save_pretrained(path)
    return model


QWEN_VL_MAX_PIXELS = 28 * 28 * 48  # at most 48 tokens an image: several 4 x 4 windows


def write_qwen25_vl_checkpoint(path, version: str = "2.5"):
    """A tiny random Qwen2.5-VL (windowed vision tower with 2-D RoPE and patch merger, a Qwen2
    decoder with M-RoPE), or with `version` "2" Qwen2-VL (its tower without windows, with
    LayerNorms and a plain MLP), with its tokenizer (the
    `<|vision_start|><|image_pad|><|vision_end|>` placeholder), image processor (images of 4
    to 48 tokens) and chat template, as transformers writes them; returns the transformers
    model. Its processor is not saved: building one needs torchvision (for video), as does
    loading one."""
    import transformers
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    path = Path(path)
    template = IMAGE_CHATML.replace("'<image>'", f"'{QWEN_VL_PLACEHOLDER}'")
    write_tiny_tokenizer(path, vocab_size=VOCAB, chat_template=template)
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    specials = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
    tokenizer.add_special_tokens({"additional_special_tokens": specials})
    tokenizer.save_pretrained(path)
    ids = dict(zip(specials, tokenizer.convert_tokens_to_ids(specials), strict=True))
    text = dict(
        vocab_size=VOCAB + 16, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6,
        max_position_embeddings=1024, bos_token_id=1, eos_token_id=2, pad_token_id=0,
        rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 1e6},
    )  # fmt: skip
    common = dict(
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
    )  # fmt: skip
    if version == "2":
        vision = dict(depth=3, embed_dim=32, mlp_ratio=2, num_heads=2, hidden_size=64)
        config = transformers.Qwen2VLConfig(text_config=text, vision_config=vision, **common)
        model_class = transformers.Qwen2VLForConditionalGeneration
    else:
        vision = dict(
            depth=4, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=64,
            window_size=112, fullatt_block_indexes=[1, 3], hidden_act="silu",
        )  # fmt: skip
        config = transformers.Qwen2_5_VLConfig(text_config=text, vision_config=vision, **common)
        model_class = transformers.Qwen2_5_VLForConditionalGeneration
    model = save_image_text_model(model_class, config, path)
    images = Qwen2VLImageProcessorPil(min_pixels=28 * 28 * 4, max_pixels=QWEN_VL_MAX_PIXELS)
    images.save_pretrained(path)
    return model


QWEN_VL_PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"


class QwenVLProcessor:
    """Qwen2.5-VL's processor as transformers' `Qwen2_5_VLProcessor` computes it for images
    (that class needs torchvision to load): the image processor's patches and grids, each
    `<|image_pad|>` repeated as its image's tokens, and `mm_token_type_ids` (without which
    transformers' model silently falls back to 1-D positions)."""

    def __init__(self, path, **image_kwargs):
        import transformers

        self.tokenizer = transformers.AutoTokenizer.from_pretrained(path)
        self.image_processor = transformers.AutoImageProcessor.from_pretrained(path, **image_kwargs)
        self.image_token_id = self.tokenizer.convert_tokens_to_ids("<|image_pad|>")

    def __call__(self, text, images=None, return_tensors="pt", **kwargs):
        import numpy as np
        import torch

        (text,) = text
        out = {}
        if images:
            pixels = self.image_processor(images=images, return_tensors="np")
            parts = text.split("<|image_pad|>")
            grids = pixels["image_grid_thw"]
            text = parts[0] + "".join(
                "<|image_pad|>" * (int(np.prod(g)) // 4) + rest
                for g, rest in zip(grids, parts[1:], strict=True)
            )
            out = {"pixel_values": pixels["pixel_values"], "image_grid_thw": grids}
        ids = np.asarray([self.tokenizer(text)["input_ids"]])
        out.update(
            input_ids=ids,
            attention_mask=np.ones_like(ids),
            mm_token_type_ids=(ids == self.image_token_id).astype(np.int64),
        )
        if return_tensors == "pt":
            out = {k: torch.from_numpy(np.asarray(v)) for k, v in out.items()}
        return out


# ---- the KV cache manager's books, driven as the scheduler drives them -----------------------


def book_request(rid: str, tokens: list[int], max_tokens: int = 8, **kwargs):
    """A greedy request for a `KVCacheManager` made by hand (no engine)."""
    from jaxllm import SamplingParams
    from jaxllm.engine.request import Request

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return Request(rid, tokens, params, eos_token_ids=(), max_tokens=max_tokens, seed=0, **kwargs)


def admit(kv, req) -> int:
    """Admits and fully computes a request's prompt, like the scheduler would; returns the
    tokens its prefix-cache hit covered."""
    blocks, cached = kv.get_computed_blocks(req)
    req.num_computed_tokens = cached
    assert kv.allocate_slots(req, req.num_tokens - cached, blocks)
    req.num_computed_tokens = req.num_tokens
    kv.cache_full_blocks(req)
    kv.check_invariants()
    return cached


def token_ids(outputs) -> list[list[int]]:
    """Every completion's tokens, request by request."""
    return [c.token_ids for o in outputs for c in o.outputs]


def recorded_drafts(llm) -> list[dict[str, list[int]]]:
    """The drafts `llm`'s proposer returns from now on, step by step ({request id: drafts})."""
    proposed: list[dict] = []
    propose = llm.runner.proposer.propose
    llm.runner.proposer.propose = lambda *a: proposed.append(propose(*a)) or proposed[-1]
    return proposed
