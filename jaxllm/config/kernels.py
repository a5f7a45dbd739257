"""The kernels a model is traced with: the engine's `CompilationConfig` section, and the
context that carries its choices to the kernels' call sites.

The choices travel one way: the model is built with the engine's (resolved)
`CompilationConfig` and puts it in this context around its forward pass and head
(`using_kernels`), where the kernels' call sites read it while the step is traced
(`kernel_choices()`). A new choice is one field of `CompilationConfig` and its use.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses

from jaxllm.config.flags import check_types, option

# pallas_kernels.ATTENTION_BACKENDS, spelled out here so the command line need not import JAX
# (tests/test_cli_and_cache.py checks that they agree).
ATTENTION_BACKENDS = ("auto", "pallas", "reference", "xla", "cpu", "pallas_tpu", "pallas_gpu")
QUANT_MATMUL_BACKENDS = ("auto", "xla", "pallas")


@dataclasses.dataclass(frozen=True)
class CompilationConfig:
    """The runner's programs: the kernels they are traced with, their warmup and their
    persistent cache."""

    attention_backend: str = option("auto", choices=ATTENTION_BACKENDS)
    """auto: the platform's kernel (on CPU the native `cpu` kernel, or `xla` where no C++
    compiler builds it); pallas: the platform's Pallas kernel (interpreted on CPU, for
    checking); or a backend by name. Hybrid models' gated delta rule follows it: the
    reference for reference, the TPU's or GPU's Pallas kernel where it resolves to one
    (interpreted off its platform), the chunked XLA form otherwise; always the GPU kernel on
    a GPU (`jaxllm.models.linear_attention.delta_rule_backend`)."""
    quant_matmul_backend: str = option("auto", choices=QUANT_MATMUL_BACKENDS)
    """The matmul of quantized weights: auto is the native kernel on CPU and XLA's
    dequantization fused into the dot on TPU and GPU; xla those XLA ops everywhere; pallas the
    Pallas (Triton) kernel for NVIDIA GPUs, not yet measured on one (interpreted elsewhere,
    for checking)."""
    skip_warmup: bool = False
    """Do not compile every bucket at startup (programs then compile on first use)."""
    compilation_cache_dir: str | None = "default"
    """JAX's persistent compilation cache: default is `xla` under $JAXLLM_CACHE_DIR or
    ~/.cache/jaxllm; none leaves JAX's own setting alone."""

    def __post_init__(self) -> None:
        if self.compilation_cache_dir is not None and hasattr(
            self.compilation_cache_dir, "__fspath__"
        ):  # a Path is welcome
            object.__setattr__(self, "compilation_cache_dir", str(self.compilation_cache_dir))
        check_types(self)


REFERENCE_KERNELS = CompilationConfig(attention_backend="reference")
"""The choices of a model built without an engine (tests, researchers): the reference
attention, the platform's quantized matmul."""
_KERNEL_CHOICES: contextvars.ContextVar[CompilationConfig] = contextvars.ContextVar(
    "jaxllm_kernel_choices", default=REFERENCE_KERNELS
)


@contextlib.contextmanager
def using_kernels(compilation: CompilationConfig):
    """Within it (while a function is traced), the kernels follow `compilation`."""
    token = _KERNEL_CHOICES.set(compilation)
    try:
        yield
    finally:
        _KERNEL_CHOICES.reset(token)


def kernel_choices() -> CompilationConfig:
    """The `CompilationConfig` the function being traced was built with."""
    return _KERNEL_CHOICES.get()
