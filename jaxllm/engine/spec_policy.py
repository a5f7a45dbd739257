"""When speculation pays, and how far: each step the scheduler verifies at most `speculate(n)`
drafts per request (0: none, and none are proposed), the number measured to give the most
tokens a second at that batch size.

Speculation trades a wider step (each request's drafts are verified in the same forward pass)
for more tokens per step. Whether that pays, and for how many drafts, depends on the
proposer's acceptance on today's traffic (later drafts are accepted less often) and on how the
step's cost grows with its width on this machine: on a GPU at batch 1 a step of 4 tokens costs
about what a step of 1 does, on a CPU or at batch 64 it costs up to 4 times as much. Neither is
known in advance, so the policy measures both as one figure, the tokens a second that decode
steps deliver, per batch size (rounded up to a power of two) and per way of running them: k
drafts (the configured number), 1 draft, or plain decode (an arm each of a bandit):

- a batch size not measured yet follows what was measured at others, where that says
  something: at most the best way of a smaller batch, at least that of a larger one (a wider
  batch gains less: its verification costs more of the device), so only the ways left are
  tried (none, where one is left); the ways left are tried in turn for `probe_steps` measured
  steps each (the fastest at the nearest batch size measured first, else k drafts), a way that
  gives under 80% of a measured one's rate after 3 steps is dropped there, then the fastest
  runs (within 5%, the one of fewer drafts), and a way not measured for `reprobe_steps` steps
  (an eighth of that where it came within 80%) is measured again (acceptance changes with
  the traffic, and a close call may have been noise);
- only steps of decodes alone are measured (a prompt chunk's cost says nothing of either), from
  one step's output to the next, and only when the step before ran the same way (the first
  speculating step after plain ones has no drafts yet: it only proposes);
- a rate is the mean tokens of a way's last 32 measured steps over their median duration: it
  follows the traffic, and a step the machine stalled (another process, a page fault) does
  not decide for 8.

vLLM's `disable_by_batch_size` is honoured as a fixed bound on top: a step with that many
running requests or more never speculates. `adaptive: false` verifies every draft in every
step. The output is the same either way: drafts are only ever verified.
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
    owed: int = -1  # measured steps its probe still takes, whatever the rates say (-1: unset)

    @property
    def probing(self) -> bool:
        return self.owed != 0

    @property
    def known(self) -> bool:
        return self.owed == 0 and bool(self.seconds)

    rate: float = 0.0  # tokens a second: mean tokens a step over the median step

    def add(self, tokens: int, seconds: float, step: int) -> None:
        self.tokens.append(tokens)
        self.seconds.append(seconds)
        self.samples += 1
        self.last = step
        self.owed = max(self.owed - 1, 0)
        median = statistics.median(self.seconds)
        self.rate = statistics.fmean(self.tokens) / max(median, 1e-9)

    def forget(self) -> None:
        self.tokens.clear()
        self.seconds.clear()
        self.rate = 0.0


class SpeculationPolicy:
    def __init__(
        self,
        num_speculative_tokens: int,
        *,
        adaptive: bool = True,
        disable_by_batch_size: int | None = None,
        probe_steps: int = 8,
        reprobe_steps: int = 1024,
        clock=time.perf_counter,
    ):
        self.k = num_speculative_tokens
        # The ways tried, most drafts first: k, 1 and none.
        self.ways = tuple(sorted({num_speculative_tokens, 1, 0}, reverse=True))
        self.adaptive = adaptive
        self.disable_by_batch_size = disable_by_batch_size
        self.probe_steps = probe_steps
        self.reprobe_steps = reprobe_steps
        self.clock = clock
        self.arms: dict[tuple[int, int], _Arm] = {}
        self.num_steps = 0  # measured steps
        self._last: tuple[tuple[int, int] | None, float] | None = None
        self._chosen: dict[int, int] = {}  # by batch size: the way last logged as fastest
        self._decided: dict[int, int] = {}  # by batch size, until the next measurement

    @staticmethod
    def bucket(num_requests: int) -> int:
        return 1 << max(0, num_requests - 1).bit_length()

    def speculate(self, num_running: int) -> int:
        """The most drafts a request verifies in a step over `num_running` requests (0: the
        step verifies none and has none proposed)."""
        limit = self.disable_by_batch_size
        if limit is not None and num_running >= limit:
            return 0
        if not self.adaptive:
            return self.k
        b = self.bucket(num_running)
        if b not in self._decided:  # (the engine asks twice a step: whether to sync, then)
            self._decided[b] = self._decide(b)
        return self._decided[b]

    def _decide(self, b: int) -> int:
        ways = self._candidates(b)
        if len(ways) == 1:
            return ways[0]
        arms = {w: self._arm(b, w) for w in ways}
        for w in self._probe_order(b, ways):  # each way's probe, or a re-measurement's
            arm = arms[w]
            if arm.owed < 0:
                arm.owed = self.probe_steps
            if arm.probing and not self._losing(arm, arms.values()):
                return w
            arm.owed = 0  # (a probe cut short: it loses clearly)
        return _fastest_of(arms)

    def _probe_order(self, bucket: int, ways: tuple[int, ...]) -> list[int]:
        """The order ways are first tried at `bucket`: the fastest at the nearest batch size
        measured every way first (likely the fastest here too), else k drafts first (what was
        asked for); then the others, most drafts first."""
        measured = [b for b in {b for b, _ in self.arms} if self._fastest(b) is not None]
        if not measured:
            return list(ways)
        nearest = min(measured, key=lambda b: abs(b.bit_length() - bucket.bit_length()))
        first = self._fastest(nearest)
        return sorted(ways, key=lambda w: (w != first, -w))

    def _losing(self, arm: _Arm, arms) -> bool:
        """Whether a way being probed already gives under 80% of a known way's rate, after 3
        measured steps (a clearly slower way is not measured for all its probe)."""
        if len(arm.seconds) < 3:
            return False
        best = max((a.rate for a in arms if a is not arm and a.known), default=0.0)
        return arm.rate < 0.8 * best

    def _candidates(self, bucket: int) -> tuple[int, ...]:
        """The ways worth trying at `bucket`, from the batch sizes measured every way: at most
        the fastest of a smaller one, at least the fastest of a larger one."""
        low, high = 0, self.k
        for b in {b for b, _ in self.arms} - {bucket}:
            best = self._fastest(b)
            if best is None:
                continue
            if b < bucket:
                high = min(high, best)
            else:
                low = max(low, best)
        ways = tuple(w for w in self.ways if low <= w <= high)
        return ways or (high,)

    def _fastest(self, bucket: int) -> int | None:
        """The fastest way at `bucket`, once every way was measured there."""
        arms = {w: self.arms.get((bucket, w)) for w in self.ways}
        if any(a is None or not a.known for a in arms.values()):
            return None
        return _fastest_of(arms)

    def observe(self, num_decodes: int | None, num_drafts: int, num_tokens: int) -> None:
        """A step's output is back: `num_decodes` its requests if all were decodes (None if
        any ran a prompt chunk), `num_drafts` what `speculate` allowed it, `num_tokens` the
        tokens it gave."""
        now = self.clock()
        key = None if num_decodes is None else (self.bucket(num_decodes), num_drafts)
        last, self._last = self._last, (key, now)
        if key is None or last is None or last[0] != key:
            return
        self.num_steps += 1
        self._decided.clear()
        bucket = key[0]
        arm = self._arm(*key)
        arm.add(num_tokens, now - last[1], self.num_steps)
        self._log_choice(bucket)
        # The other ways at this batch size, measured again once they have not been for long
        # (sooner where they came close: a few noisy steps may have decided).
        for w in self._candidates(bucket):
            other = self._arm(bucket, w)
            close = other.rate >= 0.8 * arm.rate
            wait = self.reprobe_steps // 8 if close else self.reprobe_steps
            if w != num_drafts and other.known and self.num_steps - other.last > wait:
                other.forget()  # its old steps would outweigh the new
                other.owed = self.probe_steps

    def _log_choice(self, bucket: int) -> None:
        best = self._fastest(bucket)
        if best is not None and self._chosen.get(bucket) != best:
            self._chosen[bucket] = best
            logger.info(
                "speculative decoding at batch <= %d: %s (tok/s by drafts verified: %s)",
                bucket,
                f"{best} drafts" if best else "plain decode",
                ", ".join(f"{w}: {self.arms[bucket, w].rate:.1f}" for w in self.ways),
            )

    def _arm(self, bucket: int, num_drafts: int) -> _Arm:
        return self.arms.setdefault((bucket, num_drafts), _Arm())

    def rates(self) -> dict[str, float]:
        """Tokens a second by batch size and drafts verified (for logs and benchmarks)."""
        return {
            f"{b}:{w}": round(arm.rate, 2)
            for (b, w), arm in sorted(self.arms.items())
            if arm.samples
        }


def _fastest_of(arms: dict[int, _Arm]) -> int:
    """The way with the most tokens a second; within 5% of it, the fewest drafts (a tie goes
    to the narrower step, which also lets plain steps overlap)."""
    best = max(arm.rate for arm in arms.values())
    return min(w for w, arm in arms.items() if arm.rate >= best / 1.05)
