"""prompt_logprobs: the logprob, rank and top alternatives of each prompt token a chunk
scores, from the step's hidden states (the forward pass returns all of them), by one more
program per token bucket that runs only when some chunk of the step asks."""

from __future__ import annotations

import functools

import jax
import numpy as np

from jaxllm.worker.compiler import Compiler
from jaxllm.worker.features import Feature, LaunchedForward, Warmup
from jaxllm.worker.input_batch import InputBatch
from jaxllm.worker.programs import score_prompt
from jaxllm.worker.step_data import PromptTokenLogprobs, SchedulerOutput


class PromptScorer(Feature):
    output = "prompt_logprobs"

    def __init__(
        self,
        graphdef,
        params_def,
        input_batch: InputBatch,
        compiler: Compiler,
        token_buckets: list[int],
    ):
        self.input_batch = input_batch
        self.compiler = compiler
        self.token_buckets = token_buckets
        self._score = jax.jit(functools.partial(score_prompt, graphdef, params_def))

    @property
    def num_programs(self) -> int:
        return len(self.token_buckets)

    def warmup_jobs(self, warm: Warmup) -> list:
        """One compile job per token bucket."""

        def compile_scorer(t):
            args = (warm.params, warm.rows(t), np.zeros(t, np.int32))
            self.compiler.compile("prompt_scorer", (t,), self._score, *args)

        return [functools.partial(compile_scorer, t) for t in self.token_buckets]

    def after_forward(self, step: LaunchedForward):
        """Dispatches the scorer over the step's hidden states when a chunk scores prompt
        tokens; (targets, device results) or None."""
        out = step.out
        if not any(s.prompt_logprob_targets for s in out.requests):
            return None
        targets = np.full(step.t_pad, -1, np.int32)
        start = 0
        for s in out.requests:
            if s.prompt_logprob_targets:
                targets[start : start + s.num_scheduled_tokens] = s.prompt_logprob_targets
            start += s.num_scheduled_tokens
        return targets, self._score(step.params, step.hidden, targets)

    def fetch(self, out: SchedulerOutput, scoring) -> dict[str, list[PromptTokenLogprobs]]:
        """The scored tokens of a launched step, by request (those still in the batch)."""
        if scoring is None:
            return {}
        targets, results = scoring
        logprob, rank, top_ids, top_lps = jax.device_get(results)
        ib = self.input_batch
        scored: dict[str, list[PromptTokenLogprobs]] = {}
        start = 0
        for s in out.requests:
            n = s.num_scheduled_tokens
            if s.prompt_logprob_targets and s.request_id in ib.row_of:
                k = int(ib.sampling.num_prompt_logprobs[ib.row_of[s.request_id]])
                scored[s.request_id] = [
                    PromptTokenLogprobs(
                        int(targets[t]),
                        float(logprob[t]),
                        int(rank[t]),
                        top_ids[t, :k].tolist(),
                        top_lps[t, :k].tolist(),
                    )
                    for t in range(start, start + n)
                    if targets[t] >= 0
                ]
            start += n
        return scored
