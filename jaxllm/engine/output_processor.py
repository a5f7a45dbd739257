"""Turns the core's token updates into `CompletionOutput`s: detokenizes incrementally,
applies stop strings (asking the core to abort a request that hit one), and gathers logprobs."""

from __future__ import annotations

import dataclasses

from jaxllm.detokenizer import IncrementalDetokenizer
from jaxllm.engine.core_outputs import FinishReason, RequestUpdate
from jaxllm.outputs import CompletionOutput, Logprob
from jaxllm.sampling_params import SamplingParams
from jaxllm.worker import TokenLogprobs


@dataclasses.dataclass
class _State:
    index: int
    params: SamplingParams
    detokenizer: IncrementalDetokenizer | None
    token_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    kv_transfer_params: dict | None = None  # a prefiller's answer (`kv_transfer`)


class OutputProcessor:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.states: dict[str, _State] = {}

    def add_request(
        self, request_id: str, index: int, prompt_token_ids: list[int], params: SamplingParams
    ) -> None:
        detok = None
        if self.tokenizer is not None:
            detok = IncrementalDetokenizer(
                self.tokenizer,
                prompt_token_ids,
                skip_special_tokens=params.skip_special_tokens,
                stop=params.stop,
                include_stop_str_in_output=params.include_stop_str_in_output,
            )
        state = _State(index, params, detok)
        if params.logprobs is not None:
            state.logprobs, state.cumulative_logprob = [], 0.0
        if params.prompt_logprobs is not None:
            state.prompt_logprobs = [None]  # the first prompt token has no logprob
        self.states[request_id] = state

    def remove(self, request_id: str) -> None:
        self.states.pop(request_id, None)

    def process(self, updates: list[RequestUpdate]) -> tuple[list[str], list[str]]:
        """Applies updates; returns (finished request ids, ids the core must abort because a
        stop string ended them)."""
        finished, to_abort = [], []
        for u in updates:
            state = self.states.get(u.request_id)
            if state is None:
                continue
            if u.new_prompt_logprobs and state.prompt_logprobs is not None:
                for entry in u.new_prompt_logprobs:
                    state.prompt_logprobs.append(self._logprobs(entry.token_id, entry))
            for i, token in enumerate(u.new_token_ids):
                state.token_ids.append(token)
                if u.new_logprobs is not None and state.logprobs is not None:
                    state.logprobs.append(self._logprobs(token, u.new_logprobs[i]))
                    state.cumulative_logprob += u.new_logprobs[i].logprob
                if state.detokenizer is None:
                    continue
                # The token that stopped the output (EOS or a stop id) leaves its text out
                # unless include_stop_str_in_output.
                ends = u.finish_reason == FinishReason.STOP and i == len(u.new_token_ids) - 1
                skip = ends and not state.params.include_stop_str_in_output
                # Stop strings count only past min_tokens, as EOS and stop ids (vLLM's rule).
                check = len(state.token_ids) > state.params.min_tokens
                if state.detokenizer.add_token(token, skip_text=skip, check_stop=check):
                    state.finish_reason = FinishReason.STOP
                    state.stop_reason = state.detokenizer.stop_reason
                    to_abort.append(u.request_id)
                    break
            if u.kv_transfer_params is not None:
                state.kv_transfer_params = u.kv_transfer_params
            if state.finish_reason is None and u.finish_reason is not None:
                state.finish_reason, state.stop_reason = u.finish_reason, u.stop_reason
                check = len(state.token_ids) > state.params.min_tokens
                if state.detokenizer is not None and state.detokenizer.flush(check_stop=check):
                    state.finish_reason = FinishReason.STOP
                    state.stop_reason = state.detokenizer.stop_reason
            if state.finish_reason is not None:
                finished.append(u.request_id)
        return finished, to_abort

    def _logprobs(self, token: int, entry: TokenLogprobs) -> dict[int, Logprob]:
        out = {}
        for r, (tid, lp) in enumerate(zip(entry.top_ids, entry.top_logprobs, strict=True), 1):
            out[tid] = Logprob(lp, r, self._decode_one(tid))
        if token not in out:
            out[token] = Logprob(entry.logprob, entry.rank, self._decode_one(token))
        return out

    def _decode_one(self, token: int) -> str | None:
        return None if self.tokenizer is None else self.tokenizer.decode([token])

    def kv_transfer_params(self, request_id: str) -> dict | None:
        return self.states[request_id].kv_transfer_params

    def prompt_logprobs(self, request_id: str) -> list[dict[int, Logprob] | None] | None:
        return self.states[request_id].prompt_logprobs

    def output(self, request_id: str) -> CompletionOutput:
        """The completion so far. Until it finishes, its text leaves out the tail a stop
        string could still cut (`IncrementalDetokenizer.stable_text`), so a stream of these
        snapshots never sends text the finished answer removes."""
        s = self.states[request_id]
        text = ""
        if s.detokenizer is not None:
            d = s.detokenizer
            text = d.text if s.finish_reason is not None else d.stable_text
        return CompletionOutput(
            index=s.index,
            text=text,
            token_ids=list(s.token_ids),
            cumulative_logprob=s.cumulative_logprob,
            logprobs=None if s.logprobs is None else list(s.logprobs),  # a snapshot
            finish_reason=s.finish_reason,
            stop_reason=s.stop_reason,
        )
