"""The sampler's inputs, per logit row: each request's sampling parameters kept in its batch
row (`SamplingRows`, written once when it enters the batch), gathered for a step
(`SamplingInputsBuilder`).

One table, `NEUTRAL`, holds the value of each input that changes nothing (no bias, no penalty,
no cut-off; for ids, one past the vocabulary, which the sampler drops): padding rows hold it,
and so does a row whose request does not use the feature. A new sampling parameter is a field
of `SamplingParams`, a field of `SamplingInputs` with its use in the sampler, and here an entry
in the table and a line in `SamplingRows.write`.

The inputs few requests use (logit bias, penalties and their [R, max_model_len] history, the
[R, V / 32] grammar bitmask) are kept on the device at their neutral values per logit bucket:
a batch that uses none of them neither builds nor sends them.
"""

from __future__ import annotations

import jax
import numpy as np

from jaxllm.sampling_params import MAX_LOGIT_BIAS, MAX_STOP_TOKEN_IDS, SAMPLING_EPS
from jaxllm.worker.device_state import DeviceState
from jaxllm.worker.sampler import SamplerVariant, SamplingInputs
from jaxllm.worker.step_data import NewRequestData, SchedulerOutput

# Width of the per-request blocked-id array (EOS ids plus stop ids, while min_tokens holds).
MAX_BLOCKED_IDS = MAX_STOP_TOKEN_IDS + 16

VOCAB = "vocab"  # stands for the vocabulary size in `NEUTRAL`: an id the sampler drops

# Per `SamplingInputs` field: (dtype, the value that changes nothing, the row's width: None for
# one value, or the name of the width in `_FIXED_WIDTHS` or `SamplingInputsBuilder._widths`).
NEUTRAL: dict[str, tuple[type, float | int | str, str | None]] = {
    "temperature": (np.float32, 0.0, None),  # greedy
    "top_k": (np.int32, 0, None),
    "top_p": (np.float32, 1.0, None),
    "min_p": (np.float32, 0.0, None),
    "seeds": (np.uint32, 0, "seed_words"),
    "counters": (np.int32, 0, None),
    "logprobs": (np.bool_, False, None),
    "blocked_ids": (np.int32, VOCAB, "blocked"),
    "logit_bias_ids": (np.int32, VOCAB, "bias"),
    "logit_bias": (np.float32, 0.0, "bias"),
    "presence_penalty": (np.float32, 0.0, None),
    "frequency_penalty": (np.float32, 0.0, None),
    "repetition_penalty": (np.float32, 1.0, None),
    "history_ids": (np.int32, VOCAB, "history"),
    "num_prompt_tokens": (np.int32, 0, None),
    "token_bitmask": (np.int32, -1, "bitmask"),  # every bit set: all tokens allowed
}
# The widths that do not depend on the model: a seed's two words, the blocked and biased ids.
_FIXED_WIDTHS = {"seed_words": 2, "blocked": MAX_BLOCKED_IDS, "bias": MAX_LOGIT_BIAS}
# Kept on the device at their neutral values (see the module's docstring).
_BIAS = ("logit_bias_ids", "logit_bias")
_PENALTIES = ("presence_penalty", "frequency_penalty", "repetition_penalty")
_IDLE = (*_BIAS, *_PENALTIES, "history_ids", "num_prompt_tokens", "token_bitmask")
# Copied from a request's row to each of its logit rows as they are.
_PER_REQUEST = ("temperature", "top_k", "top_p", "min_p", "seeds")
# Sent with every step (in the step's one buffer, see `jaxllm.worker.packing`).
HOST = tuple(name for name in NEUTRAL if name not in _IDLE)


class SamplingRows:
    """The sampling parameters of the requests in the persistent batch, one row each."""

    def __init__(self, max_num_reqs: int, vocab_size: int, max_model_len: int):
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        widths = _FIXED_WIDTHS
        for name in (*_PER_REQUEST, "blocked_ids", *_BIAS, *_PENALTIES):
            dtype, neutral, width = NEUTRAL[name]
            shape = (max_num_reqs,) if width is None else (max_num_reqs, widths[width])
            setattr(self, name, np.full(shape, vocab_size if neutral == VOCAB else neutral, dtype))
        n = max_num_reqs
        self.num_logprobs = np.full(n, -1, np.int32)  # -1: no logprobs
        self.num_prompt_logprobs = np.zeros(n, np.int32)
        self.min_tokens = np.zeros(n, np.int32)  # blocked_ids apply until this many are out
        self.has_logit_bias = np.zeros(n, np.bool_)
        self.uses_penalties = np.zeros(n, np.bool_)

    def write(self, i: int, new: NewRequestData) -> None:
        """Row `i` from a request entering the batch."""
        p, vocab = new.sampling_params, self.vocab_size
        self.temperature[i] = p.temperature
        self.top_k[i] = p.top_k if p.top_k < vocab else 0  # all tokens: off
        self.top_p[i] = p.top_p
        self.min_p[i] = p.min_p
        seed = new.seed % 2**64
        self.seeds[i] = (seed & 0xFFFFFFFF, seed >> 32)
        self.num_logprobs[i] = -1 if p.logprobs is None else p.logprobs
        self.num_prompt_logprobs[i] = p.prompt_logprobs or 0
        self.min_tokens[i] = min(p.min_tokens, self.max_model_len)  # past the end: all
        blocked = [*new.eos_token_ids, *(p.stop_token_ids or [])][:MAX_BLOCKED_IDS]
        self.blocked_ids[i] = vocab
        self.blocked_ids[i, : len(blocked)] = blocked
        bias = p.logit_bias or {}
        self.has_logit_bias[i] = bool(bias)
        self.logit_bias_ids[i] = vocab
        self.logit_bias[i] = 0.0
        self.logit_bias_ids[i, : len(bias)] = list(bias)
        self.logit_bias[i, : len(bias)] = list(bias.values())
        self.uses_penalties[i] = p.uses_penalties
        self.presence_penalty[i] = p.presence_penalty
        self.frequency_penalty[i] = p.frequency_penalty
        self.repetition_penalty[i] = p.repetition_penalty


class SamplingInputsBuilder:
    def __init__(self, input_batch, device: DeviceState, vocab_size: int, max_model_len: int):
        """`input_batch`: the runner's persistent batch (`InputBatch`), whose `sampling` rows
        and token histories the inputs are gathered from."""
        self.input_batch = input_batch
        self.device = device
        self.vocab_size = vocab_size
        self.bitmask_words = -(-vocab_size // 32)  # int32 words per grammar bitmask row
        self._widths = {
            **_FIXED_WIDTHS,
            "history": max_model_len,  # the longest a sequence can be
            "bitmask": self.bitmask_words,
        }
        self._idle_device_inputs: dict[int, dict[str, jax.Array]] = {}  # by logit bucket

    def neutral(self, name: str, n: int) -> np.ndarray:
        """`n` rows of the input `name` at its neutral value."""
        dtype, value, width = NEUTRAL[name]
        shape = (n,) if width is None else (n, self._widths[width])
        return np.full(shape, self.vocab_size if value == VOCAB else value, dtype)

    def host_padding(self, n: int) -> dict[str, np.ndarray]:
        """The inputs sent with every step (`HOST`) for `n` rows, at their neutral values."""
        return {name: self.neutral(name, n) for name in HOST}

    def padding(self, n: int) -> SamplingInputs:
        """Inputs for `n` rows that sample nothing anyone reads."""
        return SamplingInputs(**self.host_padding(n), **self.idle_inputs(n))

    def idle_inputs(self, n: int) -> dict[str, jax.Array]:
        """The inputs few requests use (`_IDLE`) for `n` rows, at their neutral values, kept
        on the device."""
        if n not in self._idle_device_inputs:
            idle = {name: self.neutral(name, n) for name in _IDLE}
            self._idle_device_inputs[n] = self.device.put(idle)
        return self._idle_device_inputs[n]

    def build(
        self,
        host: dict[str, np.ndarray],
        rows: np.ndarray,
        seq_len: np.ndarray,
        samples: np.ndarray,
        out: SchedulerOutput,
        first_row: np.ndarray,
    ) -> tuple[dict[str, jax.Array | np.ndarray], SamplerVariant]:
        """A step's inputs: the ones every step sends written into `host` (its padded rows at
        their neutral values, see `host_padding`), and returned, the others (`idle_inputs`,
        or host arrays where some row uses them) and the sampler's parts they need (a variant:
        see `SamplerVariant.covers`). Per real logit row: its request's batch row (`rows`),
        its sequence length with the drafts before it (`seq_len`), and whether its request's
        chunk reaches the end of its sequence (`samples`); `first_row`: each request's first
        logit row (structured outputs' bitmask rows go there)."""
        ib, params = self.input_batch, self.input_batch.sampling
        k = len(rows)
        for name in _PER_REQUEST:
            host[name][:k] = getattr(params, name)[rows]
        num_output = seq_len - ib.num_prompt_tokens[rows]
        host["counters"][:k] = num_output
        wants_logprobs = params.num_logprobs[rows] >= 0
        host["logprobs"][:k] = wants_logprobs
        blocked = num_output < params.min_tokens[rows]  # EOS and stop ids wait for min_tokens
        if blocked.any():
            host["blocked_ids"][:k] = np.where(
                blocked[:, None], params.blocked_ids[rows], self.vocab_size
            )
        uses = (params.has_logit_bias[rows] | params.uses_penalties[rows]) & samples
        needs = SamplerVariant(
            modify=out.grammar_bitmask is not None or bool(blocked.any() or uses.any()),
            random=bool((host["temperature"][:k] >= SAMPLING_EPS).any()),
            logprobs=bool(wants_logprobs.any()),
        )
        n = len(host["temperature"])
        idle = self.idle_inputs(n)
        if uses.any():
            idle = self._fill_penalty_inputs(idle, rows, samples, seq_len)
        return self._fill_bitmask(idle, n, out, first_row), needs

    def _fill_penalty_inputs(
        self, idle: dict, rows: np.ndarray, samples: np.ndarray, lens: np.ndarray
    ) -> dict:
        """Host arrays for logit bias and penalties, filled from the rows that sample with
        them (batch rows `rows`, each sampling after its first `lens` tokens), in place of the
        device-resident `idle` ones; `idle` unchanged when none does."""
        ib, params = self.input_batch, self.input_batch.sampling
        biased = params.has_logit_bias[rows] & samples
        penalized = params.uses_penalties[rows] & samples
        if not (biased.any() or penalized.any()):
            return idle
        names = _BIAS if not penalized.any() else _IDLE[:-1]
        r = len(idle["logit_bias"])
        host = {name: self.neutral(name, r) for name in names}
        k = len(rows)
        for name in _BIAS if biased.any() else ():
            host[name][:k] = np.where(biased[:, None], getattr(params, name)[rows], host[name][0])
        if penalized.any():
            for name in _PENALTIES:
                host[name][:k] = np.where(penalized, getattr(params, name)[rows], host[name][0])
            seen = np.arange(ib.token_ids.shape[1])[None, :] < lens[:, None]
            host["history_ids"][:k] = np.where(seen, ib.token_ids[rows], self.vocab_size)
            host["num_prompt_tokens"][:k] = ib.num_prompt_tokens[rows]
        return {**idle, **self.device.put_if_mesh(host)}

    def _fill_bitmask(
        self, idle: dict, n: int, out: SchedulerOutput, first_row: np.ndarray
    ) -> dict:
        """Structured outputs: the step's bitmask rows at their requests' logit rows."""
        mask = out.grammar_bitmask
        if mask is None:
            return idle
        rows = np.frombuffer(mask.data, np.int32).reshape(-1, self.bitmask_words)
        index = {s.request_id: i for i, s in enumerate(out.requests)}
        host = self.neutral("token_bitmask", n)
        start = 0
        for rid in mask.request_ids:
            i = index[rid]
            k = 1 + len(out.requests[i].spec_token_ids)
            host[first_row[i] : first_row[i] + k] = rows[start : start + k]
            start += k
        return {**idle, "token_bitmask": self.device.put_if_mesh(host)}
