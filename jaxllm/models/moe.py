"""Mixture of experts (Mixtral, Qwen3-MoE, Qwen3-Next, Qwen3.5-MoE, gpt-oss): top-k routing,
experts as grouped matmuls, expert weights sharded over the mesh (and kept in MXFP4 where a
gpt-oss checkpoint ships them so, or in FP8 as DeepSeek-V3's does: `quantization.MXFP4Experts`,
`FP8Experts`, dequantized inside the step),
and a shared expert where the family has one; gpt-oss adds a router bias, biases on every
expert projection and a clamped SwiGLU (`ModelConfig.swiglu_limit`); Llama 4 routes by the
sigmoid of the top logits, which scales each chosen expert's input (`router_sigmoid`,
`moe_weight_inputs`), beside an ungated shared expert; DeepSeek-V2/V3 choose experts within
their best groups, V3 by sigmoid scores with a correction bias, and scale the routed weights.

Routing is data: each token's k (expert, weight) pairs are sorted by expert, and the experts
run as three `jax.lax.ragged_dot` grouped matmuls over the sorted rows, whose group sizes are
counted per step. Shapes depend only on the token bucket, so no routing recompiles anything.

Parallelism ("model" mesh axis, see sharding.py): the expert weights `[E, ...]` are split on
the expert axis when the mesh divides E (expert parallelism: each device holds E / n whole
experts), else on each expert's MLP width (tensor parallelism inside every expert). Either
way a device computes a partial output for every token from the weights it holds (tokens
routed elsewhere contribute nothing) and one `psum` adds the partials, as after any
row-parallel matmul. The activations are replicated between layers anyway, so this needs no
all-to-all.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxllm.config import ModelConfig
from jaxllm.models.layers import ACTIVATIONS, MLP, l2_norm, linear, matmul, param
from jaxllm.quantization import (
    KEPT_EXPERTS,
    FP8Experts,
    MXFP4Experts,
    dequantize_experts,
    dequantize_half,
)
from jaxllm.sharding import spec_for


class MoE(nnx.Module):
    def __init__(self, config: ModelConfig, *, dtype, mesh: Mesh | None, rngs: nnx.Rngs | None):
        d, f, e = config.hidden_size, config.moe_intermediate_size, config.num_experts
        # DeepSeek's router (and its score bias) stay float32, as transformers keeps them.
        router_dtype = jnp.float32 if config.router_float32 else dtype
        self.router = param(rngs, (d, e), ("embed", None), router_dtype)
        self.router_bias = param(rngs, (e,), (None,), dtype) if config.router_bias else None
        self.score_bias = (
            param(rngs, (e,), (None,), router_dtype) if config.router_score_bias else None
        )
        self.scoring = config.router_scoring
        self.groups = (config.expert_groups, config.expert_groups_kept)
        self.scaling = config.routed_scaling_factor
        # Gemma 4: the router reads its input normalised, scaled per channel and by 1/sqrt(D),
        # and each chosen expert's weight is scaled by a factor of the expert's.
        if config.moe_beside_mlp:
            self.router_scale = param(rngs, (d,), (None,), dtype)
            self.per_expert_scale = param(rngs, (e,), (None,), dtype)
            self.router_eps = config.rms_norm_eps
        else:
            self.router_scale = self.per_expert_scale = None
        self.gate_proj = param(rngs, (e, d, f), ("expert", "embed", "expert_mlp"), dtype)
        self.up_proj = param(rngs, (e, d, f), ("expert", "embed", "expert_mlp"), dtype)
        self.down_proj = param(rngs, (e, f, d), ("expert", "expert_mlp", "embed"), dtype)
        if config.expert_bias:
            # Split as the weights' outputs are; the down projection's bias is added once,
            # outside the partial sums (replicated).
            self.gate_bias = param(rngs, (e, f), ("expert", "expert_mlp"), dtype)
            self.up_bias = param(rngs, (e, f), ("expert", "expert_mlp"), dtype)
            self.down_bias = param(rngs, (e, d), (None, None), dtype)
        else:
            self.gate_bias = self.up_bias = self.down_bias = None
        self.top_k = config.num_experts_per_tok
        self.renormalize = config.moe_renormalize
        self.sigmoid = config.router_sigmoid
        self.weight_inputs = config.moe_weight_inputs
        if config.swiglu_limit is None:
            act = ACTIVATIONS[config.hidden_act]
            self.glu = lambda gate, up: act(gate) * up
        else:
            self.glu = functools.partial(
                clamped_swiglu, limit=config.swiglu_limit, alpha=config.swiglu_alpha
            )
        self.mesh = mesh
        # A shared expert every token goes through, scaled by a sigmoid gate of its own.
        if config.shared_expert_intermediate_size:
            width = config.shared_expert_intermediate_size
            self.shared_expert = MLP(config, dtype=dtype, rngs=rngs, width=width)
            gated = config.shared_expert_gated
            self.shared_expert_gate = param(rngs, (d, 1), ("embed", None), dtype) if gated else None
        else:
            self.shared_expert = self.shared_expert_gate = None

    def route(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        """(weights f32[T, k], expert ids i32[T, k]): the router logits in x's dtype (as
        transformers rounds them; float32 where the router is kept so), each expert scored by
        a float32 softmax over all of them (or its sigmoid), the top k (by the scores plus
        their correction bias, within the best groups, where the family says so) weighted by
        their scores, renormalised to sum to 1 and scaled where the family does."""
        if self.router_scale is not None:
            d = x.shape[-1]
            x = l2_norm(x, self.router_eps) * self.router_scale.get_value()
            x = x * jnp.asarray(d**-0.5, x.dtype)
        router = self.router.get_value()
        logits = matmul(x, router).astype(jnp.promote_types(x.dtype, router.dtype))
        if self.router_bias is not None:
            logits = logits + self.router_bias.get_value()
        if self.sigmoid:  # the top logits' sigmoids, rounded to x's dtype as transformers does
            top, experts = jax.lax.top_k(logits, self.top_k)
            weights = jax.nn.sigmoid(top.astype(jnp.float32)).astype(x.dtype)
            return weights.astype(jnp.float32), experts.astype(jnp.int32)
        logits = logits.astype(jnp.float32)
        if self.scoring == "sigmoid":
            scores = jax.nn.sigmoid(logits)
        else:
            scores = jax.nn.softmax(logits, axis=-1)
        choice = scores
        if self.score_bias is not None:
            choice = scores + self.score_bias.get_value().astype(jnp.float32)
        if self.groups[0] > 1:
            choice = _best_groups(choice, *self.groups, by_top2=self.score_bias is not None)
        if choice is scores:
            weights, experts = jax.lax.top_k(scores, self.top_k)
        else:
            experts = jax.lax.top_k(choice, self.top_k)[1]
            weights = jnp.take_along_axis(scores, experts, axis=-1)
        if self.renormalize:
            total = weights.sum(axis=-1, keepdims=True)
            weights = weights / (total + 1e-20 if self.scoring == "sigmoid" else total)
        if self.scaling != 1.0:
            weights = weights * self.scaling
        if self.per_expert_scale is not None:
            weights = weights * self.per_expert_scale.get_value()[experts].astype(jnp.float32)
        return weights, experts.astype(jnp.int32)

    def __call__(self, x: jax.Array, router_input: jax.Array | None = None) -> jax.Array:
        """[T, D] -> [T, D]; `router_input`: what the router reads where it is not x (Gemma 4:
        the residual, while the experts read its norm)."""
        routed = self._routed(x, x if router_input is None else router_input)
        if self.shared_expert is None:
            return routed
        if self.shared_expert_gate is None:
            return routed + self.shared_expert(x)
        gate = linear(x, self.shared_expert_gate.get_value())  # [T, 1]
        shared = jax.nn.sigmoid(gate.astype(jnp.float32)).astype(x.dtype) * self.shared_expert(x)
        return routed + shared

    def _routed(self, x: jax.Array, router_input: jax.Array) -> jax.Array:
        weights, experts = self.route(router_input)
        out = self._experts(x, weights, experts)
        if self.down_bias is not None:  # sum_j weight_j * bias of expert j, in float32
            bias = self.down_bias.get_value()[experts].astype(jnp.float32)  # [T, k, D]
            out = out + jnp.einsum("tk,tkd->td", weights, bias)
        return out.astype(x.dtype)

    def _experts(self, x, weights, experts) -> jax.Array:  # f32[T, D]
        w = [self.gate_proj.get_value(), self.up_proj.get_value(), self.down_proj.get_value()]
        biased = self.gate_bias is not None
        if biased:
            w += [self.gate_bias.get_value(), self.up_bias.get_value()]
        run = functools.partial(_experts, glu=self.glu, weight_inputs=self.weight_inputs)
        spec = _weight_spec(self.gate_proj, self.mesh)
        if spec is None:
            return run(x, weights, experts, *w, expert_axis_sharded=False)
        gate_spec, down_spec = spec, P(spec[0], spec[2], spec[1])
        weight_specs = [
            v.specs(s) if isinstance(v, KEPT_EXPERTS) else s
            for v, s in zip(w[:3], (gate_spec, gate_spec, down_spec), strict=True)
        ]
        bias_specs = (P(spec[0], spec[2]),) * 2 if biased else ()

        def partial_sum(x, weights, experts, *w):
            out = run(x, weights, experts, *w, expert_axis_sharded=spec[0] is not None)
            return jax.lax.psum(out, "model")  # partials summed in float32

        return jax.shard_map(
            partial_sum,
            mesh=self.mesh,
            in_specs=(P(), P(), P(), *weight_specs, *bias_specs),
            out_specs=P(),
            check_vma=False,
        )(x, weights, experts, *w)


def _best_groups(choice: jax.Array, groups: int, kept: int, *, by_top2: bool) -> jax.Array:
    """`choice` [T, E] with the experts outside each token's best `kept` of `groups` equal
    groups set to -inf; a group scored by its best expert, or `by_top2` by its two best
    (DeepSeek-V2's group_limited_greedy, V3's noaux_tc)."""
    t, e = choice.shape
    grouped = choice.reshape(t, groups, e // groups)
    if by_top2:
        score = jax.lax.top_k(grouped, min(2, e // groups))[0].sum(axis=-1)
    else:
        score = grouped.max(axis=-1)
    best = jax.lax.top_k(score, kept)[1]  # [T, kept]
    keep = jnp.zeros((t, groups), bool).at[jnp.arange(t)[:, None], best].set(True)
    return jnp.where(keep[:, :, None], grouped, -jnp.inf).reshape(t, e)


def _weight_spec(var: nnx.Param, mesh: Mesh | None) -> P | None:
    """The PartitionSpec of the [E, D, F] expert weights on `mesh`; None when they are whole
    on every device (no mesh, or nothing divides)."""
    if mesh is None:
        return None
    spec = spec_for(var.get_metadata()["axes"], var.shape, mesh)
    return None if all(s is None for s in spec) else spec


def clamped_swiglu(gate: jax.Array, up: jax.Array, *, limit: float, alpha: float) -> jax.Array:
    """gpt-oss's expert activation: (clip(up, -limit, limit) + 1) * g * sigmoid(alpha * g),
    g = min(gate, limit)."""
    gate = jnp.minimum(gate, limit)
    up = jnp.clip(up, -limit, limit)
    return (up + 1) * (gate * jax.nn.sigmoid(gate * alpha))


def _experts(
    x,
    weights,
    experts,
    gate,
    up,
    down,
    gate_bias=None,
    up_bias=None,
    *,
    glu,
    expert_axis_sharded: bool,
    weight_inputs: bool = False,
):
    """f32[T, D]: sum_j weights[t, j] * expert_{experts[t, j]}(x[t]) over the experts held
    here: `gate`, `up` [E', D, F'] and `down` [E', F', D] are this device's slice (E' = E / n
    experts from index device * E', or all experts with F' = F / n), `gate_bias` and `up_bias`
    [E', F'] theirs (or None); `glu(gate, up)` is the activation. Each matmul's output is
    rounded to x's dtype, as in the dense MLP. `weight_inputs`: expert_j(weights[t, j] * x[t])
    instead (Llama 4). MXFP4 weights (`MXFP4Experts`) are dequantized here, each device its
    own slice: see `_matmul_rows`."""
    num_tokens, k = experts.shape
    num_local = gate.shape[0]
    first = jax.lax.axis_index("model") * num_local if expert_axis_sharded else 0
    local = experts.reshape(-1) - first  # [T*k]
    held = (local >= 0) & (local < num_local)
    group = jnp.where(held, local, num_local)  # rows for other devices sort last
    order = jnp.argsort(group, stable=True)
    sizes = jnp.bincount(group, length=num_local + 1)[:num_local].astype(jnp.int32)
    row_expert = jnp.minimum(group[order], num_local - 1)  # rows held elsewhere: dropped below
    token = order // k
    rows = x[token]  # [T*k, D], grouped by expert
    row_weight = weights.reshape(-1)[order][:, None]
    if weight_inputs:
        rows, row_weight = (rows * row_weight).astype(x.dtype), 1.0
    rows = rows.astype(gate.dtype)

    def grouped(lhs, rhs):
        return _matmul_rows(lhs, rhs, sizes, row_expert).astype(x.dtype)

    g, u = grouped(rows, gate), grouped(rows, up)
    if gate_bias is not None:  # each row's expert's bias
        g, u = g + gate_bias[row_expert], u + up_bias[row_expert]
    h = glu(g, u)
    y = grouped(h.astype(down.dtype), down).astype(jnp.float32)  # [T*k, D]
    # Rows held elsewhere fall outside every group: drop them whatever ragged_dot left there.
    y = jnp.where(held[order][:, None], y * row_weight, 0.0)
    return jnp.zeros((num_tokens, x.shape[-1]), jnp.float32).at[token].add(y)


def _matmul_rows(lhs, w, sizes, row_expert) -> jax.Array:
    """f32[R, O]: each row of `lhs` [R, I] (sorted by expert, `sizes` rows each) times its
    expert's [I, O] of `w` ([E', I, O]), as one grouped matmul (`ragged_dot`).
    MXFP4 experts are dequantized on the way, their even and odd inputs' halves one after
    the other (`dequantize_half`), never all of a model's at once: where the rows are fewer
    than the experts (decode), only the rows' experts (`row_expert`), each row its own, so
    only the routed experts' 4-bit bytes are read; otherwise the device's experts, ordered by
    optimization barriers after the rows and the first half's product (without them XLA
    dequantized every layer's experts early and held them all, 187 GiB of temporaries for
    gpt-oss-120b on an H200; with both halves at once, 2.5 GB for one of its layers, over
    what an H100 has left)."""
    if isinstance(w, FP8Experts):
        return _matmul_rows_fp8(lhs, w, sizes, row_expert)
    if not isinstance(w, MXFP4Experts):
        return jax.lax.ragged_dot(lhs, w, sizes, preferred_element_type=jnp.float32)
    halves = lhs[:, 0::2], lhs[:, 1::2]
    if lhs.shape[0] < w.shape[0]:
        taken = w.take(row_expert)
        return sum(
            jnp.einsum(
                "ri,roi->ro",
                x,
                dequantize_half(taken, w.dtype, odd=odd),  # [R, O, I / 2]
                preferred_element_type=jnp.float32,
            )
            for x, odd in zip(halves, (False, True), strict=True)
        )
    numbers = jax.lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(([1], [2]), ([], [])),
        lhs_ragged_dimensions=[0],
        rhs_group_dimensions=[0],
    )
    out = None
    for x, odd in zip(halves, (False, True), strict=True):
        x, w = jax.lax.optimization_barrier((x, w) if out is None else (x, w, out))[:2]
        y = jax.lax.ragged_dot_general(
            x, dequantize_half(w, w.dtype, odd=odd), sizes, numbers,
            preferred_element_type=jnp.float32,
        )  # fmt: skip
        out = y if out is None else out + y
    return out


def _matmul_rows_fp8(lhs, w: FP8Experts, sizes, row_expert) -> jax.Array:
    """`_matmul_rows` for FP8 experts: dequantized inside the step like MXFP4 ones, only the
    rows' experts where the rows are fewer than the experts, else the device's experts after
    the rows are ready (an optimization barrier, so XLA does not dequantize every layer's
    experts early)."""
    if lhs.shape[0] < w.shape[0]:
        taken = dequantize_experts(w.take(row_expert), w.dtype)  # [R, O, I]
        return jnp.einsum("ri,roi->ro", lhs, taken, preferred_element_type=jnp.float32)
    lhs, w = jax.lax.optimization_barrier((lhs, w))
    numbers = jax.lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(([1], [2]), ([], [])),
        lhs_ragged_dimensions=[0],
        rhs_group_dimensions=[0],
    )
    return jax.lax.ragged_dot_general(
        lhs, dequantize_experts(w, w.dtype), sizes, numbers, preferred_element_type=jnp.float32
    )
