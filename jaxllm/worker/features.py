"""The one interface between the runner and its feature modules: the image encoder
(`mm_encoder`), the host KV tier (`kv_offload`), the prompt scorer (`prompt_logprobs`), the
pooler of a decoder served for pooling (`hidden_pooler`) and the draft proposers
(`spec_decode`).

The runner keeps the features an engine serves in one list and drives them all the same way:
at startup it counts their programs (`num_programs`) and compiles them (`warmup_jobs`); in
each step it lets them dispatch what the forward pass reads (`before_forward`: KV blocks
copied back from the host, images encoded), then what reads the forward pass's hidden states
(`after_forward`, which returns a handle on the device results), and when the step's output
comes back it collects each handle (`fetch`) into the `RunnerOutput` field the feature names
(`output`). Every hook does nothing by default: a feature defines the ones its work needs, so
a new feature is a module of its own and one entry of the runner's list.

The proposers take part in startup only: proposing runs between the sampler and the next step
(`spec_decode.Proposer`), on the path every speculative step takes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, ClassVar

import jax

from jaxllm.worker.step_data import SchedulerOutput


@dataclasses.dataclass(frozen=True)
class Warmup:
    """What a feature's compile jobs are made from."""

    params: list  # the model's flat parameter list
    token_buckets: list[int]  # the compiled token counts
    rows: Callable[[int], jax.ShapeDtypeStruct]  # abstract hidden states of n rows


@dataclasses.dataclass(frozen=True)
class LaunchedForward:
    """What a feature sees of a step whose forward pass was dispatched."""

    out: SchedulerOutput
    params: list
    hidden: jax.Array  # [t_pad, D]: every token's final hidden state, on the device
    t_pad: int  # the step's padded token count


class Feature:
    """A feature module of the runner (see the module's docstring)."""

    output: ClassVar[str | None] = None
    """The `RunnerOutput` field that `fetch` fills, if any."""

    @property
    def num_programs(self) -> int:
        """The programs it compiles at startup."""
        return 0

    def warmup_jobs(self, warm: Warmup) -> list[Callable[[], Any]]:
        """One job per program it compiles."""
        return []

    def before_forward(self, out: SchedulerOutput) -> None:
        """Dispatches, before the step's forward pass, what that pass reads."""

    def after_forward(self, step: LaunchedForward) -> Any:
        """Dispatches its programs over the step's hidden states; a handle for `fetch`."""
        return None

    def fetch(self, out: SchedulerOutput, handle: Any) -> Any:
        """The results of a launched step's `handle`, for the `output` field."""
        return None
