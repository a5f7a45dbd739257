"""`jaxllm compile`: the engine as `jaxllm serve` would build it on a TPU slice or a GPU host,
compiled by that target's real compiler on this machine, without the hardware.

- `targets`: the chips and slices (`v5e-4`, `v6e-1`, `h100x8`, ...), their published memory,
  bandwidth and peaks, and their compile-only devices (libtpu, the CUDA plugin);
- `engine`: the model from its config alone (abstract weights), the KV pool sized for the
  target, and every startup program compiled (`ModelRunner.warmup` on an abstract runner);
- `report`: memory per device, compile times, KV-cache copies (there must be none) and decode
  speed predicted from the compiler's cost analysis (labelled as a prediction).
"""

from __future__ import annotations

from jaxllm.aot.targets import CHIPS, Target, parse_target

__all__ = ["CHIPS", "Target", "parse_target"]
