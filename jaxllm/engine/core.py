"""EngineCore: the loop `schedule -> execute -> update`, one step per call.

The `LLM` class drives it in process; the server's core process (`core_proc.py`) runs the same
class behind a socket.

Async scheduling (on by default): `step` schedules and launches step N+1 before it collects
step N, so the host's work (scheduling, building inputs, and whatever the caller does with the
outputs) overlaps the device's. A decode row of step N+1 takes the token step N sampled
straight from the device (`ModelRunner.last_tokens`); the scheduler sees that token, and so its
stop checks, one step later, and a step scheduled past a stop is discarded. Outputs are the
same as without it: sampling depends only on a request's seed and token count. Rows with
penalties need their whole history on the host, so a step with such a request runs
synchronously.
"""

from __future__ import annotations

from jaxllm.engine.request import Request
from jaxllm.engine.scheduler import Scheduler
from jaxllm.engine.step_data import RequestUpdate, SchedulerOutput
from jaxllm.runner import InflightStep, ModelRunner


class EngineCore:
    def __init__(self, scheduler: Scheduler, runner: ModelRunner, *, async_scheduling: bool = True):
        self.scheduler = scheduler
        self.runner = runner
        self.async_scheduling = async_scheduling
        self.num_steps = 0
        self._inflight: tuple[SchedulerOutput, InflightStep] | None = None

    def add_request(self, request: Request) -> None:
        self.scheduler.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        self.scheduler.abort_requests(request_ids)

    def has_unfinished_requests(self) -> bool:
        return self._inflight is not None or self.scheduler.has_unfinished_requests()

    def forget_lost_cache(self) -> None:
        """After a failed step took the donated KV cache with it (the runner rebuilt it
        empty), the cached prefixes point at nothing: forget them. Call it once the failed
        requests are aborted (a reset needs every block free of requests)."""
        if self.runner.kv_cache_lost:
            self.scheduler.kv.reset_prefix_cache()
            self.runner.kv_cache_lost = False

    def step(self) -> list[RequestUpdate]:
        """Runs one step; returns the updates of the step that completed (with async
        scheduling, the one launched by the previous call). If it raises, no step is left in
        flight: the caller fails the running requests."""
        try:
            if not self.async_scheduling or self._needs_sync():
                updates = self.drain()
                scheduled = self.scheduler.schedule()
                if scheduled.is_empty:
                    return updates
                output = self.runner.execute(scheduled)
                self.num_steps += 1
                return updates + self.scheduler.update_from_output(scheduled, output)
            scheduled = self.scheduler.schedule()
            launched = None if scheduled.is_empty else self.runner.launch(scheduled)
            updates = self.drain()
            if launched is not None:
                self._inflight = (scheduled, launched)
                self.num_steps += 1
            return updates
        except BaseException:
            self._inflight = None
            raise

    def drain(self) -> list[RequestUpdate]:
        """Waits for the step in flight, if any (e.g. one launched past the last stop), and
        applies its output. Nothing is left in flight, even if it raises."""
        if self._inflight is None:
            return []
        scheduled, launched = self._inflight
        self._inflight = None
        return self.scheduler.update_from_output(scheduled, self.runner.fetch(launched))

    def _needs_sync(self) -> bool:
        """Penalties read a request's whole history from the host: with such a request
        running, the next step waits for the previous one's tokens."""
        return any(r.sampling_params.uses_penalties for r in self.scheduler.running)
