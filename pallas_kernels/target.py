"""What the kernels are traced for: this machine's JAX backend, or another target.

Within `target_platform`, kernels are traced for that platform ("cpu", "gpu" / "cuda", "tpu")
and device instead of JAX's default backend and device: the Pallas kernels lower natively (not
interpreted), the native CPU kernels (FFI) stay out, the tuning tables pick the target's block
sizes, and capability checks read the target's device. That is how a program is compiled on
this CPU for a TPU or a GPU that is not here (`jaxllm.aot`), from a compile-only device of
`jax.experimental.topologies`: `jax.jit(f).trace(...).lower(lowering_platforms=(platform,))`.
"""

from __future__ import annotations

import contextlib
import contextvars

import jax

_TARGET: contextvars.ContextVar[tuple[str, jax.Device | None] | None] = contextvars.ContextVar(
    "jaxllm_target", default=None
)


@contextlib.contextmanager
def target_platform(platform: str, device: jax.Device | None = None):
    """Traces kernels for `platform` (and `device`, e.g. a compile-only TPU v6e device, for
    their block sizes and capability checks) within it."""
    platform = "gpu" if platform in ("cuda", "rocm") else platform
    token = _TARGET.set((platform, device))
    try:
        yield
    finally:
        _TARGET.reset(token)


def current_platform() -> str:
    """The platform kernels are traced for: `target_platform`'s, else JAX's default backend."""
    target = _TARGET.get()
    return target[0] if target is not None else jax.default_backend()


def current_device() -> jax.Device | None:
    """The device kernels are traced for: `target_platform`'s, else JAX's first device; None
    when a target platform is given without a device."""
    target = _TARGET.get()
    if target is None:
        return jax.devices()[0]
    return target[1]


def current_device_kind() -> str:
    """`current_device()`'s kind, or "*" (the tuning tables' defaults) when there is none."""
    device = current_device()
    return "*" if device is None else device.device_kind


def compute_capability() -> tuple[int, int] | None:
    """The (major, minor) CUDA compute capability of `current_device()`, None where it has
    none (not a GPU, or no device given)."""
    device = current_device()
    capability = getattr(device, "compute_capability", None)
    if capability is None:
        return None
    return tuple(int(x) for x in str(capability).split(".")[:2])


def lowering_platform(device: jax.Device) -> str:
    """The name `.lower(lowering_platforms=...)` takes for `device`'s platform ("tpu", "cuda",
    "rocm", "cpu")."""
    if device.platform != "gpu":
        return device.platform
    return "rocm" if "rocm" in getattr(device.client, "platform_version", "").lower() else "cuda"
