"""The engine's periodic log of what it is doing, as vLLM's `LoggingStatLogger` writes it (on
by default under `jaxllm serve`, off offline; `disable_log_stats` turns it off or on), every
`interval` seconds while there is work (and once more when it has stopped; then at DEBUG):

    Engine 000: Avg prompt throughput: 1520.4 tokens/s, Avg generation throughput: 310.2
    tokens/s, Running: 8 reqs, Waiting: 0 reqs, GPU KV cache usage: 12.5%, Prefix cache hit
    rate: 43.0%
    SpecDecoding metrics: Mean acceptance length: 2.41, Accepted throughput: 180.20 tokens/s,
    Drafted throughput: 376.40 tokens/s, Accepted: 1802 tokens, Drafted: 3764 tokens,
    Per-position acceptance rate: 0.712, 0.451, 0.247, Avg Draft acceptance rate: 47.9%

(each one line). Throughputs and rates are over the interval: the prompt tokens of requests
whose first token came in it and the tokens generated, the prefix cache's hits of the tokens
looked up, the drafts verified. The speculative line appears where drafts were verified.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from jaxllm.engine.core_outputs import Stats

logger = logging.getLogger("jaxllm.stats")

# vLLM's VLLM_LOG_STATS_INTERVAL default.
LOG_STATS_INTERVAL = 10.0


class LoggingStatLogger:
    """Collects each step's token counts and the core's latest `Stats`; `maybe_log` writes
    the lines when an interval has passed."""

    def __init__(
        self,
        engine_index: int = 0,
        interval: float = LOG_STATS_INTERVAL,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.engine_index = engine_index
        self.interval = interval
        self.clock = clock
        self.last_log = clock()
        self.stats: Stats | None = None
        self._at_last_log: Stats | None = None  # the counters as of the last lines
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self._was_busy = False

    def record(self, stats: Stats, prompt_tokens: int = 0, generation_tokens: int = 0) -> None:
        self.stats = stats
        if self._at_last_log is None:
            self._at_last_log = stats
        self.prompt_tokens += prompt_tokens
        self.generation_tokens += generation_tokens

    def maybe_log(self) -> list[str]:
        """The lines written at INFO, if an interval has passed (while idle, after the first
        idle interval, at DEBUG only: none returned)."""
        now = self.clock()
        if self.stats is None or now - self.last_log < self.interval:
            return []
        lines = self.lines(now - self.last_log)
        busy = bool(
            self.prompt_tokens
            or self.generation_tokens
            or self.stats.num_running
            or self.stats.num_waiting
        )
        self.last_log, self._at_last_log = now, self.stats
        self.prompt_tokens = self.generation_tokens = 0
        shown = busy or self._was_busy  # an idle engine's lines go to debug (vLLM's rule)
        self._was_busy = busy
        for line in lines:
            (logger.info if shown else logger.debug)("%s", line)
        return lines if shown else []

    def lines(self, seconds: float) -> list[str]:
        s, before = self.stats, self._at_last_log
        assert s is not None and before is not None
        queries = s.prefix_cache_queries - before.prefix_cache_queries
        hits = s.prefix_cache_hits - before.prefix_cache_hits
        out = [
            f"Engine {self.engine_index:03d}: "
            f"Avg prompt throughput: {self.prompt_tokens / seconds:.1f} tokens/s, "
            f"Avg generation throughput: {self.generation_tokens / seconds:.1f} tokens/s, "
            f"Running: {s.num_running} reqs, Waiting: {s.num_waiting} reqs, "
            f"GPU KV cache usage: {100 * s.kv_cache_usage:.1f}%, "
            f"Prefix cache hit rate: {100 * hits / queries if queries else 0.0:.1f}%"
        ]
        spec, was = s.spec_decoding, before.spec_decoding
        drafts = spec.num_drafts - was.num_drafts
        if drafts > 0:
            drafted = spec.num_draft_tokens - was.num_draft_tokens
            accepted = spec.num_accepted_tokens - was.num_accepted_tokens
            per_pos = [
                (n - (was.num_accepted_per_pos[i] if i < len(was.num_accepted_per_pos) else 0))
                / drafts
                for i, n in enumerate(spec.num_accepted_per_pos)
            ]
            out.append(
                "SpecDecoding metrics: "
                f"Mean acceptance length: {1 + accepted / drafts:.2f}, "
                f"Accepted throughput: {accepted / seconds:.2f} tokens/s, "
                f"Drafted throughput: {drafted / seconds:.2f} tokens/s, "
                f"Accepted: {accepted} tokens, Drafted: {drafted} tokens, "
                f"Per-position acceptance rate: {', '.join(f'{r:.3f}' for r in per_pos)}, "
                f"Avg Draft acceptance rate: {100 * accepted / drafted if drafted else 0.0:.1f}%"
            )
        return out
