"""When speculation pays: the scheduler verifies drafts (and has the next ones proposed) only in
steps where measurement says it gives more tokens a second than plain decode at that batch size.

Speculation trades a wider step (each request's drafts are verified in the same forward pass)
for more tokens per step. Whether that pays depends on the head's acceptance on today's traffic
and on how the step's cost grows with its width on this machine: on a GPU at batch 1 a step of
4 tokens costs about what a step of 1 does, on a CPU or at batch 64 it costs up to 4 times as
much. Neither is known in advance, so the policy measures both as one figure, the tokens a
second that decode steps deliver with and without speculation, per batch size (rounded up to a
power of two), and takes the better (an epsilon-greedy bandit with two arms per batch size):

- a batch size not measured yet both ways follows what was measured at others, where that says
  something: plain if a smaller batch runs plain, speculating if a larger batch speculates (a
  wider batch gains less: its verification costs more of the device); otherwise it speculates
  for `probe_steps` measured steps, then runs plain for as many, and from then on it takes the
  faster, measuring the other again for `probe_steps` once it has not for `reprobe_steps`
  steps (acceptance changes with the traffic);
- only steps of decodes alone are measured (a prompt chunk's cost says nothing of either), from
  one step's output to the next, and only when the step before ran the same way (the first
  speculating step after plain ones has no drafts yet: it only proposes);
- a rate is the mean tokens of an arm's last 32 measured steps over their median duration:
  it follows the traffic, and a step the machine stalled (another process, a page fault)
  does not decide for 8.

vLLM's `disable_by_batch_size` is honoured as a fixed bound on top: a step with that many
running requests or more never speculates. `adaptive: false` keeps speculation always on (the
output is the same either way: drafts are only ever verified).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import statistics
import time

logger = logging.getLogger(__name__)

_WINDOW = 32


@dataclasses.dataclass
class _Arm:
    """One way of running steps at one batch size: its last measured steps."""

    tokens: collections.deque = dataclasses.field(
        default_factory=lambda: collections.deque(maxlen=_WINDOW)
    )
    seconds: collections.deque = dataclasses.field(
        default_factory=lambda: collections.deque(maxlen=_WINDOW)
    )
    samples: int = 0  # measured steps since start
    last: int = 0  # the policy's step count at its last measurement
    target: int = 0  # measure until `samples` reaches it (probing), whatever the rates say

    @property
    def rate(self) -> float:
        """Tokens a second: mean tokens a step over the median step."""
        if not self.seconds:
            return 0.0
        return statistics.fmean(self.tokens) / max(statistics.median(self.seconds), 1e-9)

    def add(self, tokens: int, seconds: float, step: int) -> None:
        self.tokens.append(tokens)
        self.seconds.append(seconds)
        self.samples += 1
        self.last = step

    def forget(self) -> None:
        self.tokens.clear()
        self.seconds.clear()


class SpeculationPolicy:
    def __init__(
        self,
        *,
        adaptive: bool = True,
        disable_by_batch_size: int | None = None,
        probe_steps: int = 8,
        reprobe_steps: int = 1024,
        clock=time.perf_counter,
    ):
        self.adaptive = adaptive
        self.disable_by_batch_size = disable_by_batch_size
        self.probe_steps = probe_steps
        self.reprobe_steps = reprobe_steps
        self.clock = clock
        self.arms: dict[tuple[int, bool], _Arm] = {}
        self.num_steps = 0  # measured steps
        self._last: tuple[tuple[int, bool] | None, float] | None = None
        self._chosen: dict[int, bool] = {}  # by batch size: the way last logged as faster

    @staticmethod
    def bucket(num_requests: int) -> int:
        return 1 << max(0, num_requests - 1).bit_length()

    def speculate(self, num_running: int) -> bool:
        """Whether a step over `num_running` requests verifies drafts and has the next ones
        proposed."""
        limit = self.disable_by_batch_size
        if limit is not None and num_running >= limit:
            return False
        if not self.adaptive:
            return True
        b = self.bucket(num_running)
        on, off = self._arm(b, True), self._arm(b, False)
        if on.samples < self.probe_steps or off.samples < self.probe_steps:
            guess = self._guess(b)
            return on.samples < self.probe_steps if guess is None else guess
        if on.samples < on.target:
            return True
        if off.samples < off.target:
            return False
        return on.rate >= off.rate

    def _guess(self, bucket: int) -> bool | None:
        """What the batch sizes measured both ways say of `bucket`: False if a smaller one
        runs plain, True if a larger one speculates, else None."""
        for b in sorted({b for b, _ in self.arms}):
            on, off = self.arms.get((b, True)), self.arms.get((b, False))
            if b == bucket or not on or not off:
                continue
            if min(on.samples, off.samples) < self.probe_steps:
                continue
            faster = on.rate >= off.rate
            if (b < bucket and not faster) or (b > bucket and faster):
                return faster
        return None

    def observe(self, num_decodes: int | None, speculated: bool, num_tokens: int) -> None:
        """A step's output is back: `num_decodes` its requests if all were decodes (None if
        any ran a prompt chunk), `speculated` whether it ran speculating, `num_tokens` the
        tokens it gave."""
        now = self.clock()
        key = None if num_decodes is None else (self.bucket(num_decodes), speculated)
        last, self._last = self._last, (key, now)
        if key is None or last is None or last[0] != key:
            return
        self.num_steps += 1
        arm = self._arm(*key)
        arm.add(num_tokens, now - last[1], self.num_steps)
        self._log_choice(key[0])
        # The other way at this batch size, measured again once it has not been for long.
        other = self._arm(key[0], not speculated)
        stale = self.num_steps - other.last > self.reprobe_steps
        if other.samples >= max(other.target, self.probe_steps) and stale:
            other.forget()  # its old steps would outweigh the new
            other.target = other.samples + self.probe_steps

    def _log_choice(self, bucket: int) -> None:
        on, off = self._arm(bucket, True), self._arm(bucket, False)
        if min(on.samples, off.samples) < self.probe_steps:
            return
        faster = on.rate >= off.rate
        if self._chosen.get(bucket) != faster:
            self._chosen[bucket] = faster
            logger.info(
                "speculative decoding at batch <= %d: %s (%.1f tok/s speculating, %.1f plain)",
                bucket,
                "speculating" if faster else "plain decode",
                on.rate,
                off.rate,
            )

    def _arm(self, bucket: int, speculated: bool) -> _Arm:
        return self.arms.setdefault((bucket, speculated), _Arm())

    def rates(self) -> dict[str, float]:
        """Tokens a second by batch size and way (for logs and benchmarks)."""
        return {
            f"{b}:{'spec' if s else 'plain'}": round(arm.rate, 2)
            for (b, s), arm in sorted(self.arms.items())
            if arm.samples
        }
