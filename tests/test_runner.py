"""The runner's compiled programs: bounded, sized to the batch, and writing the KV cache in
place."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from jaxllm.worker import make_buckets, pick_shape


def test_buckets_fit_every_batch_tightly():
    tokens, requests, shapes = make_buckets(512, 64)
    assert tokens[0] == 1 and requests[0] == 1, "a one-request decode pays for one row"
    assert len(shapes) <= 3 * len(tokens)
    for num_tokens in range(1, 513):
        for num_reqs in {1, 2, 3, 7, 16, 33, 64, min(num_tokens, 64)}:
            if num_reqs > num_tokens:
                continue
            t, r = pick_shape(num_tokens, num_reqs, shapes)
            assert t >= num_tokens and r >= num_reqs
            assert t <= 2 * num_tokens or t == 16, "at most twice the tokens, past 16"
            assert r <= max(2 * num_reqs, 16, min(t, 64) / 4), (num_tokens, num_reqs, t, r)
    # Decode batches: one request is the (1, 1) program; n requests pay for few more rows.
    assert pick_shape(1, 1, shapes) == (1, 1)
    assert pick_shape(3, 3, shapes) == (4, 4)
    assert pick_shape(33, 33, shapes) == (64, 64)
    # Sizes that are not powers of two still close every list.
    tokens, requests, shapes = make_buckets(500, 48)
    assert tokens[-1] == 500 and requests[-1] == 48
    assert pick_shape(500, 48, shapes) == (500, 48)


def test_fine_buckets_pad_to_at_most_twice_the_rows():
    """Where a step's work grows with its rows from the first (quantized weights on the CPU),
    every batch pads to under twice its tokens and requests: 8 decodes run 8 rows, not 16."""
    tokens, requests, shapes = make_buckets(512, 64, fine=True)
    assert tokens[:5] == [1, 2, 4, 8, 16] and requests[:5] == [1, 2, 4, 8, 16]
    for num_tokens in range(1, 513):
        for num_reqs in {1, 2, 3, 7, 8, 33, 64, min(num_tokens, 64)}:
            if num_reqs > num_tokens:
                continue
            t, r = pick_shape(num_tokens, num_reqs, shapes)
            assert num_tokens <= t < 2 * num_tokens or t == num_tokens == 1
            assert r >= num_reqs and r <= max(2 * num_reqs - 1, min(t, 64) / 4), (t, r)
    assert pick_shape(8, 8, shapes) == (8, 8)
    assert pick_shape(3, 3, shapes) == (4, 4)


def test_runner_pads_finely_for_quantized_weights_on_the_cpu(tiny_model_dir):
    """The runner picks the fine ladder for weights its CPU kernel multiplies, not for float
    weights (XLA's matmuls cost about the same for 1 to 16 rows)."""
    from jaxllm import LLM
    from pallas_kernels import quant_matmul_cpu

    if not quant_matmul_cpu.available():
        pytest.skip("no C++ compiler: quantized weights go through XLA")
    small = dict(max_model_len=64, max_num_seqs=8, max_num_batched_tokens=32)
    quantized = LLM(tiny_model_dir, quantization="int8", **small).runner
    dense = LLM(tiny_model_dir, **small).runner
    assert quantized.token_buckets == [1, 2, 4, 8, 16, 32]
    assert dense.token_buckets == [1, 4, 16, 32]
    assert (8, 8) in quantized.shapes and (8, 8) not in dense.shapes


@pytest.mark.parametrize("attention_backend", ["cpu", "xla"])
def test_every_program_updates_the_kv_cache_in_place(tiny_model_dir, attention_backend):
    """From each compiled step program's memory analysis: the output aliases the donated cache
    and no temporary is large enough to hold a copy of it. The cache (64 MiB) is far larger than
    anything else the tiny model's steps hold."""
    from jaxllm import LLM

    llm = LLM(
        tiny_model_dir,
        max_model_len=256,
        num_pages=8192,
        max_num_seqs=16,
        max_num_batched_tokens=128,
        attention_backend=attention_backend,
    )
    runner = llm.runner
    assert runner.kv_cache.nbytes >= 64 * 2**20
    forward = {p.shape: p for p in runner.programs if p.name == "forward"}
    assert set(forward) == set(runner.shapes)
    for shape, program in forward.items():
        assert program.updates_in_place, (shape, program, runner.kv_cache.nbytes)


def test_cache_copies_are_read_from_the_compiled_program():
    """A step that keeps the old cache beside the new one copies it; a scatter into it does
    not. The TPU compiler's copy of the cache for an unaligned kv-head count had this form."""
    from jaxllm.worker import cache_copy_ops

    cache = jax.ShapeDtypeStruct((4, 64, 2, 16, 48), jnp.float32)
    i = jax.ShapeDtypeStruct((), jnp.int32)

    def ops(f):
        return cache_copy_ops(jax.jit(f, donate_argnums=0).lower(cache, i).compile().as_text(),
                              [cache.shape])  # fmt: skip

    assert ops(lambda c, i: c.at[1, i].set(1.0)) == ()
    copies = ops(lambda c, i: (c.at[1, i].set(1.0), c[1, i]))
    assert copies and all(op.startswith("copy ") for op in copies)


def test_a_round_trip_through_vmem_is_not_a_cache_copy():
    """XLA:TPU's memory-space assignment staged a small state's update through VMEM (`S(1)`):
    the async copy in and the one back into HBM are one round trip, not a second array; a
    copy within HBM still is one (lines as the TPU compiler printed them for a hybrid's
    convolution state)."""
    from jaxllm.worker import cache_copy_ops

    t, vmem = "bf16[3,4,1536]{2,1,0:T(4,128)(2,1)}", "bf16[3,4,1536]{2,1,0:T(4,128)(2,1)S(1)}"
    staged = f"""ENTRY %main () -> {t} {{
  %copy-start.1 = ({vmem}, {t}, u32[]{{:S(2)}}) copy-start(%p)
  %copy-done.1 = {vmem} copy-done(%copy-start.1)
  %dynamic-update-slice.16 = {vmem} dynamic-update-slice(%copy-done.1, %row, %i, %j, %k)
  %copy-start.18 = ({t}, {vmem}, u32[]{{:S(2)}}) copy-start(%dynamic-update-slice.16)
  ROOT %copy-done.18 = {t} copy-done(%copy-start.18)
}}"""
    assert cache_copy_ops(staged, [(3, 4, 1536)]) == ()
    copied = staged.replace("ROOT %copy-done.18", "%copy-done.18").replace(
        "\n}", f"\n  ROOT %copy.2 = {t} copy(%copy-done.18)\n}}"
    )
    assert cache_copy_ops(copied, [(3, 4, 1536)]) == ("copy %copy.2",)


def test_a_cache_copy_fails_warmup(tiny_model_dir, monkeypatch):
    """A step program that would copy the KV cache stops the engine at warmup, naming it."""
    from jaxllm import LLM
    from jaxllm.worker import compiler

    def copies(compiled, cache, array="data"):
        return ("copy %copy.7",) if array == "data" else ()

    monkeypatch.setattr(compiler, "_cache_copy_ops", copies)
    with pytest.raises(RuntimeError, match=r"would copy the KV cache.*copied by copy %copy.7"):
        LLM(tiny_model_dir, max_model_len=64, num_pages=16, max_num_seqs=2,
            max_num_batched_tokens=16)  # fmt: skip


@pytest.mark.parametrize(
    "platform,quantization,kv_cache_dtype",
    [
        ("tpu", None, "auto"),
        ("cuda", None, "auto"),
        ("tpu", "int4", "int8"),
        ("cuda", "int8", "fp8"),
    ],
)
def test_whole_step_lowers_for_tpu_and_cuda(tiny_model_dir, platform, quantization, kv_cache_dtype):
    """The engine's step programs (forward pass with the platform's Pallas attention kernel,
    head and sampler), not only the kernel, lower for TPU and CUDA from this CPU: a change that
    breaks either shows here without a device. Quantized weights (through the Pallas matmul for
    CUDA) and an 8-bit cache too."""
    import pallas_kernels
    from jaxllm import LLM

    llm = LLM(
        tiny_model_dir,
        dtype="bfloat16",
        max_model_len=128,
        num_pages=16,
        max_num_seqs=4,
        max_num_batched_tokens=32,
        attention_backend="pallas_tpu" if platform == "tpu" else "pallas_gpu",
        quantization=quantization,
        quant_matmul_backend="pallas" if platform == "cuda" else "auto",
        kv_cache_dtype=kv_cache_dtype,
        skip_warmup=True,
    )
    runner = llm.runner
    batch_template = runner.inputs.batch_template(*runner.shapes[-1])
    buffer, batch = batch_template.new()
    num_logits = len(batch.logits_indices)
    head = runner.inputs.head_template(num_logits)
    idle = runner.inputs.sampling.idle_inputs(num_logits)
    with pallas_kernels.target_platform(platform):
        forward = runner.forward.trace(
            runner.params, runner.cache, runner.last_tokens, buffer, runner.resident(),
            layout=batch_template.layout,
        )  # fmt: skip
        text = forward.lower(lowering_platforms=(platform,)).as_text()
        _, hidden, _, _ = forward.out_info
        rows = jax.ShapeDtypeStruct((num_logits, *hidden.shape[1:]), hidden.dtype)
        for program in runner.head_and_sample.values():
            traced = program.trace(
                runner.params, rows, head.buffer, idle, runner.last_tokens, layout=head.layout
            )
            traced.lower(lowering_platforms=(platform,))
    assert ("tpu_custom_call" if platform == "tpu" else "triton") in text
    # Quantized weights: the GPU program through the Pallas matmul, the TPU's through XLA.
    assert ("quant_matmul_int8_gpu" in text) == (platform == "cuda" and quantization == "int8")
    assert "jaxllm_" not in text, "a native CPU kernel was traced into an accelerator program"


@pytest.mark.slow  # a benchmark: 3.5 minutes
def test_host_step_benchmark_runs(tmp_path):
    """benchmarks/host_step.py (issue 11's measurement) at a tiny size: it reads the runner's
    in-flight step, so a change there must not break it unnoticed."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).parents[1] / "benchmarks" / "host_step.py"
    out = tmp_path / "result.json"
    cmd = [sys.executable, str(script), "--requests", "2", "--output-len", "4"]
    done = subprocess.run([*cmd, "--json", str(out)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    row = json.loads(out.read_text())["2"]
    for side in ("async", "sync"):
        assert row[side]["tok_per_s"] > 0 and row[side]["idle_ms"] is not None, row[side]
