"""Multi-head latent attention (DeepSeek-V2/V3, Kimi K2), with the cache holding only each
token's latent.

Shapes (V3's in brackets): D model width, N heads [128], L = kv_lora_rank [512], P =
qk_nope_head_dim [128], R = qk_rope_head_dim [64] (the config's `head_dim`), V = v_head_dim
[128]. As transformers computes it:

    q          = q_b_proj(norm(q_a_proj(x)))  or  q_proj(x)       [T, N, P + R]
    c_kv, k_pe = kv_a_proj_with_mqa(x)                             [T, L], [T, R]
    c_kv       = norm(c_kv);  q_pe, k_pe = RoPE(q[..., P:]), RoPE(k_pe)
    k_nope, v  = kv_b_proj(c_kv)                                   [T, N, P], [T, N, V]
    out        = o_proj(softmax([q_nope | q_pe] . [k_nope | k_pe] * scale) v)

Here in the absorbed form (vLLM's and tpu-inference's): kv_b_proj's key half W_UK [L, N, P]
is folded into the query (`ql = q_nope W_UK^T`, [T, N, L]) and its value half W_UV [L, N, V]
applied after attention, so attention runs over the rows [c_kv | k_pe] that the cache keeps,
one per token whatever N (576 values for V3, against N x (P + R + V) = 40,960 expanded). The
rows are paired in the cache's pages (`pallas_kernels.write_latent`); attention is
`pallas_kernels.mla_paged_attention`. Prefill and decode both take this form. (vLLM expands
long prefills back to per-head keys, cheaper in FLOPs there; not done here.)

Tensor parallelism splits the heads (q's projections, kv_b_proj and o_proj by head) over the
"model" axis. The latent is every head's, so each device keeps all of it: the config repeats
the one kv head per device (`sharding.shard_config`), as vLLM replicates it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

import pallas_kernels
from jaxllm.config import ModelConfig, kernel_choices
from jaxllm.models.layers import (
    AttentionMetadata,
    RMSNorm,
    Rope,
    apply_rope,
    linear,
    linears,
    param,
)
from jaxllm.sharding import kv_cache_specs
from pallas_kernels import KVCache

# The low-rank norms' eps: transformers builds them with its RMSNorm's default, whatever
# rms_norm_eps says.
_LOW_RANK_EPS = 1e-6


class MLAttention(nnx.Module):
    def __init__(self, config: ModelConfig, layer: int, *, dtype, mesh=None, rngs: nnx.Rngs | None):
        mla = config.latent_attention
        d, n = config.hidden_size, config.num_heads
        lat, nope, rope, v = mla.kv_lora_rank, mla.qk_nope_head_dim, config.head_dim, mla.v_head_dim
        q_width = n * (nope + rope)
        if mla.q_lora_rank is None:
            self.q_proj = param(rngs, (d, q_width), ("embed", "q_heads"), dtype)
            self.q_a_proj = self.q_a_layernorm = self.q_b_proj = None
        else:
            self.q_proj = None
            self.q_a_proj = param(rngs, (d, mla.q_lora_rank), ("embed", None), dtype)
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank, _LOW_RANK_EPS, axis=None, dtype=dtype)
            self.q_b_proj = param(rngs, (mla.q_lora_rank, q_width), (None, "q_heads"), dtype)
        self.kv_a_proj_with_mqa = param(rngs, (d, lat + rope), ("embed", None), dtype)
        self.kv_a_layernorm = RMSNorm(lat, _LOW_RANK_EPS, axis=None, dtype=dtype)
        # [L, N * (P + V)]: each head's key columns then its value columns.
        self.kv_b_proj = param(rngs, (lat, n * (nope + v)), (None, "q_heads"), dtype)
        self.o_proj = param(rngs, (n * v, d), ("q_heads", "embed"), dtype)
        self.dims = (n, lat, nope, rope, v)
        self.kv_copies = config.layer_num_kv_heads(layer)  # one per device under TP
        self.sm_scale = mla.softmax_scale
        self.mesh = mesh

    def __call__(
        self,
        x: jax.Array,  # [T, D]
        rope: Rope,
        kv_cache: KVCache,
        layer: int,
        meta: AttentionMetadata,
    ) -> tuple[jax.Array, KVCache]:
        n, lat, nope, rope_dim, v = self.dims
        t = x.shape[0]
        if self.q_proj is not None:
            q, ckv = linears(x, [self.q_proj.get_value(), self.kv_a_proj_with_mqa.get_value()])
        else:
            q_a, ckv = linears(x, [self.q_a_proj.get_value(), self.kv_a_proj_with_mqa.get_value()])
            q = linear(self.q_a_layernorm(q_a), self.q_b_proj.get_value())
        q = q.reshape(t, n, nope + rope_dim)
        q_nope, q_pe = q[..., :nope], apply_rope(q[..., nope:], rope)
        c_kv = self.kv_a_layernorm(ckv[:, :lat])
        k_pe = apply_rope(ckv[:, None, lat:], rope)[:, 0]
        kv_b = self.kv_b_proj.get_value().reshape(lat, n, nope + v)
        w_uk, w_uv = kv_b[..., :nope], kv_b[..., nope:]
        # Absorbed into the latent space, kept in float32 into the attention.
        ql = jnp.einsum("tnp,lnp->tnl", q_nope, w_uk, preferred_element_type=jnp.float32)
        # What the cache keeps: [c_kv | k_pe] per token, a copy per device's slot.
        c_kv, k_pe = (jnp.broadcast_to(a[:, None, :], (t, self.kv_copies, a.shape[-1]))
                      for a in (c_kv, k_pe))  # fmt: skip
        out, kv_cache = self._attend(ql, q_pe, c_kv, k_pe, kv_cache, layer, meta)  # f32[T,N,L]
        out = jnp.einsum(
            "tnl,lnv->tnv", out.astype(x.dtype), w_uv, preferred_element_type=jnp.float32
        )
        return linear(out.astype(x.dtype).reshape(t, n * v), self.o_proj.get_value()), kv_cache

    def _attend(self, ql, q_pe, c_kv, k_pe, kv_cache, layer: int, meta: AttentionMetadata):
        """Writes the step's rows into the layer's slot and attends; with a mesh, per device on
        its heads and its copy of the rows."""
        ((group, slot),) = meta.where(layer)
        args = dict(
            ql=ql,
            q_pe=q_pe,
            c_kv=c_kv,
            k_pe=k_pe,
            slot_mapping=meta.slot_mapping[group],
            block_tables=meta.block_tables[group],
            seq_lens=meta.seq_lens,
            cu_q_lens=meta.cu_q_lens,
            num_seqs=meta.num_seqs,
        )

        def run(kv_cache, a):
            kv_cache = pallas_kernels.write_latent(
                kv_cache, slot, a["c_kv"], a["k_pe"], a["slot_mapping"]
            )
            out = pallas_kernels.mla_paged_attention(
                a["ql"],
                a["q_pe"],
                kv_cache,
                slot,
                a["seq_lens"],
                a["block_tables"],
                a["cu_q_lens"],
                a["num_seqs"],
                sm_scale=self.sm_scale,
                backend=kernel_choices().attention_backend,
            )
            return out, kv_cache

        if self.mesh is None:
            return run(kv_cache, args)
        heads = P(None, "model", None)
        specs = {name: P() for name in args} | dict(ql=heads, q_pe=heads, c_kv=heads, k_pe=heads)
        cache = kv_cache_specs(kv_cache.quantized)
        return jax.shard_map(
            run,
            mesh=self.mesh,
            in_specs=(cache, specs),
            out_specs=(heads, cache),
            check_vma=False,
        )(kv_cache, args)
