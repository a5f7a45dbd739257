"""`jaxllm train-draft MODEL --prompts FILE --out DIR`: an EAGLE-3 head for MODEL, trained with
optax on MODEL's own answers, written in the layout vLLM loads (and this engine's
`{"method": "eagle3", "model": DIR}`).

1. The target answers the prompts (greedy, through the engine): the head learns what the model
   says, which is what speculation must guess.
2. Teacher-forced, the target's residual stream entering the three layers the head reads
   (vLLM's default: 2, L/2, L - 3) is taken for every token of every conversation, once.
3. The head is trained with the training-time test of EAGLE-3: step 0 reads the target's states
   and the next token and predicts the one after; step j reads its own step j - 1 output and
   attends to step 0's keys up to its position and to its own chain's (as drafting does), at
   position t + j; the loss is the cross-entropy of each step's prediction over the draft
   vocabulary on the answer's tokens, step j weighted 0.8^j. The draft vocabulary is the
   answers' most frequent tokens (`d2t` maps it to the target's ids).
4. The head starts from the target: its layer from the layer it reads last, its norm and
   output head from the target's (rows of the draft vocabulary), `fc` passing that layer's
   input through.
5. Held-out prompts are answered with the head drafting k tokens: the mean acceptance length
   (1 + accepted drafts per verification, vLLM's figure) and per-position acceptance are
   printed and written to DIR/train_report.json. The optimizer state is checkpointed with orbax
   after every epoch (DIR/checkpoint; `--resume` continues from it).

Left out: hidden states of an online target per batch (they are computed once and kept in host
memory: about 3 x D x 2 bytes a token), several head layers, soft (distribution) labels, and
data parallel training.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jaxllm.config import ModelConfig
from jaxllm.models import AttentionMetadata, ModelCache
from jaxllm.models.eagle3 import Eagle3Config, Eagle3Head, default_aux_layers
from jaxllm.models.layers import Rope as RopeTable
from jaxllm.models.layers import apply_rope
from jaxllm.quantization import QUANTIZED, dequantize_np
from jaxllm.training.options import TrainOptions
from pallas_kernels import get_kv_cache_shape

logger = logging.getLogger(__name__)

STEP_WEIGHT = 0.8  # EAGLE-3's weight of the training-time test's step j: 0.8^j


@dataclasses.dataclass
class Sample:
    tokens: np.ndarray  # i32[T]: the prompt, then the target's answer
    prompt_len: int


# ---- data -----------------------------------------------------------------------------------


def read_prompts(path: str | Path) -> list[list[dict]]:
    """Conversations from a file of one prompt a line: a JSON object with `messages` (a chat,
    ending with the user's turn) or `prompt` (a string), a JSON string, or plain text."""
    convs = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        line = line.strip()
        if not line:
            continue
        try:
            item: Any = json.loads(line)
        except json.JSONDecodeError:
            item = line
        if isinstance(item, dict) and isinstance(item.get("messages"), list):
            convs.append(item["messages"])
        elif isinstance(item, dict) and isinstance(item.get("prompt"), str):
            convs.append([{"role": "user", "content": item["prompt"]}])
        elif isinstance(item, str):
            convs.append([{"role": "user", "content": item}])
        else:
            raise ValueError(f"--prompts {path}, line {n}: neither messages, prompt nor text")
    if not convs:
        raise ValueError(f"--prompts {path} has no prompts")
    return convs


def answer(llm, convs: list[list[dict]], max_tokens: int, progress: bool) -> list[Sample]:
    """The target's greedy answers to `convs`, each with its prompt."""
    from jaxllm import SamplingParams

    outs = llm.chat(convs, SamplingParams(temperature=0, max_tokens=max_tokens), use_tqdm=progress)
    return [
        Sample(np.asarray(o.prompt_token_ids + o.outputs[0].token_ids, np.int32),
               len(o.prompt_token_ids))
        for o in outs
    ]  # fmt: skip


class TargetStates:
    """The target's residual stream entering `aux_layers`, [T, 3D] a sequence, taken from its
    forward pass over whole sequences packed `budget` tokens at a time (one program)."""

    def __init__(self, runner, aux_layers: tuple[int, ...], *, budget: int = 2048):
        model = nnx.merge(runner.graphdef, runner.state)
        model.set_aux_hidden_state_layers(aux_layers)
        self.graphdef, state = nnx.split(model)
        self.params, self.params_def = jax.tree.flatten(state)
        self.config: ModelConfig = model.config
        self.budget, self.page, self.max_seqs = budget, 16, 32
        # Pages for the budget's tokens with each sequence's last one partial, and a spare
        # one that padding writes.
        self.num_pages = budget // self.page + self.max_seqs + 1
        self._fn = jax.jit(self._forward)

    def _forward(self, params, ids, positions, slots, tables, seq_lens, cu_q_lens, num_seqs):
        model = nnx.merge(self.graphdef, jax.tree.unflatten(self.params_def, params))
        c = self.config
        shape = get_kv_cache_shape(
            c.num_layers, self.num_pages, self.page, c.cache_kv_heads, c.cache_head_dim,
            jax.devices()[0].platform, latent=c.latent_attention is not None,
        )  # fmt: skip
        dtype = model.norm.weight.get_value().dtype
        cache = ModelCache(kv=jnp.zeros(shape, dtype))
        meta = AttentionMetadata(
            slot_mapping=slots[None],
            seq_lens=seq_lens,
            block_tables=tables[None],
            cu_q_lens=cu_q_lens,
            num_seqs=num_seqs,
        )
        _, _, aux = model(ids, positions, cache, meta)
        return aux

    def __call__(self, samples: list[Sample], progress=None) -> list[np.ndarray]:
        out: list[np.ndarray] = [None] * len(samples)  # type: ignore[list-item]
        pending = list(range(len(samples)))
        while pending:
            group, used = [], 0
            while pending and len(group) < self.max_seqs:
                n = min(len(samples[pending[0]].tokens), self.budget)
                if used + n > self.budget:
                    break
                group.append(pending.pop(0))
                used += n
            out_rows = self._run([samples[i].tokens[: self.budget] for i in group])
            for i, rows in zip(group, out_rows, strict=True):
                out[i] = rows
            if progress is not None:
                progress.update(len(group))
        return out

    def _run(self, seqs: list[np.ndarray]) -> list[np.ndarray]:
        t, r, page = self.budget, self.max_seqs, self.page
        spare = self.num_pages - 1
        ids = np.zeros(t, np.int32)
        positions = np.zeros(t, np.int32)
        slots = np.full(t, spare * page, np.int32)
        tables = np.full((r, -(-t // page)), spare, np.int32)
        seq_lens = np.zeros(r, np.int32)
        cu = np.zeros(r + 1, np.int32)
        at, next_page = 0, 0
        for i, s in enumerate(seqs):
            n, used = len(s), -(-len(s) // page)
            ids[at : at + n] = s
            positions[at : at + n] = np.arange(n)
            tables[i, :used] = np.arange(next_page, next_page + used)
            slots[at : at + n] = tables[i, np.arange(n) // page] * page + np.arange(n) % page
            seq_lens[i] = n
            at, next_page = at + n, next_page + used
            cu[i + 1] = at
        cu[len(seqs) + 1 :] = at
        aux = self._fn(
            self.params, ids, positions, slots, tables, seq_lens, cu,
            np.array([len(seqs)], np.int32),
        )  # fmt: skip
        aux = np.asarray(aux.astype(jnp.bfloat16))
        return [aux[cu[i] : cu[i + 1]] for i in range(len(seqs))]


def draft_vocabulary(samples: list[Sample], size: int, vocab_size: int) -> np.ndarray:
    """The `size` ids the answers use most (then the prompts'), sorted."""
    answers = np.concatenate([s.tokens[s.prompt_len :] for s in samples] or [np.zeros(0)])
    prompts = np.concatenate([s.tokens[: s.prompt_len] for s in samples] or [np.zeros(0)])
    counts = np.bincount(answers.astype(np.int64), minlength=vocab_size).astype(np.float64)
    counts += np.bincount(prompts.astype(np.int64), minlength=vocab_size) * 1e-6
    order = np.argsort(-counts, kind="stable")
    used = int((counts > 0).sum())
    return np.sort(order[: max(1, min(size, used))]).astype(np.int64)


# ---- the head ---------------------------------------------------------------------------------


def train_aux_layers(num_layers: int) -> tuple[int, int, int]:
    """The target layers a head trained here reads: vLLM's default, or for a target of under 7
    layers (where that repeats a layer) the first, middle and last layer's inputs."""
    ids = default_aux_layers(num_layers)
    if len(set(ids)) == 3 and min(ids) >= 0:
        return ids
    return (0, num_layers // 2, num_layers)


def check_target(target: ModelConfig) -> None:
    """Refuses, before any work, a target whose layer the head cannot start from here."""
    why = None
    if target.rope_scaling is not None:
        why = "scaled RoPE (the head's config would need the scaling's record)"
    elif target.num_experts:
        why = "mixture-of-experts layers"
    elif target.linear_attention is not None or target.latent_attention is not None:
        why = "linear-attention or latent-attention layers"
    elif target.heads_vary_by_layer or target.norm_offset:
        why = "layers of several shapes or offset (Gemma) norms"
    elif target.kv_head_replicas > 1:
        why = "kv heads repeated for tensor parallelism (train with --tensor-parallel-size 1)"
    if why:
        raise ValueError(
            f"train-draft: {target.architecture} has {why}; heads for it are not trained here yet"
        )


def head_hf_config(target: ModelConfig, draft_ids: np.ndarray, aux: tuple[int, ...]) -> dict:
    """The head's config.json (`LlamaForCausalLMEagle3`, vLLM's layout): one layer shaped as
    the target's."""
    config = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "vocab_size": target.vocab_size,
        "draft_vocab_size": len(draft_ids),
        "target_hidden_size": target.hidden_size,
        "hidden_size": target.hidden_size,
        "intermediate_size": target.intermediate_size,
        "num_hidden_layers": 1,
        "num_attention_heads": target.num_heads,
        "num_key_value_heads": target.num_kv_heads // target.kv_head_replicas,
        "head_dim": target.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": target.rms_norm_eps,
        "rope_theta": target.rope_theta,
        "max_position_embeddings": target.max_position_embeddings,
        "tie_word_embeddings": False,
        "norm_before_residual": False,
        "eagle_config": {"use_aux_hidden_state": True, "eagle_aux_hidden_state_layer_ids": aux},
        "torch_dtype": "float32",
    }
    return config


def init_head(target_model, config: Eagle3Config, draft_ids: np.ndarray, seed: int) -> Eagle3Head:
    """A head starting from the target (see the module docstring)."""
    head = Eagle3Head(config, dtype=jnp.float32, rngs=nnx.Rngs(seed))
    t = target_model
    src = t.layers[min(config.aux_layers[-1], len(t.layers) - 1)]
    d = config.hidden_size

    def f32(x):  # a quantized matrix ([O, I]) as our float layout ([I, O])
        return jnp.asarray(dequantize_np(x).T if isinstance(x, QUANTIZED) else x, jnp.float32)

    attn = head.self_attn
    for name in ("q_proj", "k_proj", "v_proj"):
        w = getattr(attn, name)
        w.set_value(w.get_value().at[d:].set(f32(getattr(src.self_attn, name).get_value())))
    attn.o_proj.set_value(f32(src.self_attn.o_proj.get_value()))
    for name in ("gate_proj", "up_proj", "down_proj"):
        getattr(head.mlp, name).set_value(f32(getattr(src.mlp, name).get_value()))
    head.input_layernorm.weight.set_value(f32(src.input_layernorm.weight.get_value()))
    head.hidden_norm.weight.set_value(f32(src.input_layernorm.weight.get_value()))
    head.post_attention_layernorm.weight.set_value(
        f32(src.post_attention_layernorm.weight.get_value())
    )
    head.norm.weight.set_value(f32(t.norm.weight.get_value()))
    if t.lm_head is None:
        rows = float_embeddings(t)[draft_ids].T
    else:
        rows = f32(t.lm_head.get_value())[:, draft_ids]
    head.lm_head.set_value(rows)
    fc = jnp.zeros_like(head.fc.get_value()).at[2 * d :].set(jnp.eye(d))
    head.fc.set_value(fc)
    head.d2t.set_value(jnp.asarray(draft_ids - np.arange(len(draft_ids)), jnp.int32))
    return head


def float_embeddings(target_model) -> jax.Array:
    """The target's embedding table [V, D] in float32 (a quantized one dequantized)."""
    table = target_model.embed_tokens.get_value()
    table = dequantize_np(table) if isinstance(table, QUANTIZED) else table
    return jnp.asarray(table, jnp.float32)


def _split(head: Eagle3Head):
    """(graph, trainable float parameters, the rest: `d2t`)."""
    graphdef, trainable, rest = nnx.split(
        head, lambda path, v: jnp.issubdtype(v.get_value().dtype, jnp.floating), ...
    )
    return graphdef, trainable, rest


def ttt_loss(
    head: Eagle3Head,
    embed: jax.Array,  # [V, D] the target's embeddings
    target_to_draft: jax.Array,  # i32[V]: a target id's draft id, -1 outside the vocabulary
    aux: jax.Array,  # [B, L, 3D]
    tokens: jax.Array,  # i32[B, L]
    lengths: jax.Array,  # i32[B]
    prompt_lens: jax.Array,  # i32[B]
    steps: int,
) -> tuple[jax.Array, jax.Array]:
    """The training-time test's weighted loss, and each step's accuracy on its labels."""
    b, length = tokens.shape
    attn = head.self_attn
    n, k, h = attn.num_heads, attn.num_kv_heads, attn.head_dim
    g = n // k
    pos = jnp.arange(length)
    causal = pos[None, :] <= pos[:, None]  # [t, s]
    in_seq = pos[None, :] < lengths[:, None]  # [B, s]

    def shifted(offset: int) -> jax.Array:
        return jnp.concatenate([tokens[:, offset:], jnp.zeros((b, offset), tokens.dtype)], 1)

    hidden = head.combine(aux)
    keys, values = [], []
    total, accs = 0.0, []
    for j in range(steps):
        emb = embed[shifted(1 + j)].astype(hidden.dtype)
        if head.norm_before_residual:
            residual = normed_h = head.hidden_norm(hidden)
        else:
            residual, normed_h = hidden, head.hidden_norm(hidden)
        x = jnp.concatenate([head.input_layernorm(emb), normed_h], -1)
        q = (x @ attn.q_proj.get_value()).reshape(b, length, k, g, h)
        kk = (x @ attn.k_proj.get_value()).reshape(b, length, k, h)
        v = (x @ attn.v_proj.get_value()).reshape(b, length, k, h)
        rope = RopeTable.at(pos + j, head.inv_freq, None, head.rope_scale)
        q = apply_rope(q.reshape(b * length, n, h), _tiled(rope, b)).reshape(b, length, k, g, h)
        kk = apply_rope(kk.reshape(b * length, k, h), _tiled(rope, b)).reshape(b, length, k, h)
        keys.append(kk)
        values.append(v)
        scale = attn.sm_scale
        s0 = jnp.einsum("btkgh,bskh->bkgts", q, keys[0]) * scale
        s0 = jnp.where((causal[None] & in_seq[:, None, :])[:, None, None], s0, -1e30)
        chain = [jnp.einsum("btkgh,btkh->bkgt", q, kc)[..., None] * scale for kc in keys[1:]]
        scores = jnp.concatenate([s0, *chain], -1).astype(jnp.float32)
        w = jax.nn.softmax(scores, -1).astype(v.dtype)
        out = jnp.einsum("bkgts,bskh->btkgh", w[..., :length], values[0])
        for i, vc in enumerate(values[1:]):
            out = out + jnp.einsum("bkgt,btkh->btkgh", w[..., length + i], vc)
        o = out.reshape(b, length, n * h) @ attn.o_proj.get_value()
        mid = o + residual
        out = head.mlp(head.post_attention_layernorm(mid)) + mid
        logits = head.draft_logits(head.norm(out))  # [B, L, Vd]
        at = pos[None, :] + 2 + j  # the predicted token's position
        label = target_to_draft[shifted(2 + j)]
        valid = (at < lengths[:, None]) & (at >= prompt_lens[:, None]) & (label >= 0)
        lse = jax.nn.logsumexp(logits, -1)
        picked = jnp.take_along_axis(logits, jnp.maximum(label, 0)[..., None], -1)[..., 0]
        count = jnp.maximum(valid.sum(), 1)
        total = total + STEP_WEIGHT**j * jnp.where(valid, lse - picked, 0.0).sum() / count
        hit = (jnp.argmax(logits, -1) == label) & valid
        accs.append(hit.sum() / count)
        hidden = out
    return total, jnp.stack(accs)


def _tiled(rope: RopeTable, b: int) -> RopeTable:
    return RopeTable(jnp.tile(rope.cos, (b, 1)), jnp.tile(rope.sin, (b, 1)))


# ---- the loop ---------------------------------------------------------------------------------


def _batches(samples: list[Sample], tokens_per_batch: int, max_len: int, rng) -> list:
    """(sample indices, width, rows) per batch: sequences of one width (their length rounded up
    to 64, at most `max_len`), `tokens_per_batch // width` rows (the last one padded with empty
    rows), so the training step compiles once per width."""
    widths: dict[int, list[int]] = {}
    for i in rng.permutation(len(samples)):
        n = min(len(samples[i].tokens), max_len)
        widths.setdefault(-(-n // 64) * 64, []).append(int(i))
    batches = []
    for width, idx in sorted(widths.items()):
        size = max(1, tokens_per_batch // width)
        batches += [(idx[i : i + size], width, size) for i in range(0, len(idx), size)]
    rng.shuffle(batches)
    return batches


def _pack(samples, states, idx, width, size, dim3):
    tokens = np.zeros((size, width), np.int32)
    aux = np.zeros((size, width, dim3), np.float32)
    lengths = np.zeros(size, np.int32)
    prompt_lens = np.zeros(size, np.int32)
    for r, j in enumerate(idx):
        n = min(len(samples[j].tokens), width)
        tokens[r, :n] = samples[j].tokens[:n]
        aux[r, :n] = states[j][:n]
        lengths[r] = n
        prompt_lens[r] = samples[j].prompt_len
    return tokens, aux, lengths, prompt_lens


def train_draft(
    model: str,
    prompts: str | Path,
    out: str | Path,
    options: TrainOptions | None = None,
    *,
    engine: dict | None = None,
    progress: bool = True,
) -> dict:
    """Trains and writes the head (see the module docstring); returns the report. `engine`:
    the target engine's settings (`LLM`'s keyword arguments; by default sized for a small
    model)."""
    import shutil

    import orbax.checkpoint as ocp
    from tqdm.auto import tqdm

    from jaxllm import LLM
    from jaxllm.loaders.eagle3 import load_eagle3_config

    options = options or TrainOptions()
    start = time.perf_counter()
    logging.getLogger("absl").setLevel(logging.WARNING)  # orbax's per-save lines
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    if not options.resume:  # a fresh run: nothing of an earlier one in `out` is reused
        shutil.rmtree(out / "checkpoint", ignore_errors=True)
        (out / "answers.npz").unlink(missing_ok=True)
    convs = read_prompts(prompts)
    rng = np.random.default_rng(options.seed)
    order = rng.permutation(len(convs))
    if options.held_out_prompts:
        held_convs, train_convs = read_prompts(options.held_out_prompts), convs
    else:
        held = min(options.held_out, len(convs) // 5)
        held_convs = [convs[i] for i in order[:held]]
        train_convs = [convs[i] for i in order[held:]]
    if not train_convs:
        raise ValueError(f"--prompts {prompts}: no prompts left to train on after --held-out")
    if engine is None:
        engine = dict(max_model_len=2048, max_num_seqs=64, max_num_batched_tokens=1024)
    engine = {k: v for k, v in engine.items() if k != "speculative_config"}
    llm = LLM(model, **engine)
    target = llm.runner.config
    check_target(target)
    target_model = nnx.merge(llm.runner.graphdef, llm.runner.state)
    aux_layers = train_aux_layers(target.num_layers)
    data = out / "answers.npz"
    if options.resume and data.is_file():  # the answers and states of the run resumed
        samples, states = _load_data(data)
    else:
        logger.info("train-draft: the target answers %d prompts", len(train_convs))
        samples = answer(llm, train_convs, options.max_tokens, progress)
        # Whole sequences: as long as the engine allows.
        budget = max(2048, max(len(x.tokens) for x in samples))
        states_of = TargetStates(llm.runner, aux_layers, budget=budget)
        bar = tqdm(total=len(samples), desc="target states", disable=not progress, unit="seq")
        states = states_of(samples, bar)
        bar.close()
        _save_data(data, samples, states)
    draft_ids = draft_vocabulary(samples, options.draft_vocab_size, target.vocab_size)
    raw = head_hf_config(target, draft_ids, aux_layers)
    config = Eagle3Config.from_hf_config(raw, target, {"d2t"})
    head = init_head(target_model, config, draft_ids, options.seed)
    embed = float_embeddings(target_model)
    t2d = np.full(target.vocab_size, -1, np.int32)
    t2d[draft_ids] = np.arange(len(draft_ids))
    t2d = jnp.asarray(t2d)
    # The serving engine's device memory (weights, KV pool) goes before training.
    llm.engine.shutdown()
    del llm, target_model
    graphdef, trainable, rest = _split(head)
    steps = options.num_speculative_tokens
    max_len = options.max_tokens + max(s.prompt_len for s in samples)
    max_len = -(-max_len // 64) * 64
    plan = _batches(samples, options.tokens_per_batch, max_len, rng)
    total_steps = options.epochs * len(plan)
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, options.learning_rate, max(1, total_steps // 20), max(total_steps, 2)
    )
    opt = optax.chain(optax.clip_by_global_norm(0.5), optax.adamw(schedule, weight_decay=0.0))
    opt_state = opt.init(trainable)
    first_epoch = 0
    checkpoints = ocp.CheckpointManager(
        (out / "checkpoint").absolute(), options=ocp.CheckpointManagerOptions(max_to_keep=1)
    )
    if options.resume and checkpoints.latest_step() is not None:
        first_epoch = checkpoints.latest_step() + 1
        restored = checkpoints.restore(
            checkpoints.latest_step(),
            args=ocp.args.StandardRestore({"params": trainable, "opt": opt_state}),
        )
        trainable, opt_state = restored["params"], restored["opt"]
        logger.info("train-draft: resumed after epoch %d", first_epoch)

    # The target's embeddings and the id map as arguments: constants of their size would be
    # folded into the program at every compile.
    @jax.jit
    def train_step(trainable, opt_state, rest, embed, t2d, aux, tokens, lengths, prompt_lens):
        def loss_fn(p):
            h = nnx.merge(graphdef, p, rest)
            return ttt_loss(h, embed, t2d, aux, tokens, lengths, prompt_lens, steps)

        (loss, accs), grads = jax.value_and_grad(loss_fn, has_aux=True)(trainable)
        updates, opt_state = opt.update(grads, opt_state, trainable)
        return optax.apply_updates(trainable, updates), opt_state, loss, accs

    dim3 = states[0].shape[-1]
    bar = tqdm(
        total=(options.epochs - first_epoch) * len(plan), desc="train-draft",
        disable=not progress, unit="batch",
    )  # fmt: skip
    history = []
    for epoch in range(first_epoch, options.epochs):
        if epoch:
            rng.shuffle(plan)
        for idx, width, size in plan:
            tokens, aux, lengths, prompt_lens = _pack(samples, states, idx, width, size, dim3)
            trainable, opt_state, loss, accs = train_step(
                trainable, opt_state, rest, embed, t2d, aux, tokens, lengths, prompt_lens
            )
            bar.update(1)
            bar.set_postfix(loss=f"{float(loss):.3f}", acc=" ".join(f"{a:.2f}" for a in accs))
        history.append({"epoch": epoch, "loss": float(loss), "accuracy": np.asarray(accs).tolist()})
        checkpoints.save(epoch, args=ocp.args.StandardSave({"params": trainable, "opt": opt_state}))
        checkpoints.wait_until_finished()
    checkpoints.close()
    bar.close()
    head = nnx.merge(graphdef, trainable, rest)
    export(head, raw, draft_ids, out)
    load_eagle3_config(out, target)  # it loads as the engine (and vLLM) will read it
    train_seconds = time.perf_counter() - start
    report = {
        "model": model,
        "prompts": len(train_convs),
        "train_tokens": int(sum(len(s.tokens) - s.prompt_len for s in samples)),
        "draft_vocab_size": len(draft_ids),
        "aux_layers": list(aux_layers),
        "epochs": history,
        "train_seconds": train_seconds,
    }
    if held_convs:
        report["held_out"] = evaluate(
            model, out, held_convs, options.num_speculative_tokens, options.max_tokens,
            engine=engine,
        )  # fmt: skip
    (out / "train_report.json").write_text(json.dumps(report, indent=1))
    return report


def _save_data(path: Path, samples: list[Sample], states: list[np.ndarray]) -> None:
    lens = np.array([len(s.tokens) for s in samples])
    np.savez(
        path,
        tokens=np.concatenate([s.tokens for s in samples]),
        lengths=lens,
        prompt_lens=np.array([s.prompt_len for s in samples]),
        states=np.concatenate(states).view(np.uint16),  # bfloat16's bits
    )


def _load_data(path: Path) -> tuple[list[Sample], list[np.ndarray]]:
    data = np.load(path)
    ends = np.cumsum(data["lengths"])
    tokens = np.split(data["tokens"], ends[:-1])
    states = np.split(data["states"].view(jnp.bfloat16), ends[:-1])
    samples = [Sample(t, int(p)) for t, p in zip(tokens, data["prompt_lens"], strict=True)]
    return samples, states


def export(head: Eagle3Head, raw: dict, draft_ids: np.ndarray, out: Path) -> None:
    """config.json and model.safetensors in the layout EAGLE's training writes and vLLM loads
    (torch's [out, in] matrices, the layer as `midlayer.*`, `d2t` offsets, `t2d` mask)."""
    from safetensors.numpy import save_file

    def w(p) -> np.ndarray:
        return np.ascontiguousarray(np.asarray(p.get_value(), np.float32))

    a, m, p = head.self_attn, head.mlp, "midlayer."
    tensors = {
        "fc.weight": w(head.fc).T,
        "norm.weight": w(head.norm.weight),
        "lm_head.weight": w(head.lm_head).T,
        p + "input_layernorm.weight": w(head.input_layernorm.weight),
        p + "hidden_norm.weight": w(head.hidden_norm.weight),
        p + "post_attention_layernorm.weight": w(head.post_attention_layernorm.weight),
        p + "self_attn.q_proj.weight": w(a.q_proj).T,
        p + "self_attn.k_proj.weight": w(a.k_proj).T,
        p + "self_attn.v_proj.weight": w(a.v_proj).T,
        p + "self_attn.o_proj.weight": w(a.o_proj).T,
        p + "mlp.gate_proj.weight": w(m.gate_proj).T,
        p + "mlp.up_proj.weight": w(m.up_proj).T,
        p + "mlp.down_proj.weight": w(m.down_proj).T,
    }
    tensors = {k: np.ascontiguousarray(v) for k, v in tensors.items()}
    tensors["d2t"] = (draft_ids - np.arange(len(draft_ids))).astype(np.int64)
    t2d = np.zeros(raw["vocab_size"], np.bool_)
    t2d[draft_ids] = True
    tensors["t2d"] = t2d
    save_file(tensors, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(raw, indent=1))


def evaluate(
    model: str,
    head: str | Path,
    convs: list[list[dict]],
    k: int,
    max_tokens: int,
    *,
    engine: dict | None = None,
) -> dict:
    """The head drafting `k` tokens on `convs`, greedy: the mean acceptance length (1 +
    accepted drafts per verification) and each position's acceptance rate."""
    from jaxllm import LLM, SamplingParams

    # Every step speculates: acceptance is what is measured here, not whether it pays.
    spec = {"method": "eagle3", "model": str(head), "num_speculative_tokens": k, "adaptive": False}
    llm = LLM(model, **(engine or {}) | {"speculative_config": spec})
    try:
        llm.chat(convs, SamplingParams(temperature=0, max_tokens=max_tokens), use_tqdm=False)
        s = llm.engine.stats().spec_decoding
    finally:
        llm.engine.shutdown()
    drafts = max(s.num_drafts, 1)
    return {
        "prompts": len(convs),
        "num_speculative_tokens": k,
        "mean_acceptance_length": 1 + s.num_accepted_tokens / drafts,
        "acceptance_per_position": [n / drafts for n in s.num_accepted_per_pos],
        "draft_acceptance_rate": s.num_accepted_tokens / max(s.num_draft_tokens, 1),
    }
