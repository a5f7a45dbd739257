"""EngineCore: the loop `schedule -> execute -> update`, one step per call.

In-process today (the `LLM` class drives it directly); the server's core process will wrap
the same class behind a socket.
"""

from __future__ import annotations

from jaxllm.engine.request import Request
from jaxllm.engine.scheduler import Scheduler
from jaxllm.engine.step_data import RequestUpdate
from jaxllm.runner import ModelRunner


class EngineCore:
    def __init__(self, scheduler: Scheduler, runner: ModelRunner):
        self.scheduler = scheduler
        self.runner = runner
        self.num_steps = 0

    def add_request(self, request: Request) -> None:
        self.scheduler.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        self.scheduler.abort_requests(request_ids)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def forget_lost_cache(self) -> None:
        """After a failed step took the donated KV cache with it (the runner rebuilt it
        empty), the cached prefixes point at nothing: forget them. Call it once the failed
        requests are aborted (a reset needs every block free of requests)."""
        if self.runner.kv_cache_lost:
            self.scheduler.kv.reset_prefix_cache()
            self.runner.kv_cache_lost = False

    def step(self) -> list[RequestUpdate]:
        scheduled = self.scheduler.schedule()
        if scheduled.is_empty:
            return []
        output = self.runner.execute(scheduled)
        self.num_steps += 1
        return self.scheduler.update_from_output(scheduled, output)
