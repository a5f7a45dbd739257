"""The Pallas quantized matmul for GPUs (pallas_kernels/quant_matmul_gpu.py): in interpret mode
against XLA's dequantization (the jnp path the TPU uses), through `qmatmul` (act-order, shapes
it cannot tile), lowered for CUDA from this CPU, in the engine, and natively on a GPU when
there is one."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels
from jaxllm.config import CompilationConfig, using_kernels
from jaxllm.quantization import dequantize, dequantize_np, qmatmul
from jaxllm.testing import random_qarray
from pallas_kernels import quant_matmul_cpu
from pallas_kernels.quant_matmul_gpu import QuantMatmulBlocks, quant_matmul_gpu


def matmul_backend(name: str):
    """The kernel choice `qmatmul` reads while traced, as the decoder sets it."""
    return using_kernels(CompilationConfig(quant_matmul_backend=name))


# (num_in, group size, offsets, scale dtype)
GROUPINGS = [
    (256, 256, False, np.float32),  # per channel (int8, fp8 as quantized here)
    (256, 32, True, np.float16),  # GGUF's blocks and our int4's
    (512, 128, True, np.float16),  # GPTQ's and AWQ's, several groups a chunk
    (192, 64, False, np.float32),  # a chunk (64 codes) that is not a power of two of I
]


def _xla(x, w):
    """The XLA path (`qmatmul` on TPU): the dequantized weight in x's dtype, an f32 dot."""
    return jax.lax.dot_general(
        x, dequantize(w, x.dtype), (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32
    )


def _device(w):
    return jax.tree.map(jnp.asarray, w)


class KernelCases:
    interpret: bool

    def tolerance(self, dtype) -> float:
        # The same dequantized weights as the XLA path; only the order of the f32 sums differs
        # (and on a GPU, f32 operands go through TF32 tensor cores).
        return 1e-5 if self.interpret and dtype == jnp.float32 else 2e-3

    @pytest.mark.parametrize("fmt", ["int8", "int4", "fp8"])
    @pytest.mark.parametrize("grouping", GROUPINGS, ids=lambda g: f"i{g[0]}g{g[1]}")
    @pytest.mark.parametrize("num_tokens", [1, 37])
    @pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
    def test_matches_xla_dequantization(self, fmt, grouping, num_tokens, dtype):
        num_in, group, offset, scale_dtype = grouping
        rng = np.random.default_rng(num_in + group)
        w = _device(random_qarray(rng, fmt, 96, num_in, num_in // group, offset, scale_dtype))
        x = jnp.asarray(rng.standard_normal((num_tokens, num_in)), dtype)
        got = quant_matmul_gpu(x, w.q, w.scale, w.offset, fmt, interpret=self.interpret)
        assert got.shape == (num_tokens, 96) and got.dtype == jnp.float32
        want = np.asarray(_xla(x, w))
        tol = self.tolerance(dtype) * np.abs(want).max()
        np.testing.assert_allclose(np.asarray(got), want, rtol=0, atol=tol)

    @pytest.mark.parametrize("fmt", ["int8", "int4"])
    def test_block_sizes_do_not_change_the_result(self, fmt):
        rng = np.random.default_rng(1)
        w = _device(random_qarray(rng, fmt, 64, 256, 8, True, np.float16))
        x = jnp.asarray(rng.standard_normal((20, 256)), jnp.float32)
        results = [
            np.asarray(
                quant_matmul_gpu(
                    x, w.q, w.scale, w.offset, fmt, blocks=blocks, interpret=self.interpret
                )
            )
            for blocks in (None, QuantMatmulBlocks(16, 16, 16), QuantMatmulBlocks(32, 64, 32))
        ]
        tol = self.tolerance(jnp.float32) * np.abs(results[0]).max()
        for other in results[1:]:
            np.testing.assert_allclose(other, results[0], rtol=0, atol=tol)


class TestInterpret(KernelCases):
    interpret = True


@pytest.mark.skipif(
    jax.default_backend() != "gpu",
    reason="needs an NVIDIA GPU: the kernel runs natively only there",
)
class TestOnDevice(KernelCases):
    interpret = False


def _kernels_in(fn, *args) -> str:
    # A new function each time: JAX caches traces by function, and the backend and the
    # platform are read while tracing.
    return str(jax.make_jaxpr(lambda *a: fn(*a))(*args))


def test_qmatmul_runs_the_kernel_and_falls_back_where_it_cannot_tile():
    """With quant_matmul_backend "pallas", `qmatmul` runs the kernel, reading an act-order
    (GPTQ `g_idx`) weight's columns in its order; 70 output rows have no power-of-two tiling,
    so that weight goes through the XLA ops; both equal the numpy reading of the weight."""
    rng = np.random.default_rng(2)
    w = random_qarray(rng, "int4", 64, 256, 2, True, np.float16)
    perm = rng.permutation(256).astype(np.int32)
    shuffled = _device(w.__class__(**{**w.__dict__, "perm": perm}))
    odd = _device(random_qarray(rng, "int8", 70, 256, 1, False, np.float32))
    x = jnp.asarray(rng.standard_normal((3, 256)), jnp.float32)
    with matmul_backend("pallas"):
        assert "quant_matmul_int4_gpu" in _kernels_in(qmatmul, x, shuffled)
        assert "pallas_call" not in _kernels_in(qmatmul, x, odd)
        for weight in (shuffled, odd):
            want = np.asarray(x) @ dequantize_np(weight).T
            np.testing.assert_allclose(qmatmul(x, weight), want, rtol=1e-5, atol=1e-4)
    with pytest.raises(ValueError, match="quant_matmul_backend must be one of"):
        with matmul_backend("triton"):
            pass


def test_auto_keeps_the_kernel_off_until_measured_on_a_gpu():
    """ "auto" is the native kernel on CPU and XLA's ops on TPU and GPU (the Pallas kernel has
    not run on a GPU yet); "pallas" picks it for a GPU program, "xla" nothing."""
    w = _device(random_qarray(np.random.default_rng(3), "int8", 64, 128, 1, False, np.float32))
    x = jnp.ones((2, 128), jnp.float32)
    for platform in ("cuda", "tpu", "cpu"):
        with pallas_kernels.target_platform(platform):
            assert "pallas_call" not in _kernels_in(qmatmul, x, w)
    with pallas_kernels.target_platform("cuda"), matmul_backend("pallas"):
        assert "quant_matmul_int8_gpu" in _kernels_in(qmatmul, x, w)
    with pallas_kernels.target_platform("cpu"):
        native = "jaxllm_quant_matmul" in _kernels_in(qmatmul, x, w)
        assert native == quant_matmul_cpu.available()
        with matmul_backend("xla"):
            assert "jaxllm_quant_matmul" not in _kernels_in(qmatmul, x, w)


@pytest.mark.parametrize("fmt", ["int8", "int4", "fp8"])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32], ids=str)
def test_lowers_for_cuda(fmt, dtype):
    """Lowered to Triton from this CPU (PTX is compiled only on a GPU)."""
    w = _device(random_qarray(np.random.default_rng(4), fmt, 128, 256, 8, True, np.float16))
    x = jnp.ones((5, 256), dtype)
    with pallas_kernels.target_platform("cuda"), matmul_backend("pallas"):
        lowered = jax.jit(qmatmul).trace(x, w).lower(lowering_platforms=("cuda",))
    assert "triton" in lowered.as_text()


def test_bad_shapes_are_named():
    w = _device(random_qarray(np.random.default_rng(5), "int4", 64, 256, 8, True, np.float16))
    x = jnp.ones((2, 256), jnp.float32)
    with pytest.raises(ValueError, match="fmt must be one of"):
        quant_matmul_gpu(x, w.q, w.scale, w.offset, "int3", interpret=True)
    with pytest.raises(ValueError, match="x has 128 inputs"):
        quant_matmul_gpu(x[:, :128], w.q, w.scale, w.offset, "int4", interpret=True)
    with pytest.raises(ValueError, match="offset"):
        quant_matmul_gpu(x, w.q, w.scale, w.scale[:, :4], "int4", interpret=True)
    with pytest.raises(ValueError, match="blocks.cols must be a power of two"):
        blocks = QuantMatmulBlocks(16, 48, 16)
        quant_matmul_gpu(x, w.q, w.scale, w.offset, "int4", blocks=blocks, interpret=True)
    with pytest.raises(ValueError, match="does not tile"):
        blocks = QuantMatmulBlocks(16, 128, 16)
        quant_matmul_gpu(x, w.q, w.scale, w.offset, "int4", blocks=blocks, interpret=True)


@pytest.mark.slow
def test_engine_tokens_with_the_kernel(tiny_model_dir):
    """The whole engine with int4 weights through the kernel (interpreted) gives the greedy
    tokens of the XLA path, and compiles nothing after warmup."""
    from jaxllm import LLM, SamplingParams

    prompts = [{"prompt_token_ids": [5, 6, 7, 8] * k} for k in (1, 3)]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    tokens = {}
    for backend in ("pallas", "xla"):
        llm = LLM(
            tiny_model_dir,
            quantization="int4",
            quant_matmul_backend=backend,
            max_model_len=64,
            num_pages=16,
            max_num_seqs=2,
            max_num_batched_tokens=16,
        )
        runner = llm.runner
        batch = runner.inputs.padding_batch(*runner.shapes[-1])
        step = runner.forward.trace(
            runner.params, runner.cache, runner.last_tokens, batch, runner.resident()
        )
        assert ("quant_matmul_int4_gpu" in str(step.jaxpr)) == (backend == "pallas")
        before = runner.num_compilations
        outputs = llm.generate(prompts, params, use_tqdm=False)
        assert runner.num_compilations == before
        tokens[backend] = [o.outputs[0].token_ids for o in outputs]
    assert tokens["pallas"] == tokens["xla"]


def test_benchmark_runs(tmp_path):
    """benchmarks/kernels/quant_matmul.py (what the GPU session runs), at its CPU size."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).parents[1] / "benchmarks" / "kernels" / "quant_matmul.py"
    out = tmp_path / "result.json"
    cmd = [sys.executable, str(script), "--quick", "--backend", "xla,pallas,native"]
    done = subprocess.run(
        [*cmd, "--format", "int4", "--json", str(out)], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert {r["backend"] for r in rows} == {"xla", "pallas", "native"}
    assert all(r["max_rel_err"] < 1e-2 for r in rows if r["backend"] != "xla")
