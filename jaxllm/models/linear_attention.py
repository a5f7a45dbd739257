"""Gated DeltaNet, the linear-attention layer of the hybrid Qwen models (Qwen3-Next, Qwen3.5):
three of every four layers. In place of keys and values in pages, a layer keeps a fixed-size
state per request (`LinearState`, a field of the model's donated cache):

- the last `conv_kernel - 1` inputs of a causal depthwise convolution over the concatenated
  q, k and v channels, and
- the delta rule's matrix S [value heads, key dim, value dim], updated per token as
      S = exp(g) * S;  S += k (beta * (v - S^T k))^T;  o = S^T q
  with q and k L2-normalised, q scaled by key_dim ** -0.5, beta = sigmoid(b) and the decay
  g = -exp(A_log) * softplus(a + dt_bias) per value head.

A step's tokens are a ragged batch (`AttentionMetadata.cu_q_lens`): a request's tokens are
contiguous, its prefill chunk or its one decode token. Each request's state is read from a
slot (`StepExtras.state_slots`, a `StateSlots`: its own slot, the batch row the runner gives
it, or a saved state that a prefix-cache hit starts from), taken as zero when its chunk
starts at position 0 (a new or recomputed request: no reset is needed on admission or
preemption), carried through its tokens and written to a slot: its own, or a snapshot slot
when the scheduler saves it there (the prefix cache's saved states, whose next step reads it
back from there: `jaxllm.engine.state_snapshots`).

The recurrence is `pallas_kernels.gated_delta_rule`: the chunked (parallel-within-chunk) form
in XLA on the CPU, a Pallas kernel of the same algebra on TPUs (Mosaic) and NVIDIA GPUs
(Triton), and the token-by-token reference beside them (`delta_rule_backend`). The
convolution is a few gathers and adds here, on every backend.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

import pallas_kernels
from jaxllm.config import ModelConfig
from jaxllm.config.kernels import kernel_choices
from jaxllm.models.layers import AttentionMetadata, linear, param, rms_norm
from jaxllm.sharding import spec_for
from pallas_kernels.target import current_platform


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LinearState:
    """Every linear layer's state, per slot: `conv` [layers, slots, channels * (conv_kernel -
    1)] in the model's dtype (as transformers keeps it), each channel's last inputs side by
    side, and `recurrent` [layers, slots, value heads, key dim, value dim] in float32.

    The convolution's state is one row per slot: with the taps as an axis of their own, 3 on
    a TPU's tiled second-minor dimension, XLA:TPU laid the step's update out another way and
    copied the whole state to and from it in every forward program. Channel-major, so a
    split of the row over devices is a split of the channels, as tensor parallelism splits
    them."""

    conv: jax.Array
    recurrent: jax.Array

    @classmethod
    def shapes(cls, config: ModelConfig, num_slots: int, dtype) -> LinearState:
        """The state's `jax.ShapeDtypeStruct`s for `num_slots` requests."""
        la = config.linear_attention
        n = len(config.linear_layers)
        return cls(
            jax.ShapeDtypeStruct((n, num_slots, la.conv_dim * (la.conv_kernel - 1)), dtype),
            jax.ShapeDtypeStruct(
                (n, num_slots, la.num_value_heads, la.key_head_dim, la.value_head_dim),
                jnp.float32,
            ),
        )

    @staticmethod
    def specs() -> LinearState:
        """Its PartitionSpecs under tensor parallelism: the channels and the value heads
        split over "model" as the layers' weights are (each device holds its heads' state)."""
        return LinearState(P(None, None, "model"), P(None, None, "model"))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StateSlots:
    """Per request of a step, i32[R] each, the slots of `LinearState` it uses: `read`, where
    its state before the step is (its own slot, or a saved state: one a prefix-cache hit
    starts from, or its own last save); `write`, where its state after the step goes (its own
    slot, or a snapshot slot that saves it). Padding requests' `write` is out of range
    (dropped)."""

    read: jax.Array
    write: jax.Array


def state_bytes_per_slot(config: ModelConfig, dtype) -> int:
    """Bytes of one request's state over all linear layers."""
    shapes = LinearState.shapes(config, 1, dtype)
    return sum(s.size * jnp.dtype(s.dtype).itemsize for s in jax.tree.leaves(shapes))


@dataclasses.dataclass(frozen=True)
class _Rows:
    """Where each of a step's tokens sits: its request, its index in the request's chunk, and
    the per-request facts the convolution needs."""

    request: jax.Array  # i32[T]
    index: jax.Array  # i32[T]: 0 for a request's first token of the step
    starts: jax.Array  # i32[R]: each request's first token in the step
    q_lens: jax.Array  # i32[R]
    fresh: jax.Array  # bool[R]: the chunk starts at position 0 (a zero state)

    @classmethod
    def of(cls, meta: AttentionMetadata, num_tokens: int) -> _Rows:
        cu = meta.cu_q_lens
        num_reqs = cu.shape[0] - 1
        t = jnp.arange(num_tokens, dtype=jnp.int32)
        request = jnp.searchsorted(cu[1:], t, side="right", method="compare_all").astype(jnp.int32)
        request = jnp.minimum(request, num_reqs - 1)
        return cls(
            request=request,
            index=t - cu[request],
            starts=cu[:-1],
            q_lens=cu[1:] - cu[:-1],
            fresh=_fresh(meta),
        )


def _fresh(meta: AttentionMetadata) -> jax.Array:
    """bool[R]: each request's chunk starts at position 0 (its state is zero: a new or
    recomputed request)."""
    return meta.seq_lens == meta.cu_q_lens[1:] - meta.cu_q_lens[:-1]


class GatedDeltaNet(nnx.Module):
    """One Gated DeltaNet layer. Its channels are laid out by key head ("group-major"): key
    head g's q, k, v (its value heads) and z are side by side, as Qwen3-Next's fused
    projections are (the loader reorders Qwen3.5's split ones and every convolution into it).
    So a split of the channels over devices gives each device whole key heads with their
    value heads: under tensor parallelism each device runs the layer on its own heads, with
    its share of the state, and one sum after the output projection (`__call__`)."""

    def __init__(
        self, config: ModelConfig, ordinal: int, *, dtype, mesh=None, rngs: nnx.Rngs | None
    ):
        """`ordinal`: this layer's index among the model's linear layers (its row of the
        state). `mesh`: tensor parallelism over its "model" axis (heads split); None for one
        device."""
        la = config.linear_attention
        d, nv = config.hidden_size, la.num_value_heads
        self.shape = la
        self.ordinal = ordinal
        self.mesh = mesh
        heads = ("embed", "linear_heads")  # column-parallel by key head group
        if la.fused_projections:
            self.in_proj_qkvz = param(rngs, (d, la.conv_dim + la.value_dim), heads, dtype)
            self.in_proj_ba = param(rngs, (d, 2 * nv), heads, dtype)
        else:
            self.in_proj_qkv = param(rngs, (d, la.conv_dim), heads, dtype)
            self.in_proj_z = param(rngs, (d, la.value_dim), heads, dtype)
            self.in_proj_b = param(rngs, (d, nv), heads, dtype)
            self.in_proj_a = param(rngs, (d, nv), heads, dtype)
        self.conv1d = param(rngs, (la.conv_kernel, la.conv_dim), (None, "linear_heads"), dtype)
        self.dt_bias = nnx.Param(jnp.ones((nv,), dtype), axes=("linear_heads",))
        self.A_log = nnx.Param(jnp.zeros((nv,), dtype), axes=("linear_heads",))
        self.norm_weight = nnx.Param(jnp.ones((la.value_head_dim,), dtype), axes=(None,))
        self.out_proj = param(rngs, (la.value_dim, d), ("linear_heads", "embed"), dtype)
        self.eps = config.rms_norm_eps

    def _weights(self) -> dict[str, jax.Array]:
        names = ["conv1d", "dt_bias", "A_log", "norm_weight", "out_proj"]
        if self.shape.fused_projections:
            names += ["in_proj_qkvz", "in_proj_ba"]
        else:
            names += ["in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"]
        return {name: getattr(self, name).get_value() for name in names}

    def __call__(
        self,
        x: jax.Array,  # [T, D]
        state: LinearState,
        meta: AttentionMetadata,
        slots: StateSlots,
    ) -> tuple[jax.Array, LinearState]:
        weights = self._weights()
        run = functools.partial(_mix, ordinal=self.ordinal, shape=self.shape, eps=self.eps)
        if self.mesh is None:
            return run(x, state, weights, meta, slots)
        specs = {
            name: spec_for(getattr(self, name).get_metadata()["axes"], w.shape, self.mesh)
            for name, w in weights.items()
        }

        def local(x, state, weights, meta, slots):
            out, state = run(x, state, weights, meta, slots)
            return jax.lax.psum(out.astype(jnp.float32), "model").astype(x.dtype), state

        return jax.shard_map(
            local,
            mesh=self.mesh,
            in_specs=(P(), LinearState.specs(), specs, P(), P()),
            out_specs=(P(), LinearState.specs()),
            check_vma=False,
        )(x, state, weights, meta, slots)


def _mix(x, state: LinearState, w: dict, meta, slots, *, ordinal, shape, eps):
    """The layer on the heads whose weights `w` holds (all of them, or one device's share):
    (its output [T, D], a partial sum under tensor parallelism; the state updated)."""
    la = shape
    num_tokens = x.shape[0]
    rows = _Rows.of(meta, num_tokens)
    r = la.num_value_heads // la.num_key_heads
    dk, dv = la.key_head_dim, la.value_head_dim
    group = 2 * dk + r * dv  # one key head's q, k and v channels
    groups = w["conv1d"].shape[1] // group  # the key heads held here
    if la.fused_projections:
        qkvz = linear(x, w["in_proj_qkvz"]).reshape(num_tokens, groups, group + r * dv)
        mixed, z = qkvz[..., :group], qkvz[..., group:]
        ba = linear(x, w["in_proj_ba"]).reshape(num_tokens, groups, 2 * r)
        b, a = ba[..., :r].reshape(num_tokens, -1), ba[..., r:].reshape(num_tokens, -1)
        mixed = mixed.reshape(num_tokens, -1)
    else:
        mixed, z, b, a = (
            linear(x, w[name]) for name in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")
        )
    prior = _conv_state(state.conv, ordinal, slots.read, la.conv_kernel)  # [R, K - 1, C]
    mixed, new_conv = _causal_conv(mixed, prior, w["conv1d"], rows)
    mixed = mixed.reshape(num_tokens, groups, group)
    # Each key head serves r consecutive value heads (g * r + j), as transformers repeats it.
    q = jnp.repeat(mixed[..., :dk], r, axis=1)  # [T, Hv, Dk]
    k = jnp.repeat(mixed[..., dk : 2 * dk], r, axis=1)
    v = mixed[..., 2 * dk :].reshape(num_tokens, groups * r, dv)
    beta = jax.nn.sigmoid(b.astype(jnp.float32)).astype(b.dtype)  # rounded as HF does
    decay = -jnp.exp(w["A_log"].astype(jnp.float32)) * jax.nn.softplus(
        a.astype(jnp.float32) + w["dt_bias"].astype(jnp.float32)
    )
    initial = state.recurrent[ordinal][slots.read]  # [R, Hv, Dk, Dv]
    out, final = gated_delta_rule(q, k, v, decay, beta, initial, meta)
    out = out.astype(x.dtype)
    # The gated RMSNorm per value head: normalise, scale, then times silu(z) in float32.
    z = z.reshape(num_tokens, groups * r, dv)
    normed = rms_norm(out, w["norm_weight"], eps)
    gated = (normed * jax.nn.silu(z.astype(jnp.float32))).astype(x.dtype)
    out = linear(gated.reshape(num_tokens, -1), w["out_proj"])
    # Each request's state after the step to its slot (one scatter of R rows: one of 2R, a
    # row and a save slot each, made XLA:GPU copy the convolution's state); padding requests
    # write nowhere (an out-of-range slot is dropped).
    num_slots = state.conv.shape[1]
    live = jnp.arange(slots.write.shape[0]) < meta.num_seqs[0]
    where = jnp.where(live, slots.write, num_slots)
    state = LinearState(
        state.conv.at[ordinal, where].set(_conv_rows(new_conv, state.conv.dtype), mode="drop"),
        state.recurrent.at[ordinal, where].set(final, mode="drop"),
    )
    return out, state


def _conv_state(conv: jax.Array, ordinal: int, read: jax.Array, kernel: int) -> jax.Array:
    """The requests' convolution states [R, K - 1, C] from their slots' rows. Read once, before
    the step writes the array in place: XLA fused the read (with its transpose) into each of
    its consumers, one of which (the convolution's output) the write does not wait for, and
    then copied the whole array to keep the old rows readable, in every forward program.
    The barrier keeps it one read on GPUs and TPUs; XLA:CPU drops barriers early, and there a
    one-request read stays one when it is made as two rows, the second dropped."""
    rows = conv[ordinal][jnp.concatenate([read, read]) if read.shape[0] == 1 else read]
    rows = rows[: read.shape[0]]
    prior = rows.reshape(rows.shape[0], -1, kernel - 1).transpose(0, 2, 1)
    return jax.lax.optimization_barrier(prior)


def _conv_rows(conv: jax.Array, dtype) -> jax.Array:
    """[R, K - 1, C] -> the state's rows [R, C * (K - 1)], channel-major."""
    return conv.transpose(0, 2, 1).reshape(conv.shape[0], -1).astype(dtype)


def _causal_conv(mixed, prior, weight, rows: _Rows):
    """The depthwise causal convolution of each request's chunk, continued from its state,
    with silu; and each request's new state (its last K - 1 inputs). mixed [T, C], prior
    [R, K - 1, C] (each request's state), weight [K, C] (tap K - 1 is the current token)."""
    kernel = weight.shape[0]
    num_tokens = mixed.shape[0]
    prior = jnp.where(rows.fresh[:, None, None], 0, prior).astype(mixed.dtype)
    t = jnp.arange(num_tokens)
    acc = jnp.zeros(mixed.shape, jnp.float32)
    for back in range(kernel):  # the input `back` tokens before each token
        own = rows.index >= back
        from_batch = mixed[jnp.maximum(t - back, 0)]
        held = prior[rows.request, jnp.clip(kernel - 1 + rows.index - back, 0, kernel - 2)]
        source = jnp.where(own[:, None], from_batch, held)
        acc = acc + source.astype(jnp.float32) * weight[kernel - 1 - back].astype(jnp.float32)
    out = jax.nn.silu(acc.astype(mixed.dtype).astype(jnp.float32)).astype(mixed.dtype)
    # The new state: the chunk's last K - 1 inputs, reaching into the old state when the
    # chunk is shorter than that.
    j = jnp.arange(kernel - 1)
    pos = rows.q_lens[:, None] - (kernel - 1) + j[None, :]  # [R, K - 1], in the chunk
    from_batch = mixed[jnp.clip(rows.starts[:, None] + pos, 0, num_tokens - 1)]
    held = jnp.take_along_axis(prior, jnp.clip(kernel - 1 + pos, 0, kernel - 2)[:, :, None], axis=1)
    new_state = jnp.where((pos >= 0)[:, :, None], from_batch, held)
    return out, new_state


def gated_delta_rule(q, k, v, decay, beta, initial, meta: AttentionMetadata, *, backend=None):
    """The gated delta rule over a step's ragged batch: q, k [T, Hv, Dk]; v [T, Hv, Dv]; decay,
    beta f32[T, Hv]; initial f32[R, Hv, Dk, Dv] (each request's state before the step; a fresh
    request's, one whose chunk starts at position 0, is taken as zero). Returns (o f32[T, Hv,
    Dv], each request's state after its last token f32[R, Hv, Dk, Dv]; a request with no token
    keeps its initial state).

    q and k are L2-normalised here and q scaled by Dk ** -0.5, as transformers does inside its
    kernels; the recurrence itself is `pallas_kernels.gated_delta_rule` in the form `backend`
    names (default: `delta_rule_backend()`)."""
    q = _l2norm(q.astype(jnp.float32)) * (q.shape[-1] ** -0.5)
    k = _l2norm(k.astype(jnp.float32))
    initial = jnp.where(_fresh(meta)[:, None, None, None], 0.0, initial)
    return pallas_kernels.gated_delta_rule(
        q, k, v, decay, beta, initial, meta.cu_q_lens, meta.num_seqs,
        backend=backend or delta_rule_backend(),
    )  # fmt: skip


def delta_rule_backend() -> str:
    """The recurrence's form for the step being traced, the engine's attention backend
    resolved for the platform (`pallas_kernels.resolve_backend`): its Pallas kernel on a TPU
    or a GPU (either one interpreted off its platform, for checking), the token-by-token
    reference for "reference", the chunked XLA form for the rest. A GPU always takes its
    kernel: the chunked form's `while` over a device-side trip count would copy its predicate
    to the host every iteration there."""
    chosen = kernel_choices().attention_backend
    if chosen == "reference":
        return "reference"
    platform = current_platform()
    if platform == "gpu":
        return "pallas_gpu"
    resolved = pallas_kernels.resolve_backend(chosen, platform)
    return resolved if resolved in ("pallas_tpu", "pallas_gpu") else "chunked"


def _l2norm(x: jax.Array, eps: float = 1e-6) -> jax.Array:
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)
