"""Compiling a runner's programs: the `Compiler` compiles each one ahead of time (for this
machine's devices, or for a target's that are not here, see `jaxllm.aot`), records what its
compiler says of it (`CompiledProgram`), and checks that the step programs update the KV cache
in place. `CompileCounter` counts every program the process had to produce, so the engine can
prove that nothing compiles after warmup.
"""

from __future__ import annotations

import dataclasses
import os
import re
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jax
import numpy as np
from tqdm.auto import tqdm

import pallas_kernels
from jaxllm.worker.device_state import DeviceState
from pallas_kernels.kv_cache import as_kv_cache


class CompileCounter:
    """Counts the XLA programs this process had to produce, through jax.monitoring: backend
    compilations plus executables loaded from the persistent compilation cache (a program
    that was needed either way). Registered once per process."""

    _lock = threading.Lock()
    _count = 0
    _installed = False

    @classmethod
    def _bump(cls) -> None:
        with cls._lock:
            cls._count += 1

    @classmethod
    def install(cls) -> None:
        with cls._lock:
            if cls._installed:
                return
            cls._installed = True

        def on_duration(event: str, *args, **kwargs) -> None:
            if event == "/jax/core/compile/backend_compile_duration":
                cls._bump()

        def on_event(event: str, *args, **kwargs) -> None:
            if event == "/jax/compilation_cache/cache_hits":
                cls._bump()

        jax.monitoring.register_event_duration_secs_listener(on_duration)
        jax.monitoring.register_event_listener(on_event)

    @classmethod
    def count(cls) -> int:
        return cls._count


@dataclasses.dataclass(frozen=True)
class CompiledProgram:
    """One compiled program and what its compiler says of it (per device). On a target that is
    not here (`jaxllm.aot`) the cost figures are the compiler's predictions, not measurements."""

    name: str  # forward, head_and_sample, prompt_scorer, draft_step
    shape: tuple  # its bucket: (tokens, requests) or (rows,)
    compile_seconds: float
    argument_bytes: int
    output_bytes: int
    alias_bytes: int  # outputs that reuse a donated input's buffer (the KV cache)
    temp_bytes: int
    code_bytes: int
    flops: float | None  # the compiler's cost analysis, where it gives one
    bytes_accessed: float | None  # in every memory the program touches (a TPU's VMEM too)
    optimal_seconds: float | None  # the compiler's own estimate of its run time (XLA:TPU)
    updates_cache: bool  # takes the donated KV cache and returns it
    cache_bytes: int = 0  # per device, of the KV cache it updates (the draft model's, or not)
    cache_copy_ops: tuple[str, ...] = ()  # its instructions that copy the cache, if any
    scales_copy_ops: tuple[str, ...] = ()  # those that copy an 8-bit cache's scales
    state_copy_ops: tuple[str, ...] = ()  # those that copy a hybrid's recurrent state (reported)
    # Read from the compiled program where it matters (a GPU's; `jaxllm compile`), else None
    # (see `launches`): its `conditional` and `while` instructions (on a GPU each stops the
    # host until the device is done), and the kernels it launches.
    host_syncs: int | None = None
    kernels: int | None = None

    @classmethod
    def of(
        cls,
        name: str,
        shape: tuple,
        compiled,
        seconds: float,
        *,
        updates_cache: bool,
        read_launches: bool = False,
    ) -> CompiledProgram:
        m = compiled.memory_analysis()
        try:
            cost = compiled.cost_analysis() or {}
        except Exception:  # some backends have none
            cost = {}
        if isinstance(cost, list):  # older JAX: one dict per device
            cost = cost[0] if cost else {}
        syncs, kernels = launches(compiled.as_text()) if read_launches else (None, None)
        return cls(
            name,
            tuple(shape),
            seconds,
            m.argument_size_in_bytes,
            m.output_size_in_bytes,
            m.alias_size_in_bytes,
            m.temp_size_in_bytes,
            m.generated_code_size_in_bytes,
            cost.get("flops"),
            cost.get("bytes accessed"),
            cost.get("optimal_seconds"),
            updates_cache,
            host_syncs=syncs,
            kernels=kernels,
        )

    @property
    def updates_in_place(self) -> bool:
        """Whether a step program writes the donated KV cache in place, from what its compiler
        says: its output aliases the cache, and no instruction of the compiled program makes a
        new array of the cache's shape, its data's or an 8-bit cache's scales' (see
        `cache_copy_ops`). A hybrid's recurrent state's copies (`state_copy_ops`) are reported
        by `jaxllm compile` and refused by the accelerator compile tests, not here: XLA:CPU
        widens a bfloat16 state for its update (a copy of the convolution's state at every
        step, a few MiB for the demo sizes)."""
        copies = self.cache_copy_ops or self.scales_copy_ops
        return self.alias_bytes >= self.cache_bytes and not copies

    def describe(self) -> str:
        text = f"{self.alias_bytes / 2**20:.1f} MiB aliased, {self.temp_bytes / 2**20:.1f} MiB of "
        text += "temporaries"
        if copies := self.cache_copy_ops + self.scales_copy_ops + self.state_copy_ops:
            text += f", copied by {', '.join(copies[:3])}"
        return text


# Compiled HLO text: a computation's first line, and an instruction with an array result (its
# name, dimensions and opcode).
_HLO_COMPUTATION = re.compile(r"^(?:ENTRY )?%(\S+) \(")
_HLO_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%(\S+) = \w+\[([\d,]*)\]\S* ([\w-]+)\(")
# An async copy between memory spaces: (its name, its source's type: the tuple's second).
_HLO_COPY_START = re.compile(r"^\s*%(\S+) = \(\S+, (\S+), .*\) copy-start\(")
# What makes a KV-cache-shaped array without copying the cache: the argument itself, a view of
# it, in-place updates, and fusions whose root is one; custom calls (the kernels) alias their
# outputs to operands or make none of the cache's shape.
_IN_PLACE = {"parameter", "bitcast", "get-tuple-element", "scatter", "dynamic-update-slice"}


class Compiler:
    """Compiles programs for the devices of a runner's `DeviceState` and keeps their records
    (`programs`); with `keep_executables` set, the executables too (`jaxllm compile
    --save-executables` serializes them)."""

    def __init__(self, device: DeviceState):
        CompileCounter.install()
        self.device = device
        self.programs: list[CompiledProgram] = []
        self.keep_executables = False
        self.executables: dict[tuple[str, tuple], Any] = {}
        self._lock = threading.Lock()

    def compile(
        self,
        name: str,
        shape: tuple,
        fn,
        *args,
        updates_cache: bool = False,
        cache=None,
        static: dict | None = None,
    ) -> CompiledProgram:
        """Compiles `fn(*args, **static)` (a jitted function; `static`: the keyword arguments
        it takes as static, such as a step buffer's layout) and records it. An abstract runner
        compiles for its parameters' devices with their platform's compiler (a TPU's or a
        GPU's, on this machine), with the kernels traced for that platform. `updates_cache`:
        the program takes the donated KV cache (the device state's, or `cache`) and returns
        it."""
        device = self.device
        static = static or {}
        start = time.perf_counter()
        if not device.abstract:
            compiled = fn.lower(*args, **static).compile()
        else:
            args = jax.tree.map(device.abstract_input, args)
            with device.traced_for_target():
                traced = fn.trace(*args, **static)
                platforms = (pallas_kernels.lowering_platform(device.device),)
                compiled = traced.lower(lowering_platforms=platforms).compile()
        # What the program launches is read for a GPU (host syncs) and for a target that is
        # not here (`jaxllm compile` reports it); reading a CPU program's text would only cost
        # startup time.
        program = CompiledProgram.of(
            name,
            shape,
            compiled,
            time.perf_counter() - start,
            updates_cache=updates_cache,
            read_launches=device.abstract or device.platform in ("gpu", "cuda", "rocm"),
        )
        if updates_cache:
            cache = device.cache if cache is None else cache
            program = dataclasses.replace(
                program,
                cache_bytes=sum(
                    int(np.prod(x.sharding.shard_shape(x.shape))) * x.dtype.itemsize
                    for x in jax.tree.leaves(cache)
                ),
                cache_copy_ops=_cache_copy_ops(compiled, cache),
                scales_copy_ops=_cache_copy_ops(compiled, cache, "scales"),
                state_copy_ops=_cache_copy_ops(compiled, cache, "linear"),
            )
        with self._lock:
            self.programs.append(program)
            if self.keep_executables:
                self.executables[name, tuple(shape)] = compiled
        return program

    def run(self, jobs: list[Callable[[], Any]], *, progress: bool) -> None:
        """Runs compile jobs: XLA compiles without the GIL, so on one thread per CPU core.
        Several processes (multi-host) compile one at a time: compiling a program that spans
        them exchanges messages between them, which must come in the same order on each.
        libtpu compiling two programs at once for compile-only devices (`jaxllm compile`)
        crashes the process (SIGSEGV, measured with jax 0.10.2 / libtpu 0.0.42.1)."""
        device = self.device
        serial = jax.process_count() > 1 or (device.abstract and device.platform == "tpu")
        workers = 1 if serial else max(1, min(os.cpu_count() or 1, 8))
        with (
            ThreadPoolExecutor(workers) as pool,
            tqdm(total=len(jobs), desc="Compiling", disable=not progress, unit="program") as bar,
        ):
            for future in [pool.submit(job) for job in jobs]:
                future.result()
                bar.update(1)

    def check_in_place(self) -> None:
        """Raises if a step program copies the KV cache (an 8-bit cache's scales included)
        instead of updating it in place: slow steps, and twice the cache's memory (a copy of
        the scales alone, a 16th to a 32nd of the data, kept a v5e's full int8 pool from
        compiling)."""
        if copies := self.cache_copies():
            raise RuntimeError(
                f"{len(copies)} step program(s) would copy the KV cache "
                f"({self.device.cache.nbytes / 2**20:.0f} MiB) instead of updating it in place "
                f"(slow steps, and twice the cache's memory): "
                + ", ".join(f"{p.name} {p.shape}: {p.describe()}" for p in copies)
            )

    def cache_copies(self) -> list[CompiledProgram]:
        """The compiled programs that take the KV cache and would copy it."""
        return [p for p in self.programs if p.updates_cache and not p.updates_in_place]


def _cache_copy_ops(compiled, cache, array: str = "data") -> tuple[str, ...]:
    """The instructions of a compiled step program that copy the KV cache's `array` ("data", or
    the 8-bit cache's "scales"; "linear": a hybrid's recurrent state's arrays). XLA has copied
    the data when a one-token write became a dynamic-update-slice (see `write_kv`), when it widened a float8 cache for the scatter, and
    when the TPU kernel wanted another tiling of the cache than the one it was given. A copy
    needs temporaries of the array's size, so only a program that has that many is read (the
    temporaries alone would also count a small cache's neighbours: an MoE layer's transposed
    expert weights outweigh a 64-page one)."""
    if array == "linear":  # a hybrid's recurrent state: its arrays
        arrays = [] if cache.linear is None else jax.tree.leaves(cache.linear)
    else:
        arrays = [getattr(as_kv_cache(cache.kv), array)]
    arrays = [x for x in arrays if x is not None]
    if not arrays:
        return ()
    shapes = [x.sharding.shard_shape(x.shape) for x in arrays]
    smallest = min(np.prod(s) * x.dtype.itemsize for s, x in zip(shapes, arrays, strict=True))
    if compiled.memory_analysis().temp_size_in_bytes < smallest:
        return ()
    return cache_copy_ops(compiled.as_text(), shapes)


def cache_copy_ops(hlo_text: str, shapes: list[tuple[int, ...]]) -> tuple[str, ...]:
    """The instructions of compiled HLO text (`Compiled.as_text()`, per device) that make a new
    array of one of `shapes` (the KV cache's arrays): copies, converts, transposes, and fusions
    that do not update their operand in place. Fusions' own computations are not read: what a
    fusion makes is judged by its root."""
    dims = {",".join(map(str, s)) for s in shapes}
    roots: dict[str, str] = {}  # computation -> its root's opcode
    fused: set[str] = set()  # computations that are fusions' bodies
    candidates: list[tuple[str, str, str, str]] = []  # (computation, name, opcode, called)
    staged: set[str] = set()  # async copies out of another memory space (`S(1)`)
    computation = ""
    for line in hlo_text.splitlines():
        if m := _HLO_COPY_START.match(line):
            if "S(1)" in m.group(2):
                staged.add(m.group(1))
            continue
        if m := _HLO_COMPUTATION.match(line):
            computation = m.group(1)
            continue
        called = re.search(r"calls=%([\w.-]+)", line)
        if " fusion(" in line and called:
            fused.add(called.group(1))
        if (m := _HLO_INSTRUCTION.match(line)) is None:
            continue
        name, shape, opcode = m.groups()
        if line.lstrip().startswith("ROOT "):
            roots[computation] = opcode
        # A result in another memory space (`S(1)`: a TPU's VMEM) is a prefetch of a cache
        # small enough to fit there, not a second copy of it in HBM; the copy that brings it
        # back (XLA's memory-space assignment staged a small state's update through VMEM) is
        # the other half of the same round trip, into the donated buffer.
        in_hbm = "S(1)" not in line.split(" = ", 1)[1].split(" ", 1)[0]
        back = opcode == "copy-done" and any(f"copy-done(%{n})" in line for n in staged)
        if shape in dims and in_hbm and not back and opcode not in _IN_PLACE | {"custom-call"}:
            candidates.append((computation, name, opcode, called.group(1) if called else ""))
    return tuple(
        f"{opcode} %{name}"
        for computation, name, opcode, called in candidates
        if computation not in fused and not (opcode == "fusion" and roots.get(called) in _IN_PLACE)
    )


# Opcodes of compiled HLO that launch nothing on the device: structure, views, and the control
# flow whose bodies are read instead.
_NO_KERNEL = {
    "parameter", "constant", "tuple", "get-tuple-element", "bitcast", "conditional", "while",
    "call", "after-all", "add-dependency", "opt-barrier", "partition-id", "replica-id", "domain",
}  # fmt: skip
_CALLED = re.compile(
    r"(?:condition|body|true_computation|false_computation|to_apply)=%([\w.-]+)"
    r"|branch_computations=\{([^}]*)\}"
)
_OPCODE = re.compile(r"^\s*(?:ROOT )?%\S+ = (?:\([^=]*?\)|\S+) ([\w-]+)\(")


def launches(hlo_text: str) -> tuple[int, int]:
    """(host syncs, kernels) of a compiled program's HLO text (`Compiled.as_text()`): its
    `conditional` and `while` instructions, each of which XLA:GPU runs by copying a predicate to
    the host and waiting for the device (a `while` on every trip); and the instructions that
    launch work (fusions, custom calls such as the Pallas kernels and cuBLAS, copies,
    collectives), counted once wherever they sit (a loop's body once, each branch of a
    conditional), read from the entry computation and the control flow it reaches, not from
    fusions' bodies."""
    bodies: dict[str, list[str]] = {}
    entry, name = "", ""
    for line in hlo_text.splitlines():
        if m := _HLO_COMPUTATION.match(line):
            name = m.group(1)
            bodies[name] = []
            if line.startswith("ENTRY "):
                entry = name
        elif name and line.strip() not in ("", "}"):
            bodies[name].append(line)
    syncs = kernels = 0
    seen, todo = set(), [entry]
    while todo:
        computation = todo.pop()
        if computation in seen or computation not in bodies:
            continue
        seen.add(computation)
        for line in bodies[computation]:
            if (m := _OPCODE.match(line)) is None:
                continue
            opcode = m.group(1)
            if opcode in ("conditional", "while"):
                syncs += 1
            if opcode in ("conditional", "while", "call"):
                for single, several in _CALLED.findall(line):
                    todo += [single] if single else [c.strip(" %") for c in several.split(",")]
            elif opcode not in _NO_KERNEL and not opcode.endswith("-done"):
                kernels += 1
    return syncs, kernels
