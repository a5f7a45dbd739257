"""What `jaxllm compile` says of a compiled engine: memory per device, compile times, KV-cache
copies, and decode speed predicted from the compilers' cost analyses.

Predictions are labelled as such everywhere: the step time of a decode program is the larger of
(bytes it accesses / the chip's HBM bandwidth) and (its flops / the chip's peak), with the bytes
and flops the target's compiler counts. The attention kernels declare their cost at the full
reach of their block tables (`pallas_kernels.kv_cache.attention_cost`), so for a stated context
that declared part is replaced by the context's own: the KV bytes `batch x context` tokens take,
and their flops. The roofline is the bytes a decode step cannot avoid (the weights as laid out,
and the KV cache it reads) over the bandwidth; the share is the prediction over it.
XLA:GPU gives no cost analysis for compile-only devices: for a GPU target the step's bytes and
flops are counted from the weights and the KV cache instead, so its prediction is the roofline
itself (share 100%) and says so (`source`). Collectives under tensor parallelism are not
counted.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

from jaxllm.aot.engine import CompiledEngine
from jaxllm.models.linear_attention import state_bytes_per_slot
from jaxllm.worker import pick_shape
from pallas_kernels.kv_cache import attention_cost
from pallas_kernels.mla_attention_tpu import latent_attention_cost

_GIB = 2**30


@dataclasses.dataclass(frozen=True)
class DecodePrediction:
    batch: int
    context: int
    shape: tuple[int, int]  # the forward program that serves it
    bytes_per_step: float
    flops_per_step: float
    step_seconds: float
    tokens_per_s: float
    roofline_tokens_per_s: float
    source: str  # "cost analysis", or "counted" where the compiler gave none

    @property
    def share(self) -> float:
        return self.tokens_per_s / self.roofline_tokens_per_s


def predict_decode(engine: CompiledEngine, batch: int, context: int) -> DecodePrediction:
    """The decode step of `batch` requests at `context` tokens each: the forward program of
    its shape plus its output head and sampler, from their compiled cost analyses."""
    runner = engine.runner
    shape = pick_shape(batch, batch, runner.shapes)
    forward = _program(engine, "forward", shape)
    # The head of an all-greedy batch (a GPU's greedy sampler variant).
    head = _program(engine, runner.head_name(runner.sampler_variants[0]), (shape[1],))
    cfg = engine.model_config
    tp = engine.tensor_parallel_size
    # One slot's attention, in the cache's rows (a packed layer's heads as they are there),
    # as the kernel declares it: its flops, its bytes, and of those its queries' and outputs'.
    head_dim = cfg.cache_head_dim
    heads, kv_heads = cfg.num_heads // tp, max(cfg.cache_kv_heads // tp, 1)
    cache = runner.kv_cache
    quantized = cache.scales is not None
    cache_shape = (1, runner.num_pages, kv_heads, runner.page_size, 2 * head_dim)
    dtype = engine.dtype
    cache_dtype = cache.dtype if not quantized else jnp.int8
    tables = (shape[1], runner.pages_per_seq)
    mla = cfg.latent_attention
    if mla is not None:  # the pair rows as they are
        cache_shape = (1, runner.num_pages, kv_heads, *cache.shape[3:])
        flops_a, _, bytes_a, io_bytes = latent_attention_cost(
            shape[0], heads, mla.kv_lora_rank, cfg.head_dim, jnp.dtype(dtype).itemsize,
            cache_shape, jnp.dtype(cache_dtype).itemsize, tables, quantized,
        )  # fmt: skip
        pair_flops = 2 * (2 * mla.kv_lora_rank + cfg.head_dim)  # a query head and a key's
    else:
        flops_a, _, bytes_a = attention_cost(
            (shape[0], heads, head_dim), dtype, cache_shape, cache_dtype, tables, quantized
        )
        io_bytes = 2 * shape[0] * heads * head_dim * jnp.dtype(dtype).itemsize
        pair_flops = 4 * head_dim
    layers = len(cfg.attention_layers)  # a hybrid's linear layers read no KV
    # Each layer reads the keys its window sees (a sliding layer at most its window, a chunked
    # one at most its chunk).
    seen = [min(context, cfg.layer_kv_reach(i) or context) for i in cfg.attention_layers]
    kv_read = batch * sum(seen) * _kv_bytes_per_token(engine) / layers
    if cfg.linear_attention is not None:  # each request's state read and written back
        state = state_bytes_per_slot(cfg, dtype) // engine.tensor_parallel_size
        kv_read += 2 * batch * state
    attention_flops = pair_flops * heads * batch * sum(seen)
    weights = engine.weights[0]
    if forward.bytes_accessed is None or head.bytes_accessed is None:
        source = "counted"  # each weight read once, 2 flops per weight and row
        nbytes = weights.weight_device_bytes + kv_read
        params = weights.weight_bytes / jnp.dtype(dtype).itemsize
        flops = 2 * params * batch + attention_flops
    else:
        source = "cost analysis"
        # The cost analysis's attention calls, replaced by the KV they read: one per layer, or
        # one per cache slot of a layer packed over several (`jaxllm.models.kv_layout`).
        calls = sum(cfg.layer_kv_parts(cfg.layer_kv_source(i)) for i in cfg.attention_layers)
        nbytes = forward.bytes_accessed + head.bytes_accessed - calls * (bytes_a - io_bytes)
        nbytes += kv_read
        flops = (forward.flops or 0.0) + (head.flops or 0.0) - calls * flops_a
        flops += attention_flops
    chip = engine.target.chip
    peak = chip.int8_ops if engine.config.load.quantization in ("int8", "fp8") else chip.bf16_flops
    step = max(nbytes / chip.hbm_bytes_per_s, flops / peak)
    roofline = (weights.weight_device_bytes + kv_read) / chip.hbm_bytes_per_s
    return DecodePrediction(
        batch, context, shape, nbytes, flops, step, batch / step, batch / roofline, source
    )


def _kv_bytes_per_token(engine: CompiledEngine) -> float:
    """The model's KV bytes per token on one device (a draft model's cache excluded)."""
    from jaxllm.sharding import kv_cache_placement
    from jaxllm.worker import device_page_bytes

    runner = engine.runner
    device = runner.device.device
    placement = kv_cache_placement(runner.mesh, engine.kv_dtype, device)
    page = device_page_bytes(
        engine.model_config, runner.page_size, engine.kv_dtype, placement,
        engine.tensor_parallel_size,
    )  # fmt: skip
    return page / runner.page_size


def _program(engine: CompiledEngine, name: str, shape: tuple):
    for p in engine.runner.programs:
        if p.name == name and p.shape == tuple(shape):
            return p
    raise KeyError(f"no {name} program of shape {shape}")


def summary(engine: CompiledEngine, *, context: int, batches: tuple[int, ...] = (1, 64)) -> dict:
    """Everything the report prints, as plain data (for --json)."""
    runner = engine.runner
    cfg, target = engine.config, engine.target
    programs = runner.programs
    temp = max(programs, key=lambda p: p.temp_bytes)
    # The plan's other consumers of device memory (LoRA slots, the encoder cache, a hybrid's
    # recurrent state), by name.
    others = {
        name: n
        for name, n in engine.plan.memory.items()
        if n and name not in ("weights", "kv cache")
    }
    total = (
        engine.weight_device_bytes
        + engine.kv_cache_device_bytes
        + sum(others.values())
        + temp.temp_bytes
    )
    usable = target.limit_bytes(cfg.cache.memory_utilization)
    forward = [p for p in programs if p.updates_cache]
    copies = runner.cache_copies()
    batches = sorted({min(b, cfg.scheduler.max_num_seqs) for b in batches})
    # The pool's tokens at every layer's cost (a hybrid model's pages hold one layer group:
    # a sequence's sliding layers take less, see `jaxllm.worker.kv_groups`).
    groups, num_layers = runner.kv_groups, len(engine.model_config.attention_layers)
    capacity = runner.num_pages * runner.page_size * groups.num_slots // num_layers
    predictions = [
        predict_decode(engine, b, max(1, min(context, cfg.scheduler.max_model_len, capacity // b)))
        for b in batches
    ]
    return {
        "model": cfg.load.model,
        "architecture": engine.model_config.architecture,
        "target": target.name,
        "device_kind": target.chip.device_kind,
        "num_devices": target.num_devices,
        "tensor_parallel_size": engine.tensor_parallel_size,
        "dtype": jnp.dtype(engine.dtype).name,
        "quantization": cfg.load.quantization,
        "kv_cache_dtype": jnp.dtype(engine.kv_dtype).name,
        "attention_backend": cfg.compilation.attention_backend,
        "page_size": runner.page_size,
        "max_num_seqs": cfg.scheduler.max_num_seqs,
        "max_num_batched_tokens": cfg.scheduler.max_num_batched_tokens,
        "memory_per_device": {
            "device_bytes": target.chip.memory_bytes,
            "usable_bytes": usable,
            "memory_utilization": cfg.cache.memory_utilization,
            "weight_bytes": engine.weight_bytes,
            "weight_device_bytes": engine.weight_device_bytes,
            "kv_cache_bytes": engine.kv_cache_device_bytes,
            "kv_page_bytes": engine.page_bytes,
            "num_pages": runner.num_pages,
            "kv_cache_tokens": capacity,
            "kv_cache_groups": {"windows": list(groups.windows), "slots": groups.num_slots},
            "other_bytes": others,
            "max_temp_bytes": temp.temp_bytes,
            "max_temp_program": f"{temp.name} {temp.shape}",
            "total_bytes": total,
            "fits": total <= usable,
        },
        "max_model_len": cfg.scheduler.max_model_len,
        "model_context": engine.model_config.max_position_embeddings,
        "num_programs": len(programs),
        "compile_seconds": engine.compile_seconds,
        "programs": [
            {
                "name": p.name,
                "shape": list(p.shape),
                "compile_seconds": round(p.compile_seconds, 2),
                "argument_bytes": p.argument_bytes,
                "alias_bytes": p.alias_bytes,
                "temp_bytes": p.temp_bytes,
                "flops": p.flops,
                "bytes_accessed": p.bytes_accessed,
                "host_syncs": p.host_syncs,
                "kernels": p.kernels,
            }
            for p in sorted(programs, key=lambda p: (p.name, p.shape))
        ],
        "kv_cache_in_place": len(forward) - len(copies),
        "kv_cache_programs": len(forward),
        "kv_cache_copies": [f"{p.name} {p.shape}" for p in copies],
        "kv_scales_copies": [f"{p.name} {p.shape}" for p in forward if p.scales_copy_ops],
        "state_copies": [f"{p.name} {p.shape}" for p in forward if p.state_copy_ops],
        "decode_prediction": {
            "note": "predicted from the compiler's cost analysis (or, where it gives none, "
            "the weights' and the KV cache's bytes) and the chip's published peaks; not a "
            "measurement",
            "hbm_bytes_per_s": target.chip.hbm_bytes_per_s,
            "peak_flops": target.chip.bf16_flops,
            "rows": [dataclasses.asdict(p) | {"share": p.share} for p in predictions],
        },
    }


def _source(data: dict[str, Any]) -> str:
    if all(r["source"] == "cost analysis" for r in data["decode_prediction"]["rows"]):
        return "the compiler's cost analysis"
    return "the weights' and KV cache's bytes (this compiler gives no cost analysis: the roofline)"


def render(data: dict[str, Any]) -> str:
    """The summary as text for a terminal."""
    m = data["memory_per_device"]
    lines = [
        f"jaxllm compile: {data['model']} ({data['architecture']}) for {data['target']} "
        f"({data['num_devices']} x {data['device_kind']})",
        f"  weights {data['dtype']}{_q(data['quantization'])}, KV cache "
        f"{data['kv_cache_dtype']}, tensor parallel {data['tensor_parallel_size']}, attention "
        f"{data['attention_backend']}, page_size {data['page_size']}, max_num_seqs "
        f"{data['max_num_seqs']}, max_num_batched_tokens {data['max_num_batched_tokens']}",
        "",
        f"memory per device: {_g(m['usable_bytes'])} usable of {_g(m['device_bytes'])}, "
        f"memory_utilization {m['memory_utilization']}",
        f"  weights      {_g(m['weight_device_bytes']):>12}  (logical {_g(m['weight_bytes'])})",
        f"  KV cache     {_g(m['kv_cache_bytes']):>12}  {m['num_pages']:,} pages = "
        f"{m['kv_cache_tokens']:,} tokens of every layer "
        f"({m['kv_cache_bytes'] / max(m['kv_cache_tokens'], 1) / 1024:.1f} KiB per token)"
        + _groups_line(m.get("kv_cache_groups")),
        *(f"  {name:<12} {_g(n):>12}" for name, n in m.get("other_bytes", {}).items()),
        f"  temporaries  {_g(m['max_temp_bytes']):>12}  (the most of one program: "
        f"{m['max_temp_program']})",
        f"  total        {_g(m['total_bytes']):>12}  "
        + (
            f"fits ({m['total_bytes'] / m['usable_bytes']:.0%} of usable)"
            if m["fits"]
            else "DOES NOT FIT: lower memory_utilization, max_num_batched_tokens or num_pages"
        ),
        f"  max_model_len {data['max_model_len']:,} (the model's context: "
        f"{data['model_context']:,})",
        "",
        _programs_line(data),
        _launches_line(data),
        f"KV cache updated in place: {data['kv_cache_in_place']} of "
        f"{data['kv_cache_programs']} step programs; copies: {len(data['kv_cache_copies'])}"
        + (f" ({', '.join(data['kv_cache_copies'])})" if data["kv_cache_copies"] else "")
        + (
            f"; the 8-bit cache's scales copied in {', '.join(data['kv_scales_copies'])}"
            if data.get("kv_scales_copies")
            else ""
        )
        + (
            f"; the recurrent state copied in {', '.join(data['state_copies'])}"
            if data.get("state_copies")
            else ""
        ),
        "",
        f"decode, PREDICTED from {_source(data)} (not measured): "
        f"{data['decode_prediction']['hbm_bytes_per_s'] / 1e9:,.0f} GB/s, "
        f"{data['decode_prediction']['peak_flops'] / 1e12:,.0f} TFLOP/s peak",
        "  batch  context  GiB/step  GFLOP/step  step ms   tok/s  roofline tok/s  share",
    ]
    for r in data["decode_prediction"]["rows"]:
        lines.append(
            f"  {r['batch']:>5}  {r['context']:>7,}  {r['bytes_per_step'] / _GIB:>8.2f}  "
            f"{r['flops_per_step'] / 1e9:>10,.1f}  {r['step_seconds'] * 1e3:>7.2f}  "
            f"{r['tokens_per_s']:>6,.0f}  {r['roofline_tokens_per_s']:>14,.0f}  "
            f"{r['share']:>5.0%}"
        )
    return "\n".join(lines)


def _programs_line(data: dict) -> str:
    kinds: dict[str, int] = {}
    for p in data["programs"]:
        kinds[p["name"]] = kinds.get(p["name"], 0) + 1
    slowest = max(data["programs"], key=lambda p: p["compile_seconds"])
    return (
        f"programs: {data['num_programs']} ("
        + ", ".join(f"{n} {k}" for k, n in kinds.items())
        + f"), compiled in {data['compile_seconds']:.1f} s; slowest {slowest['name']} "
        f"{tuple(slowest['shape'])} {slowest['compile_seconds']:.1f} s"
    )


def _launches_line(data: dict) -> str:
    """Host syncs (conditionals and loops: a GPU stops the host on each) and kernels per step."""
    programs = data["programs"]
    syncing = [p for p in programs if p.get("host_syncs")]
    kernels = [p["kernels"] for p in programs if p.get("kernels") is not None]
    text = "host syncs (conditional, while): " + (
        "none in any program"
        if not syncing
        else ", ".join(f"{p['host_syncs']} in {p['name']} {tuple(p['shape'])}" for p in syncing)
    )
    if kernels:
        text += f"; kernels per program {min(kernels)}-{max(kernels)}"
    return text


def _g(n: float) -> str:
    return f"{n / _GIB:.2f} GiB" if n >= 2**28 else f"{n / 2**20:.1f} MiB"


def _q(quantization: str | None) -> str:
    return "" if quantization in (None, "float") else f" ({quantization})"


def _groups_line(groups: dict | None) -> str:
    """How a hybrid model's layers share the pages, or nothing for one group."""
    if not groups or len(groups["windows"]) == 1:
        return ""
    sliding = [w for w in groups["windows"] if w is not None]
    return (
        f"; hybrid: {len(groups['windows'])} layer groups of {groups['slots']}, "
        f"{len(sliding)} sliding (window {max(sliding)}) keep only their window"
    )
